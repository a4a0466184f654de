"""Waits that a Ctrl-C can interrupt anywhere without leaving a lock held: :class:`Latch` and :func:`poll_until`.

CPython raises ``KeyboardInterrupt`` (or whatever a signal handler raises) in the main thread at
any point where it runs signal handlers, which includes the moment right after a lock's
``acquire()`` returned inside ``threading.Condition.__enter__`` (a Python function): the lock then
stays held for good. ``threading.Event.wait`` and ``.set`` both go through that condition, so a
Ctrl-C in ``Checkpointer.wait()`` could leave a save's event locked, the tier writer that finishes
the save blocked in ``set()`` forever, and the exit hook's ``close()`` hung behind it.

The waits the training thread does here take no lock shared with another thread: a
:class:`Latch` waiter blocks on a private lock of its own that :meth:`Latch.set` releases, and
:func:`poll_until` only reads. An interrupted wait leaves at most a stale private lock behind
(released by ``set()`` later, harmless); an interrupted ``set()`` delays the waiters it had not
woken yet by one :data:`SLICE_S` (every waiter re-checks the flag that often).
"""

from __future__ import annotations

import threading
from time import monotonic, sleep
from typing import Callable, Optional

#: the longest a waiter blocks before it checks the flag again (bounds what an interrupted set() costs)
SLICE_S = 0.05


class Latch:
    """A flag (``threading.Event``'s ``set`` / ``clear`` / ``wait``) whose methods a signal handler's
    exception can interrupt at any point without leaving anything locked."""

    __slots__ = ("_flag", "_waiters")

    def __init__(self) -> None:
        self._flag = False
        self._waiters: list[threading.Lock] = []

    def is_set(self) -> bool:
        """Whether :meth:`set` was called."""
        return self._flag

    def set(self) -> None:
        """Set the flag and wake every waiter."""
        self._flag = True
        waiters = self._waiters
        while waiters:
            try:
                w = waiters.pop()
            except IndexError:  # another thread's set() took the last one
                return
            try:
                w.release()
            except RuntimeError:  # not held: a waiter that was interrupted before it blocked
                pass

    def clear(self) -> None:
        """Unset the flag (waiters go on waiting)."""
        self._flag = False

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until the flag is set (True, also when it was cleared again since) or ``timeout``
        seconds passed (False)."""
        if self._flag:
            return True
        deadline = None if timeout is None else monotonic() + timeout
        mine = threading.Lock()
        mine.acquire()
        self._waiters.append(mine)  # set() releases it; the flag is set before that
        try:
            while not self._flag:
                left = SLICE_S if deadline is None else min(SLICE_S, deadline - monotonic())
                if left <= 0:
                    return False
                if mine.acquire(timeout=left):  # set() released it
                    return True
            return True
        finally:
            try:
                self._waiters.remove(mine)
            except ValueError:  # set() took it already
                pass


def poll_until(ready: Callable[[], bool], timeout: Optional[float] = None) -> bool:
    """Wait until ``ready()`` (which must only read state, taking no lock) is true, checking it at
    growing intervals up to 10 ms; False when ``timeout`` seconds passed first."""
    deadline = None if timeout is None else monotonic() + timeout
    pause = 0.0005
    while not ready():
        left = pause if deadline is None else min(pause, deadline - monotonic())
        if left <= 0:
            return False
        sleep(left)
        pause = min(pause * 2, 0.01)
    return True
