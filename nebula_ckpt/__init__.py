"""nebula_ckpt: fast asynchronous, tiered checkpointing for PyTorch.

Example::

    import nebula_ckpt as nc

    ckpt = nc.Checkpointer("/ckpt/run-42")
    for step, batch in enumerate(loader):
        ...
        if step % 100 == 0:
            ckpt.save_async(step, {"model": model, "optim": opt, "step": step})
    ckpt.close()

    # after a crash, in a new process:
    step = nc.Checkpointer("/ckpt/run-42").load_latest(into={"model": model, "optim": opt, "step": 0})
"""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Any, Optional

from nebula_ckpt import knobs
from nebula_ckpt._version import __version__ as __version__
from nebula_ckpt.checkpointer import Checkpointer
from nebula_ckpt.errors import (
    ConsistencyError,
    CorruptCheckpointError,
    FencedError,
    NebulaError,
    NotFoundError,
    PersistError,
    PickleNotAllowedError,
    ValidationError,
)
from nebula_ckpt.handle import SaveHandle, SaveMetrics
from nebula_ckpt.loop import LoopState

# documented beside Checkpointer's ``coordinator=`` argument (a coordinator on a subgroup): reachable
# as ``nc.DistCoordinator``, though it belongs to the seam for integration authors (nebula_ckpt.adapters)
from nebula_ckpt.ranks.distributed import DistCoordinator as DistCoordinator
from nebula_ckpt.tiers import LocalTier, MemoryTier, RemoteTier, Tier

# what users call; what adapters of frameworks need beyond it is in nebula_ckpt.adapters
__all__ = [
    "Checkpointer", "SaveHandle", "SaveMetrics", "MemoryTier", "LocalTier", "RemoteTier", "Tier",
    "save_async", "load_latest", "close_all", "LoopState",
    "NebulaError", "ValidationError", "PersistError", "ConsistencyError", "CorruptCheckpointError",
    "FencedError", "NotFoundError", "PickleNotAllowedError",
]

# No NullHandler on purpose: without a logging configuration, Python's last-resort handler prints
# this library's warnings and errors to stderr, so a dropped or failed save is never silent.
_level = knobs.get("log_level")
if _level:
    logging.getLogger(__name__).setLevel(_level.upper())

_registry: dict[str, Checkpointer] = {}
_registry_lock = threading.Lock()


def _shared(root: str, **kwargs: Any) -> Checkpointer:
    with _registry_lock:
        ck = _registry.get(root)
        if ck is None or ck.closed:
            ck = Checkpointer(root, **kwargs)
            _registry[root] = ck
        return ck


def save_async(root: str, step: int, state: Any, *, tag: Optional[str] = None, **kwargs: Any) -> SaveHandle:
    """One-liner: ``save_async`` on a per-root :class:`Checkpointer` shared by the process.

    The first call for a ``root`` creates it with ``kwargs``; it is closed at exit (or by
    :func:`close_all`). ``tag``: see :meth:`Checkpointer.save_async`.

    Example::

        nc.save_async("/ckpt/run", step, {"model": model, "optim": opt})
    """
    return _shared(root, **kwargs).save_async(step, state, tag=tag)


def load_latest(root: str, into: Any = None, **kwargs: Any) -> Optional[int]:
    """One-liner: restore the newest healthy checkpoint under ``root`` into ``into``; return its step.

    Example::

        step = nc.load_latest("/ckpt/run", into={"model": model, "optim": opt}) or 0
    """
    load_kw = {k: kwargs.pop(k) for k in ("map_location", "strict", "on_damaged", "must_exist") if k in kwargs}
    return _shared(root, **kwargs).load_latest(into, **load_kw)


def close_all() -> None:
    """Close every checkpointer created by the one-liners (waits for pending saves)."""
    with _registry_lock:
        cks = list(_registry.values())
        _registry.clear()
    for ck in cks:
        ck.close()


atexit.register(close_all)
