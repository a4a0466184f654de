"""A rank of a 2-rank job (gloo) for tests/cli/test_persist_memory_ranks.py:
``persist_memory_ranks_worker.py save|restore ROOT OUT``.

``save``: steps 1..5 to ``[MemoryTier(keep_last=2), LocalTier(root, every=4)]`` (the disk takes
steps 1 and 5, the memory tier keeps 4 and 5), then ends without close(), as a killed job does.
``restore``: ``load_latest`` from the root alone; writes ``OUT/r<rank>.json`` with the step and
whether every tensor is bit-exact what that step saved."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import nebula_ckpt as nc


def _state(step: int, rank: int) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(1000, dtype=torch.float32) * step + rank}


def main(mode: str, root: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if mode == "save":
        ck = nc.Checkpointer(root, tiers=[nc.MemoryTier(keep_last=2), nc.LocalTier(root, every=4, keep_last=100)])
        for s in range(1, 6):
            ck.save(s, _state(s, rank)).result()
        dist.barrier()
        os._exit(0)
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
        state = {"w": torch.zeros(1000)}
        step = ck.load_latest(state)
    exact = step is not None and torch.equal(state["w"], _state(step, rank)["w"])
    with open(os.path.join(out, f"r{rank}.json"), "w") as f:
        json.dump({"step": step, "exact": exact}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
