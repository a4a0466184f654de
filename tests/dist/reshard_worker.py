"""One rank of a resharding test job (run as a subprocess by tests/dist/test_reshard.py).

Usage: python reshard_worker.py SCENARIO ROOT OUT [ROOT2]   (RANK, WORLD_SIZE, MASTER_* in env)

``save``: FSDP2 (``fully_shard`` on a CPU mesh of every rank, gloo) trains a small model with
AdamW, saves step 5 through ``nebula_ckpt.Checkpointer(ROOT)`` and rank 0 writes the full
(unsharded) state to ``OUT/ref.pt``. The last layer has 6 rows: with 4 ranks one rank's shard of
it is empty.

It also saves and restores the DTensors of :func:`layout_worker.roles_swapped` (``OUT/roles-swapped``).

``load``: a job of another world size builds the same model sharded over its own ranks and
(a) restores ROOT with ``nebula_ckpt.restore.reshard.load_resharded`` -> ``OUT/resharded.pt``;
(b) loads it again with ``dcp.load`` through ``NebulaStorageReader`` into fresh nested state
dicts -> ``OUT/dcp.pt``; (c) saves the restored state as step 6 under ROOT2 (a checkpoint of
this world size, for the CLI export test).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model sharded with FSDP2 over every rank, and its AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 6))
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


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Every tensor of the model and optimizer state, unsharded (a collective), by saved key."""
    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

    out: dict[str, Any] = {f"model/{k}": full(v) for k, v in model.state_dict().items()}
    osd = opt.state_dict()
    for i, st in osd["state"].items():
        for k, v in st.items():
            out[f"optim/state/{i}/{k}"] = full(v)
    out["lr"] = osd["param_groups"][0]["lr"]
    return out


def main() -> None:
    scenario, root, out = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    import nebula_ckpt as nc

    if scenario == "save":
        model, opt = build(0)
        train(model, opt, 2, seed=10 + rank)
        opt.param_groups[0]["lr"] = 0.0123  # a non-tensor leaf the restore must bring back
        with nc.Checkpointer(root, memory_tier=False) as ck:
            ck.save(5, {"model": model, "optim": opt, "step": 5})
        ref = full_state(model, opt)
        if rank == 0:
            torch.save(ref, f"{out}/ref.pt")
        from launch import write_report
        from layout_worker import roles_swapped  # the same world size, another layout (test_reshard_layout.py)

        write_report(out, "roles-swapped", rank, roles_swapped(f"{out}/roles-swapped"))
    elif scenario == "load":
        import torch.distributed.checkpoint as dcp

        from nebula_ckpt.dcp import NebulaStorageReader
        from nebula_ckpt.errors import ValidationError
        from nebula_ckpt.restore.dcp_reader import newest_manifest as newest
        from nebula_ckpt.restore.reshard import load_resharded
        from nebula_ckpt.storage.local import LocalStorage

        storage = LocalStorage(root)
        man = newest(storage)
        # DTensor parameters whose AdamW has no state yet (created lazily): refused on every rank,
        # naming the key and the fix, before anything changes (the state's layout is unknown)
        fresh, fresh_opt = build(1234)
        try:
            load_resharded(storage, man.step, man, {"model": fresh, "optim": fresh_opt, "step": -1})
            refused = "restored"
        except ValidationError as e:
            refused = str(e)
        if rank == 0:
            with open(f"{out}/fresh-optimizer.txt", "w") as f:
                f.write(refused)

        model, opt = build(1234)
        train(model, opt, 1, seed=99)  # AdamW creates its state lazily: make it exist
        into: dict[str, Any] = {"model": model, "optim": opt, "step": -1}
        load_resharded(storage, man.step, man, into)
        got = full_state(model, opt)
        got["step"] = into["step"]
        if rank == 0:
            torch.save(got, f"{out}/resharded.pt")

        model2, opt2 = build(7)
        train(model2, opt2, 1, seed=98)
        sd = {"model": model2.state_dict(), "optim": opt2.state_dict(), "step": 0}
        with NebulaStorageReader(root) as reader:
            dcp.load(sd, storage_reader=reader)
        model2.load_state_dict(sd["model"])
        opt2.load_state_dict(sd["optim"])
        got2 = full_state(model2, opt2)
        got2["step"] = sd["step"]
        if rank == 0:
            torch.save(got2, f"{out}/dcp.pt")

        with nc.Checkpointer(sys.argv[4], memory_tier=False) as ck:
            ck.save(6, {"model": model, "optim": opt, "step": 6})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from launch import leave  # the script's folder is on sys.path

    leave()  # no interpreter teardown: see launch.leave (a torch / gloo abort at exit)
