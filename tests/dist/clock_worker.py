"""One rank of the multi-rank wall-clock test (run by tests/dist/test_multirank_clock.py).

Usage: python clock_worker.py ROOT OUT   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in env)

The shared disk tier takes at most one save per 0.5 s window of the wall clock (``every_seconds``);
the ranks save 8 times in lock-step (a barrier per save, as DDP's all-reduce keeps them), 0.6 s
apart, and the wall clock of both ranks steps back one hour (an NTP correction of a clock that
ran ahead) before the third save. Each rank writes the saves its disk tier wrote and dropped, and
the steps the tier lists, to ``OUT/clock-r<rank>.json``.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from launch import gloo, write_report

import nebula_ckpt as nc

_real_time = time.time
_shift = [0.0]


def _wall_clock() -> float:
    return _real_time() + _shift[0]


def main() -> None:
    root, out = sys.argv[1:3]
    time.time = _wall_clock  # this process's wall clock, stepped back below
    handles = []
    with gloo() as rank:
        with nc.Checkpointer(root, tiers=[nc.LocalTier(root, every_seconds=0.5, keep_last=100)],
                             memory_tier=False) as ck:
            for step in range(8):
                dist.barrier()
                if step == 2:
                    _shift[0] = -3600.0
                handles.append(ck.save_async(step, {"w": torch.full((16,), float(10 * step + rank))}))
                handles[-1].result(timeout=120)
                time.sleep(0.6)
            listed = ck.list()
    write_report(out, "clock", rank, {
        "written": [h.step for h in handles if any(t.startswith("local") for t in h.tiers_written)],
        "dropped": [h.step for h in handles if any(t.startswith("local") for t in h.tiers_dropped)],
        "listed": listed})


if __name__ == "__main__":
    main()
