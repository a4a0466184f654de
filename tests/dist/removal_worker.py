"""One rank of the multi-rank durable removal test (run by tests/dist/test_removal_multirank.py).

Usage: python removal_worker.py SCENARIO ROOT OUT   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in env)

``remove``: every rank saves steps 1..3 of a state with a large frozen tensor (its own) and a small
trained one on the shared root alone (steps 2 and 3 refer to step 1's shards), asks ``remove(1)``
(rank 0 records the request on the shared tier: step 1 stays while 2 and 3 refer to it), reports,
and SIGKILLs itself. ``rest``: a new job removes steps 2 and 3 and reports what is listed then.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist
from launch import gloo, write_report

import nebula_ckpt as nc


def main() -> None:
    scenario, root, out = sys.argv[1:4]
    with gloo() as rank:
        frozen = torch.randn(256, 256, generator=torch.Generator().manual_seed(100 + rank))
        report: dict[str, Any] = {"rank": rank}
        with nc.Checkpointer(root, keep_last=10, memory_tier=False) as ck:
            if scenario == "remove":
                for step in (1, 2, 3):
                    h = ck.save(step, {"frozen": frozen, "train": torch.full((64,), float(step + rank))})
                    report.setdefault("written", []).append(sum(h.metrics.written_bytes.values()))
                report["removed"] = ck.remove(1)
                dist.barrier()
                report["listed"] = ck.list()
                write_report(out, scenario, rank, report)
                dist.barrier()  # both reports are out: the job dies right after remove() returned
                os.kill(os.getpid(), signal.SIGKILL)
            report["listed_before"] = ck.list()
            dist.barrier()  # every rank listed before rank 0 removes
            report["removed"] = [ck.remove(2), ck.remove(3)]
            dist.barrier()
            report["listed"] = ck.list()
            report["latest"] = ck.load_latest(into={"frozen": torch.zeros(256, 256), "train": torch.zeros(64)})
        write_report(out, scenario, rank, report)


if __name__ == "__main__":
    main()
