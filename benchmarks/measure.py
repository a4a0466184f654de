"""The single-process measurements of ``nebula-ckpt bench``: what the runner does with each system.

For one system on one workload (:func:`run_system`): 1 warm-up + ``--reps`` timed saves
(:func:`one_save`: call, stall before the next optimizer step, time to durable), restores
checked against a fingerprint (:func:`measure_restores`), and the interleaved throughput rounds
(:func:`measure_throughput`, also run by every rank of :mod:`benchmarks.rank_jobs`). Plus the
bare snapshot copy (:func:`measure_floor`) and nebula's host memory over many saves
(:func:`flat_memory_check`). The order of a run and the command line are :mod:`benchmarks.runner`'s.
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import os
import shutil
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Optional

import torch

from benchmarks import workloads as wl
from benchmarks.common import summary
from benchmarks.limits import PeakRss, dir_bytes, evict, io_write_bytes, resident_fraction, rss_bytes, shm_used_bytes
from benchmarks.peer_base import Peer, PeerUnavailable
from benchmarks.peers import PEERS, Nebula, SnapshotFloor

log = logging.getLogger(__name__)


def train_loop(w: wl.Workload, steps: int, interval: int, peer: Optional[Peer] = None,
               step0: int = 0) -> float:
    """``steps`` training steps, saving on steps 1, 1+interval, ...; return seconds."""
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        w.forward_backward()
        if peer is not None:
            peer.wait_safe()  # what the library's optimizer.step() hook would wait for anyway
        w.optimizer_step()
        w.sync()
        if peer is not None and (i - 1) % interval == 0:
            peer.save(step0 + i, functools.partial(w.state, step0 + i))
    return time.perf_counter() - t0


def one_save(peer: Peer, w: wl.Workload, step: int) -> dict[str, float]:
    """One measured save (see the module docstring): call/stall/blocking/durable in seconds, and
    the save's start ``t0`` and durable moment ``done`` on ``time.monotonic`` (comparable across
    the ranks of one machine)."""
    done_at: list[float] = []
    error: list[BaseException] = []

    def waiter() -> None:
        try:
            peer.wait_durable()
        except BaseException as e:  # re-raised on the training thread below
            error.append(e)
        done_at.append(time.monotonic())

    t0 = time.monotonic()
    peer.save(step, lambda: w.state(step))
    t1 = time.monotonic()
    th = threading.Thread(target=waiter, name="bench-durable", daemon=True)
    th.start()
    w.forward_backward()
    w.sync()
    t2 = time.monotonic()
    peer.wait_safe()
    t3 = time.monotonic()
    w.optimizer_step()
    w.sync()
    th.join()
    if error:
        raise error[0]
    return {"step": step, "t0": t0, "done": done_at[0], "call": t1 - t0, "stall": t3 - t2,
            "blocking": (t1 - t0) + (t3 - t2), "durable": done_at[0] - t0}


def idle_save(peer: Peer, w: wl.Workload, step: int) -> float:
    """Save and wait until durable with no training in between; return the seconds."""
    t0 = time.perf_counter()
    peer.save(step, lambda: w.state(step))
    peer.wait_safe()
    peer.wait_durable()
    return time.perf_counter() - t0


def run_system(name: str, w: wl.Workload, target: str, base: Optional[Path], args: argparse.Namespace,
               baselines: list[float], step_base: int) -> dict[str, Any]:
    """Measure one system on workload ``w``; never raises (errors are recorded).

    The no-checkpoint loop timed for the throughput comparison is appended to ``baselines``.
    """
    peer = PEERS[name]()
    res: dict[str, Any] = {"name": name, "calls": peer.calls, "durability": peer.durability,
                           "status": "ok", "reason": None}
    try:
        peer.check(target)
    except PeerUnavailable as e:
        log.warning("%s: unavailable: %s", name, e)
        res.update(status="unavailable", reason=str(e))
        return res
    root: Any = (base / f"{w.name}-{name}") if base is not None else f"{target.rstrip('/')}/{w.name}-{name}"
    opened = False
    try:
        peer.open(root)
        opened = True
        gc.collect()
        rss0 = rss_bytes()
        step, fingerprint = measure_saves(peer, w, args, res, step_base, rss0)
        measure_restores(peer, w, args, res, fingerprint, step, rss0)
        measure_throughput(peer, w, args, res, step, baselines, rss0)
        res["end_step"] = step + args.steps
    except Exception as e:
        log.exception("%s failed on %s", name, w.name)
        res.update(status="error", reason=f"{type(e).__name__}: {e}")
    finally:
        if opened:
            try:
                peer.close()
            except Exception as e:
                log.warning("%s: close() failed: %s", name, e)
                if res["status"] == "ok":
                    res.update(status="error", reason=f"close: {type(e).__name__}: {e}")
        if base is not None and not args.keep:
            shutil.rmtree(base / f"{w.name}-{name}", ignore_errors=True)
        gc.collect()
    return res


def measure_saves(peer: Peer, w: wl.Workload, args: argparse.Namespace, res: dict[str, Any],
                   step: int, rss0: int) -> tuple[int, list[float]]:
    """1 warm-up + ``args.reps`` measured saves; return (last step saved, its fingerprint)."""
    shm0 = shm_used_bytes()
    io0 = io_write_bytes()
    fingerprint: list[float] = []
    reps = []
    idle = []
    with PeakRss() as peak:
        res["rss_method"] = peak.method
        for r in range(args.reps + 1):
            step += 1
            w.train_step()
            if r == args.reps:
                fingerprint = w.fingerprint()
            reps.append(one_save(peer, w, step))
            if r < args.reps:
                peer.prune()
            if r == 0 and not peer.blocking:
                # persist with the training thread idle: comparable with the write limit
                for _ in range(min(3, args.reps)):
                    step += 1
                    w.train_step()
                    idle.append(idle_save(peer, w, step))
                    peer.prune()
        save_peak = peak.peak()
    io1 = io_write_bytes()
    nsaves = len(reps) + len(idle)
    res["first_save"] = reps.pop(0)
    for k in ("call", "stall", "blocking", "durable"):
        res[k + "_s"] = summary([x[k] for x in reps])
    res["ckpt_bytes"] = sum(os.path.getsize(p) for p in peer.files())
    res["bytes_written_per_save"] = (io1 - io0) / nsaves if io0 is not None and io1 is not None else None
    res["persist_gbps"] = w.state_bytes / res["durable_s"]["median"] / 1e9
    # a blocking save has nothing to overlap: its durable time is already "idle"
    res["durable_idle_s"] = summary(idle) if idle else res["durable_s"]
    res["persist_idle_gbps"] = w.state_bytes / res["durable_idle_s"]["median"] / 1e9
    res["peak_rss_bytes"] = save_peak
    res["peak_rss_delta_bytes"] = save_peak - rss0
    if isinstance(peer, Nebula):
        res["shm_bytes"] = dir_bytes(peer.memory_tier_dir())
        res["stats_after_saves"] = peer.stats()
    elif shm0 is not None:
        res["shm_bytes"] = max(0, (shm_used_bytes() or 0) - shm0)
    return step, fingerprint


def measure_restores(peer: Peer, w: wl.Workload, args: argparse.Namespace, res: dict[str, Any],
                      fingerprint: list[float], saved_step: int, rss0: int) -> None:
    """Restore right after the save (page cache as the save left it: O_DIRECT writes leave
    nothing cached), warm (second read), then cold (files evicted); each checked."""
    into = w.state(0)
    files = peer.files()
    res["after_save_resident_fraction"] = resident_fraction(files)

    def timed_restore(key: str) -> int:
        w.train_step()  # move away from the saved state, so a no-op restore cannot pass
        c0, t0 = time.process_time(), time.perf_counter()
        got = peer.restore(into)
        took, cpu = time.perf_counter() - t0, time.process_time() - c0
        ok = _close(w.fingerprint(), fingerprint)
        res.setdefault(f"restore_{key}_samples_s", []).append(took)
        # CPU time of the process (all its threads): on a machine shared with other jobs the wall
        # time measures the neighbours as much as the restore
        res.setdefault(f"restore_{key}_cpu_samples_s", []).append(cpu)
        res[f"restore_{key}_cpu_s"] = statistics.median(res[f"restore_{key}_cpu_samples_s"])
        res[f"restore_{key}_ok"] = res.get(f"restore_{key}_ok", True) and ok
        res[f"restore_{key}_s"] = statistics.median(res[f"restore_{key}_samples_s"])
        return got

    with PeakRss() as peak:
        res["restore_step_ok"] = timed_restore("after_save") == saved_step
        res["restore_peak_rss_delta_bytes"] = peak.peak() - rss0
    res["restore_ok"] = res.pop("restore_after_save_ok")
    reps = max(1, getattr(args, "restore_reps", 1))
    for _ in range(reps):  # the medians of the warm and cold restores, interleaved
        timed_restore("warm")
        method, frac = evict(peer.files(), args.drop_caches)
        res["cold_method"] = method
        res["cold_resident_fraction"] = max(frac or 0.0, res.get("cold_resident_fraction") or 0.0) \
            if frac is not None else res.get("cold_resident_fraction")
        timed_restore("cold")
    if isinstance(peer, Nebula) and peer.memory_tier_dir():
        res["cold_note"] = ("restore reads the memory tier in /dev/shm (tmpfs pages cannot "
                            "be evicted); only the local tier's files were evicted")
    if not all(res[k] for k in ("restore_ok", "restore_warm_ok", "restore_cold_ok", "restore_step_ok")):
        log.warning("%s: restored state does not match the state saved at step %d", peer.name, saved_step)


def measure_throughput(peer: Peer, w: wl.Workload, args: argparse.Namespace, res: dict[str, Any],
                        step: int, baselines: list[float], rss0: int) -> None:
    """Training throughput with a save every ``args.interval`` steps vs without.

    Interleaved rounds, so both sides see the same neighbours on a shared machine: K steps
    without a checkpoint, then K steps with a save on the first of them, then whatever is left
    of that save's persist (*backlog*, timed: with a checkpoint every K steps, a save has K steps
    to become durable; what it needs beyond that stalls, delays or drops the next save). A last
    K steps without closes the sequence: each round's baseline is the mean of the segments
    before and after it, which cancels a slow drift of the machine's speed.
    """
    k = args.interval
    rounds = max(1, args.steps // k)
    base_t = with_t = backlog = 0.0
    per_round = []
    peer.reset_counters()
    with PeakRss() as peak:
        b_next = train_loop(w, k, k)
        baselines.append(b_next)
        for _ in range(rounds):
            b_prev = b_next
            t0 = time.perf_counter()
            train_loop(w, k, k, peer, step0=step)
            t1 = time.perf_counter()
            peer.wait_durable()
            t2 = time.perf_counter()
            step += k
            peer.prune()
            b_next = train_loop(w, k, k)
            baselines.append(b_next)
            b = (b_prev + b_next) / 2
            base_t += b
            with_t += t2 - t0
            backlog += t2 - t1
            per_round.append({"without_s": b, "with_s": t2 - t0, "backlog_s": t2 - t1,
                              "overhead": (t2 - t0) / b - 1.0})
        loop_peak = peak.peak()
    res["throughput"] = {"steps": rounds * k, "interval": k, "saves": rounds, "with_ckpt_s": with_t,
                         "baseline_s": base_t, "overhead": with_t / base_t - 1.0,
                         "backlog_s": backlog, "overhead_excl_backlog": (with_t - backlog) / base_t - 1.0,
                         "per_save_s": (with_t - base_t) / rounds, "rounds": per_round, **peer.counters()}
    # after the restores (which may leave the allocator bigger): reported apart from the saves
    res["loop_peak_rss_delta_bytes"] = loop_peak - rss0
    if isinstance(peer, Nebula):
        res["stats"] = peer.stats()


def measure_floor(w: wl.Workload, args: argparse.Namespace, baselines: list[float]) -> dict[str, Any]:
    """Throughput overhead of the bare snapshot copy (:class:`SnapshotFloor`) on workload ``w``."""
    peer = SnapshotFloor()
    res: dict[str, Any] = {}
    try:
        measure_throughput(peer, w, args, res, 0, baselines, rss_bytes())
    except Exception as e:  # a reference figure: never fail the run for it
        log.warning("snapshot floor not measured: %s", e)
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        peer.close()
    th = res["throughput"]
    return {"overhead": th["overhead"], "interval": th["interval"], "rounds": th["rounds"]}


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1e-6 * max(1.0, abs(y)) for x, y in zip(a, b, strict=True))


def flat_memory_check(target: str, base: Optional[Path], saves: int, keep: bool) -> dict[str, Any]:
    """nebula_ckpt, default tiers: ``saves`` saves of a small state, one per training step."""
    import nebula_ckpt as nc

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(8, 512)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    state_bytes = sum(t.numel() * t.element_size()
                      for t in list(model.state_dict().values())
                      + [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)])
    root = str(base / "flat-nebula") if base is not None else f"{target.rstrip('/')}/flat-nebula"
    ck = nc.Checkpointer(root)
    marks: dict[int, dict[str, Any]] = {}
    warm = min(10, saves)
    try:
        for i in range(1, saves + 1):
            step()
            ck.save_async(i, {"model": model, "optim": opt, "step": i})
            if i in (warm, saves):
                ck.wait()
                gc.collect()
                stats = ck.stats() if hasattr(ck, "stats") else {}
                marks[i] = {"rss_bytes": rss_bytes(), "staging_bytes": stats.get("staging_bytes")}
    finally:
        ck.close()
        if base is not None and not keep:
            shutil.rmtree(root, ignore_errors=True)
    a, b = marks[warm], marks[saves]
    return {"saves": saves, "state_bytes": state_bytes, "after_warmup_save": warm,
            "rss_after_warmup": a["rss_bytes"], "rss_after_last": b["rss_bytes"],
            "rss_growth_bytes": b["rss_bytes"] - a["rss_bytes"],
            "staging_after_warmup": a["staging_bytes"], "staging_after_last": b["staging_bytes"]}


# --------------------------------------------------------------------------- CLI
