"""A rank of a 2-rank job (gloo) for tests/cli/test_inspect_ranks.py:
``inspect_ranks_worker.py save|restore ROOT OUT``.

``save``: steps 1 and 2 to ``[MemoryTier(keep_last=2), LocalTier(root)]``, rank 1 holding a key rank 0 lacks
(``stage1``, a pipeline stage's); then rank 1 dies and rank 0 saves step 3, which its own memory
tier commits and the shared tier cannot (rank 1 is gone), and dies too: no close(), as a killed job.
``restore``: a read-only ``load_latest`` on every rank (memory tier included, as a restart of the job
on the same host); writes ``OUT/r<rank>.json`` with the step restored."""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

import nebula_ckpt as nc


def _state(step: int, rank: int) -> dict[str, object]:
    state: dict[str, object] = {"model": {"w": torch.full((16,), float(step))}, "step": step}
    if rank == 1:
        state["stage1"] = torch.full((8,), float(step))
    return state


def main(mode: str, root: str, out: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    rank = dist.get_rank()
    if mode == "save":
        ck = nc.Checkpointer(root, tiers=[nc.MemoryTier(keep_last=2), nc.LocalTier(root)])
        for step in (1, 2):
            ck.save_async(step, _state(step, rank)).result()
        dist.barrier()
        if rank == 1:
            os._exit(0)
        try:
            ck.save_async(3, {"model": {"w": torch.full((16,), 3.0)}, "step": 3}).result(timeout=60)
        except Exception:  # the shared tier cannot commit without rank 1; rank 0's memory tier has
            pass
        os._exit(0)
    with nc.Checkpointer(root, read_only=True) as ck:
        state = _state(0, rank)
        step = ck.load_latest(into=state)
    with open(os.path.join(out, f"r{rank}.json"), "w") as f:
        json.dump({"step": step}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
