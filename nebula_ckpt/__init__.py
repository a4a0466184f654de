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
import os
import threading
from typing import Any, Optional

from nebula_ckpt import knobs
from nebula_ckpt._version import __version__ as __version__
from nebula_ckpt.checkpointer import Checkpointer, close_at_exit
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
from nebula_ckpt.tiers import LocalTier, MemoryTier, RemoteTier, Tier, canonical_root, strip_credentials

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

#: the one-liners' Checkpointers, one per root (its canonical identity: ``run``, ``./run`` and the
#: absolute path are one root, which two Checkpointers would fence each other on), with their options
_registry: dict[Any, tuple[Checkpointer, dict[str, Any]]] = {}
_registry_lock = threading.Lock()
_warned: set[tuple[Any, tuple[str, ...]]] = set()
log = logging.getLogger(__name__)


def _shared(root: Any, **kwargs: Any) -> Checkpointer:
    if isinstance(root, os.PathLike):
        root = os.fspath(root)
    key = canonical_root(root) if isinstance(root, str) and root else root
    with _registry_lock:
        ck, made_with = _registry.get(key, (None, {}))
        if ck is None or ck.closed:
            ck, made_with = Checkpointer(root, **kwargs), kwargs
            _registry[key] = (ck, kwargs)
        else:
            differ = sorted(k for k in kwargs if k not in made_with or made_with[k] is not kwargs[k]
                            and made_with[k] != kwargs[k])
            if differ and (key, tuple(differ)) not in _warned:  # names only: values may hold credentials
                _warned.add((key, tuple(differ)))
                log.warning("nebula_ckpt: the one-liners' Checkpointer of %s was made by an earlier call with other "
                            "settings; this call's %s are ignored (make your own nc.Checkpointer(root, ...) for "
                            "other settings)", strip_credentials(str(key)), ", ".join(differ))
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


def _take_all() -> list[Checkpointer]:
    with _registry_lock:
        cks = [ck for ck, _ in _registry.values()]
        _registry.clear()
    return cks


def close_all() -> None:
    """Close every checkpointer created by the one-liners (waits for pending saves)."""
    for ck in _take_all():
        ck.close()


def _close_all_at_exit() -> None:
    # like any Checkpointer left open: NEBULA_EXIT_TIMEOUT_S bounds each, a failure is logged (without
    # the warning of a forgotten close(): the one-liners' Checkpointers are closed at exit by design)
    close_at_exit(_take_all())


atexit.register(_close_all_at_exit)
