"""The processes of the recovery benchmark: ``python -m benchmarks.recovery_worker ROLE SPEC.json``.

One module for what runs in the benchmark's own fresh processes (the parent is
:mod:`benchmarks.recovery`): the MLP + AdamW state of a given size (:class:`Geometry`), its
training step and digest, and the three roles: ``save`` (one checkpoint per system, then SIGKILL
for the memory tier), ``restart`` (load one system's checkpoint and take the first step) and
``saves`` (a fresh process's first saves, the later ones, one plain copy of the state, torch.save).
Each writes its result as JSON where its :class:`WorkerSpec` says.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import nn

from benchmarks.limits import PeakRss
from nebula_ckpt.storage.local import fsync_dir

#: widest layer of the MLP; narrower only where two such layers would exceed the size asked for
MAX_WIDTH = 4096
#: rows of the synthetic batch of every training step
BATCH = 8
#: restart rows, in report order: (row name, system restarted, page cache before the restart)
#: saves of the first-save measurement: the first ``FIRST_SAVES`` are reported one by one
FIRST_SAVES = 4
#: targets (see :func:`evaluate_targets`)
#: the step the saving process saves (its first training step)
SAVED_STEP = 1


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
    fault_ahead: Optional[int] = None  # nebula_ckpt.storage.prefault.FAULT_AHEAD_THREADS (None: its default)

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
    """``python -m benchmarks.recovery_worker ROLE SPEC.json``."""
    if len(argv) != 2 or argv[0] not in ("save", "restart", "saves"):
        raise SystemExit("usage: python -m benchmarks.recovery_worker {save,restart,saves} SPEC.json")
    spec = WorkerSpec(**json.loads(Path(argv[1]).read_text()))
    if spec.role != argv[0]:
        raise ValueError(f"spec is for role {spec.role!r}, not {argv[0]!r}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(spec.threads)
    if spec.fault_ahead is not None:
        from nebula_ckpt.storage import prefault
        prefault.FAULT_AHEAD_THREADS = spec.fault_ahead
    {"save": _save_worker, "restart": _restart_worker, "saves": _saves_worker}[spec.role](spec)
    return 0



if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
