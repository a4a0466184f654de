"""One rank of a job whose resharded ``load_latest`` loses a rank (run by tests/dist/test_reshard_rank_death.py).

Usage: python reshard_death_worker.py MODE ROOT OUT   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in env)

``save``: every rank saves steps 1 and 2 on the shared ROOT (disk tier only). The other modes run
at another world size, so ``load_latest`` reshards; rank 1 fails at a point of it, as a node
fault would make it, and every rank reports what its ``load_latest`` raised and what ``into``
holds afterwards in ``OUT/<mode>-r<rank>.json``:

* ``agree``  rank 1 SIGKILLs itself as it enters the resharded restore (before the ranks tell
             each other whether their ``into`` matched);
* ``dcp``    rank 1 SIGKILLs itself as it enters DCP's load (its plan collectives);
* ``stall``  rank 1 stalls as it enters DCP's load until the others' collective timed out.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launch import gloo, leave, write_report  # noqa: E402

import nebula_ckpt as nc  # noqa: E402
import nebula_ckpt.restore.reshard as reshard  # noqa: E402


def _fail_on_rank1(rank: int, name: str, stall: bool) -> None:
    """Replace ``reshard.<name>`` so that rank 1 dies (or stalls) as it enters it."""
    real = getattr(reshard, name)

    def entered(*a: Any, **k: Any) -> Any:
        if rank == 1:
            if stall:
                time.sleep(float(os.environ["NEBULA_COMMIT_TIMEOUT_S"]) + 6)
                leave(0)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **k)

    setattr(reshard, name, entered)


def main(mode: str, root: str, out: str) -> None:
    with gloo() as rank:
        if mode == "save":
            with nc.Checkpointer(root, memory_tier=False) as ck:
                for s in (1, 2):
                    ck.save_async(s, {"w": torch.full((1024,), float(s)), "step": s}).result(timeout=60)
            return
        _fail_on_rank1(rank, "load_resharded" if mode == "agree" else "_dcp_load", mode == "stall")
        ck = nc.Checkpointer(root, memory_tier=False)
        into = {"w": torch.zeros(1024), "step": -1}
        report: dict[str, Any] = {"kind": "ok"}
        try:
            ck.load_latest(into)
        except Exception as e:  # what the caller of load_latest gets
            report = {"kind": type(e).__name__, "persist": isinstance(e, nc.PersistError), "msg": str(e)}
        report.update(w_sum=float(into["w"].sum()), step=into["step"])
        write_report(out, mode, rank, report)
        leave(0)  # the group lost a rank: skip its teardown


if __name__ == "__main__":
    main(*sys.argv[1:4])
