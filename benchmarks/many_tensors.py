"""The save call against the number of tensors: 100 -> 100,000 tensors, every system in one run.

``python -m benchmarks.many_tensors`` (see ``--help``; benchmarks/README.md). States of N tensors:

* ``flat``: a dict of N tensors of 1 KB (what a framework hands over: live tensors, no module);
* ``model``: a module of N/4 parameters of 1 KB (16x16, no bias) and its AdamW: 4 tensors per
  parameter (the parameter, ``exp_avg``, ``exp_avg_sq``, ``step``), passed as
  ``{"model": model, "optim": opt, "step": step}``;
* ``moe``: MoE-shaped: N/4 - 4 small expert parameters (1 KB) beside 4 large dense ones
  (1024x1024, 4 MB), with AdamW.

For each system, each size and each state: ``--warmup`` saves, then ``--reps`` saves (4x that up
to 1,000 tensors: sub-millisecond calls need more samples), the systems interleaved rep by rep (a
busy neighbour slows them all alike). Each system saves in a process of its own (one per state and
size; :func:`worker`), so what one holds (staging, threads, file descriptors: PyTorch's
shared-memory staging keeps one per tensor) cannot slow another or make it fail. Timed per save:
the call, and the call plus the wait until the state may change (``wait_safe``: for systems whose
call returns before the state is copied). Untimed after each save: the wait until it is durable
(so no save overlaps another's writes, and no system's writes run while another system or a floor
is timed). In the parent process, in the same rep, two floors: ``floor_s`` a bare Python loop
reading every tensor's ``data_ptr()`` (the least any per-tensor check from Python costs) and
``copy_s`` one copy of the state's bytes as a single block into a buffer touched before (the bytes
every snapshot must move; the faster of ATen's ``copy_`` and a plain ``memmove``). ``nebula``'s
first save (the state planned from scratch, staging allocated) is kept apart.

Results: ``results.json`` (every sample) and ``results.md`` (:mod:`benchmarks.many_report`) in ``--out``.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as _dt
import gc
import json
import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from benchmarks.common import summary
from benchmarks.limits import machine_info
from benchmarks.many_report import write_report
from benchmarks.peer_base import Peer, PeerUnavailable
from benchmarks.peers import DcpAsyncSave, Nebula, NebulaLocal, TorchSave
from benchmarks.peers_staged import DcpAsyncSaveShared, TorchCheckpointing

log = logging.getLogger("benchmarks.many_tensors")

WORKLOADS = ("flat", "model", "moe")
SIZES = (100, 1_000, 10_000, 100_000)
#: up to this many tensors a size takes 4x the timed saves (:func:`reps_for`)
SMALL_SIZE = 1_000


class NebulaAsync(NebulaLocal):
    """``nebula_local`` with ``snapshot="async"``: the call returns once the copy is enqueued (a
    GPU's default); the copy is waited for by ``wait_safe`` (what the next ``optimizer.step()``'s hook
    waits for)."""

    name = "nebula_async"
    calls = ('nc.Checkpointer(root, tiers=[LocalTier(root)], snapshot="async"): the call returns once the '
             "copy is enqueued; handle.wait_snapshot() before the state changes")

    def open(self, root: Path | str) -> None:
        import nebula_ckpt as nc

        super().open(root)
        self.ck.close()
        self.ck = nc.Checkpointer(str(root), tiers=[nc.LocalTier(str(root))], snapshot="async")


#: the systems of this benchmark, in report order
SYSTEMS: dict[str, type[Peer]] = {p.name: p for p in (
    NebulaLocal, NebulaAsync, TorchSave, DcpAsyncSave, DcpAsyncSaveShared, TorchCheckpointing)}


# --------------------------------------------------------------------------- states

class Experts(torch.nn.Module):
    """``n`` small parameters of 1 KB (a 16x16 Linear without bias each), and ``dense`` large ones."""

    def __init__(self, n: int, dense: int = 0) -> None:
        super().__init__()
        self.dense = torch.nn.ModuleList(torch.nn.Linear(1024, 1024, bias=False) for _ in range(dense))
        self.experts = torch.nn.ModuleList(torch.nn.Linear(16, 16, bias=False) for _ in range(n))


def build_state(workload: str, n: int) -> dict[str, Any]:
    """The state of ``workload`` with about ``n`` tensors (see the module docstring)."""
    torch.manual_seed(0)
    if workload == "flat":
        return {f"t{i}": torch.randn(256) for i in range(n)}
    dense = 4 if workload == "moe" else 0
    model = Experts(max(1, n // 4 - dense), dense)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return {"model": model, "optim": opt, "step": 0}


def state_tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    """Every tensor a save of ``state`` copies (the floors' input)."""
    out: list[torch.Tensor] = []
    for v in state.values():
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, torch.nn.Module):
            out += list(v.state_dict().values())
        elif isinstance(v, torch.optim.Optimizer):
            out += [t for s in v.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return out


def floor_loop(tensors: list[torch.Tensor]) -> float:
    """Seconds of a bare Python loop reading each tensor's ``data_ptr()``."""
    t = time.perf_counter()
    for x in tensors:
        x.data_ptr()
    return time.perf_counter() - t


def make_copy_floor(tensors: list[torch.Tensor]) -> Callable[[], float]:
    """A function timing one copy of the state's bytes as a single block (buffers touched first):
    the faster of ATen's ``copy_`` (parallel) and one plain ``memmove`` (ATen's parallel region
    costs milliseconds on a small block, which would make the floor larger than the save)."""
    nbytes = max(sum(t.numel() * t.element_size() for t in tensors), 1)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)

    def run() -> float:
        t = time.perf_counter()
        dst.copy_(src)
        t1 = time.perf_counter()
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        return min(t1 - t, time.perf_counter() - t1)
    return run


# --------------------------------------------------------------------------- one size

class _Run:
    """One system saving one state: its samples."""

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self.call: list[float] = []
        self.safe: list[float] = []
        self.first: Optional[dict[str, float]] = None
        self.error: Optional[str] = None

    def save(self, step: int, state: dict[str, Any], keep: bool) -> None:
        if self.error is not None:
            return
        try:
            self.peer.wait_durable()  # the previous save is not timed, nor overlapped
            t0 = time.perf_counter()
            self.peer.save(step, lambda: state)
            t1 = time.perf_counter()
            self.peer.wait_safe()
            t2 = time.perf_counter()
            # untimed: durable before the reply, so no save of this system is still writing while
            # the next system's save or the parent's floors are timed (two cores: it would show)
            self.peer.wait_durable()
            self.peer.prune()
        except Exception as e:  # recorded, the run goes on
            log.exception("%s failed", self.peer.name)
            self.error = f"{type(e).__name__}: {e}"
            return
        if self.first is None:
            self.first = {"call_s": t1 - t0, "safe_s": t2 - t0}
        elif keep:
            self.call.append(t1 - t0)
            self.safe.append(t2 - t0)

    def finish(self) -> dict[str, Any]:
        try:
            self.peer.wait_durable()
        except Exception as e:
            self.error = self.error or f"{type(e).__name__}: {e}"
        stats = self.peer.ck.stats().get("plans", {}) if isinstance(self.peer, Nebula) else {}
        try:
            self.peer.close()
        except Exception as e:
            self.error = self.error or f"close: {type(e).__name__}: {e}"
        if self.error is not None:
            return {"status": "error", "reason": self.error}
        return {"status": "ok", "first": self.first, "call_s": summary(self.call), "safe_s": summary(self.safe),
                "plans": stats}


def worker(conn: Any, name: str, workload: str, n: int, root: str) -> None:
    """A process saving one state with one system, a save per message (``measure_size``): each
    system in a process of its own, so what one holds (file descriptors, staging, threads) cannot
    change another's figures or make it fail."""
    logging.basicConfig(level=logging.WARNING)
    state = build_state(workload, n)
    peer = SYSTEMS[name]()
    try:
        peer.check(root)
        peer.open(Path(root))
    except (PeerUnavailable, ImportError) as e:
        conn.send({"status": "unavailable", "reason": str(e)})
        return
    conn.send({"status": "ready"})
    run = _Run(peer)
    while True:
        msg = conn.recv()
        if msg[0] == "save":
            if "step" in state:
                state["step"] = msg[1]
            run.save(msg[1], state, msg[2])
            conn.send(run.error)
        else:
            conn.send(run.finish())
            return


def _start(name: str, workload: str, n: int, root: Path) -> tuple[Any, Any, dict[str, Any]]:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=worker, args=(there, name, workload, n, str(root)), daemon=False)
    proc.start()
    first = here.recv() if here.poll(900) else {"status": "error", "reason": "the worker did not start"}
    return proc, here, first


def reps_for(n: int, reps: int) -> int:
    """Timed saves at ``n`` tensors: 4x ``reps`` up to 1,000 tensors (sub-millisecond calls, whose
    medians need more samples on a shared machine; cheap), ``reps`` above."""
    return reps * 4 if n <= SMALL_SIZE else reps


def measure_size(workload: str, n: int, systems: list[str], a: argparse.Namespace, base: Path) -> dict[str, Any]:
    """Every system saving the ``workload`` state of ``n`` tensors (see the module docstring)."""
    state = build_state(workload, n)
    tensors = state_tensors(state)
    copy_floor = make_copy_floor(tensors)
    out: dict[str, Any] = {"workload": workload, "tensors": len(tensors),
                           "bytes": sum(t.numel() * t.element_size() for t in tensors), "systems": {}}
    workers = {}
    for name in systems:
        if name == NebulaAsync.name and workload == "flat":  # live tensors no hook guards: copied in the call
            out["systems"][name] = {"status": "n/a", "reason": "a flat dict of tensors is always copied in the call"}
            continue
        proc, conn, first = _start(name, workload, n, base / f"{workload}-{n}" / name)
        if first.get("status") != "ready":
            out["systems"][name] = first
            proc.join(60)
            continue
        workers[name] = (proc, conn)
    floors: list[float] = []
    copies: list[float] = []
    for rep in range(a.warmup + reps_for(n, a.reps)):
        for _proc, conn in workers.values():
            conn.send(("save", rep, rep >= a.warmup))
            conn.recv()
        floors.append(floor_loop(tensors))
        copies.append(copy_floor())
    out["floor_s"] = summary(floors[a.warmup:])
    out["copy_s"] = summary(copies[a.warmup:])
    for name, (proc, conn) in workers.items():
        conn.send(("finish",))
        out["systems"][name] = conn.recv()
        proc.join(120)
    return out


# --------------------------------------------------------------------------- the run

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.many_tensors", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=None, help=f"numbers of tensors (default {','.join(str(s) for s in SIZES)})")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"of {', '.join(WORKLOADS)}")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"of {', '.join(SYSTEMS)}")
    p.add_argument("--reps", type=int, default=5, help="timed saves per system and size (4x that up to 1,000 tensors)")
    p.add_argument("--warmup", type=int, default=2, help="saves before the timed ones (the first is kept apart)")
    p.add_argument("--max-save-s", type=float, default=60.0,
                   help="skip a system at the larger sizes once one of its saves took longer than this")
    p.add_argument("--target", default=None, help="folder to write the checkpoints in (default: under bench_out/)")
    p.add_argument("--out", default=None, help="results folder (default: benchmarks/results/many-tensors-<date>)")
    p.add_argument("--quick", action="store_true", help="1 warm-up, 2 reps, sizes 100,1000 unless given (a smoke run)")
    a = p.parse_args(argv)
    if a.quick:
        a.sizes, a.reps, a.warmup = a.sizes or "100,1000", 2, 1
    a.sizes = [int(s) for s in str(a.sizes or ",".join(str(s) for s in SIZES)).split(",") if s]
    a.workloads = [w for w in str(a.workloads).split(",") if w]
    a.systems = [s for s in str(a.systems).split(",") if s]
    for w in a.workloads:
        if w not in WORKLOADS:
            p.error(f"unknown workload {w!r} (of {', '.join(WORKLOADS)})")
    for s in a.systems:
        if s not in SYSTEMS:
            p.error(f"unknown system {s!r} (of {', '.join(SYSTEMS)})")
    if a.reps < 1 or a.warmup < 1:
        p.error("--reps and --warmup must be >= 1 (the first save is kept apart)")
    return a


def _slow(row: dict[str, Any], limit: float) -> set[str]:
    """Systems whose slowest save at this size took longer than ``limit`` s."""
    slow = set()
    for name, s in row["systems"].items():
        if s.get("status") == "ok" and max(s["safe_s"]["samples"] or [0.0]) > limit:
            slow.add(name)
    return slow


def run(a: argparse.Namespace) -> dict[str, Any]:
    """Every workload, size and system (see the module docstring)."""
    base = Path(a.target or tempfile.mkdtemp(prefix="many-", dir=_bench_out()))
    results: dict[str, Any] = {"settings": {k: v for k, v in vars(a).items()}, "rows": [],
                               "calls": {n: SYSTEMS[n].calls for n in a.systems},
                               "load_before": os.getloadavg()}
    try:
        for workload in a.workloads:
            skip: set[str] = set()
            for n in sorted(a.sizes):
                systems = [s for s in a.systems if s not in skip]
                log.info("%s, %d tensors: %s", workload, n, ", ".join(systems))
                row = measure_size(workload, n, systems, a, base)
                for s in skip:
                    row["systems"][s] = {"status": "skipped",
                                         "reason": f"a save at a smaller size took > {a.max_save_s} s"}
                skip |= _slow(row, a.max_save_s)
                results["rows"].append(row)
                gc.collect()
    finally:
        if a.target is None:
            shutil.rmtree(base, ignore_errors=True)
    results["load_after"] = os.getloadavg()
    results["machine"] = machine_info(base.parent, str(base))
    return results


def _bench_out() -> str:
    d = Path(__file__).resolve().parents[1] / "bench_out"
    d.mkdir(exist_ok=True)
    return str(d)


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("nebula_ckpt").setLevel(logging.WARNING)
    a = parse_args(argv)
    out = Path(a.out or Path(__file__).resolve().parent / "results" / f"many-tensors-{_dt.date.today()}")
    out.mkdir(parents=True, exist_ok=True)
    results = run(a)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    write_report(results, out / "results.md")
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
