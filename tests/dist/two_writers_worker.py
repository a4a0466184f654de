"""One rank of a job that opens a second Checkpointer on its root while the first one still
persists (run by tests/dist/test_two_writers_ranks.py), as DeepSpeed's tests build a second
engine to load what the first one saved.

Usage: python two_writers_worker.py ROOT OUT   (RANK, WORLD_SIZE, MASTER_* in env)

The older Checkpointer saves step 1 (tag ``t1``); its disk write is held in the shard (a real
local tier paused there, :mod:`faults`) once its memory tier committed it. Then the newer
Checkpointer is made (in a multi-rank job its constructor takes the writer generation); the
pause ends once that constructor returned, or after a grace period (the newer one waits for
the older one's persist). The newer one reads ``t1``, saves step 2 and closes; the report says
what it read, which tiers hold what, and what the older one says when asked to save again.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: faults

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from launch import write_report  # noqa: E402

import nebula_ckpt as nc  # noqa: E402
from faults import FaultyTier  # noqa: E402

GRACE_S = 3.0


def _state(step: int, rank: int) -> dict[str, Any]:
    return {"w": torch.full((64,), float(10 * step + rank)), "step": step}


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def main() -> None:
    root, out = sys.argv[1:3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report: dict[str, Any] = {"rank": rank}
    slow = FaultyTier(root, pause_at="shard")
    older = nc.Checkpointer(root, tiers=[nc.MemoryTier(), slow])
    h = older.save_async(1, _state(1, rank), tag="t1")
    mem = older.tiers[0].name
    deadline = time.monotonic() + 120
    while (mem not in h.tiers_written or not slow.reached.is_set()) and not h.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    report["older_before"] = {"written": list(h.tiers_written), "disk_paused": slow.reached.is_set()}
    made = threading.Event()

    def opener() -> None:
        made.wait(GRACE_S)
        slow.gate.set()
    threading.Thread(target=opener, daemon=True).start()
    newer = nc.Checkpointer(root, tiers=[nc.MemoryTier(), nc.LocalTier(root)])
    made.set()
    report["older_result"] = _error(lambda: h.result(120))
    report["read_t1"] = _error(lambda: newer.read(tag="t1"))
    if report["read_t1"] == "no error":
        step, got = newer.read(tag="t1")
        report["read_t1_value"] = [step, float(got["w"][0])]
    newer.save(2, _state(2, rank), tag="t2")
    report["newer_tiers"] = {name.split(":")[0]: steps for name, steps in newer.list(detailed=True).items()}
    report["older_again"] = _error(lambda: older.save(3, _state(3, rank)))
    newer.close()
    slow.gate.set()
    older.close()
    dist.barrier()
    with nc.Checkpointer(root) as again:  # every rank restarts: both steps are on disk
        report["restart"] = again.list()
    write_report(out, "two", rank, report)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
