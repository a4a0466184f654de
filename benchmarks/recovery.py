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
import gc
import hashlib
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
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import nn

from benchmarks.limits import PeakRss, evict, resident_fraction
from benchmarks.report import _target, fmt_b, fmt_s
from nebula_ckpt.storage.atomic import fsync_dir

log = logging.getLogger(__name__)

#: state sizes (GB) of the full run and of ``--quick``
DEFAULT_SIZES = (0.3, 1.2, 3.0, 4.0)
QUICK_SIZES = (0.3,)
#: widest layer of the MLP; narrower only where two such layers would exceed the size asked for
MAX_WIDTH = 4096
#: rows of the synthetic batch of every training step
BATCH = 8
#: restart rows, in report order: (row name, system restarted, page cache before the restart)
ROWS: tuple[tuple[str, str, str], ...] = (
    ("nebula_memory", "nebula_memory", "after crash"),
    ("nebula_local", "nebula_local", "warm"),
    ("torch_load", "torch_load", "warm"),
    ("torch_load_mmap", "torch_load_mmap", "warm"),
    ("nebula_local_cold", "nebula_local", "cold"),
    ("torch_load_cold", "torch_load", "cold"),
    ("torch_load_mmap_cold", "torch_load_mmap", "cold"),
)
#: saves of the first-save measurement: the first ``FIRST_SAVES`` are reported one by one
FIRST_SAVES = 4
#: targets (see :func:`evaluate_targets`)
MEMORY_SPEEDUP = 0.5
RSS_FACTOR = 1.1
FIRST_SAVE_FACTOR = 1.2
FLOOR_FACTOR = 1.2
#: host memory, shm space and disk space a size needs, as multiples of its state bytes: the saving
#: process holds the state, its gradients, a staging buffer and the memory tier's copy; the
#: memory tier needs ~2-3x in the shm folder while a new save stages beside the last checkpoint
NEED_RAM = 4.0
NEED_SHM = 3.0
NEED_DISK = 3.5
#: the step the saving process saves (its first training step)
SAVED_STEP = 1

CALLS = {
    "nebula_memory": "saving process: nc.Checkpointer(root) (default tiers: memory tier + root), h = "
                     "ck.save_async(1, {model, optim, step}); h.result(); os.kill(getpid(), SIGKILL). Restart: "
                     "nc.Checkpointer(root).load_latest(into={model, optim, step}) (must restore from the memory tier)",
    "nebula_local": "saving process: nc.Checkpointer(root, memory_tier=False), save_async -> result() -> close(). "
                    "Restart: nc.Checkpointer(root).load_latest(into=...) (no memory tier: reads the root)",
    "torch_load": "saving process: torch.save({model: sd, optim: osd, step}, f) + fsync(file, dir). Restart: "
                  "sd = torch.load(f, map_location='cpu', weights_only=True); model.load_state_dict(sd['model']); "
                  "opt.load_state_dict(sd['optim'])",
    "torch_load_mmap": "same file; torch.load(f, map_location='cpu', weights_only=True, mmap=True)",
}

METHOD = (
    "Each restart is a fresh process with the model and AdamW already built (optimizer state empty). Load = from "
    "before the load call (`nc.Checkpointer(root)` included) until `load_latest` / `load_state_dict` returns; to "
    "first step = until one full training step (forward, backward, `optimizer.step()`) after it is done (a "
    "mapped load pays its page faults there). Extra peak RSS = the process's VmHWM after that step (high-water "
    "mark reset just before the load) minus its VmRSS before the load, as a multiple of the state bytes; pages of "
    "a mapped file (shm or page cache) count once touched; of the load alone = the same at the end of the load "
    "(the optimizer state a restore must create is 2/3 of the state with AdamW: 0.67x is the floor; the first "
    "step adds the gradients, 1/3, and AdamW's temporaries, one or two of the largest parameter's size). Handed "
    "over = bytes the memory tier gave the restart without a copy (`last_restore['adopted_bytes']`). Bit-exact: "
    "the state after the first step has the digest the saving process reached with the same step from the "
    "state it saved. nebula_memory restarts right "
    "after the saving process was SIGKILLed; warm: the files were read once just before; cold: evicted with "
    "posix_fadvise(DONTNEED). Medians over the repetitions, each with its own fresh processes.")


# --------------------------------------------------------------------------- the state

@dataclass(frozen=True)
class Geometry:
    """Shape of the MLP: ``layers`` x ``nn.Linear(width, width)``."""

    width: int
    layers: int
    batch: int = BATCH

    @property
    def params(self) -> int:
        """Parameters (weights and biases)."""
        return self.layers * (self.width * self.width + self.width)

    @property
    def state_bytes(self) -> int:
        """fp32 parameters + AdamW's exp_avg and exp_avg_sq, plus one scalar step per parameter tensor."""
        return 3 * 4 * self.params + 2 * self.layers * 4

    def describe(self) -> str:
        """``"6 x Linear(4096, 4096) + AdamW"``."""
        return f"{self.layers} x Linear({self.width}, {self.width}) + AdamW"


def geometry(state_gb: float, max_width: int = MAX_WIDTH) -> Geometry:
    """The MLP whose AdamW state is closest to ``state_gb`` GB: layers of ``max_width`` (at least 2
    layers; narrower layers, a multiple of 64, when two full-width ones would be too big)."""
    if not state_gb > 0:
        raise ValueError(f"state size must be > 0 GB, got {state_gb}")
    target = state_gb * 1e9
    per_layer = 12 * (max_width * max_width + max_width)
    layers = max(2, round(target / per_layer))
    width = min(max_width, max(64, round(math.sqrt(target / (12 * layers)) / 64) * 64))
    return Geometry(width=width, layers=layers)


def build(g: Geometry, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model (seeded) and its AdamW, optimizer state empty as after construction."""
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(g.width, g.width) for _ in range(g.layers)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def batch(g: Geometry, step: int) -> torch.Tensor:
    """The input of training step ``step`` (the same in every process)."""
    return torch.randn(g.batch, g.width, generator=torch.Generator().manual_seed(1000 + step))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    """Forward, backward, ``optimizer.step()``, gradients dropped."""
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def state_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the checkpointed state (model state dict, optimizer state)."""
    out = list(model.state_dict().values())
    for st in opt.state.values():
        out += [v for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def digest(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> str:
    """Fingerprint of the state: CRC32C of every tensor's bytes (with its name, dtype and shape),
    the optimizer's parameter groups and ``step``. Equal digests: bit-identical states."""
    import crc32c

    h = hashlib.sha256(f"step={step};".encode())

    def add(name: str, v: Any) -> None:
        if isinstance(v, torch.Tensor):
            t = v.detach().reshape(-1).contiguous()
            h.update(f"{name}:{t.dtype}:{tuple(v.shape)}:".encode())
            h.update(int(crc32c.crc32c(t.view(torch.uint8).numpy().data)).to_bytes(4, "little"))
        else:
            h.update(f"{name}={v!r};".encode())

    for k, v in model.state_dict().items():
        add(f"model/{k}", v)
    osd = opt.state_dict()
    for pid in sorted(osd["state"]):
        for k in sorted(osd["state"][pid]):
            add(f"optim/{pid}/{k}", osd["state"][pid][k])
    for i, grp in enumerate(osd["param_groups"]):
        for k in sorted(grp):
            add(f"group/{i}/{k}", grp[k])
    return h.hexdigest()[:32]


# --------------------------------------------------------------------------- worker processes

@dataclass
class WorkerSpec:
    """What one worker process does (written as JSON, passed by path)."""

    role: str  # "save" | "restart" | "saves"
    width: int
    layers: int
    threads: int
    result: str
    batch: int = BATCH
    dir: str = ""  # save / saves: where to write
    system: str = ""  # restart: the system restarted
    path: str = ""  # restart: the root (nebula) or the file (torch)
    expect_tier: str = ""  # restart, nebula: the kind of tier the restore must come from
    saves: int = 8  # saves: saves made
    torch_reps: int = 2  # saves: torch.save + fsync timed
    prepare: bool = False  # saves: Checkpointer.prepare(state) made the staging before the first save

    @property
    def geometry(self) -> Geometry:
        """The model's shape."""
        return Geometry(width=self.width, layers=self.layers, batch=self.batch)


def layout(d: Path) -> dict[str, Path]:
    """Where the saving process writes each system's checkpoint under ``d``."""
    return {"torch": d / "torch.pt", "nebula_local": d / "nebula_local", "nebula_memory": d / "nebula"}


def _status_fields(*names: str) -> dict[str, Optional[int]]:
    """Fields of ``/proc/self/status`` in bytes (``None`` where missing)."""
    out: dict[str, Optional[int]] = dict.fromkeys(names)
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in out:
                    out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def _write_result(path: str, obj: dict[str, Any]) -> None:
    """Write ``obj`` as JSON, durably (a worker may SIGKILL itself right after)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(Path(path).parent)


def _torch_save(model: nn.Module, opt: torch.optim.Optimizer, step: int, path: Path) -> float:
    """``torch.save`` of the plain state dicts + fsync of the file and its folder; return seconds."""
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(path.parent)
    return time.perf_counter() - t0


def _save_worker(spec: WorkerSpec) -> None:
    """Build the state, one training step, save it with every system, record the digests, SIGKILL."""
    import nebula_ckpt as nc

    g = spec.geometry
    paths = layout(Path(spec.dir))
    model, opt = build(g, seed=0)
    train_step(model, opt, batch(g, SAVED_STEP))
    res: dict[str, Any] = {"state_bytes": sum(t.numel() * t.element_size() for t in state_tensors(model, opt)),
                           "num_tensors": len(state_tensors(model, opt)), "step": SAVED_STEP,
                           "digest_saved": digest(model, opt, SAVED_STEP)}
    res["torch_save_s"] = _torch_save(model, opt, SAVED_STEP, paths["torch"])
    state = {"model": model, "optim": opt, "step": SAVED_STEP}
    t0 = time.perf_counter()
    ck = nc.Checkpointer(str(paths["nebula_local"]), memory_tier=False)
    ck.save_async(SAVED_STEP, state).result()
    ck.close()
    res["nebula_local_save_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ck = nc.Checkpointer(str(paths["nebula_memory"]))
    res["memory_tier"] = any(getattr(t, "kind", "") == "memory" for t in ck.tiers)
    res["nebula_memory_tiers_written"] = ck.save_async(SAVED_STEP, state).result()
    res["nebula_memory_save_s"] = time.perf_counter() - t0
    # the reference of the restarts' check: the same first step from the saved state
    train_step(model, opt, batch(g, SAVED_STEP + 1))
    res["digest_after_step"] = digest(model, opt, SAVED_STEP)
    _write_result(spec.result, res)
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)  # a crash: the memory tier stays


def _restart_worker(spec: WorkerSpec) -> None:
    """Build model + optimizer, then (timed) load and one training step; record times, RSS, digest."""
    g = spec.geometry
    if spec.system.startswith("nebula"):
        import nebula_ckpt as nc
    model, opt = build(g, seed=1)  # not the saved values: a restore that does nothing cannot pass
    x = batch(g, SAVED_STEP + 1)
    res: dict[str, Any] = {"system": spec.system}
    ck: Any = None
    got: Any = None
    gc.collect()
    before = _status_fields("VmRSS")["VmRSS"] or 0
    with PeakRss() as peak:
        t0 = time.perf_counter()
        if spec.system.startswith("nebula"):
            ck = nc.Checkpointer(spec.path)
            res["open_s"] = time.perf_counter() - t0
            state = {"model": model, "optim": opt, "step": 0}
            ck.load_latest(into=state)
            got = state["step"]
        else:
            sd = torch.load(spec.path, map_location="cpu", weights_only=True, mmap=spec.system == "torch_load_mmap")
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optim"])
            got = sd["step"]
            del sd
        t1 = time.perf_counter()
        peak_load = peak.peak()
        after_load = _status_fields("VmRSS", "RssAnon", "RssFile", "RssShmem")
        train_step(model, opt, x)
        t2 = time.perf_counter()
        hwm = peak.peak()
        res["rss_method"] = peak.method
    res.update(load_s=t1 - t0, first_step_s=t2 - t0, step_s=t2 - t1, rss_before=before, peak_rss=hwm,
               extra_rss_bytes=hwm - before, extra_rss_load_bytes=peak_load - before, after_load=after_load,
               after_step=_status_fields("VmRSS", "RssAnon", "RssFile", "RssShmem"), step=got)
    if ck is not None:
        res["last_restore"] = ck.last_restore
        res["adopted_bytes"] = int((ck.last_restore or {}).get("adopted_bytes") or 0)
        tier = str((ck.last_restore or {}).get("tier") or "")
        res["tier"] = tier
        res["tier_ok"] = tier.split(":", 1)[0] == spec.expect_tier
        ck.close()
    res["digest_after_step"] = digest(model, opt, got if isinstance(got, int) else -1)
    _write_result(spec.result, res)


def _saves_worker(spec: WorkerSpec) -> None:
    """First saves of a fresh process, the later saves, one plain copy of the state, torch.save."""
    import nebula_ckpt as nc

    g = spec.geometry
    d = Path(spec.dir)
    model, opt = build(g, seed=0)
    train_step(model, opt, batch(g, 0))
    res: dict[str, Any] = {"state_bytes": sum(t.numel() * t.element_size() for t in state_tensors(model, opt))}
    ck = nc.Checkpointer(str(d / "nebula"))
    res["tiers"] = [t.name for t in ck.tiers]
    if spec.prepare:  # as a job does once its state has its size (untimed: training steps run meanwhile)
        ck.prepare({"model": model, "optim": opt, "step": 0}, wait=True)
    saves: list[dict[str, float]] = []
    steps: list[float] = []
    copies: list[float] = []
    src = state_tensors(model, opt)
    dst: list[torch.Tensor] = []
    try:
        for i in range(1, spec.saves + 1):
            if i == FIRST_SAVES + 1:  # after the first saves: they must find a fresh process
                dst = [torch.empty_like(t) for t in src]
                for t in dst:
                    t.zero_()  # every page touched before timing
            x = batch(g, i)
            t0 = time.perf_counter()
            train_step(model, opt, x)
            steps.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            h = ck.save_async(i, {"model": model, "optim": opt, "step": i})
            t1 = time.perf_counter()
            h.wait_snapshot()
            t2 = time.perf_counter()
            written = h.result()
            t3 = time.perf_counter()
            saves.append({"call_s": t1 - t0, "stall_s": t2 - t0, "durable_s": t3 - t0, "tiers": len(written)})
            if dst:  # one plain copy right after each later save: the same conditions, paired
                t0 = time.perf_counter()
                for a, b in zip(dst, src, strict=True):
                    a.copy_(b)
                copies.append(time.perf_counter() - t0)
        res["stats"] = ck.stats()
    finally:
        ck.close()
    del dst
    res["saves"] = saves
    res["train_step_s"] = steps
    res["copy_s"] = copies
    ts = []
    for r in range(spec.torch_reps):
        p = d / f"torch-{r}.pt"
        ts.append(_torch_save(model, opt, spec.saves, p))
        p.unlink()
    res["torch_save_s"] = ts
    _write_result(spec.result, res)


def worker_main(argv: Sequence[str]) -> int:
    """``python -m benchmarks.recovery worker ROLE SPEC.json``."""
    if len(argv) != 2 or argv[0] not in ("save", "restart", "saves"):
        raise SystemExit("usage: python -m benchmarks.recovery worker {save,restart,saves} SPEC.json")
    spec = WorkerSpec(**json.loads(Path(argv[1]).read_text()))
    if spec.role != argv[0]:
        raise ValueError(f"spec is for role {spec.role!r}, not {argv[0]!r}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(spec.threads)
    {"save": _save_worker, "restart": _restart_worker, "saves": _saves_worker}[spec.role](spec)
    return 0


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
    pkg_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, OMP_NUM_THREADS=str(spec.threads),
               PYTHONPATH=pkg_root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rc: Optional[int] = None
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.recovery", "worker", spec.role,
                                 str(spec_path)], env=env, stdout=logf, stderr=subprocess.STDOUT, cwd=pkg_root)
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
    from benchmarks.peers import list_files

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


def summary(samples: list[float]) -> dict[str, Any]:
    """median / p95 / min / max (the runner's :func:`~benchmarks.runner.summary`)."""
    from benchmarks.runner import summary as _summary

    return _summary(samples)


def aggregate_row(row: str, system: str, cache: str, reps: list[dict[str, Any]],
                  state_bytes: int) -> dict[str, Any]:
    """One restart row over the repetitions: medians, restore and tier checks, status."""
    ok = [r for r in reps if "error" not in r]
    out: dict[str, Any] = {"row": row, "system": system, "cache": cache, "reps": reps, "status": "ok",
                           "reason": None, "calls": CALLS[system]}
    errors = [r["error"] for r in reps if "error" in r]
    if ok:
        for key in ("load_s", "first_step_s", "step_s", "extra_rss_bytes", "extra_rss_load_bytes"):
            out[key] = summary([float(r[key]) for r in ok])
        out["extra_rss_ratio"] = out["extra_rss_bytes"]["median"] / state_bytes
        out["extra_rss_load_ratio"] = out["extra_rss_load_bytes"]["median"] / state_bytes
        out["restore_ok"] = all(r.get("restore_ok") is True for r in ok)
        out["tiers"] = sorted({r["tier"] for r in ok if r.get("tier")})
        fr = [r["resident_fraction"] for r in ok if r.get("resident_fraction") is not None]
        out["resident_fraction"] = max(fr) if cache == "cold" and fr else (min(fr) if fr else None)
        if any(r.get("open_s") is not None for r in ok):
            out["open_s"] = summary([float(r["open_s"]) for r in ok if r.get("open_s") is not None])
        if system.startswith("nebula"):
            out["tier_ok"] = all(r.get("tier_ok") is True for r in ok)
        if system == "nebula_memory":
            out["from_memory_tier"] = out["tier_ok"]
            out["adopted_bytes"] = min(int(r.get("adopted_bytes") or 0) for r in ok)
    else:
        out["restore_ok"] = False
    if errors:
        out.update(status="error", reason=f"{len(errors)} of {len(reps)} repetition(s) failed: {errors[0]}")
    elif out.get("tier_ok") is False:
        want = "the memory tier" if system == "nebula_memory" else "the local root"
        out.update(status="error", reason=f"restored from {', '.join(out['tiers']) or 'nothing'}, not {want}")
    elif out["restore_ok"] is not True:
        out.update(status="error", reason="restored state is not bit-exact (digest after the first step differs)")
    return out


def aggregate_saves(res: dict[str, Any]) -> dict[str, Any]:
    """The first-save and floor figures of one ``saves`` worker."""
    stalls = [s["stall_s"] for s in res["saves"]]
    later = stalls[FIRST_SAVES:]
    out = {"status": "ok", "reason": None, "tiers": res["tiers"], "state_bytes": res["state_bytes"],
           "first_stalls_s": stalls[:FIRST_SAVES], "later_stall_s": summary(later),
           "calls_s": [s["call_s"] for s in res["saves"]], "durable_s": [s["durable_s"] for s in res["saves"]],
           "torch_save_s": summary(res["torch_save_s"]), "copy_s": summary(res["copy_s"]),
           "train_step_s": summary(res["train_step_s"]), "stats": res.get("stats")}
    if not any(str(t).startswith("memory:") for t in res["tiers"]):
        out["note"] = "no memory tier (the shm folder refused it): saves went to the local root only"
    lm = out["later_stall_s"]["median"]
    out["first_two_ratio"] = max(stalls[:2]) / lm if lm else None
    cm = out["copy_s"]["median"]
    out["floor_ratio"] = lm / cm if lm is not None and cm else None
    out["copy_gbps"] = res["state_bytes"] / cm / 1e9 if cm else None
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


# --------------------------------------------------------------------------- targets and report

def _row(size: dict[str, Any], name: str) -> Optional[dict[str, Any]]:
    r = next((r for r in size.get("rows", []) if r["row"] == name), None)
    return r if r and r.get("status") == "ok" else None


def _med(r: Optional[dict[str, Any]], key: str) -> Optional[float]:
    v = (r or {}).get(key)
    return v.get("median") if isinstance(v, dict) else None


def _label(size: dict[str, Any]) -> str:
    return f"{size['size_gb']:g} GB"


def _memory_target(s: dict[str, Any]) -> dict[str, Any]:
    title = f"restart from memory <= {MEMORY_SPEEDUP:g}x the better of torch.load / mmap (to first step)"
    mem = _row(s, "nebula_memory")
    peers = [(n, _med(_row(s, n), "first_step_s")) for n in ("torch_load", "torch_load_mmap")]
    have = [(n, t) for n, t in peers if t is not None]
    m = _med(mem, "first_step_s")
    if m is None or not have:
        why = "nebula_memory did not restore from the memory tier" if m is None else "no torch.load row"
        return _target("recovery_memory", title, None, "n/a", f"<= {MEMORY_SPEEDUP:g}x", _label(s), why)
    best, bt = min(have, key=lambda x: x[1])
    r = m / bt
    return _target("recovery_memory", title, r <= MEMORY_SPEEDUP, f"{r:.2f}x ({fmt_s(m)} vs {fmt_s(bt)} {best})",
                   f"<= {MEMORY_SPEEDUP:g}x", _label(s),
                   f"page cache warm for torch; load alone {fmt_s(_med(mem, 'load_s'))} vs "
                   f"{fmt_s(_med(_row(s, best), 'load_s'))}")


def _rss_target(s: dict[str, Any]) -> dict[str, Any]:
    title = f"nebula_memory extra peak RSS <= {RSS_FACTOR:g}x state (restart + first step)"
    mem = _row(s, "nebula_memory")
    if mem is None:
        return _target("recovery_rss", title, None, "n/a", f"<= {RSS_FACTOR:g}x", _label(s), "nebula_memory failed")
    r = mem["extra_rss_ratio"]
    peers = [(n, _row(s, n)) for n in ("torch_load", "torch_load_mmap")]
    others = "; ".join(f"{n} {p['extra_rss_ratio']:.2f}x (load alone {p['extra_rss_load_ratio']:.2f}x)"
                       for n, p in peers if p is not None)
    return _target("recovery_rss", title, r <= RSS_FACTOR, f"{r:.2f}x ({fmt_b(_med(mem, 'extra_rss_bytes'))})",
                   f"<= {RSS_FACTOR:g}x", _label(s),
                   f"VmHWM - VmRSS before the load; includes the first step's gradients and AdamW temporaries; "
                   f"the load alone {mem['extra_rss_load_ratio']:.2f}x (the optimizer state it creates: 0.67x); "
                   f"{others}")


def _local_target(s: dict[str, Any]) -> dict[str, Any]:
    title = "nebula_local restore warm and cold <= torch.load (to first step)"
    parts, met = [], True
    for cache, nl_name, tl_name in (("warm", "nebula_local", "torch_load"),
                                    ("cold", "nebula_local_cold", "torch_load_cold")):
        nl, tl = _med(_row(s, nl_name), "first_step_s"), _med(_row(s, tl_name), "first_step_s")
        if nl is None or tl is None:
            return _target("recovery_local", title, None, "n/a", "<= torch.load", _label(s),
                           f"{nl_name} or {tl_name} did not run")
        met = met and nl <= tl
        parts.append(f"{cache} {fmt_s(nl)} vs {fmt_s(tl)}")
    cold = _row(s, "nebula_local_cold") or {}
    return _target("recovery_local", title, met, "; ".join(parts), "<= torch.load + load_state_dict", _label(s),
                   f"cold: posix_fadvise(DONTNEED), {cold.get('resident_fraction') or 0:.0%} of the files "
                   "still cached before the restart")


def _first_save_target(s: dict[str, Any], key: str = "saves") -> dict[str, Any]:
    title = f"first two saves' stall <= {FIRST_SAVE_FACTOR:g}x later saves' median" + \
        (" (after prepare())" if key == "saves_prepared" else "")
    sv = s.get(key) or {}
    if sv.get("status") != "ok" or sv.get("first_two_ratio") is None:
        return _target("recovery_first_saves", title, None, "n/a", f"<= {FIRST_SAVE_FACTOR:g}x", _label(s),
                       sv.get("reason") or "not measured")
    r = sv["first_two_ratio"]
    return _target("recovery_first_saves", title, r <= FIRST_SAVE_FACTOR,
                   f"{r:.2f}x ({' / '.join(fmt_s(x) for x in sv['first_stalls_s'][:2])} vs "
                   f"{fmt_s(sv['later_stall_s']['median'])})", f"<= {FIRST_SAVE_FACTOR:g}x", _label(s),
                   "stall = save_async call + wait_snapshot(); saves 3-4: "
                   + " / ".join(fmt_s(x) for x in sv["first_stalls_s"][2:]))


def _floor_target(s: dict[str, Any]) -> dict[str, Any]:
    title = f"save stall <= {FLOOR_FACTOR:g}x one copy of the state into pre-touched buffers"
    sv = s.get("saves") or {}
    if sv.get("status") != "ok" or sv.get("floor_ratio") is None:
        return _target("recovery_floor", title, None, "n/a", f"<= {FLOOR_FACTOR:g}x", _label(s),
                       sv.get("reason") or "not measured")
    r = sv["floor_ratio"]
    return _target("recovery_floor", title, r <= FLOOR_FACTOR,
                   f"{r:.2f}x ({fmt_s(sv['later_stall_s']['median'])} vs {fmt_s(sv['copy_s']['median'])})",
                   f"<= {FLOOR_FACTOR:g}x", _label(s),
                   f"both idle, medians, one copy right after each save; copy {sv['copy_gbps']:.2f} GB/s "
                   "(dst.copy_(src) per tensor)")


def evaluate_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The recovery targets per size that ran (``met`` None for n/a); skipped sizes give none."""
    sec = results.get("recovery")
    if not sec or sec.get("error"):
        return []
    out: list[dict[str, Any]] = []
    for s in sec.get("sizes", []):
        if s.get("status") != "ok":
            out.append(_target("recovery_skipped", "recovery targets", None, "n/a", "-", f"{s['size_gb']:g} GB",
                               str(s.get("reason"))))
            continue
        out += [_memory_target(s), _rss_target(s), _local_target(s), _first_save_target(s),
                _first_save_target(s, "saves_prepared"), _floor_target(s)]
    return out


def _restart_line(s: dict[str, Any], r: dict[str, Any]) -> str:
    size = f"{fmt_b(s['state_bytes'])}"
    if r.get("load_s") is None:
        return f"| {size} | {r['row']} | {r['cache']} |" + " n/a |" * 7 + f" {r.get('reason')} |"
    tiers = ", ".join(sorted({t.split(":", 1)[0] for t in r.get("tiers", [])})) or "-"
    exact = "yes" if r.get("restore_ok") else "**NO**"
    status = "ok" if r["status"] == "ok" else f"**{r['reason']}**"
    load_rss = f"{r['extra_rss_load_ratio']:.2f}x" if r.get("extra_rss_load_ratio") is not None else "n/a"
    handed = fmt_b(r["adopted_bytes"]) if r.get("adopted_bytes") else "-"
    return (f"| {size} | {r['row']} | {r['cache']} | {fmt_s(_med(r, 'load_s'))} | {fmt_s(_med(r, 'first_step_s'))} "
            f"| {fmt_s(_med(r, 'step_s'))} | {r['extra_rss_ratio']:.2f}x ({fmt_b(_med(r, 'extra_rss_bytes'))}) "
            f"| {load_rss} | {tiers} | {handed} | {exact} | {status} |")


def _pressure_note(sec: dict[str, Any]) -> str:
    ps = [p for p in (sec.get("cpu_pressure_start"), sec.get("cpu_pressure_end")) if p is not None]
    if not ps:
        return ""
    note = (" CPU pressure (share of time some task waited for a CPU, last 10 s) at start / end: "
            + " / ".join(f"{p:.0%}" for p in ps))
    return note + (" - **other work competed for the CPUs: timings are noisy**." if max(ps) > 0.2 else ".")


def render_markdown(results: dict[str, Any]) -> list[str]:
    """The ``## Recovery after a crash`` section of ``results.md`` (empty when it did not run)."""
    sec = results.get("recovery")
    if not sec:
        return []
    lines = ["## Recovery after a crash", ""]
    if sec.get("error"):
        return lines + [f"Not run: {sec['error']}", ""]
    sizes = sec.get("sizes", [])
    lines += [f"MLP + AdamW sized to {', '.join(f'{x:g}' for x in sec.get('sizes_gb', []))} GB of state; "
              f"{sec.get('reps')} repetition(s), {sec.get('threads')} torch threads; memory tier in "
              f"`{sec.get('shm_dir')}`." + _pressure_note(sec), "", METHOD, "",
              "### Restart to the first optimizer step", "",
              "| state | system | page cache | load | to first step done | first step alone | extra peak RSS "
              "| of the load alone | restored from | handed over | bit-exact | status |",
              "|---|---|---|---:|---:|---:|---:|---:|---|---:|---|---|"]
    for s in sizes:
        if s.get("status") != "ok":
            lines.append(f"| {s['size_gb']:g} GB | - | - |" + " n/a |" * 8 + f" {s.get('reason')} |")
            continue
        lines += [_restart_line(s, r) for r in s["rows"]]
    lines += ["", "### First saves of a fresh process and the snapshot floor", "",
              "Stall = `save_async` call + `handle.wait_snapshot()`, after a training step, nothing in the "
              "background (each save's `result()` waited for, untimed). One copy = `dst.copy_(src)` for every "
              "tensor into buffers allocated and touched before, one right after each later save (paired: the same "
              "moment's conditions), same process.", "",
              "| state | model | staging | save 1 | save 2 | save 3 | save 4 | later saves (median) "
              "| one copy (median) | stall / copy | torch.save + fsync | training step | status |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for s, key in ((s, k) for s in sizes for k in ("saves", "saves_prepared")):
        sv = s.get(key) or {}
        how = "`prepare(state)` first" if key == "saves_prepared" else "default"
        head = f"| {fmt_b(s.get('state_bytes'))} | {s.get('description', '-')} | {how} |"
        if s.get("status") != "ok" or sv.get("status") != "ok":
            lines.append(head + " n/a |" * 9 + f" {s.get('reason') or sv.get('reason')} |")
            continue
        firsts = [fmt_s(x) for x in sv["first_stalls_s"]] + ["n/a"] * (FIRST_SAVES - len(sv["first_stalls_s"]))
        ratio = f"{sv['floor_ratio']:.2f}x" if sv.get("floor_ratio") is not None else "n/a"
        lines.append(head + " " + " | ".join(firsts) + f" | {fmt_s(sv['later_stall_s']['median'])} "
                     f"| {fmt_s(sv['copy_s']['median'])} | {ratio} | {fmt_s(sv['torch_save_s']['median'])} "
                     f"| {fmt_s(sv['train_step_s']['median'])} | {sv.get('note') or 'ok'} |")
    lines += ["", "How each system saves and restarts:", ""]
    lines += [f"- **{n}**: {c}." for n, c in sec.get("calls", {}).items()]
    if sec.get("shm_left"):
        lines += ["", f"**Memory tiers left behind (removed by the benchmark): {', '.join(sec['shm_left'])}**"]
    lines.append("")
    return lines


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
