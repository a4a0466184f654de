"""One rank of the multi-rank health test (run by tests/dist/test_health_ranks.py).

Usage: python health_worker.py ROOT OUT PHASE   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in env)

``train``: every rank saves steps 0, 5, 10 and reports a finite loss at every step up to 12.
``nan``: every rank restores; rank 1 alone sees a NaN loss at the first step after it; then the
job restarts (a new Checkpointer) and every rank restores again. Each rank writes what it
restored and skipped to ``OUT/<phase>-r<rank>.json``.
"""

from __future__ import annotations

import math
import sys

import torch
from launch import gloo, write_report

import nebula_ckpt as nc


def main() -> None:
    root, out, phase = sys.argv[1:4]
    with gloo() as rank:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8)
        state = {"model": model, "step": -1}
        report: dict[str, object] = {"rank": rank}
        with nc.Checkpointer(root, keep_last=10) as ck:
            report["restored"] = ck.load_latest(into=state)
            report["last_restore"] = ck.last_restore
            if phase == "train":
                for step in range(13):
                    ck.report(step, loss=1.0)
                    if step % 5 == 0:
                        state["step"] = step
                        ck.save(step, state)
            elif phase == "nan":
                ck.report(11, loss=math.nan if rank == 1 else 1.0)
                ck.report(12, loss=1.0)
        if phase == "nan":  # the job restarts
            with nc.Checkpointer(root, keep_last=10) as ck:
                report["restarted"] = ck.load_latest(into=state)
                report["restart"] = ck.last_restore
    write_report(out, phase, rank, report)


if __name__ == "__main__":
    main()
