"""One rank of a 2-rank job that restores DTensors at the same world size into another layout
(run by tests/dist/test_reshard_layout.py).

Usage: python layout_worker.py ROOT OUT   (RANK, WORLD_SIZE=2, MASTER_ADDR, MASTER_PORT in env)

Saves step 1 (``memory_tier=False``): a (4, 4) DTensor ``a`` and an (8, 2) DTensor ``b``, both
``[Shard(0)]`` on a (2,) mesh, an FSDP2 model on that mesh with its AdamW state, and ``step``.
Then, in the same processes, restores it with ``load_latest`` into:

- ``other_mesh``: ``a``, the model and its optimizer on a (1, 2) mesh (HSDP: ``[Replicate(),
  Shard(0)]``, the same pieces on another mesh);
- ``plain``: full plain tensors, a plain model and an AdamW without state;
- ``shape``: ``b`` as a (4, 4) DTensor sharded on dim 1 (the same local shape, another global
  one): refused;
- ``one_rank``: ``load_resharded`` called directly, rank 1's ``b`` of another shape: refused on
  every rank before DCP's collectives (last: without the agreement the other rank would wait).

Writes ``OUT/layout-r<rank>.json``: for each case the keys whose full tensors are not the saved
ones, or the error. :func:`roles_swapped` (4 ranks) is run by ``reshard_worker.py save``.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from launch import leave, write_report  # the script's folder is on sys.path

A = torch.arange(16, dtype=torch.float32).reshape(4, 4)
B = torch.arange(16, dtype=torch.float32).reshape(8, 2) + 100


def model_on(mesh: Any, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model (FSDP2 over ``mesh``; plain without one) and its AdamW, its state made by one step."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 6))
    if mesh is not None:
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def full(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of ``state`` (DTensors gathered: a collective) by path."""
    out: dict[str, torch.Tensor] = {}
    for name, v in (("a", state["a"]), ("b", state["b"])):
        out[name] = v.full_tensor() if hasattr(v, "full_tensor") else v
    for k, v in state["model"].state_dict().items():
        out[f"model/{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v
    for i, st in state["optim"].state_dict()["state"].items():
        for k, v in st.items():
            out[f"optim/{i}/{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v
    return {k: v.detach().clone() for k, v in out.items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The keys whose tensors differ (or that only one side has)."""
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))


def roles_swapped(root: str) -> dict[str, Any]:
    """(4 ranks, run by ``reshard_worker.py save``) A (4, 4) DTensor saved on a (2, 2) mesh as
    ``[Replicate(), Shard(0)]`` restored as ``[Shard(0), Replicate()]``: the same mesh and local
    shapes, the mesh's dims used the other way round (ranks 1 and 2 hold each other's rows)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import nebula_ckpt as nc

    mesh = init_device_mesh("cpu", (2, 2))
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, {"a": distribute_tensor(A.clone(), mesh, [Replicate(), Shard(0)])})
    into = {"a": distribute_tensor(torch.zeros(4, 4), mesh, [Shard(0), Replicate()])}
    return {"got": restore(root, into), "equal": bool(torch.equal(into["a"].full_tensor(), A)),
            "local": into["a"].to_local().tolist()}


def restore(root: str, into: dict[str, Any]) -> Any:
    import nebula_ckpt as nc

    try:
        with nc.Checkpointer(root, memory_tier=False) as ck:
            return ck.load_latest(into=into)
    except nc.ValidationError as e:
        return f"ValidationError: {e}"


def main() -> None:
    root, out = sys.argv[1:3]
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import nebula_ckpt as nc
    from nebula_ckpt.restore.open import read_manifest
    from nebula_ckpt.restore.reshard import load_resharded
    from nebula_ckpt.storage.local import LocalStorage

    mesh = init_device_mesh("cpu", (2,))
    hsdp = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
    model, opt = model_on(mesh, 0)
    saved = {"a": distribute_tensor(A.clone(), mesh, [Shard(0)]), "b": distribute_tensor(B.clone(), mesh, [Shard(0)]),
             "model": model, "optim": opt, "step": 1}
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, saved)
    ref = full(saved)
    report: dict[str, Any] = {}

    model2, opt2 = model_on(hsdp, 5)
    moved = {"a": distribute_tensor(torch.zeros(4, 4), hsdp, [Replicate(), Shard(0)]),
             "b": distribute_tensor(torch.zeros(8, 2), mesh, [Shard(0)]), "model": model2, "optim": opt2, "step": 0}
    report["other_mesh"] = {"got": restore(root, moved), "differ": same(ref, full(moved)), "step": moved["step"]}

    model3 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 6))
    plain = {"a": torch.zeros(4, 4), "b": torch.zeros(8, 2), "model": model3,
             "optim": torch.optim.AdamW(model3.parameters(), lr=1e-2), "step": 0}
    report["plain"] = {"got": restore(root, plain), "differ": same(ref, full(plain))}

    model4, opt4 = model_on(mesh, 6)
    shape = {"a": distribute_tensor(torch.zeros(4, 4), hsdp, [Replicate(), Shard(0)]),
             "b": distribute_tensor(torch.zeros(4, 4), mesh, [Shard(1)]), "model": model4, "optim": opt4, "step": 0}
    report["shape"] = {"got": restore(root, shape), "a_untouched": bool((shape["a"].full_tensor() == 0).all())}

    storage = LocalStorage(root)
    one = {"a": distribute_tensor(torch.zeros(4, 4), hsdp, [Replicate(), Shard(0)]),
           "b": torch.zeros(9 if rank == 1 else 8, 2)}
    try:
        load_resharded(storage, 1, read_manifest(storage, 1), one, strict=False)
        report["one_rank"] = {"got": "restored"}
    except Exception as e:
        report["one_rank"] = {"got": f"{type(e).__name__}: {e}"}
    report["one_rank"]["a_untouched"] = bool((one["a"].to_local() == 0).all())
    write_report(out, "layout", rank, report)
    leave()  # no interpreter teardown: see launch.leave (a torch / gloo abort at exit)


if __name__ == "__main__":
    main()
