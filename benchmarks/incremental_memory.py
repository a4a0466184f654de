"""Incremental vs full saves on the memory tier, interleaved: ``python -m benchmarks.incremental_memory``.

A state of a frozen tensor and a trained one (``--trainable`` of the bytes, default 1%) is saved
by two checkpointers whose only tier is the memory tier, one incremental (the default) and one
with ``incremental=False``, in alternating order save after save, so that both see the same load
of a shared machine. Per save: blocking time (``save_async`` + ``wait_snapshot``), time until
durable on the memory tier (``result()``) and the bytes the step holds in ``/dev/shm`` (its own
folder's shard files). Medians of the saves after the first (each checkpointer's base).
The memory tier lives in a private folder of ``/dev/shm``, removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Optional

import torch


def _held(ck: Any, step: int) -> int:
    folder = os.path.join(ck.tiers[0].path, f"step-{step}")
    return sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder) if n.endswith(".safetensors"))


def run(state_mb: float, trainable: float, saves: int) -> dict[str, Any]:
    """``saves`` saves per checkpointer, alternating which goes first; the medians per system."""
    import nebula_ckpt as nc
    from nebula_ckpt import knobs

    n = int(state_mb * 2**20 / 4)
    frozen, train = torch.randn(int(n * (1 - trainable))), torch.zeros(max(1, int(n * trainable)))
    shm = tempfile.mkdtemp(prefix="nebula-bench-", dir="/dev/shm")
    roots = [tempfile.mkdtemp(prefix="nebula-bench-root-") for _ in range(2)]
    rows: dict[str, list[tuple[float, float, int]]] = {"incremental": [], "full": []}
    try:
        with knobs.override(shm_dir=shm):
            cks = {name: nc.Checkpointer(root, tiers=[nc.MemoryTier()], incremental=name == "incremental")
                   for name, root in zip(rows, roots, strict=True)}
            for i in range(saves):
                for name in (("incremental", "full") if i % 2 else ("full", "incremental")):
                    train += 1
                    t = time.perf_counter()
                    h = cks[name].save_async(i, {"frozen": frozen, "train": train})
                    h.wait_snapshot()
                    blocking = time.perf_counter() - t
                    h.result()
                    if i:
                        rows[name].append((blocking, time.perf_counter() - t, _held(cks[name], i)))
            for ck in cks.values():
                ck.close()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        for r in roots:
            shutil.rmtree(r, ignore_errors=True)
    state = frozen.nbytes + train.nbytes
    return {"state_bytes": state, "trainable_share": train.nbytes / state, "saves": saves, "systems": {
        name: {"blocking_s": [r[0] for r in v], "durable_s": [r[1] for r in v], "held_bytes": [r[2] for r in v],
               "median_blocking_s": statistics.median(r[0] for r in v),
               "median_durable_s": statistics.median(r[1] for r in v),
               "median_held_bytes": statistics.median(r[2] for r in v)} for name, v in rows.items()}}


def main(argv: Optional[list[str]] = None) -> int:
    """Run it; print the medians and write ``--out`` (JSON) if given."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.incremental_memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state-mb", type=float, default=500.0)
    p.add_argument("--trainable", type=float, default=0.01, help="share of the state's bytes that trains")
    p.add_argument("--saves", type=int, default=10, help="saves per system (the first is the base)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    torch.manual_seed(0)
    res = run(a.state_mb, a.trainable, a.saves)
    for name, r in res["systems"].items():
        sys.stdout.write(f"{name}: blocking {r['median_blocking_s'] * 1e3:.1f} ms, durable "
                         f"{r['median_durable_s'] * 1e3:.1f} ms, held in /dev/shm per step "
                         f"{r['median_held_bytes'] / 1e6:.2f} MB ({r['median_held_bytes'] / res['state_bytes']:.2%})\n")
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
