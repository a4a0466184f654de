"""One rank of a multi-rank job (``python -m benchmarks.rank_jobs SPEC.json``).

:class:`JobSpec` says what every rank of a job does; the parent (:mod:`benchmarks.ranks`)
writes it as JSON and spawns the ranks with ``RANK`` / ``WORLD_SIZE`` / ``MASTER_*`` in the
environment, as torchrun does. A rank builds its DDP workload, measures each system in turn
(``compare``) or times nebula's commit protocol (``protocol``), and writes its records as JSON
into the job's ``out`` folder; a rank that fails writes ``r<R>-error.json`` and exits with 3.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shutil
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from benchmarks import workloads as wl
from benchmarks.common import usable_cores
from benchmarks.measure import measure_throughput, one_save, train_loop
from benchmarks.peer_base import Peer
from benchmarks.peers import Nebula
from benchmarks.rank_peers import NEBULA_SHARD, RankNebula, TimedCoordinator, make_peer

log = logging.getLogger(__name__)

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


# --------------------------------------------------------------------------- worker (one rank)

def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _idle_save(peer: Peer, w: wl.Workload, step: int) -> dict[str, float]:
    """Save and wait until durable, nothing else running; absolute timestamps."""
    t0 = time.monotonic()
    peer.save(step, lambda: w.state(step))
    peer.wait_safe()
    peer.wait_durable()
    return {"step": step, "t0": t0, "done": time.monotonic()}


def _measure_system(peer: Peer, w: wl.Workload, spec: JobSpec, rank: int, step: int,
                    baselines: list[float]) -> dict[str, Any]:
    """Saves, files, throughput of one system on this rank (see :mod:`benchmarks.ranks`)."""
    rec: dict[str, Any] = {"reps": [], "idle": []}
    for r in range(spec.reps + 1):
        step += 1
        w.train_step()
        _barrier()
        rec["reps"].append(one_save(peer, w, step))
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
    measure_throughput(peer, w, loop, th, step, baselines, 0)
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
                   cores_per_rank=usable_cores() / spec.world,
                   params=w.params, num_tensors=w.num_tensors, description=w.description)
        _write_json(out / f"r{rank}-{name}.json", rec)
        _barrier()
        if rank == 0 and not spec.keep:
            shutil.rmtree(root, ignore_errors=True)
    _write_json(out / f"r{rank}-baselines.json", baselines)


def _file_times(step_dir: Path) -> dict[str, Any]:
    """mtimes (ns) of a committed step folder's shards and COMMIT (rank 0, right after the save)."""
    out: dict[str, Any] = {"shards": {}, "commit": None}
    try:
        for p in step_dir.iterdir():
            if NEBULA_SHARD.fullmatch(p.name):
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



if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
