"""One rank of a job whose partner's host-memory budget cannot hold its replica (run by
tests/tiers/memory/dist/test_replicas_budget.py).

Usage: python budget_replica_worker.py ROOT OUT SHM_BASE   (RANK, WORLD_SIZE, MASTER_* in env)

Two simulated nodes, one rank each: rank 0 is node ``n0`` (A, a 4 MiB state), rank 1 node ``n1``
(B, a 0.25 MiB state, ``host_memory_budget`` 2 MiB: its own saves fit, A's copy does not), each
with its own ``NEBULA_SHM_DIR`` and ``MemoryTier(replicas=1)``. Both save steps 1 and 2 and report
what each handle said, B's stats and what B's replica store holds.
"""

from __future__ import annotations

import glob
import os
import sys
from typing import Any

from tests.dist.launch import gloo, simulated_node, write_report

ROOT, OUT, SHM_BASE = sys.argv[1:4]
RANK = int(os.environ["RANK"])
SHM = simulated_node(SHM_BASE, f"n{RANK}")
MiB = 1 << 20
BUDGET = 2 * MiB

import torch  # noqa: E402

import nebula_ckpt as nc  # noqa: E402


def main() -> None:
    with gloo():
        nbytes = 4 * MiB if RANK == 0 else MiB // 4
        ck = nc.Checkpointer(ROOT, tiers=[nc.MemoryTier(replicas=1), nc.LocalTier(ROOT, every=1000)],
                             host_memory_budget=BUDGET if RANK == 1 else None)
        written: dict[int, Any] = {}
        errors: dict[int, str] = {}
        for step in (1, 2):
            h = ck.save_async(step, {"w": torch.full((nbytes // 4,), float(10 * RANK + step))})
            try:
                written[step] = h.result(timeout=120)
            except nc.PersistError as e:
                errors[step] = f"{sorted(e.failures)}: {e}"
                written[step] = list(h.tiers_written)
        held = sorted(os.path.relpath(p, SHM) for p in glob.glob(f"{SHM}/nebula_ckpt-*/*/replicas/r*/step-*"))
        used = ck._saves.pool.used()  # what the budget counts on this rank, after the saves
        ck.close()
        write_report(OUT, "budget", RANK, {"written": written, "errors": errors, "held": held, "used": used},
                     default=str)


if __name__ == "__main__":
    main()
