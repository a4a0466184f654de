"""A rank of a 2-rank job (gloo) whose save waits for the host-memory budget while its memory tier
holds a step no persistent tier has (tests/save/test_budget_no_hang.py):
``budget_ranks_worker.py ROOT OUT``. Writes ``OUT/r<rank>.json``: what each save did."""

from __future__ import annotations

import json
import logging
import os
import sys

import torch
import torch.distributed as dist

import nebula_ckpt as nc

MB = 1 << 20


def main(root: str, out: str) -> None:
    logging.basicConfig(level=logging.INFO)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ck = nc.Checkpointer(root, tiers=[nc.MemoryTier(), nc.LocalTier(root, every=100)], host_memory_budget=6 * MB,
                         incremental=False, on_full="wait")
    saves: dict[str, str] = {}
    for step in range(1, 4):
        try:
            h = ck.save_async(step, {"w": torch.full((MB,), float(step + rank))})  # 4 MiB: under two states
            h.wait()
            saves[str(step)] = "ok"
        except Exception as e:  # reported to the test
            saves[str(step)] = f"{type(e).__name__}: {e}"
            break
    with open(os.path.join(out, f"r{rank}.json"), "w") as f:
        json.dump({"saves": saves, "listed": ck.list(detailed=True)}, f)
    sys.stdout.flush()
    os._exit(0)  # no close(): a rank that raised would wait for its peer's rounds


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
