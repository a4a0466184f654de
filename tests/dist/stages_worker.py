"""One rank of a pipeline-stage job saved with ``Checkpointer`` (run by tests/dist/test_stages_reshard.py).

Usage: python stages_worker.py SCENARIO ROOT OUT   (RANK, WORLD_SIZE, MASTER_* in env)

The ranks hold different state, like the stages of a pipeline, each stage's ranks a data-parallel
group (:func:`state`): ``stage<S>`` (that stage's model and its AdamW), ``common`` (a tensor every
rank holds alike) and ``step``.

``save``: 4 ranks (2 stages x 2) save step 3 through ``Checkpointer(ROOT)`` (disk tier alone).
``load``: 2 ranks (2 stages x 1) each restore their stage's state with ``load_latest`` (another
world size: resharded) into a fresh model and AdamW of their stage; each writes
``OUT/load-r<rank>.json``: whether every tensor is the saved one, bit for bit.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist


def stage_model(stage: int, fill: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Stage ``stage``'s model and AdamW after 2 steps (the same on every rank of the stage), or
    a fresh one of the same structure (``fill`` False) with one step of other data."""
    torch.manual_seed(100 + stage if fill else 999)
    model = torch.nn.Sequential(torch.nn.Linear(8 + stage, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2 if fill else 1):
        model(torch.randn(3, 8 + stage)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def state(stage: int, fill: bool) -> dict[str, Any]:
    model, opt = stage_model(stage, fill)
    common = torch.arange(6.0) if fill else torch.zeros(6)
    return {f"stage{stage}": {"model": model, "optim": opt}, "common": common, "step": 3 if fill else -1}


def tensors(st: dict[str, Any], stage: int) -> dict[str, torch.Tensor]:
    """Every tensor of ``st``, by a name: the model's, the optimizer's state, ``common``."""
    part = st[f"stage{stage}"]
    out = {f"model/{k}": v for k, v in part["model"].state_dict().items()}
    for i, s in part["optim"].state_dict()["state"].items():
        out.update({f"optim/{i}/{k}": v for k, v in s.items() if isinstance(v, torch.Tensor)})
    out["common"] = st["common"]
    return out


def main() -> None:
    scenario, root, out = sys.argv[1:4]
    from launch import write_report  # the script's folder is on sys.path

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    import nebula_ckpt as nc

    stage = rank // (world // 2)
    if scenario == "save":
        with nc.Checkpointer(root, memory_tier=False) as ck:
            ck.save(3, state(stage, fill=True)).result()
    else:
        into = state(stage, fill=False)
        with nc.Checkpointer(root, memory_tier=False) as ck:
            step = ck.load_latest(into)
        want = tensors(state(stage, fill=True), stage)
        got = tensors(into, stage)
        same = sorted(k for k in want if k in got and torch.equal(want[k], got[k]))
        write_report(out, "load", rank, {"rank": rank, "stage": stage, "step": step, "tensors": len(want),
                                         "same": same, "value": into["step"]})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
