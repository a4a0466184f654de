"""Recovery at memory speed (``nebula-ckpt bench --recovery``): restart after a crash, first saves.

The state is an MLP (``nn.Sequential`` of ``nn.Linear(d, d)``, ``d`` = 4096 where the size allows)
with AdamW, sized to each requested number of GB (state = parameters + AdamW's two moments, 3x the
parameter bytes). For each size, every figure comes from the same run, the peers beside nebula:

1. **Restart to the first optimizer step**, each in a *fresh* process
   (``python -m benchmarks.recovery worker restart SPEC``), timed from before the load call
   (``nc.Checkpointer(root)`` included) until one full training step (forward, backward,
   ``optimizer.step()``) after the restore is done: a memory-mapped load pays its page faults
   there. Model and optimizer are built before the clock starts (optimizer state empty, as
   after construction). A saving process (``worker save``) builds the state, takes one
   training step and writes it with every system:

   * ``torch_load`` / ``torch_load_mmap``: ``torch.save({"model": sd, "optim": osd, "step"})``
     + fsync; restarted with ``torch.load(weights_only=True[, mmap=True])``,
     ``model.load_state_dict``, ``opt.load_state_dict``;
   * ``nebula_local``: ``nc.Checkpointer(root, memory_tier=False)``, ``save_async`` ->
     ``result()`` -> ``close()``: no memory tier, the restore reads the root on local disk;
   * ``nebula_memory``: ``nc.Checkpointer(root)`` (default tiers: memory tier in the shm
     folder + root), ``save_async`` -> ``result()``, then the saving process kills itself with
     SIGKILL, so the memory tier stays, as after a crash. The restart must report
     ``ckpt.last_restore`` on the memory tier; a restore from another tier is a failed row.

   The restarts run right after the crash (``nebula_memory``, first), then with the page cache
   warm (each system's files read once just before) and cold (evicted with
   ``posix_fadvise(DONTNEED)``, residency checked with ``mincore``). Each restart records the
   load seconds, the seconds to the first step done and the process's extra peak RSS
   (``VmHWM`` after the step, its high-water mark reset by ``clear_refs`` just before the load,
   minus ``VmRSS`` then), and whether the restore was bit-exact: the saving process takes the
   same training step after its saves and records a digest (CRC32C of every tensor of the model
   and the optimizer, parameter groups, step) of the state it reaches; the restart's state after
   its first step must have the same digest (CPU training steps are deterministic for the same
   inputs and thread count; a digest taken before the step would fault a mapped load's pages
   in before the step and hide its cost). Medians over ``reps`` repetitions, each with its own
   fresh processes.
2. **First saves of a fresh process** (``worker saves``): a ``Checkpointer`` with default tiers;
   before each save a training step; the stall of each save (``save_async`` call +
   ``handle.wait_snapshot()``), then ``result()`` untimed, so every save starts with nothing in
   the background. The first 4 saves one by one, the later ones' median, and ``torch.save`` +
   fsync of the same state for reference.
3. **Snapshot at the floor**: the later saves' stall (training thread idle, nothing in the
   background) against one plain copy of the state (``dst.copy_(src)`` for every tensor) into
   buffers allocated and touched once (after the first saves), one copy right after each later
   save's ``result()``: the pairs share the machine's conditions of the moment (on a shared VM
   memory bandwidth drifts by 2x within a minute); medians of both.

Sizes that do not fit (free RAM, free space in the shm folder and on the target's disk) are
skipped and say so. Every process runs under a deadline; every memory tier the benchmark made is
removed (``NEBULA_SHM_DIR`` is honoured, as by the library).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from benchmarks.common import fmt_b, fmt_s, python_popen
from benchmarks.limits import evict, resident_fraction
from benchmarks.recovery_report import CALLS, METHOD, ROWS, aggregate_row, aggregate_saves
from benchmarks.recovery_worker import FIRST_SAVES, Geometry, WorkerSpec, geometry, layout, worker_main

log = logging.getLogger(__name__)

#: state sizes (GB) of the full run and of ``--quick``
DEFAULT_SIZES = (0.3, 1.2, 3.0, 4.0)
QUICK_SIZES = (0.3,)
#: host memory, shm space and disk space a size needs, as multiples of its state bytes: the saving
#: process holds the state, its gradients, a staging buffer and the memory tier's copy; the
#: memory tier needs ~2-3x in the shm folder while a new save stages beside the last checkpoint
NEED_RAM = 4.0
NEED_SHM = 3.0
NEED_DISK = 3.5


# --------------------------------------------------------------------------- the parent

def parse_sizes(text: Optional[str]) -> Optional[list[float]]:
    """``"0.3,1.2"`` -> ``[0.3, 1.2]`` (``None`` for ``None``); raises ValueError on a bad list."""
    if text is None:
        return None
    try:
        sizes = [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--recovery-sizes: comma-separated GB values, got {text!r}") from None
    if not sizes or any(not (s > 0 and math.isfinite(s)) for s in sizes):
        raise ValueError(f"--recovery-sizes: positive GB values, got {text!r}")
    return list(dict.fromkeys(sizes))


def _shm_dir() -> str:
    from nebula_ckpt import knobs

    return str(knobs.get("shm_dir"))


def _memory_tier_of(root: Path) -> str:
    from nebula_ckpt.tiers.memory.tier import memory_tier_path

    return memory_tier_path(str(root))


def cpu_pressure() -> Optional[float]:
    """Share of the last 10 s in which some task waited for a CPU (``/proc/pressure/cpu``), or None:
    how much other work competed with the benchmark's processes."""
    try:
        with open("/proc/pressure/cpu") as f:
            for line in f:
                if line.startswith("some"):
                    return float(line.split("avg10=")[1].split()[0]) / 100.0
    except (OSError, IndexError, ValueError):
        pass
    return None


def _free_bytes(path: str) -> Optional[int]:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def fit(state_bytes: int, base: Path) -> Optional[str]:
    """``None`` if a state of ``state_bytes`` fits in host memory, the shm folder and ``base``'s disk;
    else the reason (``"skipped: not enough memory ..."``)."""
    import psutil

    avail = int(psutil.virtual_memory().available)
    shm = _shm_dir()
    shm_free = _free_bytes(shm)
    disk_free = _free_bytes(str(base))
    short = []
    if avail < NEED_RAM * state_bytes:
        short.append(f"needs ~{fmt_b(NEED_RAM * state_bytes)} of RAM, {fmt_b(avail)} available")
    if shm_free is not None and shm_free < NEED_SHM * state_bytes:
        short.append(f"needs ~{fmt_b(NEED_SHM * state_bytes)} free in {shm}, {fmt_b(shm_free)} free")
    if short:
        return "skipped: not enough memory (" + "; ".join(short) + ")"
    if disk_free is not None and disk_free < NEED_DISK * state_bytes:
        return (f"skipped: not enough disk space (needs ~{fmt_b(NEED_DISK * state_bytes)} under {base}, "
                f"{fmt_b(disk_free)} free)")
    return None


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b")


def _log_tail(path: Path) -> str:
    """The exception a worker died of (the last ``XxxError: ...`` line of its log) and its last line."""
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    exc = next((ln for ln in reversed(lines) if _EXCEPTION_LINE.match(ln)), None)
    shown = [exc] if exc is not None else []
    if lines and lines[-1] != exc:
        shown.append(lines[-1])
    return " | ".join(ln[-400:] for ln in shown)


def launch(spec: WorkerSpec, work: Path, name: str, timeout_s: float,
           expect_rc: int = 0) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """Run one worker process under a deadline; return (its result, None) or (None, why it failed)."""
    spec_path = work / f"{name}.spec.json"
    spec_path.write_text(json.dumps(asdict(spec)))
    log_path = work / f"{name}.log"
    pkg_root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, OMP_NUM_THREADS=str(spec.threads),
               PYTHONPATH=pkg_root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rc: Optional[int] = None
    with open(log_path, "wb") as logf:
        proc = python_popen([sys.executable, "-m", "benchmarks.recovery_worker", spec.role, str(spec_path)],
                            env=env, stdout=logf, stderr=subprocess.STDOUT, cwd=pkg_root)
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("recovery: %s past its deadline (%.0f s): killed", name, timeout_s)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    result = Path(spec.result)
    if rc is None:
        return None, f"{name}: no result within {timeout_s:.0f} s (killed); log: {_log_tail(log_path)}"
    if rc != expect_rc or not result.exists():
        return None, f"{name}: exit code {rc} (expected {expect_rc}); log: {_log_tail(log_path)}"
    try:
        return json.loads(result.read_text()), None
    except ValueError as e:
        return None, f"{name}: unreadable result: {e}"


def _read_through(files: list[Path]) -> None:
    """Read ``files`` once, so the page cache holds them (a warm restart)."""
    buf = bytearray(16 << 20)
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def _files(path: Path) -> list[Path]:
    from benchmarks.peer_base import list_files

    return list_files(path) if path.exists() else []


def _remove_memory_tier(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def run_rep(g: Geometry, work: Path, rep: int, threads: int, deadline_s: float,
            drop_caches: bool) -> dict[str, dict[str, Any]]:
    """One repetition: a saving process, then one fresh restart process per row (never raises).

    Returns ``{row name: the restart's result, or {"error": why}}``.
    """
    d = work / f"rep{rep}"
    d.mkdir(parents=True)
    paths = layout(d)
    mem_tiers = [_memory_tier_of(paths["nebula_memory"]), _memory_tier_of(paths["nebula_local"])]
    out: dict[str, dict[str, Any]] = {}
    try:
        saved, why = launch(WorkerSpec(role="save", width=g.width, layers=g.layers, threads=threads,
                                       result=str(d / "save.json"), dir=str(d)),
                            work, f"rep{rep}-save", deadline_s, expect_rc=-signal.SIGKILL)
        if saved is None:
            return {row: {"error": f"saving process: {why}"} for row, _, _ in ROWS}
        if not saved.get("memory_tier"):
            log.warning("recovery: the saving process had no memory tier (%s)", _shm_dir())
        for row, system, cache in ROWS:
            path = paths["torch"] if system.startswith("torch") else paths[system]
            files = _files(path)
            info: dict[str, Any] = {"cache": cache}
            try:
                if cache == "warm":
                    _read_through(files)
                elif cache == "cold":
                    info["cold_method"], _ = evict(files, drop_caches)
                if files:
                    info["resident_fraction"] = resident_fraction(files)
            except OSError as e:
                out[row] = {"error": f"preparing the page cache ({cache}): {e}", **info}
                continue
            expect = {"nebula_memory": "memory", "nebula_local": "local"}.get(system, "")
            res, why = launch(WorkerSpec(role="restart", width=g.width, layers=g.layers, threads=threads,
                                         result=str(d / f"{row}.json"), system=system, path=str(path),
                                         expect_tier=expect), work, f"rep{rep}-{row}", deadline_s)
            if res is None:
                out[row] = {"error": why, **info}
            else:
                res.update(info, state_bytes=saved["state_bytes"],
                           restore_ok=res["digest_after_step"] == saved["digest_after_step"]
                           and res.get("step") == saved["step"])
                out[row] = res
            if row == "nebula_memory":  # the crash's leftovers: the memory tier and its root
                _remove_memory_tier(mem_tiers[0])
                shutil.rmtree(paths["nebula_memory"], ignore_errors=True)
        out["_save"] = saved
    finally:
        for m in mem_tiers:  # a restore-only Checkpointer does not remove a memory tier it did not write
            _remove_memory_tier(m)
        shutil.rmtree(d, ignore_errors=True)
    return out


def run_size(size_gb: float, work: Path, reps: int, threads: int, quick: bool, drop_caches: bool) -> dict[str, Any]:
    """Every figure of one state size (never raises)."""
    g = geometry(size_gb)
    entry: dict[str, Any] = {"size_gb": size_gb, "width": g.width, "layers": g.layers, "params": g.params,
                             "state_bytes": g.state_bytes, "description": g.describe(), "status": "ok",
                             "reason": None, "rows": [], "saves": None}
    why = fit(g.state_bytes, work)
    if why:
        log.warning("recovery %.2f GB: %s", size_gb, why)
        entry.update(status="skipped", reason=why)
        return entry
    gb = g.state_bytes / 1e9
    deadline = 120.0 + 90.0 * gb
    per_rep: list[dict[str, dict[str, Any]]] = []
    for rep in range(reps):
        log.info("recovery %.2f GB (%s): repetition %d/%d", size_gb, g.describe(), rep + 1, reps)
        per_rep.append(run_rep(g, work / f"{size_gb:g}gb", rep, threads, deadline, drop_caches))
    saved = [r["_save"] for r in per_rep if "_save" in r]
    if saved:
        entry["state_bytes"] = saved[0]["state_bytes"]
        entry["num_tensors"] = saved[0]["num_tensors"]
        entry["save_s"] = {k: statistics.median(s[k] for s in saved)
                           for k in ("torch_save_s", "nebula_local_save_s", "nebula_memory_save_s")}
    for row, system, cache in ROWS:
        agg = aggregate_row(row, system, cache, [r[row] for r in per_rep], entry["state_bytes"])
        entry["rows"].append(agg)
        if agg["status"] == "ok":
            log.info("recovery %.2f GB: %s: load %s, first step done %s, extra peak RSS %.2fx", size_gb, row,
                     fmt_s(agg["load_s"]["median"]), fmt_s(agg["first_step_s"]["median"]), agg["extra_rss_ratio"])
        else:
            log.warning("recovery %.2f GB: %s: %s", size_gb, row, agg["reason"])
    for key, prepared in (("saves", False), ("saves_prepared", True)):
        entry[key] = _first_saves(g, work / f"{size_gb:g}gb" / key, threads, quick, deadline, prepared)
    return entry


def _first_saves(g: Geometry, sdir: Path, threads: int, quick: bool, deadline: float, prepared: bool) -> dict[str, Any]:
    """The first saves of a fresh process (``prepared``: after ``Checkpointer.prepare``)."""
    log.info("recovery %s: first saves of a fresh process%s", g.describe(), " after prepare()" if prepared else "")
    sdir.mkdir(parents=True, exist_ok=True)
    gb = g.state_bytes / 1e9
    nsaves = FIRST_SAVES + (2 if quick else 6)
    try:
        res, why = launch(WorkerSpec(role="saves", width=g.width, layers=g.layers, threads=threads,
                                     result=str(sdir / "saves.json"), dir=str(sdir), saves=nsaves,
                                     torch_reps=1 if quick else 2, prepare=prepared),
                          sdir, "saves", deadline + 30.0 * gb * nsaves)
    finally:
        _remove_memory_tier(_memory_tier_of(sdir / "nebula"))
        shutil.rmtree(sdir, ignore_errors=True)
    if res is None:
        log.warning("recovery %s: first saves: %s", g.describe(), why)
        return {"status": "error", "reason": why}
    return aggregate_saves(res)


def run(a: argparse.Namespace, base: Optional[Path]) -> dict[str, Any]:
    """The recovery section of the results (``a.recovery_sizes``, ``a.recovery_reps``). Never raises."""
    sizes = list(a.recovery_sizes)
    sec: dict[str, Any] = {"sizes_gb": sizes, "reps": a.recovery_reps, "model": "mlp", "calls": CALLS,
                           "method": METHOD, "shm_dir": _shm_dir(), "threads": torch.get_num_threads(),
                           "sizes": [], "shm_left": [], "cpu_pressure_start": cpu_pressure()}
    if base is None:
        sec["error"] = "the recovery benchmark writes local files: give a local --target"
        log.warning("recovery benchmark skipped: %s", sec["error"])
        return sec
    user_dir = Path(_memory_tier_of(base / "x")).parent
    user_dir_existed = user_dir.exists()
    work = Path(tempfile.mkdtemp(prefix="recovery-", dir=str(base)))
    roots: list[Path] = []
    try:
        for size in sizes:
            try:
                sec["sizes"].append(run_size(size, work, a.recovery_reps, torch.get_num_threads(), bool(a.quick),
                                             bool(getattr(a, "drop_caches", False))))
            except Exception as e:  # one size's failure is its row, not the run's end
                log.exception("recovery %.2f GB failed", size)
                sec["sizes"].append({"size_gb": size, "status": "error", "reason": f"{type(e).__name__}: {e}",
                                     "rows": [], "saves": None})
            d = work / f"{size:g}gb"
            roots += [d / f"rep{r}" / n for r in range(a.recovery_reps) for n in ("nebula", "nebula_local")]
            roots += [d / "saves" / "nebula", d / "saves_prepared" / "nebula"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    left = [m for m in (_memory_tier_of(r) for r in roots) if os.path.exists(m)]
    for m in left:
        log.warning("recovery: memory tier %s left behind; removing it", m)
        _remove_memory_tier(m)
    sec["shm_left"] = left
    sec["cpu_pressure_end"] = cpu_pressure()
    if not user_dir_existed and user_dir.is_dir() and not any(user_dir.iterdir()):
        user_dir.rmdir()
    return sec



def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m benchmarks.recovery worker ROLE SPEC.json`` (the benchmark's own processes);
    run the benchmark itself with ``nebula-ckpt bench --recovery``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["worker"]:
        return worker_main(args[1:])
    raise SystemExit("run the recovery benchmark with: nebula-ckpt bench --recovery [--recovery-sizes 0.3,1.2] "
                     "[--recovery-only]")


if __name__ == "__main__":
    sys.exit(main())
