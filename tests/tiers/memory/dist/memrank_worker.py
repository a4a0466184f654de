"""One rank of a multi-rank job on the memory tier alone (run by
tests/tiers/memory/dist/test_incremental_memory_ranks.py).

Usage: python memrank_worker.py SCENARIO ROOT OUT   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in env)

``save``: each rank saves steps 1..STEPS of a state with a large frozen tensor and a small trained
one (both its own: they differ between ranks) on its memory tier (``keep_last=3``), reports the
SHA-256 of every tensor of each step, asks ``remove(1)`` (a base later steps refer to), then
SIGKILLs itself (a job torn down after a committed step). ``load``: a new job restores the newest
step every rank has and reports what it got.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist

import nebula_ckpt as nc
from tests.dist.launch import gloo, write_report

STEPS = 5


def _state(rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(100 + rank)
    return {"frozen": torch.randn(256, 1024, generator=g), "train": torch.zeros(1024), "step": -1}


def _digest(state: dict[str, Any]) -> dict[str, str]:
    return {k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in state.items() if torch.is_tensor(v)}


def main() -> None:
    scenario, root, out = sys.argv[1:4]
    with gloo() as rank:
        state = _state(rank)
        report: dict[str, Any] = {"rank": rank}
        with nc.Checkpointer(root, tiers=[nc.MemoryTier(keep_last=3)]) as ck:
            if scenario == "save":
                for step in range(1, STEPS + 1):
                    state["train"] += step + 0.25 * rank
                    state["step"] = step
                    h = ck.save(step, state)
                    report.setdefault("written", []).append(sum(h.metrics.written_bytes.values()))
                    report[f"digest{step}"] = _digest(state)
                report["removed"] = ck.remove(1)
                write_report(out, scenario, rank, report)
                dist.barrier()  # both reports are out: the job dies after its last committed step
                os.kill(os.getpid(), signal.SIGKILL)
            into = {"frozen": torch.zeros(256, 1024), "train": torch.zeros(1024), "step": -1}
            report["step"] = ck.load_latest(into)
            report["restored_from"] = ck.last_restore
            report["saved_step"] = into["step"]
            report["digest"] = _digest(into)
        write_report(out, scenario, rank, report)


if __name__ == "__main__":
    main()
    from tests.dist.launch import leave

    leave()  # no interpreter teardown: see launch.leave
