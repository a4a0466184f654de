"""Internal: waits that a Ctrl-C can interrupt anywhere without leaving a lock held: :class:`Latch` and :class:`Wakeup`.

CPython raises ``KeyboardInterrupt`` (or whatever a signal handler raises) in the main thread at
any point where it runs signal handlers, which includes the moment right after a lock's
``acquire()`` returned inside ``threading.Condition.__enter__`` (a Python function): the lock then
stays held for good. ``threading.Event.wait`` and ``.set`` both go through that condition, so a
Ctrl-C in ``Checkpointer.wait()`` could leave a save's event locked, the tier writer that finishes
the save blocked in ``set()`` forever, and the exit hook's ``close()`` hung behind it.

The waits the training thread does here take no lock shared with another thread: a
:class:`Latch` waiter blocks on a private lock of its own that :meth:`Latch.set` releases. An
interrupted wait leaves at most a stale private lock behind (released by ``set()`` later,
harmless); an interrupted ``set()`` delays the waiters it had not woken yet by one :data:`SLICE_S`
(every waiter re-checks the flag that often). A worker thread that sleeps until there is work
sleeps on a :class:`Wakeup`, which the training thread may ring: a ring is one C call.
"""

from __future__ import annotations

import threading
from time import monotonic
from typing import Optional

#: the longest a waiter blocks before it checks the flag again (bounds what an interrupted set() costs)
SLICE_S = 0.05


class Latch:
    """A flag (``threading.Event``'s ``set`` / ``clear`` / ``wait``) whose methods a signal handler's
    exception can interrupt at any point without leaving anything locked."""

    __slots__ = ("_flag", "_waiters")

    def __init__(self, flag: bool = False) -> None:
        self._flag = flag
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


class Wakeup:
    """A wake-up call for one thread that sleeps until there is work: :meth:`ring` (any thread) wakes
    its current or next :meth:`sleep`; rings while it is awake count as one.

    A binary semaphore on one lock, held while no ring is pending: ``ring()`` releases it (one C
    call, so a Ctrl-C lands before it, no ring, or after it, rung: never half way, and never with
    a lock left held), ``sleep()`` takes it, with no timeout: an idle sleeper never wakes for nothing.
    """

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def ring(self) -> None:
        """Wake the sleeper (now, or when it next sleeps)."""
        try:
            self._lock.release()
        except RuntimeError:  # not held: a ring is pending already
            pass

    def sleep(self) -> None:
        """Block until rung (at once when a ring is pending); only the sleeping thread calls it."""
        self._lock.acquire()
