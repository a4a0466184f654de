"""Run a short piece of setup so that a Ctrl-C on the calling thread cannot cut it half way.

CPython raises ``KeyboardInterrupt`` (or whatever a signal handler raises, such as a SIGTERM
handler's ``sys.exit()``) in the main thread at any point where it runs signal handlers. Setup
that makes several objects and starts threads (the first save's tier writers and stager) cut
there is left half made, and ``threading.Thread.start()`` itself, cut inside its wait for the new
thread, can leave the stdlib's lock held (the thread then blocks for good before it runs) or turn
the interrupt into a ``RuntimeError``. :func:`run_uncut` runs such setup on a thread of its own,
which no signal handler ever interrupts; the caller only waits for it, on a
:class:`~nebula_ckpt.latch.Latch` (Ctrl-C safe). Interrupted there, the caller gets the exception
and the setup still runs to its end; a later call that needs it finds it done (or waits for it, on
a lock the setup takes).
"""

from __future__ import annotations

import _thread
import threading
from typing import Callable, Generic, Optional, TypeVar

from nebula_ckpt.latch import Latch

T = TypeVar("T")


class _Call(Generic[T]):
    """One call of ``fn`` on a fresh thread: its result or its exception, and a latch set when over."""

    def __init__(self, fn: Callable[[], T], name: str) -> None:
        self._fn, self._name = fn, name
        self.done = Latch()
        self.result: Optional[T] = None
        self.error: Optional[BaseException] = None

    def launch(self) -> None:
        """Body of the launcher (a bare ``_thread``): start the named thread that runs ``fn``."""
        try:
            threading.Thread(target=self.run, name=self._name, daemon=True).start()
        except BaseException as e:  # no thread: the caller gets why
            self.error = e
            self.done.set()

    def run(self) -> None:
        """Body of the named thread."""
        try:
            self.result = self._fn()
        except BaseException as e:  # handed to the caller, raised there
            self.error = e
        finally:
            self.done.set()


def run_uncut(fn: Callable[[], T], name: str) -> T:
    """Run ``fn()`` on a fresh daemon thread named ``name`` and return its result (or raise its
    exception) once it is over.

    The calling thread's part is one C call (``_thread.start_new_thread``: a signal lands before
    it, and ``fn`` does not run, or after it) and a Ctrl-C-safe wait. An interrupt in that wait
    propagates to the caller while ``fn`` runs on to its end: ``fn`` must be idempotent (take a
    lock, and do nothing a finished earlier call already did), as a later call repeats it.
    """
    call: _Call[T] = _Call(fn, name)
    _thread.start_new_thread(call.launch, ())
    call.done.wait()
    if call.error is not None:
        raise call.error
    return call.result  # type: ignore[return-value]

