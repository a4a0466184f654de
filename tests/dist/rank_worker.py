"""One rank of a multi-rank test job (run as a subprocess by tests/dist/test_multirank.py).

Usage: python rank_worker.py SCENARIO ROOT OUT   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in env;
       TEST_SMALL_REPLICA_BYTES, if set, replaces nebula_ckpt.ranks.shards.SMALL_REPLICA_BYTES)

Every rank trains the same tiny model (DDP: replicated; FSDP2: sharded with ``fully_shard``) with
AdamW on gloo, saves through ``nebula_ckpt.Checkpointer(ROOT)`` (which finds the process group by
itself) and writes what it observed as JSON to ``OUT/<scenario>-r<rank>.json`` for the test to check.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist

import nebula_ckpt as nc
from nebula_ckpt.ranks import shards


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    loss = torch.zeros(())
    for _ in range(steps):
        x = torch.randn(4, 16, generator=g)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())


def _flat(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(state, dict):
        for k, v in state.items():
            out.update(_flat(v, f"{prefix}{k}/"))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            out.update(_flat(v, f"{prefix}{i}/"))
    elif isinstance(state, torch.Tensor):
        t = state.to_local() if hasattr(state, "to_local") else state
        out[prefix.rstrip("/")] = t.detach().clone()
    return out


def _digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, list[float]]:
    flat = _flat({"model": model.state_dict(), "optim": opt.state_dict()["state"]})
    return {k: v.double().flatten().tolist() for k, v in flat.items()}


def _full_digest(state: Any) -> dict[str, list[float]]:
    """Every tensor of ``state`` whole (DTensors gathered: a collective, same order on all ranks)."""
    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    flat: dict[str, list[float]] = {}
    stack: list[tuple[str, Any]] = [("", state)]
    while stack:
        path, v = stack.pop(0)
        if isinstance(v, dict):
            stack.extend((f"{path}{k}/", x) for k, x in v.items())
        elif isinstance(v, (list, tuple)):
            stack.extend((f"{path}{i}/", x) for i, x in enumerate(v))
        elif isinstance(v, torch.Tensor):
            flat[path.rstrip("/")] = full(v).detach().double().flatten().tolist()
    return flat


def _ddp(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.parallel.DistributedDataParallel(_model(seed))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _frozen_ddp(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """DDP with a large frozen parameter (the same on every rank): its saves are incremental."""
    inner = _model(seed)
    inner.register_parameter("frozen", torch.nn.Parameter(torch.randn(128, 256), requires_grad=False))
    model = torch.nn.parallel.DistributedDataParallel(inner)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _fsdp(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model(seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _die_in_shared_write(step: int) -> None:
    """SIGKILL this rank while it writes its share of ``step`` on the shared tier (its file is
    half written: the other ranks' rounds see the connection drop)."""
    from nebula_ckpt.storage.local import LocalStorage

    real = LocalStorage.write_parts

    def write_parts(self: LocalStorage, rel: str, parts: list[memoryview]) -> dict[str, Any]:
        if rel.startswith(f"step-{step}/"):
            os.makedirs(os.path.join(self.root, os.path.dirname(rel)), exist_ok=True)
            with open(os.path.join(self.root, rel), "wb") as f:
                f.write(bytes(parts[0]))
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, rel, parts)

    LocalStorage.write_parts = write_parts  # type: ignore[method-assign]


def main() -> None:
    scenario, root, out = sys.argv[1:4]
    if os.environ.get("TEST_SMALL_REPLICA_BYTES"):
        shards.SMALL_REPLICA_BYTES = int(os.environ["TEST_SMALL_REPLICA_BYTES"])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    report: dict[str, Any] = {"rank": rank, "world": world}
    build = _fsdp if scenario.startswith("fsdp") else _frozen_ddp if scenario.startswith("frozen") else _ddp
    # a per-rank tensor that never changes: each rank's own share of a save refers to it
    still = {"still": torch.full((8192,), float(rank))} if scenario.startswith("frozen") else {}
    memory = os.environ.get("TEST_MEMORY_TIER", "1") == "1"
    opts = json.loads(os.environ.get("TEST_STORAGE_OPTIONS", "null"))
    if scenario.endswith("save") or scenario == "kill":
        model, opt = build(0)
        if scenario == "kill" and rank == world - 1:
            _die_in_shared_write(step=3)
        with nc.Checkpointer(root, memory_tier=memory, storage_options=opts) as ck:
            for step in ((1, 2, 3, 4) if scenario.startswith("frozen") else (1, 2, 3)):
                _train(model, opt, 2, seed=step * 10 + (rank if scenario.startswith("fsdp") else 0))
                report[f"digest{step}"] = _digest(model, opt)
                if scenario == "kill" and step == 3:
                    h = ck.save_async(step, {"model": model, "optim": opt, "step": step,
                                             "mine": torch.full((3,), float(rank))})
                    try:
                        h.result(timeout=120)
                        report["step3"] = "committed"
                    except Exception as e:  # the others must see the failure, not hang
                        report["step3"] = f"{type(e).__name__}: {e}"
                    report["list"] = ck.list(detailed=True)
                    with open(os.path.join(out, f"{scenario}-r{rank}.json"), "w") as f:
                        json.dump(report, f)
                    os._exit(0)  # a job whose rank died is torn down, not closed
                # "mine" differs between ranks (like a per-rank RNG state): never taken for a replica
                h = ck.save(step, {"model": model, "optim": opt, "step": step, "mine": torch.full((3,), float(rank)),
                                   **still})
                report.setdefault("written", []).append(h.tiers_written)
                report.setdefault("written_bytes", []).append(h.metrics.written_bytes)
            report["stats"] = ck.stats()
    elif scenario in ("sdict_write", "sdict_read"):  # DCP-style state dicts from get_state_dict (FSDP2)
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model, opt = _fsdp(0 if scenario == "sdict_write" else 1234)
        _train(model, opt, 2 if scenario == "sdict_write" else 1, seed=7 + rank)
        msd, osd = get_state_dict(model, opt)
        with nc.Checkpointer(root, memory_tier=memory, storage_options=opts) as ck:
            if scenario == "sdict_write":
                ck.save(1, {"model": msd, "optim": osd})
            else:
                report["step"] = ck.load_latest({"model": msd, "optim": osd})
                set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        report["full"] = _full_digest(get_state_dict(model, opt))
    elif scenario == "split_root":  # a node-local path: every rank sees another folder
        try:
            nc.Checkpointer(f"{root}-node{rank}", memory_tier=memory)
            report["error"] = None
        except nc.ValidationError as e:
            report["error"] = str(e)
    elif scenario == "mismatch":  # the last rank makes one save fewer than the others
        model, opt = build(0)
        with nc.Checkpointer(root, memory_tier=memory, storage_options=opts) as ck:
            for step in range(1, 4 if rank < world - 1 else 3):
                h = ck.save_async(step, {"model": model, "step": step})
                try:
                    h.result(timeout=120)
                    report[f"step{step}"] = "committed"
                except Exception as e:
                    report[f"step{step}"] = f"{type(e).__name__}: {e}"
                    break
            report["list"] = ck.list(detailed=True)
    else:  # "...load": a new job restores the newest checkpoint every rank has
        model, opt = build(1234)
        _train(model, opt, 1, seed=99)  # optimizer state exists (AdamW creates it lazily)
        state: dict[str, Any] = {"model": model, "optim": opt, "step": -1, "mine": torch.zeros(3),
                                 **{k: torch.zeros_like(v) for k, v in still.items()}}
        with nc.Checkpointer(root, memory_tier=memory, storage_options=opts) as ck:
            report["step"] = ck.load_latest(state)
            report["restored_from"] = ck.last_restore
        report["saved_step"] = state["step"]
        report["mine"] = state["mine"].tolist()
        report["still"] = state["still"].tolist() if still else None
        report["digest"] = _digest(model, opt)
    with open(os.path.join(out, f"{scenario}-r{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from launch import leave  # the script's folder is on sys.path

    leave()  # no interpreter teardown: see launch.leave (a torch / gloo abort at exit)
