"""Multi-rank cases of ``nebula-ckpt bench`` (``--ranks 2,4``).

Every case is a real job: ``W`` processes (spawned with ``python -m benchmarks.ranks``,
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
3. the throughput loop of :func:`benchmarks.runner._measure_throughput`: interleaved
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
import datetime
import json
import logging
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, cast

import torch

from benchmarks import workloads as wl
from benchmarks.peers import DcpAsyncSave, DcpSave, Nebula, Peer, StateFn, _quiet_dcp
from benchmarks.report import _target, fmt_b, fmt_pct, fmt_s

log = logging.getLogger(__name__)

#: systems of the multi-rank cases, in report order
SYSTEMS = ("nebula", "dcp_save", "dcp_async_save")

#: models of the multi-rank cases (GPT shapes of :mod:`~.workloads`; state = ~12 bytes/parameter)
RANK_MODELS: dict[str, wl.GPTConfig] = {
    "micro": wl.GPTConfig(d=64, layers=1, heads=2, vocab=1024, block=64),       # ~1.3 MB of state
    "tiny": wl.GPT_CONFIGS["tiny"],                                             # ~18 MB
    "small": wl.GPTConfig(d=256, layers=4, heads=4, vocab=16384, block=256),    # ~89 MB
}
#: the tiny state of the commit-protocol measurement
PROTOCOL_MODEL = "micro"
#: training steps every rank takes before measuring anything
WARMUP_STEPS = 5
#: the blocking target: nebula's blocking per rank within this factor of the single-process figure
BLOCKING_FACTOR = 2.0

_DCP_SHARD = re.compile(r"__(\d+)_\d+\.distcp")
_NEBULA_SHARD = re.compile(r"shard-g\d+-r(\d+)\.safetensors")

METHOD = (
    "Each row is one job of W spawned processes (gloo on 127.0.0.1) training a DDP-replicated model with "
    "AdamW; every system runs in turn on the same job. Blocking = save call + stall before the next "
    "optimizer step on one rank; per rep the slowest rank's, median / p95 over reps. Time to commit: from "
    "the earliest rank's save call until durable on every rank (nebula: `result()` returned on every rank, "
    "rank 0 wrote COMMIT; DCP: `save` / the async future returned on every rank, rank 0 wrote `.metadata`), "
    "directory fsyncs included; while the next training step runs / with the training thread idle. Written "
    "per rank: sizes of the files of the newest checkpoint each rank wrote (nebula "
    "`shard-g<G>-r<R>.safetensors`, DCP `__<R>_0.distcp`; manifest, COMMIT and `.metadata` count for rank "
    "0; nebula's memory tier in /dev/shm is not counted). Overhead: the runner's interleaved throughput "
    "rounds on every rank (a save every K steps vs none), the largest over ranks. The 1-rank row is a "
    "single process (no process group, no DDP) of the same model: the reference of the blocking target.")


# --------------------------------------------------------------------------- job description

@dataclass
class JobSpec:
    """What every rank of one job does (written as JSON for the worker processes)."""

    world: int
    mode: str                      # "compare" (systems side by side) or "protocol"
    systems: list[str]
    model: str
    root: str                      # shared checkpoint folder of the job
    out: str                       # where each rank writes its records
    reps: int = 5
    interval: int = 10
    steps: int = 30
    batch_size: int = 1
    seq_len: int = 64
    saves: int = 10                # protocol mode: measured saves (after 2 warm-up saves)
    threads: int = 1               # torch intra-op threads per rank
    timeout_s: float = 600.0       # process-group and commit-round timeout
    keep: bool = False


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


# --------------------------------------------------------------------------- the workload of a rank

def build_workload(model: str, world: int, rank: int, *, batch_size: int = 1, seq_len: int = 64,
                   seed: int = 0) -> wl.Workload:
    """GPT ``model`` of :data:`RANK_MODELS` (``DistributedDataParallel`` when ``world > 1``) + AdamW,
    one training step taken (AdamW's moments exist). Every rank builds the same weights; each
    rank has its own batch, as data parallelism has."""
    cfg = RANK_MODELS[model]
    torch.manual_seed(seed)
    gpt = wl.GPT(cfg)
    module: torch.nn.Module = gpt
    if world > 1:
        module = torch.nn.parallel.DistributedDataParallel(gpt)
    gen = torch.Generator().manual_seed(seed + 1 + rank)
    batch = torch.randint(0, cfg.vocab, (batch_size, min(seq_len, cfg.block)), generator=gen)
    desc = (f"GPT-2 shape d={cfg.d}, {cfg.layers} layers, vocab {cfg.vocab} (tied head), AdamW"
            + (", DDP-replicated" if world > 1 else ", one process") + f"; batch {tuple(batch.shape)} per rank")
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4)
    w = wl.Workload(name=model, model=module, optimizer=opt, device=torch.device("cpu"), batch=batch,
                    description=desc)
    w.train_step()
    tensors = wl.state_tensors(gpt, opt)
    w.params = sum(p.numel() for p in gpt.parameters())
    w.state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    w.num_tensors = len(tensors)
    return w


def state_bytes_estimate(model: str) -> int:
    """Parameter + AdamW bytes of ``model`` without building it."""
    c = RANK_MODELS[model]
    params = c.vocab * c.d + c.block * c.d + c.layers * (12 * c.d * c.d + 13 * c.d) + 2 * c.d
    return 12 * params


# --------------------------------------------------------------------------- the systems, rank-aware

def _dcp_state(state: dict[str, Any]) -> dict[str, Any]:
    """``{"model", "optim", "step"}`` -> DCP's state dict through ``get_state_dict`` (FQN keys; DDP's
    ``module.`` prefix removed), as DCP's documentation saves a DDP / FSDP model."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(state["model"], optimizers=state["optim"])
    return {"model": msd, "optim": osd, "step": state["step"]}


class RankDcpSave(DcpSave):
    """``dcp.save`` of ``get_state_dict(model, opt)`` on every rank (collective)."""

    name = "dcp_save"
    calls = ("torch.distributed.checkpoint.save(get_state_dict(model, opt), checkpoint_id=dir, "
             "process_group=<gloo group of its own>) on every rank - default FileSystemWriter")
    durability = ("FileSystemWriter fsyncs its data (every rank) and .metadata (rank 0) files; the "
                  "benchmark adds the directory fsyncs DCP leaves out")

    def __init__(self, rank: int = 0, world: int = 1, group: Any = None) -> None:
        super().__init__()
        self.rank, self.world, self.group = rank, world, group

    def save(self, step: int, state_fn: StateFn) -> None:
        import torch.distributed.checkpoint as dcp

        path = self._new_path(step)
        with _quiet_dcp():
            dcp.save(_dcp_state(state_fn()), checkpoint_id=str(path), process_group=self.group,
                     no_dist=self.world == 1)
        _fsync_dirs(path)

    def prune(self) -> None:
        if self.rank == 0:  # one rank deletes; the others only forget
            super().prune()
        self._older.clear()


class RankDcpAsyncSave(DcpAsyncSave):
    """``dcp.async_save`` of ``get_state_dict(model, opt)``; one save in flight at a time."""

    name = "dcp_async_save"
    calls = ("torch.distributed.checkpoint.async_save(get_state_dict(model, opt), checkpoint_id=dir, "
             "process_group=<gloo group of its own>) on every rank (thread; default stager); "
             "the future's result() for durable; the next save waits for the previous one")
    durability = ("FileSystemWriter fsyncs data and .metadata; the benchmark fsyncs the directories "
                  "once the future is done")

    def __init__(self, rank: int = 0, world: int = 1, group: Any = None) -> None:
        super().__init__()
        self.rank, self.world, self.group = rank, world, group

    def save(self, step: int, state_fn: StateFn) -> None:
        import torch.distributed.checkpoint as dcp

        self.wait_durable()
        path = self._new_path(step)
        with _quiet_dcp():
            resp = dcp.async_save(_dcp_state(state_fn()), checkpoint_id=str(path), process_group=self.group,
                                  no_dist=self.world == 1)
        # torch >= 2.9 may return AsyncSaveResponse(staging_completion, upload_completion)
        self._future = cast(Future, getattr(resp, "upload_completion", resp))
        self._pending_path = path

    def prune(self) -> None:
        if self.rank == 0:
            super().prune()
        self._older.clear()


class RankNebula(Nebula):
    """nebula's ``Checkpointer(root)`` (default tiers), its coordinator timestamping the protocol's
    rounds: with several ranks, the :class:`TimedCoordinator` replaces the default
    ``DistCoordinator`` over all ranks it is a subclass of (the same protocol, timed)."""

    def __init__(self, world: int = 1) -> None:
        super().__init__()
        self.world = world
        self.coordinator: Any = None

    def open(self, root: Path | str) -> None:
        import nebula_ckpt as nc

        self.root = root if isinstance(root, Path) else None
        self.url = str(root)
        if isinstance(root, Path):
            root.mkdir(parents=True, exist_ok=True)
        self.coordinator = TimedCoordinator.create() if self.world > 1 else None
        self.ck = nc.Checkpointer(str(root), coordinator=self.coordinator)
        self._handle = None
        self._handles = []

    def events(self) -> list[dict[str, Any]]:
        """The timestamped rounds so far (empty in one process)."""
        return list(getattr(self.coordinator, "events", []))


def _fsync_dirs(path: Path) -> None:
    from benchmarks.peers import fsync_path

    fsync_path(path)
    fsync_path(path.parent)


def make_peer(name: str, rank: int, world: int, group: Any) -> Peer:
    """The system ``name`` for this rank (``group``: DCP's own gloo group)."""
    if name == "nebula":
        return RankNebula(world)
    if name == "dcp_save":
        return RankDcpSave(rank, world, group)
    if name == "dcp_async_save":
        return RankDcpAsyncSave(rank, world, group)
    raise ValueError(f"unknown multi-rank system {name!r}; choose from {', '.join(SYSTEMS)}")


CALLS = {"nebula": "nc.Checkpointer(root) on every rank (default tiers; coordinates the ranks of the process "
                   "group itself; here with coordinator=a DistCoordinator subclass that only timestamps the "
                   "protocol's rounds); h = ck.save_async(step, {model, optim, step}); h.wait_snapshot(); "
                   "h.result()",
         "dcp_save": RankDcpSave.calls, "dcp_async_save": RankDcpAsyncSave.calls}


# --------------------------------------------------------------------------- worker (one rank)

def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _timed_save(peer: Peer, w: wl.Workload, step: int) -> dict[str, float]:
    """One save during training (see the runner's ``_one_save``), with absolute timestamps."""
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
    t2 = time.monotonic()
    peer.wait_safe()
    t3 = time.monotonic()
    w.optimizer_step()
    th.join()
    if error:
        raise error[0]
    return {"step": step, "t0": t0, "done": done_at[0], "call": t1 - t0, "stall": t3 - t2,
            "blocking": (t1 - t0) + (t3 - t2)}


def _idle_save(peer: Peer, w: wl.Workload, step: int) -> dict[str, float]:
    """Save and wait until durable, nothing else running; absolute timestamps."""
    t0 = time.monotonic()
    peer.save(step, lambda: w.state(step))
    peer.wait_safe()
    peer.wait_durable()
    return {"step": step, "t0": t0, "done": time.monotonic()}


def _measure_system(peer: Peer, w: wl.Workload, spec: JobSpec, rank: int, step: int,
                    baselines: list[float]) -> dict[str, Any]:
    """Saves, files, throughput of one system on this rank (see the module docstring)."""
    from benchmarks.runner import _measure_throughput

    rec: dict[str, Any] = {"reps": [], "idle": []}
    for r in range(spec.reps + 1):
        step += 1
        w.train_step()
        _barrier()
        rec["reps"].append(_timed_save(peer, w, step))
        if r == 0 and not peer.blocking:
            for _ in range(min(3, spec.reps)):
                step += 1
                w.train_step()
                _barrier()
                rec["idle"].append(_idle_save(peer, w, step))
        if r < spec.reps:
            peer.prune()
    rec["first"] = rec["reps"].pop(0)
    _barrier()  # every rank's files are in place
    if rank == 0:
        rec["files"] = {p.name: p.stat().st_size for p in peer.files()}
    th: dict[str, Any] = {}
    loop = argparse.Namespace(interval=spec.interval, steps=spec.steps)
    _measure_throughput(peer, w, loop, th, step, baselines, 0)
    rec["throughput"] = th["throughput"]
    rec["end_step"] = step + spec.steps
    if isinstance(peer, RankNebula):
        rec["events"] = peer.events()
    if isinstance(peer, Nebula):
        rec["stats"] = {k: v for k, v in peer.stats().items() if isinstance(v, (int, float, str))}
    return rec


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=repr))
    os.replace(tmp, path)


def _compare_job(spec: JobSpec, rank: int, out: Path) -> None:
    """Every system of ``spec.systems`` in turn on this rank; one record file per system."""
    import torch.distributed as dist

    w = build_workload(spec.model, spec.world, rank, batch_size=spec.batch_size, seq_len=spec.seq_len)
    for _ in range(WARMUP_STEPS):  # the first steps of a process are slow (allocator, OpenMP pool)
        w.train_step()
    from benchmarks.runner import train_loop

    step_s = train_loop(w, spec.interval, spec.interval) / spec.interval
    # DCP's collectives (async_save's run on a thread) get a gloo group of their own, never DDP's
    group = dist.new_group(backend="gloo") if spec.world > 1 else None
    baselines: list[float] = []
    step = 0
    for name in spec.systems:
        stage = out / f"stage-r{rank}.txt"
        stage.write_text(name)
        root = Path(spec.root) / f"w{spec.world}-{name}"
        root.mkdir(parents=True, exist_ok=True)
        _barrier()
        log.info("rank %d/%d: %s", rank, spec.world, name)
        peer = make_peer(name, rank, spec.world, group)
        peer.open(root)
        rec = _measure_system(peer, w, spec, rank, step + 1000, baselines)
        peer.close()
        step = rec.pop("end_step")
        rec.update(rank=rank, world=spec.world, system=name, step_s=step_s, state_bytes=w.state_bytes,
                   cores_per_rank=_cores() / spec.world,
                   params=w.params, num_tensors=w.num_tensors, description=w.description)
        _write_json(out / f"r{rank}-{name}.json", rec)
        _barrier()
        if rank == 0 and not spec.keep:
            shutil.rmtree(root, ignore_errors=True)
    _write_json(out / f"r{rank}-baselines.json", baselines)


class TimedCoordinator:
    """Factory of a ``DistCoordinator`` whose rounds are timestamped (``events``: one dict per round
    with tier, index, phase, enter, exit, and the step for index rounds)."""

    @staticmethod
    def create() -> Any:
        from nebula_ckpt.ranks.distributed import DistCoordinator

        class _Timed(DistCoordinator):
            def __init__(self) -> None:
                super().__init__()
                self.events: list[dict[str, Any]] = []
                self._ev_lock = threading.Lock()

            def round(self, tier: str, index: int, phase: int, payload: Any) -> list[Any]:
                enter = time.monotonic()
                try:
                    return super().round(tier, index, phase, payload)
                finally:
                    ev = {"tier": tier, "index": index, "phase": phase, "enter": enter, "exit": time.monotonic(),
                          "step": payload.get("step") if isinstance(payload, dict) else None}
                    with self._ev_lock:
                        self.events.append(ev)

        return _Timed()


def _file_times(step_dir: Path) -> dict[str, Any]:
    """mtimes (ns) of a committed step folder's shards and COMMIT (rank 0, right after the save)."""
    out: dict[str, Any] = {"shards": {}, "commit": None}
    try:
        for p in step_dir.iterdir():
            if _NEBULA_SHARD.fullmatch(p.name):
                out["shards"][p.name] = p.stat().st_mtime_ns
            elif p.name == "COMMIT":
                out["commit"] = p.stat().st_mtime_ns
    except OSError as e:
        out["error"] = str(e)
    return out


def _protocol_job(spec: JobSpec, rank: int, out: Path) -> None:
    """Saves of a tiny state with the training thread idle, rounds timestamped (see the module docstring)."""
    import nebula_ckpt as nc

    (out / f"stage-r{rank}.txt").write_text("nebula")
    w = build_workload(spec.model, spec.world, rank, batch_size=spec.batch_size, seq_len=spec.seq_len)
    for _ in range(WARMUP_STEPS):
        w.train_step()
    co = TimedCoordinator.create()
    root = Path(spec.root) / f"protocol-w{spec.world}"
    root.mkdir(parents=True, exist_ok=True)
    _barrier()
    ck = nc.Checkpointer(str(root), coordinator=co)
    saves: list[dict[str, Any]] = []
    try:
        for i in range(spec.saves + 2):
            step = i + 1
            w.train_step()
            _barrier()
            t0 = time.monotonic()
            h = ck.save_async(step, w.state(step))
            h.wait_snapshot()
            h.result()
            rec: dict[str, Any] = {"step": step, "t0": t0, "done": time.monotonic(), "warmup": i < 2}
            if rank == 0:
                rec["files"] = _file_times(root / f"step-{step}")
            saves.append(rec)
    finally:
        ck.close()
    _write_json(out / f"r{rank}-nebula.json", {"rank": rank, "world": spec.world, "system": "nebula",
                                                "saves": saves, "events": co.events, "state_bytes": w.state_bytes})
    _barrier()
    if rank == 0 and not spec.keep:
        shutil.rmtree(root, ignore_errors=True)


def worker_main(argv: Sequence[str]) -> int:
    """One rank: ``python -m benchmarks.ranks SPEC.json`` (RANK, WORLD_SIZE, MASTER_* in env)."""
    spec = JobSpec(**json.loads(Path(argv[0]).read_text()))
    rank = int(os.environ.get("RANK", "0"))
    out = Path(spec.out)
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s r{rank} %(levelname)s %(name)s: %(message)s")
    logging.getLogger("benchmarks").setLevel(logging.INFO)
    torch.set_num_threads(spec.threads)
    import torch.distributed as dist

    try:
        if spec.world > 1:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=spec.timeout_s))
        (_protocol_job if spec.mode == "protocol" else _compare_job)(spec, rank, out)
    except BaseException as e:
        stage_file = out / f"stage-r{rank}.txt"
        stage = stage_file.read_text() if stage_file.exists() else "setup"
        log.exception("rank %d failed in %s", rank, stage)
        _write_json(out / f"r{rank}-error.json", {"rank": rank, "stage": stage, "time": time.monotonic(),
                                                  "error": f"{type(e).__name__}: {e}",
                                                  "traceback": traceback.format_exc()[-4000:]})
        logging.shutdown()
        os._exit(3)  # a job whose rank failed is torn down (its peers' collectives fail), never closed
    if spec.world > 1:
        dist.destroy_process_group()
    return 0


# --------------------------------------------------------------------------- parent: launching jobs

def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(spec: JobSpec, deadline_s: float) -> list[Optional[int]]:
    """Start ``spec.world`` ranks and wait (at most ``deadline_s``; a rank that failed gives the
    others 30 s to notice); return their exit codes (``None``: killed by the deadline)."""
    out = Path(spec.out)
    out.mkdir(parents=True, exist_ok=True)
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(asdict(spec)))
    port = _free_port()
    pkg_root = str(Path(__file__).resolve().parents[2])
    procs: list[subprocess.Popen[bytes]] = []
    for r in range(spec.world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(spec.world), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(spec.world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(spec.threads),
                   NEBULA_COMMIT_TIMEOUT_S=os.environ.get("NEBULA_COMMIT_TIMEOUT_S", str(spec.timeout_s)),
                   PYTHONPATH=pkg_root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        with open(out / f"r{r}.log", "wb") as logf:
            procs.append(subprocess.Popen([sys.executable, "-m", "benchmarks.ranks", str(spec_path)],
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


# --------------------------------------------------------------------------- aggregation

def summary(samples: list[float]) -> dict[str, Any]:
    """median / p95 / min / max (the runner's :func:`~benchmarks.runner.summary`)."""
    from benchmarks.runner import summary as _summary

    return _summary(samples)


def _rank_of(name: str) -> int:
    m = _NEBULA_SHARD.fullmatch(name) or _DCP_SHARD.fullmatch(name)
    return int(m.group(1)) if m else 0


def bytes_per_rank(files: dict[str, int], world: int) -> list[int]:
    """Sizes of the newest checkpoint's files by the rank that wrote them (by name; the rest: rank 0)."""
    out = [0] * world
    for name, size in files.items():
        r = _rank_of(name)
        out[r if r < world else 0] += size
    return out


def aggregate(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's row from every rank's record (see the module docstring)."""
    world = len(recs)
    n = len(recs[0]["reps"])
    reps = [[rec["reps"][i] for rec in recs] for i in range(n)]
    row: dict[str, Any] = {"status": "ok", "reason": None, "ranks": world, "reps": n}
    for k in ("call", "stall", "blocking"):
        row[f"{k}_s"] = summary([max(x[k] for x in rep) for rep in reps])
    row["blocking_per_rank_median_s"] = [statistics.median(x["blocking"] for x in rec["reps"]) for rec in recs]
    row["commit_s"] = summary([max(x["done"] for x in rep) - min(x["t0"] for x in rep) for rep in reps])
    m = len(recs[0]["idle"])
    idle = [max(rec["idle"][i]["done"] for rec in recs) - min(rec["idle"][i]["t0"] for rec in recs)
            for i in range(m)]
    row["commit_idle_s"] = summary(idle) if idle else row["commit_s"]
    files = recs[0].get("files", {})
    row["bytes_per_rank"] = bytes_per_rank(files, world)
    row["bytes_max_rank"] = max(row["bytes_per_rank"])
    row["ckpt_bytes"] = sum(files.values())
    row["files"] = len(files)
    ov = [rec["throughput"]["overhead"] for rec in recs]
    row["overhead"] = max(ov)
    row["overhead_per_rank"] = ov
    th0 = recs[0]["throughput"]
    row["throughput"] = {k: th0.get(k) for k in ("steps", "interval", "saves", "backlog_s", "tiers_dropped",
                                                 "saves_skipped")}
    row["backlog_s"] = max(rec["throughput"].get("backlog_s", 0.0) for rec in recs)
    for k in ("state_bytes", "params", "num_tensors", "description"):
        row[k] = recs[0].get(k)
    row["step_s"] = max(rec.get("step_s", 0.0) for rec in recs)
    if recs[0].get("stats"):
        row["stats_rank0"] = recs[0]["stats"]
    if any(rec.get("events") for rec in recs):
        row["phases"] = phase_medians(recs, "reps")
        row["phases_idle"] = phase_medians(recs, "idle")
    row["cores_per_rank"] = recs[0].get("cores_per_rank")
    return row


#: the phases of one nebula save on the shared tier (see :func:`save_phases`)
PHASE_NAMES = ("to_rounds", "pre_rounds", "shard_write", "protocol", "ack")


def round_maps(recs: list[dict[str, Any]]) -> list[dict[int, dict[int, dict[str, Any]]]]:
    """Per rank: step -> phase -> timestamped round. The step of a save's rounds is the one its
    first round's payload names (every round of one (tier, save index) belongs to one step)."""
    out = []
    for rec in recs:
        evs = rec.get("events") or []
        idx_step: dict[tuple[str, int], int] = {}
        for e in sorted(evs, key=lambda e: e["phase"]):
            if e.get("step") is not None:
                idx_step.setdefault((e["tier"], e["index"]), int(e["step"]))
        m: dict[int, dict[int, dict[str, Any]]] = {}
        for e in evs:
            step = idx_step.get((e["tier"], e["index"]))
            if step is not None:
                m.setdefault(step, {})[e["phase"]] = e
        out.append(m)
    return out


def save_phases(saves: list[dict[str, Any]], maps: list[dict[int, dict[int, dict[str, Any]]]],
                step: int) -> Optional[dict[str, float]]:
    """Where one multi-rank nebula save spent its time, from every rank's save record and rounds
    (None without every round). Each phase is the slowest rank's:

    * ``to_rounds``: save call -> the tier thread posting the save's first round (snapshot, queueing);
    * ``pre_rounds``: the rounds before the shard write (digest / tensor index: who writes what),
      waiting for the slowest rank included;
    * ``shard_write``: those rounds done -> this rank's shard durable (posting the "durable" round);
    * ``protocol``: the last rank's shard durable -> rank 0 entering the verdict round (manifest and
      COMMIT written): the commit protocol proper;
    * ``ack``: -> every rank's ``result()`` returned (the verdict round, the handles).

    The phase numbers come from :mod:`nebula_ckpt.ranks.coordinator` (``PHASE_DURABLE``, ``PHASE_VERDICT``).
    """
    from nebula_ckpt.ranks.coordinator import PHASE_DURABLE, PHASE_VERDICT

    ev = [m.get(step, {}) for m in maps]
    pre = [[e[k] for k in sorted(e) if k < PHASE_DURABLE] for e in ev]
    if any(PHASE_DURABLE not in e or not p for e, p in zip(ev, pre, strict=True)) or PHASE_VERDICT not in ev[0]:
        return None
    last_durable = max(e[PHASE_DURABLE]["enter"] for e in ev)
    verdict = ev[0][PHASE_VERDICT]["enter"]
    return {"to_rounds": max(p[0]["enter"] - s["t0"] for p, s in zip(pre, saves, strict=True)),
            "pre_rounds": max(p[-1]["exit"] - p[0]["enter"] for p in pre),
            "shard_write": max(e[PHASE_DURABLE]["enter"] - p[-1]["exit"] for e, p in zip(ev, pre, strict=True)),
            "protocol": verdict - last_durable,
            "ack": max(s["done"] for s in saves) - verdict}


def phase_medians(recs: list[dict[str, Any]], key: str) -> Optional[dict[str, Any]]:
    """Median of each of :data:`PHASE_NAMES` over the saves ``rec[key]`` of every rank (None if no
    save has its rounds)."""
    maps = round_maps(recs)
    n = min(len(rec.get(key) or []) for rec in recs)
    got = []
    for i in range(n):
        saves = [rec[key][i] for rec in recs]
        if saves[0].get("step") is None or saves[0].get("warmup"):
            continue
        ph = save_phases(saves, maps, int(saves[0]["step"]))
        if ph is not None:
            got.append(ph)
    if not got:
        return None
    return {"saves": len(got), **{k: statistics.median(g[k] for g in got) for k in PHASE_NAMES}}


def aggregate_protocol(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """Protocol times per save from every rank's timestamped rounds and saves."""
    world = len(recs)
    maps = round_maps(recs)
    proto, ack, commit, shard_write, mtime = [], [], [], [], []
    for i, s0 in enumerate(recs[0]["saves"]):
        if s0.get("warmup"):
            continue
        save = [rec["saves"][i] for rec in recs]
        commit.append(max(s["done"] for s in save) - min(s["t0"] for s in save))
        f = s0.get("files") or {}
        if f.get("commit") and f.get("shards"):
            mtime.append((f["commit"] - max(f["shards"].values())) / 1e9)
        ph = save_phases(save, maps, int(s0["step"]))
        if ph is not None:
            proto.append(ph["protocol"])
            ack.append(ph["protocol"] + ph["ack"])
            shard_write.append(ph["shard_write"])
    row: dict[str, Any] = {"status": "ok", "reason": None, "ranks": world, "saves": len(commit),
                           "state_bytes": recs[0].get("state_bytes"),
                           "protocol_s": summary(proto), "protocol_ack_s": summary(ack),
                           "protocol_mtime_s": summary(mtime), "shard_write_s": summary(shard_write),
                           "commit_s": summary(commit), "phases": phase_medians(recs, "saves")}
    if not proto:
        row["note"] = ("no timestamped protocol rounds (the coordinator's round() was not called): "
                       "protocol taken from file mtimes only")
    return row


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
    cores = _cores()
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


# --------------------------------------------------------------------------- targets

def _row(sec: dict[str, Any], world: int, system: str) -> Optional[dict[str, Any]]:
    r = next((r for r in sec.get("rows", []) if r["world"] == world and r["system"] == system), None)
    return r if r is not None and r.get("status") == "ok" else None


def _med(row: Optional[dict[str, Any]], key: str) -> Optional[float]:
    v = (row or {}).get(key)
    return v.get("median") if isinstance(v, dict) else None


def _cpr(row: Optional[dict[str, Any]]) -> str:
    c = (row or {}).get("cores_per_rank")
    return "n/a" if c is None else f"{c:g}"


def _phase_line(label: str, ph: Optional[dict[str, Any]]) -> str:
    if not ph:
        return ""
    return (f"{label}: " + ", ".join(f"{k.replace('_', ' ')} {fmt_s(ph[k])}" for k in PHASE_NAMES)
            + f" ({ph['saves']} saves)")


def evaluate_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The multi-rank targets (``met`` None for n/a): blocking per rank within 2x of one process,
    time to commit falling as ranks share the replicated bytes, ahead of ``dcp.async_save``."""
    sec = results.get("ranks")
    if not sec or not sec.get("ranks"):
        return []
    out: list[dict[str, Any]] = []
    single = sec.get("single") if (sec.get("single") or {}).get("status") == "ok" else None
    sb = _med(single, "blocking_s")
    for world in sec["ranks"]:
        neb = _row(sec, world, "nebula")
        nb = _med(neb, "blocking_s")
        title = f"nebula blocking per rank <= {BLOCKING_FACTOR:g}x single-process"
        if nb is None or not sb:
            out.append(_target("ranks_blocking", title, None, "n/a", f"<= {BLOCKING_FACTOR:g}x", f"{world} ranks",
                               "nebula did not run" + (" (single process)" if not sb else f" at {world} ranks")))
            continue
        r = nb / sb
        out.append(_target("ranks_blocking", title, r <= BLOCKING_FACTOR, f"{r:.2f}x ({fmt_s(nb)} vs {fmt_s(sb)})",
                           f"<= {BLOCKING_FACTOR:g}x", f"{world} ranks",
                           f"slowest rank per rep; p95 {fmt_s((neb or {}).get('blocking_s', {}).get('p95'))}; "
                           f"cores per rank {_cpr(neb)} vs {_cpr(single)} for the single process"))
    # persist time falling as the ranks share the replicated bytes
    seq = [(1, single)] + [(w, _row(sec, w, "nebula")) for w in sec["ranks"]]
    have = [(w, _med(r, "commit_idle_s"), (r or {}).get("bytes_max_rank")) for w, r in seq]
    title = "nebula time to commit falls as ranks share replicated bytes"
    times = [t for _, t, _ in have if t is not None]
    if len(times) < len(have):
        out.append(_target("ranks_persist", title, None, "n/a", "strictly falling with ranks", None,
                           "nebula did not run at every rank count"))
    else:
        met = all(b < a for a, b in zip(times, times[1:], strict=False))
        out.append(_target("ranks_persist", title, met,
                           ", ".join(f"{w}: {fmt_s(t)}" for w, t, _ in have), "strictly falling with ranks", None,
                           "idle time to commit (median); largest share written by one rank: "
                           + ", ".join(f"{w}: {fmt_b(b)}" for w, _, b in have)))
    # ahead of dcp.async_save on every row
    title = "nebula ahead of dcp.async_save on every row"
    verdicts: list[Optional[bool]] = []
    parts: list[str] = []
    for world in sec["ranks"]:
        neb, dca = _row(sec, world, "nebula"), _row(sec, world, "dcp_async_save")
        if neb is None or dca is None:
            parts.append(f"{world} ranks: n/a")
            verdicts.append(None)
            continue
        cmp = {"blocking": (_med(neb, "blocking_s"), _med(dca, "blocking_s")),
               "commit": (_med(neb, "commit_s"), _med(dca, "commit_s")),
               "overhead": (neb["overhead"], dca["overhead"])}
        lost = [k for k, (x, y) in cmp.items() if x is None or y is None or not x < y]
        verdicts.append(not lost)
        parts.append(f"{world} ranks: blocking {fmt_s(cmp['blocking'][0])} vs {fmt_s(cmp['blocking'][1])}, "
                     f"commit {fmt_s(cmp['commit'][0])} vs {fmt_s(cmp['commit'][1])}, overhead "
                     f"{fmt_pct(cmp['overhead'][0])} vs {fmt_pct(cmp['overhead'][1])}"
                     + (f" (behind on {', '.join(lost)})" if lost else ""))
    ahead: Optional[bool] = None if any(v is None for v in verdicts) or not verdicts else all(verdicts)
    out.append(_target("ranks_vs_dcp_async", title, ahead,
                       f"{sum(1 for v in verdicts if v)}/{len(verdicts)} rows ahead",
                       "lower blocking, time to commit and overhead", None, "; ".join(parts)))
    return out


# --------------------------------------------------------------------------- markdown

def _row_line(label: str, r: dict[str, Any]) -> str:
    if r.get("status") != "ok":
        return f"| {label} | {r.get('system')} |" + " n/a |" * 6 + f" {r.get('status')}: {r.get('reason')} |"
    per = r["bytes_per_rank"]
    notes = []
    th = r.get("throughput") or {}
    if th.get("tiers_dropped"):
        notes.append(f"{th['tiers_dropped']} tier write(s) dropped")
    if r.get("backlog_s") and th.get("saves"):
        notes.append(f"backlog {fmt_s(r['backlog_s'] / th['saves'])} per save")
    return (f"| {label} | {r['system']} | {fmt_s(_med(r, 'blocking_s'))} | {fmt_s(r['blocking_s']['p95'])} "
            f"| {fmt_s(_med(r, 'commit_s'))} / {fmt_s(_med(r, 'commit_idle_s'))} "
            f"| {fmt_b(max(per))} / {fmt_b(sum(per))} ({', '.join(fmt_b(b) for b in per)}) "
            f"| {fmt_pct(r['overhead'])} | {fmt_s(r.get('step_s'))} | {'; '.join(notes) or 'ok'} |")


def render_markdown(results: dict[str, Any]) -> list[str]:
    """The ``## Multi-rank`` section of ``results.md`` (empty when no multi-rank case ran)."""
    sec = results.get("ranks")
    if not sec:
        return []
    lines = ["## Multi-rank", ""]
    if sec.get("error"):
        return lines + [f"Not run: {sec['error']}", ""]
    if sec.get("rows") or sec.get("single"):
        lines += [f"Model `{sec.get('model')}`: {sec.get('description', 'n/a')}; state "
                  f"{fmt_b(sec.get('state_bytes'))} per rank (replicated).", "", METHOD, "",
                  "| ranks | system | blocking median | blocking p95 | time to commit (training / idle) "
                  "| written per rank: max / all (each rank) | overhead | train step | status |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---|"]
        if sec.get("single"):
            lines.append(_row_line("1 (one process)", {**sec["single"], "system": "nebula"}))
        for r in sec.get("rows", []):
            lines.append(_row_line(str(r["world"]), r))
        phases = [_phase_line(f"{r['world']} ranks, {kind}", r.get(key)) for r in sec.get("rows", [])
                  if r.get("system") == "nebula" for kind, key in (("training", "phases"), ("idle", "phases_idle"))]
        if any(phases):
            lines += ["", "Where nebula's multi-rank saves spend their time (medians of the slowest rank per phase: "
                      "save call -> first protocol round posted, the rounds before the shard write (who writes "
                      "what), shard write until durable, last shard durable -> COMMIT written, -> every rank's "
                      "result()):", ""]
            lines += [f"- {ln}" for ln in phases if ln]
        lines += ["", "How each system is called:", ""]
        lines += [f"- **{n}**: {c}." for n, c in sec.get("calls", {}).items()]
        lines.append("")
    if sec.get("protocol"):
        lines += ["### nebula commit protocol time", "",
                  "Tiny state (`micro` model), saves with the training thread idle. Protocol = rank 0 entering "
                  "the verdict round (manifest.json and COMMIT written) minus the last rank entering the "
                  "'durable' round (its shard fsynced): gather of the shard records, manifest, commit marker. "
                  "Until acknowledged: until every rank's `result()` returned. By mtimes: COMMIT's mtime minus "
                  "the newest shard's (includes that shard's fsync). Rounds before the shard: the protocol's "
                  "rounds that decide who writes what (median). Medians (p95).", "",
                  "| ranks | state | saves | protocol | until acknowledged | by mtimes | rounds before the shard "
                  "| slowest shard write | time to commit | status |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for p in sec["protocol"]:
            if p.get("status") != "ok":
                lines.append(f"| {p['world']} |" + " n/a |" * 8 + f" {p.get('status')}: {p.get('reason')} |")
                continue

            def mp(key: str, p: dict[str, Any] = p) -> str:
                return f"{fmt_s(p[key]['median'])} ({fmt_s(p[key]['p95'])})"

            lines.append(f"| {p['world']} | {fmt_b(p.get('state_bytes'))} | {p['saves']} | {mp('protocol_s')} "
                         f"| {mp('protocol_ack_s')} | {mp('protocol_mtime_s')} "
                         f"| {fmt_s((p.get('phases') or {}).get('pre_rounds'))} | {mp('shard_write_s')} "
                         f"| {mp('commit_s')} | {p.get('note', 'ok')} |")
        lines.append("")
    return lines


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
