"""One rank of the copied-steps test (run by tests/dist/test_copied_steps_ranks.py).

Usage: python copied_steps_worker.py ROOT OUT   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in env)

The root holds steps copied in without their ``_nebula/`` folder, of writer generations up to 3.
The job saves steps 4, 5 and 6 with ``keep_last=2``, then restarts (a new Checkpointer), lists and
restores; every rank reports what it listed, restored and the generation it wrote under.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from launch import gloo, write_report

import nebula_ckpt as nc


def main() -> None:
    root, out = sys.argv[1:3]
    with gloo() as rank:
        report: dict[str, Any] = {"rank": rank}
        with nc.Checkpointer(root, keep_last=2, memory_tier=False) as ck:
            for s in (4, 5, 6):
                ck.save(s, {"x": torch.full((4,), float(10 * s + rank))})
        x = torch.zeros(4)
        with nc.Checkpointer(root, memory_tier=False) as ck:  # the job restarts
            # Listed after the restart: rank 0 prunes after the commit the other ranks wait
            # for, so only its close() (which the next open follows) orders the prune before a list.
            report["listed"] = ck.list()
            report["latest"] = ck.load_latest(into={"x": x})
        report["x"] = x[0].item()
        write_report(out, "copied", rank, report)


if __name__ == "__main__":
    main()
