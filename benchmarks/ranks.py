"""Multi-rank cases of ``nebula-ckpt bench`` (``--ranks 2,4``).

Every case is a real job: ``W`` processes (spawned with ``python -m benchmarks.rank_jobs``,
``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR=127.0.0.1`` in the environment, as torchrun sets them),
one gloo process group, a GPT-shaped model wrapped in ``DistributedDataParallel`` (replicated:
every rank holds the whole state) and AdamW. In one job, on the same model and process group,
each system is measured in turn:

* ``nebula``: ``nc.Checkpointer(root)`` on every rank (it finds the process group and coordinates
  the ranks itself: every rank writes its share of the replicated tensors, rank 0 commits);
  ``save_async`` -> ``wait_snapshot()`` before the next optimizer step -> ``result()``;
* ``dcp_save``: ``torch.distributed.checkpoint.save(get_state_dict(model, opt))`` with the default
  ``FileSystemWriter`` (DCP's planner also spreads replicated tensors over the ranks);
* ``dcp_async_save``: ``dcp.async_save`` of the same, on a gloo group of its own (as torchtitan
  does: its background collectives must not interleave with DDP's); the returned future is waited
  for durability, one save in flight at a time.

What each rank measures, per system (the same protocol as the single-process runner):

1. 1 warm-up + ``reps`` saves, each after a training step and a barrier (so the ranks start the
   save together): *call*, *stall* (before the next ``optimizer.step()``), *blocking* = call +
   stall, and the absolute (``CLOCK_MONOTONIC``, one clock for every process of the machine) time
   the save became durable on this rank; then (asynchronous systems) up to 3 saves with the
   training thread idle.
2. the files of the newest checkpoint (rank 0, by name: nebula ``shard-g<G>-r<R>.safetensors``,
   DCP ``__<R>_0.distcp``; manifests, ``COMMIT`` and ``.metadata`` are rank 0's);
3. the throughput loop of :func:`benchmarks.measure.measure_throughput`: interleaved
   K-step segments with / without a save every K steps.

The parent aggregates over ranks: per rep, *blocking* is the slowest rank's (DDP runs at the pace
of the slowest rank); *time to commit* runs from the earliest rank's save call until the save is
durable on every rank (nebula: ``result()`` returns on every rank once rank 0 wrote ``COMMIT``;
DCP: ``save`` / the future returns on every rank once rank 0 wrote ``.metadata``), directory
fsyncs included. A single-process job (no process group, no DDP) of the same model with nebula
is the reference row.

A system that fails in a job (its error is reported in its row) ends that job: the systems after
it run again in a new job, so a broken system never takes the others' rows with it.

**Commit protocol time** (``--protocol-ranks``, default 2,4,8; a tiny state): nebula alone, saves
with the training thread idle, through a :class:`TimedCoordinator` (a ``DistCoordinator`` that
timestamps every round of the checkpoint protocol). *Protocol* = rank 0 entering the verdict
round (``manifest.json`` and ``COMMIT`` are then written and fsynced) minus the moment the last
rank's shard was durable (that rank entering the "durable" round): the gather of the shard
records, building and writing the manifest, writing the commit marker. *Until acknowledged* runs
to the moment every rank's ``result()`` returned (adds the verdict round). A cross-check from the
files: ``COMMIT``'s mtime minus the newest shard's mtime (includes the shard's own fsync).
"""


from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from benchmarks.common import free_port, python_popen, usable_cores
from benchmarks.rank_jobs import PROTOCOL_MODEL, RANK_MODELS, JobSpec, state_bytes_estimate
from benchmarks.rank_peers import CALLS, SYSTEMS
from benchmarks.rank_report import aggregate, aggregate_protocol

__all__ = ["RANK_MODELS", "SYSTEMS", "launch", "parse_ranks", "run", "run_case"]

log = logging.getLogger(__name__)


def parse_ranks(text: Optional[str], flag: str = "--ranks") -> list[int]:
    """``"2,4"`` -> ``[2, 4]`` (sorted, deduplicated; each >= 2). ``""`` / ``"0"`` -> ``[]``.

    Raises:
        ValueError: not a comma-separated list of integers >= 2.
    """
    if text is None or text.strip() in ("", "0"):
        return []
    try:
        vals = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError as e:
        raise ValueError(f"{flag} takes comma-separated rank counts, e.g. 2,4: {e}") from e
    if any(v < 2 for v in vals):
        raise ValueError(f"{flag}: every rank count must be >= 2 (got {text!r})")
    return vals


# --------------------------------------------------------------------------- parent: launching jobs

def launch(spec: JobSpec, deadline_s: float) -> list[Optional[int]]:
    """Start ``spec.world`` ranks and wait (at most ``deadline_s``; a rank that failed gives the
    others 30 s to notice); return their exit codes (``None``: killed by the deadline)."""
    out = Path(spec.out)
    out.mkdir(parents=True, exist_ok=True)
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(asdict(spec)))
    port = free_port()
    pkg_root = str(Path(__file__).resolve().parents[1])
    procs: list[subprocess.Popen[bytes]] = []
    for r in range(spec.world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(spec.world), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(spec.world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(spec.threads),
                   NEBULA_COMMIT_TIMEOUT_S=os.environ.get("NEBULA_COMMIT_TIMEOUT_S", str(spec.timeout_s)),
                   PYTHONPATH=pkg_root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        with open(out / f"r{r}.log", "wb") as logf:
            procs.append(python_popen([sys.executable, "-m", "benchmarks.rank_jobs", str(spec_path)],
                                      env=env, stdout=logf, stderr=subprocess.STDOUT, cwd=pkg_root))
    end = time.monotonic() + deadline_s
    killed: set[int] = set()
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):
                end = min(end, time.monotonic() + 30.0)
            if time.monotonic() > end:
                log.warning("multi-rank job (%d ranks, %s) past its deadline: killing its ranks",
                            spec.world, spec.mode)
                break
            time.sleep(0.05)
    finally:
        for r, p in enumerate(procs):
            if p.poll() is None:
                p.kill()
                p.wait()
                killed.add(r)
    return [None if r in killed else p.returncode for r, p in enumerate(procs)]


def _failure(out: Path, world: int, codes: list[Optional[int]], deadline_s: float) -> tuple[str, str]:
    """(stage, reason) of a failed job: the first error a rank recorded, else exit codes and log tails."""
    errors = []
    for r in range(world):
        f = out / f"r{r}-error.json"
        if f.exists():
            try:
                errors.append(json.loads(f.read_text()))
            except ValueError:
                pass
    if errors:
        first = min(errors, key=lambda e: e["time"])
        return first["stage"], f"rank {first['rank']}: {first['error']}"
    stages = [(out / f"stage-r{r}.txt") for r in range(world)]
    stage = next((s.read_text() for s in stages if s.exists()), "setup")
    if any(c is None for c in codes):
        why = f"no result within {deadline_s:.0f} s (ranks killed)"
    else:
        why = f"ranks exited with {codes}"
    tail = ""
    for r in range(world):
        lines = [ln for ln in (out / f"r{r}.log").read_text(errors="replace").splitlines() if ln.strip()] \
            if (out / f"r{r}.log").exists() else []
        if lines:
            tail = f"; rank {r} log: {lines[-1][-300:]}"
            break
    return stage, why + tail


def _job_records(out: Path, world: int, system: str) -> Optional[list[dict[str, Any]]]:
    """Every rank's record of ``system``, or None if one is missing."""
    files = [out / f"r{r}-{system}.json" for r in range(world)]
    if not all(f.exists() for f in files):
        return None
    return [json.loads(f.read_text()) for f in files]


def run_case(spec: JobSpec, deadline_s: float) -> dict[str, dict[str, Any]]:
    """Every system of ``spec`` at ``spec.world`` ranks: aggregated row per system (never raises).

    A system that fails ends its job; the systems after it run again in a fresh job.
    """
    rows: dict[str, dict[str, Any]] = {}
    remaining = list(spec.systems)
    attempt = 0
    while remaining:
        attempt += 1
        out = Path(spec.out) / f"job{attempt}"
        job = JobSpec(**{**asdict(spec), "systems": remaining, "out": str(out),
                         "root": str(Path(spec.root) / f"job{attempt}")})
        t0 = time.monotonic()
        codes = launch(job, deadline_s)
        log.info("multi-rank %s job, %d ranks, %s: exit codes %s in %.0f s", spec.mode, spec.world,
                 ",".join(remaining), codes, time.monotonic() - t0)
        failed = any(c != 0 for c in codes)
        for name in list(remaining):
            recs = _job_records(out, spec.world, name)
            if recs is not None:
                try:
                    rows[name] = (aggregate_protocol if spec.mode == "protocol" else aggregate)(recs)
                except Exception as e:  # a record the aggregation cannot read is reported, not raised
                    log.exception("multi-rank %s: records of %s unusable", spec.mode, name)
                    rows[name] = {"status": "error", "reason": f"aggregation: {type(e).__name__}: {e}"}
                remaining.remove(name)
                continue
            stage, why = _failure(out, spec.world, codes, deadline_s) if failed else (name, "no records")
            log.warning("multi-rank %d ranks: %s failed: %s", spec.world, name, why)
            if stage == "setup":  # nothing of the job ran: every remaining system shares the failure
                for n in remaining:
                    rows[n] = {"status": "error", "reason": f"job setup: {why}"}
                remaining = []
            else:
                rows[name] = {"status": "error", "reason": why}
                remaining.remove(name)
            break
        if not spec.keep:
            shutil.rmtree(Path(spec.root) / f"job{attempt}", ignore_errors=True)
    for name, row in rows.items():
        row.update(system=name, world=spec.world)
    return rows


# --------------------------------------------------------------------------- parent: the whole section

def run(a: argparse.Namespace, base: Optional[Any]) -> dict[str, Any]:
    """The multi-rank section of the results (``a.ranks``, ``a.protocol_ranks``, ``a.ranks_model``).

    ``base``: the local run folder (multi-rank cases write local files only). Never raises.
    """
    sec: dict[str, Any] = {"model": a.ranks_model, "ranks": a.ranks, "protocol_ranks": a.protocol_ranks,
                           "systems": list(SYSTEMS), "calls": CALLS, "rows": [], "single": None, "protocol": []}
    if base is None:
        sec["error"] = "multi-rank cases write local files: give a local --target"
        log.warning("multi-rank cases skipped: %s", sec["error"])
        return sec
    cores = usable_cores()
    work = Path(tempfile.mkdtemp(prefix="ranks-", dir=str(base)))
    quick = bool(a.quick)
    deadline = 150.0 if quick else 1200.0
    timeout = 60.0 if quick else 600.0
    sec["state_bytes_estimate"] = state_bytes_estimate(a.ranks_model)
    try:
        def spec(world: int, mode: str, systems: list[str], model: str, name: str) -> JobSpec:
            return JobSpec(world=world, mode=mode, systems=systems, model=model, root=str(work / name / "ckpt"),
                           out=str(work / name / "out"), reps=a.reps, interval=a.interval, steps=a.steps,
                           batch_size=a.batch_size, seq_len=a.seq_len, saves=5 if quick else 20,
                           threads=max(1, cores // world), timeout_s=timeout, keep=a.keep)

        if a.ranks:
            log.info("multi-rank: single-process reference (nebula, %s)", a.ranks_model)
            single = run_case(spec(1, "compare", ["nebula"], a.ranks_model, "w1"), deadline)
            sec["single"] = single["nebula"]
        for world in a.ranks:
            log.info("multi-rank: %d ranks, %s, %s", world, a.ranks_model, ", ".join(SYSTEMS))
            rows = run_case(spec(world, "compare", list(SYSTEMS), a.ranks_model, f"w{world}"), deadline)
            sec["rows"].extend(rows[n] for n in SYSTEMS)
        for world in a.protocol_ranks:
            log.info("multi-rank: commit protocol at %d ranks (%s state)", world, PROTOCOL_MODEL)
            prow = run_case(spec(world, "protocol", ["nebula"], PROTOCOL_MODEL, f"p{world}"), deadline)
            sec["protocol"].append(prow["nebula"])
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    ok = [r for r in sec["rows"] + [sec["single"] or {}] if r.get("status") == "ok"]
    if ok:
        sec["state_bytes"] = ok[0]["state_bytes"]
        sec["description"] = ok[0]["description"]
    return sec
