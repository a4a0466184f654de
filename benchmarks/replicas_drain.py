"""Draining a lost node's memory: time from a node's loss to its step being durable on the shared tier.

Part ``drain`` of :mod:`benchmarks.replicas` (``--parts drain``). Real ranks as 2 simulated nodes,
``MemoryTier(replicas=1)``, ``--mb`` MB of state per rank (model + AdamW), a local-disk shared tier:

* **The persist cadence it replaces**: a job saves ``--drain-saves`` steps with the shared tier
  written on every save (``every=1``): how long each save takes to be durable there (the
  slowest rank's ``durable_s`` of that tier, median over the saves), which is what a job pays,
  per save, for never holding its newest step only in RAM.
* **The drain**: a job saves the same steps with the shared tier written only on the first save
  (``every=1000``: the newest step only in RAM, own copies and partners' replicas), then dies like
  a crash. Node 1 is lost (its memory tiers deleted). ``nebula-ckpt persist-memory`` runs on node
  0 (its ranks' own copies, its replicas of node 1's ranks): the time from its start (a fresh
  process: the moment a node's loss is acted on) to its exit with the step committed, and within
  it the drain's own time. Then the job, moved to two fresh nodes without any memory tier,
  restores that step (checked: the newest step on every rank).

Every measure is a median of ``--repeats`` runs (the drain of the same saved state, each time
from a copy of the nodes' memory tiers and of the shared tier as the job left them).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.common import python_run

REPO = Path(__file__).resolve().parents[1]


def drain_cost(world: int, args: Any, tmp: Path, shm_base: Path,
               job: Callable[[int, dict[str, Any], Path], list[dict[str, Any]]]) -> dict[str, Any]:
    """The part's numbers for ``world`` ranks (``job`` runs the ranks of :mod:`benchmarks.replicas`)."""
    saves = int(args.drain_saves)
    base = {"mb": args.mb, "iters": saves, "save_every": 1, "replicas": 1}
    shm = shm_base / f"drain-shm-{world}"
    every = job(world, dict(base, role="save-for-drain", root=str(tmp / f"every-{world}"),
                            disk=str(tmp / f"every-{world}"), disk_every=1, shm=str(shm)), tmp)
    persist_s = max(g["disk_durable_s"] for g in every)
    shutil.rmtree(shm, ignore_errors=True)
    root = tmp / f"drain-{world}"
    job(world, dict(base, role="save-for-drain", root=str(root), disk=str(root), disk_every=1000, shm=str(shm)), tmp)
    kept = tmp / f"drain-kept-{world}"
    shutil.copytree(shm, kept / "shm")
    shutil.copytree(root, kept / "root")
    runs: list[dict[str, Any]] = []
    for _ in range(args.repeats):
        for name, dst in (("shm", shm), ("root", root)):
            shutil.rmtree(dst)
            shutil.copytree(kept / name, dst)
        shutil.rmtree(shm / "n1")  # node 1 lost
        runs.append(_drain_once(root, shm / "n0"))
    moved = job(world, dict(base, role="restore-fresh", root=str(root), disk=str(root), shm=str(shm_base / "fresh")),
                tmp)
    assert all(g["step"] == saves for g in moved), moved
    med = {k: statistics.median(r[k] for r in runs) for k in ("wall_s", "drain_s", "bytes")}
    return {"runs": runs, "median": med, "persist_each_save_s": persist_s, "saves": saves,
            "restore_fresh_s": max(g["recovery_s"] for g in moved),
            "drain_vs_one_persist": med["drain_s"] / persist_s if persist_s else None}


def _drain_once(root: Path, shm: Path) -> dict[str, Any]:
    """``nebula-ckpt persist-memory`` in a fresh process on the surviving node: wall time, its
    own drain time, bytes it wrote."""
    code = ("import json, sys, time\nfrom nebula_ckpt.tiers.memory.epilogue import persist_memory\n"
            "t = time.perf_counter()\ngot = persist_memory(sys.argv[1])\n"
            "got['drain_s'] = time.perf_counter() - t\nprint(json.dumps(got))\n")
    env = dict(os.environ, NEBULA_SHM_DIR=str(shm), PYTHONPATH=str(REPO))
    t0 = time.perf_counter()
    p = python_run([sys.executable, "-c", code, str(root)], env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"persist-memory failed:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    got = json.loads(p.stdout.strip().splitlines()[-1])
    if not got["copied"]:
        raise RuntimeError(f"persist-memory committed nothing: {got}")
    step = Path(root, f"step-{got['step']}")
    return {"wall_s": wall, "drain_s": got["drain_s"], "step": got["step"],
            "bytes": sum(f.stat().st_size for f in step.iterdir())}


def report_lines(drain: dict[Any, dict[str, Any]], mb: int) -> list[str]:
    """The part's section of ``results.md``."""
    lines = ["## Draining a lost node's memory to the shared tier", "",
             f"{mb} MB of state per rank; node 1 lost; `persist-memory` on node 0 (its ranks' own copies and its "
             "replicas of node 1's ranks); the shared tier is a local disk. *Drain*: `persist_memory()` from its "
             "call to the step committed; *process start*: the rest of the fresh process's wall time (interpreter, "
             "imports), which a loaded host stretches most.", "",
             "| ranks | shared tier written every save: s per save until durable | drain after the loss, s | "
             "process start, s | bytes written | drain / one save's persist | moved job's restore, s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for w, d in drain.items():
        m = d["median"]
        lines.append(f"| {w} | {d['persist_each_save_s']:.3f} | {m['drain_s']:.3f} | {m['wall_s'] - m['drain_s']:.1f}"
                     f" | {m['bytes'] / 1e6:.0f} MB | {d['drain_vs_one_persist']:.1f}x | {d['restore_fresh_s']:.3f} |")
    return lines + [""]


def rank_tiers(nc: Any, spec: dict[str, Any]) -> list[Any]:
    """The tiers of this part's rank jobs."""
    if spec["role"] == "restore-fresh":
        return [nc.LocalTier(spec["disk"])]
    return [nc.MemoryTier(replicas=1), nc.LocalTier(spec["disk"], every=int(spec["disk_every"]))]


def save_loop(ck: Any, train_step: Callable[[], None], state: dict[str, Any], spec: dict[str, Any],
              out: dict[str, Any]) -> None:
    """The save job: ``iters`` steps, each saved and waited for; the shared tier's median
    ``durable_s`` over the saves it took into ``out`` (0.0 when it took one save or none)."""
    times = []
    for i in range(int(spec["iters"])):
        train_step()
        h = ck.save_async(i + 1, state)
        h.result()
        times += [v for k, v in h.metrics.durable_s.items() if k.startswith("local:")]
    out["disk_durable_s"] = statistics.median(times) if times else 0.0
