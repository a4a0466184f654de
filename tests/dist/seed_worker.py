"""One rank of a restarted multi-rank job (run by tests/dist/test_incremental_seed_ranks.py).

Usage: python seed_worker.py SCENARIO ROOT OUT STEPS   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in env)

Every rank holds the same state (DDP-like: two large frozen tensors and a small trained one,
each stored once on the shared disk tier, by its owner rank; whole in each rank's memory tier).
Each life restores whatever is there, saves the steps of ``STEPS`` (comma-separated, may be
empty) on the memory tier and the shared disk tier, reports what each save wrote per tier and
the SHA-256 of every tensor, then SIGKILLs itself (a job torn down after its last committed step).
Scenario ``rmbase``: before its last step, rank 0 deletes the shared tier's folder of the first
step by hand (the base the last step would build on refers to it). Scenario ``cadence``: no memory
tier (every restore reads the shared disk tier).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist

import nebula_ckpt as nc


def state() -> dict[str, Any]:
    """The job's state, the same on every rank."""
    return {"a": torch.randn(256, 1024, generator=torch.Generator().manual_seed(1)),
            "b": torch.randn(256, 1024, generator=torch.Generator().manual_seed(2)),
            "train": torch.zeros(1024), "step": -1}


def digest(s: dict[str, Any]) -> dict[str, str]:
    """SHA-256 of every tensor of ``s``."""
    return {k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in s.items() if torch.is_tensor(v)}


def main() -> None:
    scenario, root, out, steps = sys.argv[1], sys.argv[2], sys.argv[3], [int(s) for s in sys.argv[4].split(",") if s]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    s = state()
    with nc.Checkpointer(root, keep_last=5, memory_tier=scenario != "cadence") as ck:
        report: dict[str, Any] = {"rank": rank, "restored": ck.load_latest(s),
                                  "tier": (ck.last_restore or {}).get("tier"), "saves": [],
                                  "restored_digest": digest(s)}
        for step in steps:
            if scenario == "rmbase" and step == steps[-1]:  # an operator deletes the first step by hand
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(os.path.join(root, f"step-{steps[0]}"))
                dist.barrier()
            s["train"] += step
            s["step"] = step
            h = ck.save(step, s)
            h.result()
            report["saves"].append({"written": h.metrics.written_bytes, "bytes": h.metrics.bytes})
        report["digest"] = digest(s)
        with open(os.path.join(out, f"{scenario}-r{rank}.json"), "w") as f:
            json.dump(report, f)
        dist.barrier()  # every report is out: the job dies after its last committed step
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
