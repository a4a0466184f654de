"""A training process whose save waits for the host-memory budget while nothing can free memory
(tests/save/test_budget_no_hang.py): ``python budget_hang_child.py SCENARIO ROOT``. Prints one
JSON line: what each save did (``ok``, or the error it raised) and what the tiers hold."""

from __future__ import annotations

import json
import logging
import os
import sys

import torch

import nebula_ckpt as nc

MB = 1 << 20


def main(scenario: str, root: str) -> None:
    logging.basicConfig(level=logging.INFO)
    keep = 2 if scenario == "keep_last" else 1
    # a state of 4 MiB (the last one 5 MiB with keep_last=2): under two states (one beside two kept)
    budget = int(8.5 * MB) if scenario == "keep_last" else 6 * MB
    tiers = [nc.MemoryTier(keep_last=keep), nc.LocalTier(root, every=100)]
    if scenario == "disk_only":  # no memory tier: one state of staging (4 MiB), 1.25x its bytes allowed
        tiers, budget = [nc.LocalTier(root)], 5 * MB
    ck = nc.Checkpointer(root, tiers=tiers, host_memory_budget=budget, incremental=False, on_full="wait")
    out: dict[str, str] = {}
    for step in range(1, 5):
        if scenario == "suspect" and step == 2:
            ck.report(1, loss=float("nan"))  # step 2, saved after a bad loss, is suspect (only in memory)
        if scenario == "copy_fails" and step == 3:
            with open(os.path.join(root, "step-2"), "w") as f:  # the disk cannot take step 2 any more
                f.write("in the way")
        try:
            n = MB + MB // 4 if scenario == "keep_last" and step == 4 else MB  # the state grew
            ck.save_async(step, {"w": torch.full((n,), float(step))}).result()
            out[str(step)] = "ok"
        except Exception as e:  # reported to the test
            out[str(step)] = f"{type(e).__name__}: {e}"
            break
    print(json.dumps({"saves": out, "listed": ck.list(detailed=True), "held": ck.stats()["host_memory_bytes"]}),
          flush=True)
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
