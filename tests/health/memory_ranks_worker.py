"""One rank of tests/health/test_memory_keeps_healthy.py's multi-rank case.

Usage: python memory_ranks_worker.py ROOT OUT PHASE [SHM_BASE]  (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in env)

``train``: tiers ``[MemoryTier(), LocalTier(ROOT, every=2)]`` (each rank's own memory tier, the
shared disk tier): step 2 on both, step 3 on the memory tiers alone, confirmed healthy; the loss
goes NaN on every rank and step 8 is saved (suspect at once, on both tiers); a clean close.
``budget``: :func:`_budget_saves`. ``replicas`` (argv SHM_BASE: each rank a node of its own):
:func:`_replicas_train`; then ``restart`` with that SHM_BASE restores with the same memory tier.
``restart``: every rank restores. Each rank writes what it holds and restored to ``OUT/<phase>-r<rank>.json``.
"""

from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "dist"))
from launch import gloo, simulated_node, write_report  # noqa: E402

if len(sys.argv) > 4:  # the replicas phases: each rank a node of its own (SHM_BASE/n<rank>)
    simulated_node(sys.argv[4], f"n{os.environ['RANK']}")

import nebula_ckpt as nc  # noqa: E402


def _state(step: int, rank: int = -1) -> dict[str, object]:
    """Step ``step``'s state (``rank``'s own: ``10 * step + rank``; -1: ``step`` on every rank)."""
    return {"w": torch.full((16,), float(step if rank < 0 else 10 * step + rank)), "step": step}


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


def _replicas_train(root: str, rank: int) -> dict[str, object]:
    """``replicas``: as ``train`` with ``MemoryTier(replicas=1)``, ended by a crash (no close)."""
    ck = nc.Checkpointer(root, tiers=[nc.MemoryTier(replicas=1), nc.LocalTier(root, every=2, keep_last=3)])
    ck.save(2, _state(2, rank))
    ck.report(3, loss=1.0)
    ck.report(4, loss=1.0)
    ck.save(3, _state(3, rank))
    ck.report(5, loss=1.0)
    ck.report(6, loss=1.0)
    ck.report(7, loss=math.nan)
    ck.save_async(8, _state(8, rank)).result()  # its replica is in too
    return {"memory": ck.list(detailed=True)[ck.tiers[0].name],
            "replicas": ck.stats()["replicas"].get("held_steps")}


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
                # no wait for rank 0's healthy mark (written in the background): every rank keeps
                # the step it confirmed itself
                ck.report(7, loss=math.nan)
                ck.save(8, _state(8))
                report["memory"] = ck.list(detailed=True)[ck.tiers[0].name]
        elif phase == "replicas":
            report.update(_replicas_train(root, rank))
            write_report(out, phase, rank, report)
            torch.distributed.barrier()
            os._exit(0)  # a crash: nothing closed
        elif phase == "budget":
            report["saves"] = _budget_saves(root)
        else:
            into = _state(-1)
            tiers = [nc.MemoryTier(replicas=1), nc.LocalTier(root)] if len(sys.argv) > 4 else None
            with nc.Checkpointer(root, tiers=tiers) as ck:
                report["restored"] = ck.load_latest(into=into)
                report["w"] = float(into["w"][0])  # type: ignore[index]
    write_report(out, phase, rank, report)


if __name__ == "__main__":
    main()
