"""``nebula-ckpt bench``: a quick benchmark of *your* state on *your* machine.

The same command, with the same options, in every installation (pip, editable, a checkout): it
answers the question a new user has first: what does ``save_async`` cost my training loop, here,
for my state, and how fast does it come back after a crash? It saves the state with a fresh
:class:`~nebula_ckpt.Checkpointer` (default tiers: the memory tier plus a folder on the disk you
name) and measures, for every save:

* **blocking**: ``save_async()`` + ``wait_snapshot()``, the time the training thread loses
  (the first save of a process apart from the later ones: it is the one a new user sees first);
* **time to durable**: from the start of ``save_async()`` until ``result()`` returns (the
  checkpoint is fsynced on every tier);

then **restore**: ``load_latest(into=state)`` from the memory tier (a restart after a crash) and
from the disk tier alone (the memory tier gone; the file system's cache is warm), and, as the
references, ``torch.save`` of the same state into a file in the same folder + fsync of the file
and the folder, and ``torch.load`` of it copied into the state. Each figure is the median of its
repetitions with their spread (min-max). The report also gives the host memory the saves
staged in, the process's peak resident memory, what the memory tier holds in ``/dev/shm`` and
the room left there, and warns when the machine was busy (its load average, at the start, of at
least half its cores: the times then include waiting for a CPU).

The state is a file you pass (``--state FILE``: anything ``torch.save`` wrote that
``torch.load(weights_only=True)`` accepts: a state dict, a dict of them, or what ``nebula-ckpt
export --to state.pt`` writes) or a synthetic one of ``--size-gb`` GB of float32 tensors of 64 MiB.
Everything written goes into a temporary folder under ``--root`` (default: the current
directory), removed at the end with the memory tier.

Example::

    from nebula_ckpt import quickbench
    res = quickbench.run(quickbench.Options(size_gb=0.05, saves=3, root="/tmp"))
    res["nebula"]["later_blocking_s"] < res["torch_save"]["durable_s"]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch

from nebula_ckpt.checkpointer import Checkpointer
from nebula_ckpt.errors import ValidationError
from nebula_ckpt.storage.local import fsync_dir
from nebula_ckpt.tiers.memory.shm import tree_bytes
from nebula_ckpt.tiers.memory.tier import memory_tier_path

__all__ = ["Options", "main", "run", "render"]

log = logging.getLogger(__name__)

#: bytes per tensor of the synthetic state
SYNTHETIC_TENSOR_BYTES = 64 << 20


@dataclass(frozen=True)
class Options:
    """What to measure.

    Attributes:
        state: a file ``torch.save`` wrote (loaded with ``weights_only=True``), or None.
        size_gb: size of the synthetic state when ``state`` is None.
        saves: saves with nebula_ckpt (the first one is reported apart: at least 2).
        torch_reps: ``torch.save`` + fsync repetitions (and as many ``torch.load``), and restores
            from each tier.
        root: folder the temporary checkpoint folder is made in (default: the working directory).
        keep: leave what was written in place (its path is in the result).
    """

    state: Optional[str] = None
    size_gb: float = 1.0
    saves: int = 5
    torch_reps: int = 2
    root: Optional[str] = None
    keep: bool = False


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def load_state(opts: Options) -> tuple[Any, str]:
    """The state to save and a description of where it came from.

    Raises:
        ValidationError: the file is missing, ``torch.load(weights_only=True)`` refuses it, it
            holds no tensor, or ``size_gb`` is not positive.
    """
    if opts.state is None:
        if not opts.size_gb > 0:
            raise ValidationError(f"--size-gb must be > 0, got {opts.size_gb}")
        left, state, i = int(opts.size_gb * 1e9), {}, 0
        while left > 0:
            n = min(left, SYNTHETIC_TENSOR_BYTES) // 4 or 1
            state[f"t{i:04d}"] = torch.empty(n, dtype=torch.float32).uniform_()
            left -= n * 4
            i += 1
        return state, f"synthetic: {len(state)} float32 tensors"
    if not os.path.isfile(opts.state):
        raise ValidationError(f"--state {opts.state}: no such file (pass a file torch.save wrote)")
    try:
        state = torch.load(opts.state, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValidationError(f"--state {opts.state}: torch.load(weights_only=True) refused it ({e}); pass a "
                              "state dict of tensors (the quick benchmark never runs code from a file)") from None
    if not _tensors(state):
        raise ValidationError(f"--state {opts.state}: holds no tensor; pass a state dict")
    return state, f"file: {opts.state}"


def _median(xs: list[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def _spread(xs: list[float]) -> Optional[list[float]]:
    """``[min, max]`` of ``xs`` (None when empty)."""
    return [min(xs), max(xs)] if xs else None


def _restores(ck: Checkpointer, state: Any, reps: int, what: str) -> list[float]:
    """``reps`` timed ``ck.load_latest(into=state)`` (what a restarted job calls)."""
    times = []
    for r in range(reps):
        t0 = time.perf_counter()
        ck.load_latest(into=state)
        times.append(time.perf_counter() - t0)
        _progress(f"restore from {what} {r + 1}/{reps}: {times[-1]:.3f} s")
    return times


def _saves(ck: Checkpointer, state: Any, saves: int) -> tuple[list[float], list[float]]:
    blocking: list[float] = []
    durable: list[float] = []
    for i in range(saves):
        t0 = time.perf_counter()
        h = ck.save_async(i, state)
        h.wait_snapshot()
        t1 = time.perf_counter()
        h.result()
        t2 = time.perf_counter()
        blocking.append(t1 - t0)
        durable.append(t2 - t0)
        _progress(f"nebula save {i + 1}/{saves}: blocking {t1 - t0:.3f} s, durable {t2 - t0:.3f} s")
    return blocking, durable


def _shm_room(path: Optional[str]) -> Optional[dict[str, Any]]:
    """The memory tier's bytes in its tmpfs and the tmpfs' size and free bytes (None without one)."""
    if path is None or not os.path.isdir(path):
        return None
    st = os.statvfs(path)
    return {"tier_bytes": tree_bytes(path), "fs_bytes": st.f_blocks * st.f_frsize,
            "free_bytes": st.f_bavail * st.f_frsize,
            "shm_dir": os.path.dirname(os.path.dirname(path))}


def measure_nebula(state: Any, folder: str, saves: int, restores: int = 2) -> dict[str, Any]:
    """``saves`` saves of ``state`` with a fresh Checkpointer rooted in ``folder`` (blocking and time
    to durable of each), then ``restores`` restores from the memory tier and from the disk tier."""
    ck = Checkpointer(folder)
    tier = memory_tier_path(folder)
    try:
        blocking, durable = _saves(ck, state, saves)
        tiers = [t.name for t in ck.tiers]
        stats, shm = ck.stats(), _shm_room(tier if any(t.startswith("memory:") for t in tiers) else None)
        from_memory = _restores(ck, state, restores, tiers[0].split(":", 1)[0])
    finally:
        ck.close()
    with Checkpointer(folder, memory_tier=False, read_only=True) as disk:
        from_disk = _restores(disk, state, restores, "disk")
    shutil.rmtree(tier, ignore_errors=True)
    with contextlib.suppress(OSError):  # the per-user folder, when no other job's tier is in it
        os.rmdir(os.path.dirname(tier))
    return {"tiers": tiers, "blocking_s": blocking, "durable_s": durable,
            "first_blocking_s": blocking[0], "later_blocking_s": _median(blocking[1:]),
            "later_blocking_spread_s": _spread(blocking[1:]),
            "first_durable_s": durable[0], "later_durable_s": _median(durable[1:]),
            "later_durable_spread_s": _spread(durable[1:]),
            "restore_s": {"fastest_tier": _median(from_memory), "disk": _median(from_disk)},
            "restore_spread_s": {"fastest_tier": _spread(from_memory), "disk": _spread(from_disk)},
            "restored_from": tiers[0], "staging_bytes": int(stats.get("staging_bytes") or 0),
            "slot_bytes": int(stats.get("memory_tier_slot_bytes") or 0),
            "shm": shm}


def measure_torch_save(state: Any, folder: str, reps: int) -> dict[str, Any]:
    """``torch.save`` of ``state`` into a new file in ``folder`` + fsync of it and of ``folder``;
    then ``torch.load`` of that file (weights only) copied into ``state``."""
    times, loads = [], []
    path = os.path.join(folder, "torch-save.pt")
    for r in range(reps):
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(folder)
        times.append(time.perf_counter() - t0)
        _progress(f"torch.save + fsync {r + 1}/{reps}: {times[-1]:.3f} s")
    for r in range(reps):
        t0 = time.perf_counter()
        loaded = torch.load(path, map_location="cpu", weights_only=True)
        _copy_into(state, loaded)
        loads.append(time.perf_counter() - t0)
        del loaded
        _progress(f"torch.load + copy into the state {r + 1}/{reps}: {loads[-1]:.3f} s")
    os.unlink(path)
    return {"durable_s": _median(times), "samples_s": times, "spread_s": _spread(times),
            "load_s": _median(loads), "load_samples_s": loads, "load_spread_s": _spread(loads)}


def _copy_into(into: Any, loaded: Any) -> None:
    """Copy the tensors of ``loaded`` into those of ``into`` (same tree), as ``load_state_dict`` does."""
    if isinstance(into, torch.Tensor):
        with torch.no_grad():
            into.copy_(loaded)
    elif isinstance(into, dict):
        for k, v in into.items():
            _copy_into(v, loaded[k])
    elif isinstance(into, (list, tuple)):
        for a, b in zip(into, loaded, strict=True):
            _copy_into(a, b)


def _progress(msg: str) -> None:
    """One progress line on stderr, only where a person watches (a terminal)."""
    if sys.stderr.isatty():
        sys.stderr.write(msg + "\n")


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def machine_load() -> dict[str, Any]:
    """The load average (1 min) and the cores: ``busy`` when the load is at least half the cores."""
    cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:  # not available on this system
        return {"load_1min": None, "cores": cores, "busy": False}
    return {"load_1min": load, "cores": cores, "busy": load >= max(1.0, cores / 2)}


def run(opts: Options) -> dict[str, Any]:
    """Measure as ``opts`` says; return every figure (the table :func:`render` prints is made from it).

    Raises:
        ValidationError: bad options or state (nothing was written).
    """
    if opts.saves < 2 or opts.torch_reps < 1:
        raise ValidationError(f"--saves must be >= 2 and --torch-reps >= 1, got {opts.saves} / {opts.torch_reps}")
    base = os.path.abspath(opts.root or os.getcwd())
    if not os.path.isdir(base):
        raise ValidationError(f"--root {base}: no such folder")
    state, source = load_state(opts)
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(state))
    folder = tempfile.mkdtemp(prefix="nebula-quickbench-", dir=base)
    log.info("nebula_ckpt quick benchmark: %.2f GB (%s) in %s", nbytes / 1e9, source, folder)
    load = machine_load()
    try:
        neb = measure_nebula(state, os.path.join(folder, "nebula"), opts.saves, opts.torch_reps)
        ts = measure_torch_save(state, folder, opts.torch_reps)
    finally:
        if not opts.keep:
            shutil.rmtree(folder, ignore_errors=True)
    ref = ts["durable_s"]
    return {"options": asdict(opts), "source": source, "state_bytes": nbytes,
            "tensors": len(_tensors(state)), "folder": folder, "kept": opts.keep,
            "nebula": neb, "torch_save": ts, "machine": load,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "ratios": {"first_vs_later_blocking": _ratio(neb["first_blocking_s"], neb["later_blocking_s"]),
                       "later_blocking_vs_torch_save": _ratio(neb["later_blocking_s"], ref),
                       "durable_vs_torch_save": _ratio(neb["later_durable_s"], ref),
                       "restore_vs_torch_load": _ratio(neb["restore_s"]["fastest_tier"], ts["load_s"])}}


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{int(n)} B"


def _rows(res: dict[str, Any]) -> list[tuple[str, Optional[float], Optional[list[float]], Optional[float]]]:
    """(what, seconds, spread, reference) of each row of the table."""
    neb, ts = res["nebula"], res["torch_save"]
    ref, load = ts["durable_s"], ts["load_s"]
    where = neb["restored_from"].split(":", 1)[0]
    return [("save_async blocking, first save", neb["first_blocking_s"], None, ref),
            ("save_async blocking, later saves", neb["later_blocking_s"], neb["later_blocking_spread_s"], ref),
            ("time to durable, later saves", neb["later_durable_s"], neb["later_durable_spread_s"], ref),
            ("torch.save + fsync", ref, ts["spread_s"], ref),
            (f"restore: load_latest from the {where} tier", neb["restore_s"]["fastest_tier"],
             neb["restore_spread_s"]["fastest_tier"], load),
            ("restore: load_latest from disk", neb["restore_s"]["disk"], neb["restore_spread_s"]["disk"], load),
            ("torch.load + copy into the state", load, ts["load_spread_s"], load)]


def render(res: dict[str, Any]) -> str:
    """The results as a small text table, the memory figures, and a warning on a busy machine."""
    neb = res["nebula"]
    lines = [f"nebula_ckpt quick benchmark: {res['state_bytes'] / 1e9:.2f} GB in {res['tensors']} tensors "
             f"({res['source']}); tiers: {' + '.join(t.split(':', 1)[0] for t in neb['tiers'])}",
             f"{'':<44}{'median s':>10}  {'spread (min-max)':>18}  {'vs torch':>9}"]
    for name, v, spread, ref in _rows(res):
        r = _ratio(v, ref)
        sp = f"{spread[0]:.3f}-{spread[1]:.3f}" if spread else ""
        lines.append(f"{name:<44}{v:>10.3f}  {sp:>18}  {(f'{r:.2f}x' if r is not None else 'n/a'):>9}")
    lines.append("(vs torch: saves against torch.save + fsync, restores against torch.load + copy)")
    lines.append(f"host memory for the saves: {_size(neb['staging_bytes'])} of staging buffers in the process and "
                 f"{_size(neb['slot_bytes'])} of slot files in the memory tier (the state: "
                 f"{_size(res['state_bytes'])}); "
                 f"peak resident memory of this process: {_size(res['peak_rss_bytes'])}")
    shm = neb["shm"]
    if shm is not None:
        lines.append(f"{shm['shm_dir']}: the memory tier held {_size(shm['tier_bytes'])}; its file system had "
                     f"{_size(shm['free_bytes'])} free of {_size(shm['fs_bytes'])}")
    m = res["machine"]
    if m["busy"]:
        lines.append(f"warning: the machine was busy (load average {m['load_1min']:.1f} on {m['cores']} cores at "
                     "the start): the times include waiting for a CPU; run again on an idle machine for figures "
                     "to compare")
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nebula-ckpt bench", description=__doc__.split("\n\n")[0],
                                epilog="From a checkout of the repository, the full benchmark harness (peers, "
                                       "emulated remote stores, multi-rank, recovery) takes its own options: "
                                       "nebula-ckpt bench --model 124m, --ranks 2,4, --recovery ...; "
                                       "python -m benchmarks.run --help lists them")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--state", default=None, help="a file torch.save wrote (loaded with weights_only=True)")
    src.add_argument("--size-gb", type=float, default=None, help="size of a synthetic state (default 1.0)")
    p.add_argument("--saves", type=int, default=5, help="saves with nebula_ckpt (default 5; the first is shown apart)")
    p.add_argument("--torch-reps", type=int, default=2,
                   help="torch.save + fsync and torch.load repetitions, restores per tier (default 2)")
    p.add_argument("--root", default=None, help="folder to write in (default: the current directory)")
    p.add_argument("--keep", action="store_true", help="keep what was written")
    p.add_argument("--json", action="store_true", help="print every figure as JSON instead of the table")
    return p


#: the options of :func:`main` (``nebula-ckpt bench`` with any other one runs a checkout's harness)
OPTIONS = frozenset({"--state", "--size-gb", "--saves", "--torch-reps", "--root", "--keep", "--json", "-h", "--help"})


def main(argv: Optional[list[str]] = None) -> int:
    """``nebula-ckpt bench``: measure, print the table (or JSON).

    Returns:
        0, or 2 for bad options or an unusable state (the message says why; nothing was written).
    """
    a = _parser().parse_args(argv)
    opts = Options(state=a.state, size_gb=1.0 if a.size_gb is None else a.size_gb, saves=a.saves,
                   torch_reps=a.torch_reps, root=a.root, keep=a.keep)
    try:
        res = run(opts)
    except ValidationError as e:
        sys.stderr.write(f"nebula-ckpt bench: {e}\n")
        return 2
    sys.stdout.write(json.dumps(res, indent=2) + "\n" if a.json else render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
