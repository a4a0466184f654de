"""The interface every system the benchmark compares implements (:class:`Peer`), and its helpers.

The systems themselves are in :mod:`benchmarks.peers`.

Call order (on the training thread, except ``wait_durable``, which the runner calls from a
waiter thread while training goes on, to timestamp when the save became durable)::

    peer.open(root)                     # once, untimed
    peer.save(step, state_fn)           # timed: returns when training may continue
    peer.wait_safe()                    # timed as a stall: before the next optimizer.step()
    peer.wait_durable()                 # returns once the checkpoint is on disk and fsynced
    peer.prune()                        # untimed: drop all but the newest checkpoint
    peer.restore(into)                  # timed: load the newest checkpoint in place
    peer.close()

``state_fn()`` returns the live state ``{"model": nn.Module, "optim": Optimizer, "step": int}``;
peers that need plain state dicts call :func:`plain_state_dict` inside ``save`` so the cost of
``state_dict()`` is counted for everyone.

"Durable" means the same thing for every system: the data files and the directory entries that
name them have been fsynced. Where a library does not fsync by itself, the benchmark does it in
``save`` (blocking systems) or ``wait_durable`` (async systems) and says so in ``durability``;
that time is counted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

log = logging.getLogger(__name__)

StateFn = Callable[[], dict[str, Any]]



@contextlib.contextmanager
def quiet_dcp() -> Iterator[None]:
    # DCP warns on every call without a process group that it assumes a single process - which
    # is exactly what no_dist=True asks for.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class PeerUnavailable(RuntimeError):
    """The system cannot run here; the message says why (recorded in the results)."""


# --------------------------------------------------------------------------- helpers

def fsync_path(path: str | os.PathLike) -> None:
    """fsync one file or directory by path."""
    flags = os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike[str]) -> None:
    """fsync every file under ``root``, then every directory bottom-up, then ``root``'s parent."""
    for dirpath, _dirs, files in os.walk(root, topdown=False):
        for f in files:
            fsync_path(os.path.join(dirpath, f))
        fsync_path(dirpath)
    fsync_path(os.path.dirname(os.path.abspath(root)))


def list_files(root: str | os.PathLike) -> list[Path]:
    """Every regular file under ``root`` (or ``[root]`` for a file)."""
    root = Path(root)
    if root.is_file():
        return [root]
    return [Path(d) / f for d, _, fs in os.walk(root) for f in fs]


def plain_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    """``{"model": module, "optim": opt, "step": n}`` -> plain ``state_dict()`` values (any other
    entry with ``state_dict()`` becomes its state dict; the rest, a flat dict of tensors too, is
    passed as it is)."""
    return {k: v.state_dict() if callable(getattr(v, "state_dict", None)) and not isinstance(v, type) else v
            for k, v in state.items()}


def load_plain(into: dict[str, Any], sd: dict[str, Any]) -> int:
    """Load a plain state dict into the live ``into`` objects; return the step."""
    into["model"].load_state_dict(sd["model"])
    into["optim"].load_state_dict(sd["optim"])
    return int(sd["step"])


def remove_path(path: Path) -> None:
    """Remove a file or a folder tree (gone already: nothing to do)."""
    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


# --------------------------------------------------------------------------- base

class Peer:
    """One checkpointing system. Subclasses set ``name``, ``calls`` and ``durability``."""

    name = "peer"
    #: how the library is called (goes into the report)
    calls = ""
    #: how durability (fsync) is reached and who does it
    durability = ""
    #: True where save() returns before the snapshot is complete (wait_safe() may block)
    overlaps_snapshot = False
    #: True where save() itself makes the checkpoint durable (nothing runs in the background)
    blocking = False

    def __init__(self) -> None:
        self.root: Optional[Path] = None
        self._latest: Optional[Path] = None
        self._older: list[Path] = []

    def check(self, target: str) -> None:
        """Raise :class:`PeerUnavailable` if this system cannot run against ``target``."""
        if "://" in target and not target.startswith("file://"):
            raise PeerUnavailable(f"{self.name} writes local files only; target {target} is a URL")

    def open(self, root: Path) -> None:
        """Prepare to write under ``root`` (a fresh, empty directory)."""
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def save(self, step: int, state_fn: StateFn) -> None:
        """Start (or do) a checkpoint of ``state_fn()``; return when training may continue."""
        raise NotImplementedError

    def wait_safe(self) -> None:
        """Block until the state may be modified again (no-op when ``save`` already copied it)."""

    def wait_durable(self) -> None:
        """Block until the last checkpoint is durable (fsynced); raise its error if it failed."""

    def restore(self, into: dict[str, Any]) -> int:
        """Load the newest checkpoint into the live objects of ``into``; return its step."""
        raise NotImplementedError

    def files(self) -> list[Path]:
        """Files of the newest checkpoint (sizes, page-cache eviction)."""
        return list_files(self._latest) if self._latest else []

    def prune(self) -> None:
        """Delete every checkpoint but the newest (not timed)."""
        for p in self._older:
            remove_path(p)
        self._older.clear()

    def stats(self) -> dict[str, Any]:
        """Library-specific statistics (empty by default)."""
        return {}

    def reset_counters(self) -> None:
        """Start counting saves the system dropped or skipped (see :meth:`counters`)."""

    def counters(self) -> dict[str, Any]:
        """Saves since :meth:`reset_counters` that were not persisted everywhere (empty if n/a)."""
        return {}

    def close(self) -> None:
        """Release threads and buffers."""

    def _new_path(self, step: int, suffix: str = "") -> Path:
        assert self.root is not None, "open() was not called"
        if self._latest is not None:
            self._older.append(self._latest)
        self._latest = self.root / f"step_{step:08d}{suffix}"
        return self._latest
