"""One rank of a DCP-writer test job (run as a subprocess by tests/dist/test_dcp_writer.py).

Usage: python dcp_writer_worker.py SCENARIO ROOT OUT   (RANK, WORLD_SIZE, MASTER_* in env)

``save``: FSDP2 (``fully_shard`` over every rank, gloo) trains a small model with AdamW and saves
DCP-style state dicts (``get_state_dict``) with ``dcp.save`` through ``NebulaStorageWriter``
(step 5), then with ``dcp.async_save`` (step 6, given as ``checkpoint_id``); rank 0 writes the
full state of each to ``OUT/ref<step>.pt``. Then it tries step 5 again (refused: committed), and
step 7 with the last rank failing inside ``write_data`` (nothing committed), then saves step 8.
``kill``: the last rank is SIGKILLed half way through writing its shard of step 9.
``load``: a job of the same world size loads step 5 with ``dcp.load`` + ``NebulaStorageReader``
into fresh FSDP2 state dicts (``OUT/dcp5.pt``) and the newest step with
``Checkpointer.load_latest`` (``OUT/ck.pt``).

Every rank writes what it saw to ``OUT/<scenario>-r<rank>.json``.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def build(seed: int, sharded: bool = True) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model (FSDP2 over every rank when ``sharded``) and its AdamW."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 6))
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = model(torch.randn(4, 16, generator=g)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def full_sd(msd: dict[str, Any], osd: dict[str, Any]) -> dict[str, Any]:
    """Every tensor of DCP-style state dicts, whole (DTensors gathered: a collective), by saved key."""
    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

    out: dict[str, Any] = {f"model/{k}": full(v) for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            out[f"optim/state/{fqn}/{k}"] = full(v)
    out["lr"] = osd["param_groups"][0]["lr"]
    return out


def _error(e: BaseException) -> str:
    failures = getattr(e, "failures", None)
    if failures:
        return "; ".join(f"rank {r}: {type(x).__name__}: {x}" for r, (x, _) in sorted(failures.items()))
    return f"{type(e).__name__}: {e}"


def main() -> None:
    scenario, root, out = sys.argv[1:4]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import nebula_ckpt as nc
    from nebula_ckpt.dcp import NebulaStorageReader, NebulaStorageWriter

    report: dict[str, Any] = {"rank": rank, "world": world}
    if scenario in ("save", "kill"):
        model, opt = build(0)
        train(model, opt, 2, seed=10 + rank)
        opt.param_groups[0]["lr"] = 0.0123  # a non-tensor value the loads must bring back
        msd, osd = get_state_dict(model, opt)
        if scenario == "kill":
            if rank == world - 1:
                from nebula_ckpt.storage.local import LocalStorage

                def die(self: LocalStorage, rel: str, parts: list[memoryview]) -> dict[str, Any]:
                    os.makedirs(os.path.dirname(os.path.join(self.root, rel)), exist_ok=True)
                    with open(os.path.join(self.root, rel), "wb") as f:  # half a shard, then gone
                        f.write(bytes(parts[0]))
                    os.kill(os.getpid(), signal.SIGKILL)
                    raise AssertionError("unreachable")

                LocalStorage.write_parts = die  # type: ignore[method-assign]
            try:
                dcp.save({"model": msd, "optim": osd, "step": 9}, storage_writer=NebulaStorageWriter(root, step=9))
                report["step9"] = "committed"
            except BaseException as e:  # noqa: B036 - DCP raises CheckpointException (a BaseException)
                report["step9"] = _error(e)
            with open(os.path.join(out, f"{scenario}-r{rank}.json"), "w") as f:
                json.dump(report, f)
            os._exit(0)  # a job whose rank died is torn down, not closed
        dcp.save({"model": msd, "optim": osd, "step": 5}, storage_writer=NebulaStorageWriter(root, step=5))
        ref = full_sd(msd, osd)
        if rank == 0:
            torch.save(ref, f"{out}/ref5.pt")
        train(model, opt, 1, seed=20 + rank)
        msd, osd = get_state_dict(model, opt)
        fut = dcp.async_save({"model": msd, "optim": osd, "step": 6}, storage_writer=NebulaStorageWriter(root),
                             checkpoint_id="step-6")
        fut.result()
        ref = full_sd(msd, osd)
        if rank == 0:
            torch.save(ref, f"{out}/ref6.pt")
        try:  # a committed step is never overwritten
            dcp.save({"model": msd, "optim": osd, "step": 5}, storage_writer=NebulaStorageWriter(root, step=5))
            report["again5"] = "committed"
        except BaseException as e:  # noqa: B036
            report["again5"] = _error(e)
        if rank == world - 1:  # the hostile case: this rank fails in write_data
            def boom(self: Any, rel: str, tensors: Any) -> dict[str, Any]:
                raise OSError(28, "injected: no space left on device")

            real = NebulaStorageWriter._write_shard
            NebulaStorageWriter._write_shard = boom  # type: ignore[method-assign]
        try:
            dcp.save({"model": msd, "optim": osd, "step": 7}, storage_writer=NebulaStorageWriter(root, step=7))
            report["step7"] = "committed"
        except BaseException as e:  # noqa: B036
            report["step7"] = _error(e)
        report["after7"] = sorted(os.listdir(os.path.join(root, "step-7"))) if os.path.isdir(
            os.path.join(root, "step-7")) else None
        if rank == world - 1:
            NebulaStorageWriter._write_shard = real  # type: ignore[method-assign]
        dist.barrier()
        dcp.save({"model": msd, "optim": osd, "step": 8}, storage_writer=NebulaStorageWriter(root, step=8))
    elif scenario == "load":
        model, opt = build(1234)
        train(model, opt, 1, seed=99)
        msd, osd = get_state_dict(model, opt)
        sd: dict[str, Any] = {"model": msd, "optim": osd, "step": -1}
        with NebulaStorageReader(root, 5) as reader:
            dcp.load(sd, storage_reader=reader)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        got = full_sd(*get_state_dict(model, opt))
        got["step"] = sd["step"]
        if rank == 0:
            torch.save(got, f"{out}/dcp5.pt")

        model2, opt2 = build(4321)
        train(model2, opt2, 1, seed=98)
        msd2, osd2 = get_state_dict(model2, opt2)
        into: dict[str, Any] = {"model": msd2, "optim": osd2, "step": -1}
        with nc.Checkpointer(root, memory_tier=False) as ck:
            report["latest"] = ck.load_latest(into)
        set_state_dict(model2, opt2, model_state_dict=into["model"], optim_state_dict=into["optim"])
        got = full_sd(*get_state_dict(model2, opt2))
        got["step"] = into["step"]
        if rank == 0:
            torch.save(got, f"{out}/ck.pt")
    with open(os.path.join(out, f"{scenario}-r{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from launch import leave  # the script's folder is on sys.path

    leave()  # no interpreter teardown: see launch.leave (a torch / gloo abort at exit)
