"""RNG states in the layout of HF's ``rng_state.pth`` (``python``, ``numpy``, ``cpu``, ``cuda`` and
the other devices' states): taken at each save, set back at resume, so a resumed run draws the
same random numbers as an uninterrupted one. Stored as tensors and typed values, never pickled.
"""

from __future__ import annotations

import importlib
import logging
import random
from typing import Any

import numpy as np
import torch

log = logging.getLogger("nebula_ckpt")

#: device modules whose RNG state HF's rng_state.pth holds besides python / numpy / cpu
DEVICE_RNG = ("cuda", "npu", "hpu", "mlu", "musa")


def _device_module(name: str) -> Any:
    """``torch.cuda`` / ``torch.npu`` ... when that device is usable here, else None."""
    mod = getattr(torch, name, None)
    try:
        return mod if mod is not None and mod.is_available() else None
    except Exception:
        return None


def rng_states(distributed: bool) -> dict[str, Any]:
    """What ``Trainer._save_rng_state`` puts in ``rng_state.pth``: the state of every generator a
    training step may draw from (one rank's; device states of every local device when distributed)."""
    states: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                              "cpu": torch.random.get_rng_state()}
    for name in DEVICE_RNG:
        mod = _device_module(name)
        if mod is not None:
            rnd = getattr(mod, "random", mod)
            states[name] = rnd.get_rng_state_all() if distributed else rnd.get_rng_state()
    xm = _xla()
    if xm is not None:  # pragma: no cover - TPU only
        states["xla"] = xm.get_rng_state()
    return states


def _xla() -> Any:
    """``torch_xla.core.xla_model`` on a TPU host, else None."""
    from transformers.utils import is_torch_xla_available

    if not is_torch_xla_available():
        return None
    return importlib.import_module("torch_xla.core.xla_model")  # pragma: no cover


def set_rng_states(states: dict[str, Any], distributed: bool) -> None:
    """``Trainer._load_rng_state`` from the restored dict instead of ``rng_state.pth``."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.random.set_rng_state(states["cpu"])
    for name in DEVICE_RNG:
        mod = _device_module(name)
        if mod is None:
            continue
        if name not in states:
            log.warning("nebula_ckpt: the checkpoint holds no %s RNG state (saved without %s): the resumed run "
                        "will not reproduce the interrupted one exactly", name, name.upper())
            continue
        rnd = getattr(mod, "random", mod)
        try:
            if distributed:
                rnd.set_rng_state_all(states[name])
            else:
                rnd.set_rng_state(states[name])
        except Exception as e:  # as HF: a different device count is not fatal, but said
            log.error("nebula_ckpt: could not restore the %s RNG states (%s: %s): the resumed run will not "
                      "reproduce the interrupted one exactly", name, type(e).__name__, e)
    xm = _xla() if "xla" in states else None
    if xm is not None:  # pragma: no cover - TPU only
        xm.set_rng_state(states["xla"])

