"""``nebula-ckpt bench``: measure every system on the same state in one process.

For each workload the runner measures the hardware limits and a warm-up training step,
then every system in turn, each against a fresh directory of the target:

1. **save reps** (1 warm-up + ``--reps``): a training step changes the state, then
   ``save()`` (timed: *call*), the next forward/backward, ``wait_safe()`` (timed: *stall*, what
   the next ``optimizer.step()`` would wait), ``optimizer.step()``; a waiter thread records when
   ``wait_durable()`` returns (*time to durable*, from the start of ``save``). *Blocking* =
   call + stall: the time the training thread lost. Asynchronous systems also make 3 saves
   with the training thread idle (*idle time to durable*, comparable with the write limit).
2. **restore** into the existing model and optimizer, three times: right after the save (page
   cache as the save left it), warm (files cached by the first read), cold (pages evicted with
   ``posix_fadvise(DONTNEED)``, checked with ``mincore``; ``drop_caches`` only with
   ``--drop-caches``); each checked against a fingerprint taken at the last save.
3. **throughput**: ``--steps // --interval`` interleaved rounds of K steps without a checkpoint
   and K steps with a save on the first step plus the rest of that save's persist (backlog).

Then, for nebula_ckpt, 100 saves of a small state to check that host memory stays flat.

With ``--ranks 2,4``: the multi-rank cases of :mod:`~.ranks` (jobs of spawned ranks, DDP + AdamW,
nebula vs ``dcp.save`` vs ``dcp.async_save``) and nebula's commit protocol time
(``--protocol-ranks``); ``--ranks-only`` skips everything else.

With ``--recovery``: the recovery benchmark of :mod:`~.recovery` (restart after a crash to the first
optimizer step, in fresh processes, from nebula's memory tier, its local root and ``torch.load``;
the stalls of a fresh process's first saves; a save's stall against one copy of the state), at
``--recovery-sizes`` GB; ``--recovery-only`` skips the single-process workloads.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from benchmarks import limits as limits_mod
from benchmarks import ranks as ranks_mod
from benchmarks import recovery as recovery_mod
from benchmarks import report as report_mod
from benchmarks import workloads as wl
from benchmarks.measure import flat_memory_check, measure_floor, run_system, train_loop
from benchmarks.peers import PEERS, QUICK_PEERS, Nebula
from benchmarks.restore_floor import measure_restore_floor, measure_tmpfs_floor

log = logging.getLogger(__name__)

DEFAULT_SYSTEMS = tuple(PEERS)



def repo_root() -> Path:
    """The checkout this package lives in, or the working directory for an installed copy."""
    here = Path(__file__).resolve().parents[1]
    return here if (here / "benchmarks").is_dir() or (here / ".git").exists() else Path.cwd()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nebula-ckpt bench",
                                description="Benchmark nebula_ckpt against torch.save, safetensors, "
                                            "torch.distributed.checkpoint and torchsnapshot.")
    p.add_argument("--model", action="append", choices=wl.WORKLOADS, dest="models",
                   help="workload (repeatable); default 124m, or tiny with --quick")
    p.add_argument("--optimizer", choices=["adamw"], default="adamw")
    p.add_argument("--interval", type=int, default=None,
                   help="checkpoint every K steps in the throughput run (default 10; 5 with --quick)")
    p.add_argument("--steps", type=int, default=None,
                   help="steps of each throughput loop (default 3 x interval)")
    p.add_argument("--target", default=None,
                   help="directory (or URL, nebula only) to write to; default a temp dir under "
                        "<repo>/bench_out/")
    p.add_argument("--reps", type=int, default=None, help="measured saves per system (default 5; 2 with --quick)")
    p.add_argument("--out", default=None, help="output folder (default <repo>/benchmarks/results/)")
    p.add_argument("--systems", default=None,
                   help=f"comma-separated subset of: {','.join(PEERS)}")
    p.add_argument("--quick", action="store_true",
                   help="tiny model, 2 reps, 4 systems, small limits: under a minute")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--small-many-count", type=int, default=10_000)
    p.add_argument("--few-huge-gb", type=float, default=1.0,
                   help="parameter GB of few-huge (AdamW adds 2x)")
    p.add_argument("--flat-saves", type=int, default=None,
                   help="saves of the host-memory flatness check (default 100; 20 with --quick; 0 = skip)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints written")
    p.add_argument("--restore-reps", type=int, default=3,
                   help="warm and cold restores per system, interleaved (medians; default 3)")
    p.add_argument("--drop-caches", action="store_true",
                   help="for cold restores, fall back to 'echo 1 > /proc/sys/vm/drop_caches' (whole "
                        "machine; root) when posix_fadvise leaves pages resident")
    p.add_argument("--no-plot", action="store_true", help="skip results.png")
    p.add_argument("--ranks", default=None,
                   help="multi-rank cases: comma-separated rank counts, e.g. 2,4 (spawned gloo ranks, DDP "
                        "+ AdamW; nebula vs dcp.save vs dcp.async_save, plus a single-process nebula reference)")
    p.add_argument("--ranks-model", choices=list(ranks_mod.RANK_MODELS), default=None,
                   help="model of the multi-rank cases (default small, ~89 MB of state; tiny with --quick)")
    p.add_argument("--protocol-ranks", default=None,
                   help="rank counts of nebula's commit-protocol timing with a tiny state (default 2,4,8; "
                        "the --ranks counts with --quick; 0 = skip); runs only with --ranks")
    p.add_argument("--ranks-only", action="store_true",
                   help="with --ranks: only the multi-rank cases (no single-process workloads, limits or "
                        "memory check)")
    p.add_argument("--recovery", action="store_true",
                   help="also the recovery benchmark: restart after a crash (SIGKILL) to the first optimizer "
                        "step in fresh processes, nebula memory tier / local root vs torch.load (mmap or not); "
                        "first-save stalls; save stall vs one copy of the state (MLP + AdamW)")
    p.add_argument("--recovery-sizes", default=None,
                   help="state sizes in GB of the recovery benchmark, e.g. 0.3,1.2 (default 0.3,1.2,3,4; 0.3 with "
                        "--quick; sizes that do not fit in RAM / the shm folder are skipped); implies --recovery")
    p.add_argument("--recovery-reps", type=int, default=None,
                   help="repetitions per size, each with fresh processes (default 3; 1 with --quick)")
    p.add_argument("--recovery-only", action="store_true",
                   help="only the recovery benchmark (no single-process workloads, limits or memory check; "
                        "multi-rank cases only with --ranks); implies --recovery")
    p.add_argument("-q", "--quiet", action="store_true", help="warnings only, no progress bar")
    return p


def resolve_args(argv: Optional[list[str]]) -> argparse.Namespace:
    """Parse ``argv`` and fill the defaults that depend on ``--quick``."""
    p = build_parser()
    a = p.parse_args(argv)
    a.models = a.models or (["tiny"] if a.quick else ["124m"])
    a.models = list(dict.fromkeys(a.models))
    a.reps = a.reps if a.reps is not None else (2 if a.quick else 5)
    a.interval = a.interval if a.interval is not None else (5 if a.quick else 10)
    a.steps = a.steps if a.steps is not None else (2 if a.quick else 3) * a.interval
    a.flat_saves = a.flat_saves if a.flat_saves is not None else (20 if a.quick else 100)
    if a.systems:
        a.systems = [s.strip() for s in a.systems.split(",") if s.strip()]
        bad = [s for s in a.systems if s not in PEERS]
        if bad:
            p.error(f"unknown system(s) {bad}; choose from {', '.join(PEERS)}")
    else:
        a.systems = list(QUICK_PEERS if a.quick else DEFAULT_SYSTEMS)
    for name in ("reps", "interval", "steps"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1")
    try:
        a.ranks = ranks_mod.parse_ranks(a.ranks)
        a.protocol_ranks = (ranks_mod.parse_ranks(a.protocol_ranks, "--protocol-ranks")
                            if a.protocol_ranks is not None else (list(a.ranks) if a.quick else [2, 4, 8]))
    except ValueError as e:
        p.error(str(e))
    if not a.ranks:
        a.protocol_ranks = []
        if a.ranks_only:
            p.error("--ranks-only needs --ranks")
    a.ranks_model = a.ranks_model or ("tiny" if a.quick else "small")
    try:
        sizes = recovery_mod.parse_sizes(a.recovery_sizes)
    except ValueError as e:
        p.error(str(e))
    a.recovery = bool(a.recovery or a.recovery_only or sizes)
    a.recovery_sizes = sizes or list(recovery_mod.QUICK_SIZES if a.quick else recovery_mod.DEFAULT_SIZES)
    a.recovery_reps = a.recovery_reps if a.recovery_reps is not None else (1 if a.quick else 3)
    if a.recovery_reps < 1:
        p.error("--recovery-reps must be >= 1")
    root = repo_root()
    a.out = Path(a.out) if a.out else root / "benchmarks" / "results"
    a.bench_out = root / "bench_out"
    return a


@contextlib.contextmanager
def _progress(total: int, quiet: bool) -> Iterator[Any]:
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm(), tqdm(total=total, disable=quiet, unit="task",
                                       dynamic_ncols=True, file=sys.stderr) as bar:
        yield bar


def run_workload(m: str, a: argparse.Namespace, device: torch.device, target: str,
                 base: Optional[Path], bar: Any) -> dict[str, Any]:
    """Build workload ``m`` and measure every system on it; advances ``bar`` by 2 + systems."""
    bar.set_description(f"{m}: build")
    entry: dict[str, Any] = {"name": m, "systems": []}
    try:
        w = wl.build(m, device, batch_size=a.batch_size, seq_len=a.seq_len,
                     small_many_count=a.small_many_count, few_huge_bytes=int(a.few_huge_gb * 1e9))
    except (ValueError, RuntimeError) as e:
        log.warning("workload %s skipped: %s", m, e)
        entry.update(status="skipped", reason=str(e))
        bar.update(2 + len(a.systems))
        return entry
    entry.update(w.describe(), status="ok")
    log.info("workload %s: %d params, state %s in %d tensors", m, w.params,
             wl.human_bytes(w.state_bytes), w.num_tensors)
    bar.update(1)
    bar.set_description(f"{m}: warm-up")
    w.train_step()
    w.train_step()
    entry["step_s"] = train_loop(w, a.interval, a.interval) / a.interval
    baselines: list[float] = []
    bar.set_description(f"{m}: snapshot floor")
    entry["snapshot_floor"] = measure_floor(w, a, baselines)
    bar.update(1)
    step_base = 1000
    for name in a.systems:
        bar.set_description(f"{m}: {name}")
        res = run_system(name, w, target, base, a, baselines, step_base)
        step_base = max(step_base, res.get("end_step", step_base)) + 1000
        entry["systems"].append(res)
        if res["status"] == "ok":
            log.info("%s/%s: blocking %.4f s, durable %.3f s, overhead %.1f%%", m, name,
                     res["blocking_s"]["median"], res["durable_s"]["median"],
                     100 * res["throughput"]["overhead"])
        bar.update(1)
    if base is not None:  # on the same disk as the systems' restores
        bar.set_description(f"{m}: restore floor")
        try:
            entry["restore_floor"] = measure_restore_floor(w, base, drop_caches=a.drop_caches)
            entry["restore_floor_tmpfs"] = measure_tmpfs_floor(w)  # the memory tier's
        except Exception as e:  # a reference figure: never fail the run for it
            log.warning("restore floor not measured: %s", e)
            entry["restore_floor"] = {"error": f"{type(e).__name__}: {e}"}
    entry["baseline_loops_s"] = baselines
    if baselines:
        # spread of the K-step no-checkpoint segments: the noise floor of the overhead figures
        entry["baseline_spread"] = (max(baselines) - min(baselines)) / statistics.fmean(baselines)
        entry["baseline_cv"] = statistics.pstdev(baselines) / statistics.fmean(baselines)
    del w
    gc.collect()
    return entry


def _pick_device(a: argparse.Namespace) -> torch.device:
    """``--device``: cuda when asked for, or with ``auto`` when a GPU is available; else cpu."""
    return torch.device("cuda" if (a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available()))
                        else "cpu")


def _prepare_target(a: argparse.Namespace) -> tuple[str, Optional[Path], Optional[Path]]:
    """Return (target, base, made_temp): ``--target`` or a new run folder under ``--bench-out``; its
    local folder (None for a remote URL), created; and the run folder this call made, if any."""
    made_temp: Optional[Path] = None
    if a.target is None:
        a.bench_out.mkdir(parents=True, exist_ok=True)
        made_temp = Path(tempfile.mkdtemp(prefix="run-", dir=a.bench_out))
        target = str(made_temp)
    else:
        target = a.target
    is_url = "://" in target and not target.startswith("file://")
    base = None if is_url else Path(target.removeprefix("file://"))
    if base is not None:
        base.mkdir(parents=True, exist_ok=True)
    return target, base, made_temp


def _describe_machine(base: Optional[Path], target: str) -> dict[str, Any]:
    """The machine description with the starting load average; warns when timings will not mean much."""
    machine = limits_mod.machine_info(base, target)
    machine["loadavg_start"] = _loadavg()
    cores = machine.get("usable_cores") or 1
    if machine["loadavg_start"] and machine["loadavg_start"][0] > 0.5 * cores:
        log.warning("load average %.1f on %d cores: other work is running, timings will be noisy",
                    machine["loadavg_start"][0], cores)
    if machine.get("target_is_tmpfs"):
        log.warning("target %s is on tmpfs (%s): 'durable' figures measure RAM, not a disk",
                    target, machine.get("target_fs"))
    return machine


def _new_results(a: argparse.Namespace, device: torch.device, target: str,
                 machine: dict[str, Any]) -> dict[str, Any]:
    """The results tree before any measurement: settings, peers, machine, no workloads yet."""
    return {
        "schema": 1, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "argv": a.argv, "quick": a.quick, "device": str(device), "target": target,
        "settings": {"reps": a.reps, "interval": a.interval, "steps": a.steps, "systems": a.systems,
                     "models": a.models, "batch_size": a.batch_size, "seq_len": a.seq_len,
                     "optimizer": a.optimizer, "flat_saves": a.flat_saves, "ranks": a.ranks,
                     "protocol_ranks": a.protocol_ranks, "ranks_model": a.ranks_model, "ranks_only": a.ranks_only,
                     "recovery": a.recovery, "recovery_sizes": a.recovery_sizes if a.recovery else None,
                     "recovery_reps": a.recovery_reps if a.recovery else None, "recovery_only": a.recovery_only},
        "peers": {n: {"calls": PEERS[n].calls, "durability": PEERS[n].durability}
                  for n in ([] if a.ranks_only or a.recovery_only else a.systems)},
        "machine": machine, "workloads": [],
    }


def _measure_memory_flatness(results: dict[str, Any], a: argparse.Namespace, target: str,
                             base: Optional[Path]) -> None:
    """nebula's host memory over ``--flat-saves`` saves, or the error that stopped the check."""
    try:
        Nebula().check(target)
        results["memory_flatness"] = flat_memory_check(target, base, a.flat_saves, a.keep)
    except Exception as e:
        log.warning("memory flatness check failed: %s", e)
        results["memory_flatness"] = {"error": f"{type(e).__name__}: {e}"}


def _measure_all(results: dict[str, Any], a: argparse.Namespace, device: torch.device, target: str,
                 base: Optional[Path]) -> None:
    """Write limits, every workload, the memory flatness check, then the write limit again, into ``results``."""
    nsys = len(a.systems)
    flat = bool(a.flat_saves and "nebula" in a.systems)
    total = 1 + len(a.models) * (2 + nsys) + (1 if flat else 0)
    with _progress(total, a.quiet) as bar:
        bar.set_description("limits")
        est = max(wl.estimate_state_bytes(m, small_many_count=a.small_many_count,
                                          few_huge_bytes=int(a.few_huge_gb * 1e9)) for m in a.models)
        size = (128 << 20) if a.quick else int(min(2 << 30, max(256 << 20, est)))
        results["limits"] = limits_mod.measure(base, size, size)
        bar.update(1)
        for m in a.models:
            results["workloads"].append(run_workload(m, a, device, target, base, bar))
        if flat:
            bar.set_description("nebula: host memory over saves")
            _measure_memory_flatness(results, a, target, base)
            bar.update(1)
        _remeasure_write_limit(results, base, a)


def run(a: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by ``a``; return the results tree."""
    device = _pick_device(a)
    target, base, made_temp = _prepare_target(a)
    machine = _describe_machine(base, target)
    results = _new_results(a, device, target, machine)
    try:
        if not (a.ranks_only or a.recovery_only):
            _measure_all(results, a, device, target, base)
        if a.ranks:
            results["ranks"] = ranks_mod.run(a, base)
        if a.recovery:
            results["recovery"] = recovery_mod.run(a, base)
    finally:
        if made_temp is not None and not a.keep:
            shutil.rmtree(made_temp, ignore_errors=True)
    results["machine"]["loadavg_end"] = _loadavg()
    results["targets"] = report_mod.evaluate_targets(results)
    return results


def _remeasure_write_limit(results: dict[str, Any], base: Optional[Path], a: argparse.Namespace) -> None:
    """Measure the write limit again at the end: a busy neighbour at the start would otherwise
    make it too low (and the persist target too easy). The best of all samples is kept."""
    seq = results.get("limits", {}).get("seq_write_fsync", {})
    if base is None or not seq.get("gbps") or a.quick:
        return
    try:
        again = limits_mod.seq_write_fsync(base, seq["bytes"])
    except OSError as e:
        log.warning("write limit not measured again: %s", e)
        return
    seq["samples_gbps"] = seq["samples_gbps"] + again["samples_gbps"]
    seq["gbps"] = max(seq["samples_gbps"])


def _loadavg() -> Optional[list[float]]:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``nebula-ckpt bench`` and ``python -m benchmarks.run``.

    Writes ``results.json``, ``results.md``, ``results.png`` and ``machine.json`` into ``--out``
    and prints the results table. Returns the process exit code (0 even when targets are not
    met: the report says which).
    """
    a = resolve_args(argv)
    a.argv = ["nebula-ckpt", "bench", *(argv if argv is not None else sys.argv[1:])]
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not a.quiet:
        # the benchmark's own progress; the library under test stays at WARNING (it logs every commit)
        logging.getLogger("benchmarks").setLevel(logging.INFO)
    t0 = time.perf_counter()
    results = run(a)
    results["wall_s"] = time.perf_counter() - t0
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(results, indent=2, default=_json_default) + "\n")
    (a.out / "machine.json").write_text(json.dumps(results["machine"], indent=2, default=_json_default) + "\n")
    md = report_mod.render_markdown(results)
    (a.out / "results.md").write_text(md)
    if not a.no_plot:
        try:
            report_mod.plot(results, a.out / "results.png")
        except Exception as e:  # the numbers matter more than the picture
            log.warning("results.png not written: %s", e)
    print(md)
    log.info("wrote %s in %.0f s", a.out, results["wall_s"])
    return 0


def _json_default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, float):
        return o
    return repr(o)


if __name__ == "__main__":
    sys.exit(main())
