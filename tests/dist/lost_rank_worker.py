"""A job whose last rank is lost between two saves (``tests/dist/test_multirank.py``).

``lost_rank_worker.py ROOT OUT``: every rank saves steps 1..3 on the shared root (no memory tier);
then the last rank dies of SIGKILL, and the others save step 4 and report what its handle raised
(``OUT/lost-r<rank>.json``).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
from launch import gloo, write_report

import nebula_ckpt as nc


def main() -> None:
    root, out = sys.argv[1:3]
    with gloo() as rank:
        world = int(os.environ["WORLD_SIZE"])
        ck = nc.Checkpointer(root, memory_tier=False)
        for step in (1, 2, 3):
            ck.save(step, {"w": torch.full((4,), float(step)), "mine": torch.full((2,), float(rank))})
        if rank == world - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(1)  # the lost rank is gone before step 4's first round
        try:
            ck.save(4, {"w": torch.full((4,), 4.0), "mine": torch.full((2,), float(rank))})
            got = "committed"
        except Exception as e:  # the lost rank's peers must hear of it, not hang
            got = f"{type(e).__name__}: {e}"
        write_report(out, "lost", rank, {"step4": got})
        os._exit(0)  # a job whose rank died is torn down, not closed


if __name__ == "__main__":
    main()
