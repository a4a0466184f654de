"""``nebula-ckpt bench`` for an installed package: a quick benchmark of *your* state on *your* machine.

The full benchmark harness (peers, workloads, multi-rank and recovery cases) lives in the
repository's ``benchmarks/`` folder and is not installed. This module answers the question a new
user has first: what does ``save_async`` cost my training loop, here, for my state? It saves the
state with a fresh :class:`~nebula_ckpt.Checkpointer` (default tiers: the memory tier plus a
folder on the disk you name) and measures, for every save:

* **blocking**: ``save_async()`` + ``wait_snapshot()``, the time the training thread loses
  (the first save of a process apart from the later ones: it is the one a new user sees first);
* **time to durable**: from the start of ``save_async()`` until ``result()`` returns (the
  checkpoint is fsynced on every tier);

and, as the reference, ``torch.save`` of the same state into a file in the same folder + fsync
of the file and the folder. Each save starts with nothing in the background.

The state is a file you pass (``--state FILE``: anything ``torch.save`` wrote that
``torch.load(weights_only=True)`` accepts: a state dict, or a dict of them) or a synthetic one of
``--size-gb`` GB of float32 tensors of 64 MiB. Everything written goes into a temporary folder
under ``--root`` (default: the current directory), removed at the end with the memory tier.

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
from nebula_ckpt.storage.atomic import fsync_dir
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
        torch_reps: ``torch.save`` + fsync repetitions.
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


def measure_nebula(state: Any, folder: str, saves: int) -> dict[str, Any]:
    """``saves`` saves of ``state`` with a fresh Checkpointer rooted in ``folder``: blocking and
    time to durable of each (see the module docstring)."""
    ck = Checkpointer(folder)
    blocking: list[float] = []
    durable: list[float] = []
    try:
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
        tiers = [t.name for t in ck.tiers]
    finally:
        ck.close()
        tier = memory_tier_path(folder)
        shutil.rmtree(tier, ignore_errors=True)
        with contextlib.suppress(OSError):  # the per-user folder, when no other job's tier is in it
            os.rmdir(os.path.dirname(tier))
    return {"tiers": tiers, "blocking_s": blocking, "durable_s": durable,
            "first_blocking_s": blocking[0], "later_blocking_s": _median(blocking[1:]),
            "first_durable_s": durable[0], "later_durable_s": _median(durable[1:])}


def measure_torch_save(state: Any, folder: str, reps: int) -> dict[str, Any]:
    """``torch.save`` of ``state`` into a new file in ``folder`` + fsync of it and of ``folder``."""
    times = []
    for r in range(reps):
        path = os.path.join(folder, f"torch-save-{r}.pt")
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(folder)
        times.append(time.perf_counter() - t0)
        os.unlink(path)
        _progress(f"torch.save + fsync {r + 1}/{reps}: {times[-1]:.3f} s")
    return {"durable_s": _median(times), "samples_s": times}


def _progress(msg: str) -> None:
    """One progress line on stderr, only where a person watches (a terminal)."""
    if sys.stderr.isatty():
        sys.stderr.write(msg + "\n")


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


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
    try:
        neb = measure_nebula(state, os.path.join(folder, "nebula"), opts.saves)
        ts = measure_torch_save(state, folder, opts.torch_reps)
    finally:
        if not opts.keep:
            shutil.rmtree(folder, ignore_errors=True)
    ref = ts["durable_s"]
    return {"options": asdict(opts), "source": source, "state_bytes": nbytes,
            "tensors": len(_tensors(state)), "folder": folder, "kept": opts.keep,
            "nebula": neb, "torch_save": ts,
            "ratios": {"first_vs_later_blocking": _ratio(neb["first_blocking_s"], neb["later_blocking_s"]),
                       "later_blocking_vs_torch_save": _ratio(neb["later_blocking_s"], ref),
                       "durable_vs_torch_save": _ratio(neb["later_durable_s"], ref)}}


def render(res: dict[str, Any]) -> str:
    """The results as a small text table."""
    neb, ref = res["nebula"], res["torch_save"]["durable_s"]
    rows = [("save_async blocking, first save", neb["first_blocking_s"]),
            ("save_async blocking, later saves (median)", neb["later_blocking_s"]),
            ("time to durable, later saves (median)", neb["later_durable_s"]),
            ("torch.save + fsync (median)", ref)]
    lines = [f"nebula_ckpt quick benchmark: {res['state_bytes'] / 1e9:.2f} GB in {res['tensors']} tensors "
             f"({res['source']}); tiers: {' + '.join(t.split(':', 1)[0] for t in neb['tiers'])}",
             f"{'':<44}{'seconds':>10}  {'vs torch.save + fsync':>22}"]
    for name, v in rows:
        r = _ratio(v, ref)
        lines.append(f"{name:<44}{v:>10.3f}  {(f'{r:.2f}x' if r is not None else 'n/a'):>22}")
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nebula-ckpt bench", description=__doc__.split("\n\n")[0],
                                epilog="The full benchmark (peers, multi-rank, recovery) runs from a checkout of "
                                       "the repository: python -m benchmarks.run")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--state", default=None, help="a file torch.save wrote (loaded with weights_only=True)")
    src.add_argument("--size-gb", type=float, default=None, help="size of a synthetic state (default 1.0)")
    p.add_argument("--saves", type=int, default=5, help="saves with nebula_ckpt (default 5; the first is shown apart)")
    p.add_argument("--torch-reps", type=int, default=2, help="torch.save + fsync repetitions (default 2)")
    p.add_argument("--root", default=None, help="folder to write in (default: the current directory)")
    p.add_argument("--keep", action="store_true", help="keep what was written")
    p.add_argument("--json", action="store_true", help="print every figure as JSON instead of the table")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    """``nebula-ckpt bench`` without a repository checkout: measure, print the table (or JSON).

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
