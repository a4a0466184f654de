"""Saves an integration started and that are not over yet, for whoever reads the file naming them.

A framework adapter writes the file naming a checkpoint (a pointer) when the save starts, so that
the framework's own bookkeeping (existence checks, globs, links) sees it at once; the checkpoint
commits later, in the background. A read through that file must give that checkpoint, never an
older one and never "not committed":

* **in this process**, whoever reads (another plugin object, ``load_checkpoint``, ``torch.load``
  of the pointer in ``load_from_checkpoint``): the adapter registers each save with
  :func:`started` and the reader waits for it with :func:`wait_for`;
* **in another process on this host**: the pointer names the process writing it
  (:func:`writer_identity`); while :func:`writer_alive` says that process still runs and the step
  is not committed, the reader waits (:func:`wait_committed`). A writer killed between the
  pointer and the commit is gone: the reader then takes the newest committed checkpoint of the
  path, as after any crash. A writer on another host cannot be watched: the reader does not wait.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Optional

from nebula_ckpt import SaveHandle

log = logging.getLogger(__name__)

#: the longest a reader in another process waits for a live writer's save to commit (seconds);
#: then it reads what is committed (a save that failed in a writer that goes on training)
WRITER_WAIT_S = 600.0
#: how often that reader looks again (seconds)
POLL_S = 0.05

_LOCK = threading.Lock()
_SAVES: dict[tuple[str, str], SaveHandle] = {}


def started(root: str, tag: str, handle: SaveHandle) -> None:
    """Register the save ``handle`` of checkpoint ``tag`` under the canonical ``root``."""
    with _LOCK:
        _SAVES[(root, tag)] = handle


def finished(root: str, tag: str, handle: SaveHandle) -> None:
    """Forget ``handle`` (over: durable or failed); a newer save of the tag stays registered."""
    with _LOCK:
        if _SAVES.get((root, tag)) is handle:
            del _SAVES[(root, tag)]


def wait_for(root: str, tag: str) -> bool:
    """Wait until the save of ``tag`` under the canonical ``root`` this process started is over
    (durable, or failed: the reader then finds what did commit); True if there was one."""
    with _LOCK:
        handle = _SAVES.get((root, tag))
    if handle is None:
        return False
    if not handle.done():
        log.debug("nebula_ckpt: waiting for the save of %s (step %d) before reading it", tag, handle.step)
    handle.wait()
    finished(root, tag, handle)
    return True


def _start_ticks(pid: int) -> Optional[int]:
    """When process ``pid`` started (clock ticks since boot), or None when it does not exist (or
    this system has no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return int(f.read().rpartition(")")[2].split()[19])  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return None


def writer_identity() -> dict[str, Any]:
    """What a pointer records of the process writing it: host, pid and the pid's start time (a
    reused pid is another process)."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_ticks(os.getpid())}


def writer_alive(writer: Any) -> bool:
    """Whether the process a pointer names (:func:`writer_identity`) is another process of this
    host that still runs. False for this process (its saves are in :func:`started`), another host,
    or a record that is not one."""
    if not isinstance(writer, dict) or writer.get("host") != socket.gethostname():
        return False
    pid = writer.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or pid == os.getpid():
        return False
    ticks = _start_ticks(pid)
    return ticks is not None and ticks == writer.get("start")


def wait_committed(committed: Callable[[], bool], writer: Any, what: str,
                   limit_s: float = WRITER_WAIT_S) -> bool:
    """Wait while ``committed()`` is false and the ``writer`` process is alive (at most ``limit_s``);
    True once ``committed()`` holds. ``what`` names the checkpoint in the log."""
    if committed():
        return True
    if not writer_alive(writer):
        return False
    log.info("nebula_ckpt: %s is being saved by process %s; waiting for it to commit", what, writer.get("pid"))
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        time.sleep(POLL_S)
        if committed():
            return True
        if not writer_alive(writer):
            return committed()
    log.warning("nebula_ckpt: %s: process %s has not committed it after %.0f s; reading what is committed",
                what, writer.get("pid"), limit_s)
    return False
