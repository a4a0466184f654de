"""One rank of tests/health/test_memory_keeps_healthy.py's multi-rank case.

Usage: python memory_ranks_worker.py ROOT OUT PHASE   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in env)

``train``: tiers ``[MemoryTier(), LocalTier(ROOT, every=2)]`` (each rank's own memory tier, the
shared disk tier): step 2 on both, step 3 on the memory tiers alone, confirmed healthy; the loss
goes NaN on every rank and step 8 is saved (suspect at once, on both tiers); a clean close.
``budget``: :func:`_budget_saves`. ``restart``: every rank restores. Each rank writes what it holds and restored to ``OUT/<phase>-r<rank>.json``.
"""

from __future__ import annotations

import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "dist"))
from launch import gloo, write_report  # noqa: E402

import nebula_ckpt as nc  # noqa: E402
from nebula_ckpt.health.book import HealthView  # noqa: E402
from nebula_ckpt.storage.local import LocalStorage  # noqa: E402


def _state(step: int) -> dict[str, object]:
    return {"w": torch.full((16,), float(step)), "step": step}


def _budget_saves(root: str) -> dict[int, str]:
    """``budget``: 1 MiB states under ``host_memory_budget`` 2.6 MiB (``on_full="wait"``): step 3
    (the memory tier alone) confirmed healthy, the loss NaN, steps 8, 9, 10 saved; each save's outcome."""
    mb = 1 << 20
    saves: dict[int, str] = {}
    with nc.Checkpointer(root, tiers=[nc.MemoryTier(), nc.LocalTier(root, every=2, keep_last=3)],
                         host_memory_budget=int(2.6 * mb), incremental=False, on_full="wait") as ck:
        after = {2: [(3, 1.0), (4, 1.0)], 3: [(5, 1.0), (6, 1.0), (7, math.nan)], 8: [], 9: [], 10: []}
        for step in (2, 3, 8, 9, 10):
            try:
                ck.save(step, {"w": torch.full((mb // 4,), float(step))})
                ck.wait()
                saves[step] = "ok"
            except Exception as e:  # noqa: BLE001 - the outcome is the report
                saves[step] = f"{type(e).__name__}: {e}"[:300]
            for at, loss in after[step]:
                ck.report(at, loss=loss)
    return saves


def main() -> None:
    root, out, phase = sys.argv[1:4]
    with gloo() as rank:
        report: dict[str, object] = {"rank": rank}
        if phase == "train":
            with nc.Checkpointer(root, tiers=[nc.MemoryTier(), nc.LocalTier(root, every=2, keep_last=3)]) as ck:
                ck.save(2, _state(2))
                ck.report(3, loss=1.0)
                ck.report(4, loss=1.0)
                ck.save(3, _state(3))
                ck.report(5, loss=1.0)
                ck.report(6, loss=1.0)
                view = HealthView(LocalStorage(root))
                deadline = time.monotonic() + 30  # rank 0 writes the healthy mark in the background
                while view.mark(1, 3).state != "healthy" and time.monotonic() < deadline:
                    time.sleep(0.05)
                    view = HealthView(LocalStorage(root))
                ck.report(7, loss=math.nan)
                ck.save(8, _state(8))
                report["memory"] = ck.list(detailed=True)[ck.tiers[0].name]
        elif phase == "budget":
            report["saves"] = _budget_saves(root)
        else:
            into = _state(-1)
            with nc.Checkpointer(root) as ck:
                report["restored"] = ck.load_latest(into=into)
                report["w"] = float(into["w"][0])  # type: ignore[index]
    write_report(out, phase, rank, report)


if __name__ == "__main__":
    main()
