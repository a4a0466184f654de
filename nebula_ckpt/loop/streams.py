"""The random streams of a process, taken and set back as typed leaves (never pickled).

A training step draws from four kinds of streams: torch's CPU generator (dropout on the CPU,
``torch.randn``, a sampler without a generator of its own), each CUDA device's generator,
NumPy's global ``np.random`` and Python's ``random``. :func:`capture` takes them all as a dict of
tensors, NumPy arrays and plain values that the checkpoint format stores without pickle;
:func:`restore` sets them back, bit for bit.

CUDA's generators are taken only once CUDA is initialised in this process (before that no kernel
can have drawn from them, and touching them would create a context on every device); a state
taken with CUDA restored where CUDA is missing is logged, never fatal.

Your own generators (``torch.Generator`` objects, ``np.random.default_rng()``) are objects of the
program, not streams of the process: save ``g.get_state()`` / ``rng.bit_generator.state``
beside the model.
"""

from __future__ import annotations

import logging
import random
from typing import Any, Mapping, Optional

import numpy as np
import torch

from nebula_ckpt.errors import ValidationError

__all__ = ["capture", "restore", "generator_state", "STREAMS"]

log = logging.getLogger("nebula_ckpt")

#: the streams :func:`capture` takes (``cuda`` only where CUDA is initialised)
STREAMS = ("torch", "cuda", "numpy", "python")


def _numpy_state() -> dict[str, Any]:
    kind, key, pos, has_gauss, cached = np.random.get_state()
    return {"kind": str(kind), "key": np.asarray(key, dtype=np.uint32).copy(), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def _python_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    # 625 ints (the Mersenne Twister's words and its index) as one tensor: one leaf, not 625
    return {"version": int(version), "state": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": None if gauss is None else float(gauss)}


def capture(cuda: bool = True) -> dict[str, Any]:
    """Every random stream of this process, as typed leaves (tensors, NumPy arrays, ints, floats).

    Args:
        cuda: include each CUDA device's generator (when CUDA is initialised here).
    """
    out: dict[str, Any] = {"torch": torch.get_rng_state()}
    if cuda and torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [s for s in torch.cuda.get_rng_state_all()]
    out["numpy"] = _numpy_state()
    out["python"] = _python_state()
    return out


def _as_uint8(value: Any, where: str) -> torch.Tensor:
    t = torch.as_tensor(value)
    if t.dtype != torch.uint8 or t.dim() != 1:
        raise ValidationError(f"{where}: a generator state is a 1-D uint8 tensor, got {t.dtype} {tuple(t.shape)}")
    # a tensor of its own: torch's set_rng_state reads a view into a larger storage (a restored
    # tensor shares one buffer with the others of its dtype) from the wrong place and crashes
    return t.detach().cpu().clone()


def generator_state(value: Any, where: str) -> torch.Tensor:
    """A saved generator state as ``torch.Generator.set_state`` takes it (checked, a tensor of its own)."""
    return _as_uint8(value, where)


def _restore_cuda(states: Any, where: str) -> None:
    if not torch.cuda.is_available():
        log.warning("nebula_ckpt: %s holds the random state of %d CUDA device(s) but CUDA is not available here: "
                    "left as it is (a run on another kind of device does not draw the same numbers)", where,
                    len(states))
        return
    have = torch.cuda.device_count()
    if len(states) != have:
        log.warning("nebula_ckpt: %s holds the random state of %d CUDA device(s), this process sees %d: the "
                    "first %d are restored", where, len(states), have, min(have, len(states)))
    for i, s in enumerate(list(states)[:have]):
        torch.cuda.set_rng_state(_as_uint8(s, f"{where}['cuda'][{i}]"), i)


def restore(streams: Mapping[str, Any], where: str = "random streams") -> None:
    """Set every stream ``streams`` holds (what :func:`capture` returned, or its restored copy) back.

    Raises:
        ValidationError: a stream's state has the wrong shape (named with ``where``); the streams
            are checked before any is set.
    """
    unknown = sorted(set(streams) - set(STREAMS))
    if unknown:
        raise ValidationError(f"{where}: unknown random stream(s) {unknown}; known: {list(STREAMS)}")
    cpu = _as_uint8(streams["torch"], f"{where}['torch']") if "torch" in streams else None
    npy: Optional[tuple[Any, ...]] = None
    if "numpy" in streams:
        n = streams["numpy"]
        npy = (n["kind"], np.asarray(n["key"], dtype=np.uint32), int(n["pos"]), int(n["has_gauss"]),
               float(n["cached_gaussian"]))
    py: Optional[tuple[Any, ...]] = None
    if "python" in streams:
        p = streams["python"]
        words = tuple(int(v) for v in torch.as_tensor(p["state"]).tolist())
        py = (int(p["version"]), words, None if p["gauss_next"] is None else float(p["gauss_next"]))
    if cpu is not None:
        torch.set_rng_state(cpu)
    if "cuda" in streams:
        _restore_cuda(streams["cuda"], where)
    if npy is not None:
        np.random.set_state(npy)
    if py is not None:
        random.setstate(py)
