"""Internal: the close of a Checkpointer, one at a time, and what a close that stopped short leaves
to the next close and to the exit hook.

Closes of one Checkpointer can overlap: another thread's (a preemption watcher, a framework's
teardown), a signal handler's on the very thread inside ``close()``, the exit hook's. One of them
runs the close: it waits for the accepted saves, then stops the threads and releases the tiers. A
close from another thread waits until that one is over (within its own timeout) and takes over
when it stopped short (timed out, interrupted). A close from a signal handler on the thread
running it waits for the accepted saves only, taking no lock (the close it interrupted may hold
one), and leaves the rest to that close, which goes on when the handler returns. A Checkpointer
stays known to the exit hook (:func:`finish_at_exit`) until its threads are joined.

Nothing here takes a lock: a signal handler lands anywhere, a Ctrl-C anywhere in a wait.
"""

from __future__ import annotations

import logging
import os
import threading
from time import monotonic
from typing import TYPE_CHECKING, Any, Collection, Optional

from nebula_ckpt.arguments import check_timeout
from nebula_ckpt.latch import Latch
from nebula_ckpt.storage.urls import canonical_root

log = logging.getLogger("nebula_ckpt")

#: what a close() waits for other threads to leave (the Checkpointer's ``Calls.wait_left``)
SAVING = ("save_async", "save", "prepare", "remove")
#: the one key of a Checkpointer's runner slot (``dict.setdefault`` takes it atomically: no lock)
_RUNNER = "runner"
#: the Checkpointers of this process whose close has not finished (strong references: a forgotten
#: one must still be flushed at interpreter exit, see :func:`finish_at_exit`)
_open: "set[Closing]" = set()


def _left(deadline: Optional[float]) -> Optional[float]:
    return None if deadline is None else max(0.0, deadline - monotonic())


def finish_at_exit(only: Optional[Collection["Closing"]], timeout: Optional[float]) -> None:
    """At exit (before Python stops the writer threads): finish the close of ``only`` (the
    one-liners' Checkpointers, closed at exit as documented), else of every Checkpointer of this
    process whose close has not finished, with a warning; each once, ``timeout`` bounding each."""
    for ck in list(_open) if only is None else list(only):
        ck._close_at_exit(timeout, forgotten=only is None)


class Closing:
    """:meth:`close` and what the exit hook finishes (a base class of
    :class:`~nebula_ckpt.checkpointer.Checkpointer`)."""

    if TYPE_CHECKING:  # what the Checkpointer provides
        root: Any
        _saves: Any  # the SavePipeline (a layer above: typed loosely)
        _calls: Any  # its Calls (a layer above)
        _opened: Any
        _pid: int

        def wait(self, timeout: Optional[float] = None) -> None: ...

        def _close_health(self) -> None: ...

    def _open_closing(self) -> None:
        """From now on a close() closes it, and the exit hook finishes a close that has not."""
        self._close_started = self._close_finished = self._exit_tried = False
        #: why the last close stopped short (the exit hook's warning says it)
        self._close_cut: Optional[str] = None
        self._close_runner: dict[str, int] = {}  # the thread running a close, under _RUNNER
        self._close_ended: list[Latch] = []  # a latch per close waiting for the runner to be over
        _open.add(self)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._close_started

    @property
    def _close_unfinished(self) -> bool:
        """Whether a close() was called and has not finished (a later close(), or the exit hook, finishes it)."""
        return self._close_started and not self._close_finished

    def close(self, timeout: Optional[float] = None) -> None:
        """Wait for every pending persist, stop the threads, remove the memory tier.

        The memory tier is removed only when its newest save is committed on a slower tier too;
        otherwise it is kept (and logged) for a restart.

        Called from a signal handler while this thread is inside another method of this
        Checkpointer, it returns at once and closes when that call returns or raises (a warning
        says so; ``Calls``); inside ``close()`` itself, it waits for the accepted saves and the
        interrupted close does the rest. Called while another thread is inside ``save_async``,
        ``save``, ``prepare`` or ``remove``, it waits for that call first: the save it makes is
        written. Called while another thread's ``close()`` runs, it waits for that close to be over.

        Raises:
            PersistError: a failure not yet seen through a handle.
            TimeoutError: saves pending after ``timeout`` s; they go on, a later ``close()`` waits again.
        """
        check_timeout(timeout)
        if self._close_finished or self._pid != os.getpid():
            return  # closed, or a fork's child's copy: the parent closes it
        self._close_started = True
        me = threading.get_ident()
        if self._close_runner.get(_RUNNER) == me:  # a signal handler on the thread inside close()
            self._close_nested(timeout)
            return
        inside = self._calls.defer(self.close)  # a signal handler interrupted a call of this thread
        if inside is not None:
            log.warning("nebula_ckpt: close() of %s called inside %s() (from a signal handler): it finishes "
                        "when that call returns (or raises)", canonical_root(self.root), inside)
            self._close_cut = f"it was deferred behind {inside}()"
            return
        deadline = None if timeout is None else monotonic() + timeout
        try:
            while self._close_runner.setdefault(_RUNNER, me) != me:
                if not self._wait_close_over(deadline):
                    raise TimeoutError(f"close(): the close() another thread is making not done after {timeout} s "
                                       "(the saves go on; a later close() waits again)")
            if not self._close_finished:
                self._close_now(deadline, timeout)
        finally:
            if self._close_runner.get(_RUNNER) == me:
                self._close_runner.pop(_RUNNER, None)
                for over in tuple(self._close_ended):  # a close of another thread waits for it
                    over.set()

    def _wait_close_over(self, deadline: Optional[float]) -> bool:
        """Block until the close another thread runs is over (finished or stopped short); False at ``deadline``."""
        over = Latch()
        self._close_ended.append(over)
        try:
            return _RUNNER not in self._close_runner or over.wait(_left(deadline))
        finally:
            self._close_ended.remove(over)

    def _close_now(self, deadline: Optional[float], timeout: Optional[float]) -> None:
        """The close this thread runs: the saves (others' too), then the threads and the tiers."""
        try:
            if not self._calls.wait_left(SAVING, _left(deadline)):
                raise TimeoutError(f"close(): a save that another thread is making not done after {timeout} s")
            self.wait(_left(deadline))
        except TimeoutError:  # the saves go on
            self._close_cut = "it timed out"
            raise
        except KeyboardInterrupt:
            # Joining the threads now would wait for the saves without a bound, past the Ctrl-C:
            # they go on, and the exit hook finishes this close within NEBULA_EXIT_TIMEOUT_S.
            self._close_cut = "it was interrupted"
            raise
        except BaseException:  # a failure not seen yet: raised once the threads are stopped
            self._shutdown()
            raise
        self._shutdown()

    def _shutdown(self) -> None:
        """Stop hooks and threads, free staging, let each tier close (the memory tier frees its RAM
        when its newest step is safe elsewhere), release the tiers. Until the threads are joined
        (every accepted save written), the exit hook still knows this Checkpointer."""
        try:
            self._saves.shutdown(join=True)
        except BaseException as e:
            self._close_cut = f"it failed: {type(e).__name__}: {e}" if isinstance(e, Exception) else \
                "it was interrupted"
            raise
        self._close_finished = True
        _open.discard(self)
        self._close_health()
        self._opened.release()

    def _close_nested(self, timeout: Optional[float]) -> None:
        """A close() from a signal handler on the thread running a close: wait for the accepted saves
        on their latches (the writer threads finish them; nothing this thread may hold is taken),
        and leave the rest to the interrupted close, which goes on when the handler returns."""
        shown = canonical_root(self.root)
        if any(not s.confirmed for s in tuple(self._saves.inflight)):
            # an overlapped copy is confirmed by this thread, in the interrupted close: waiting here could hang
            log.warning("nebula_ckpt: close() of %s called inside close() (from a signal handler) before that close "
                        "confirmed its saves' copies: it finishes when the handler returns", shown)
            return
        log.info("nebula_ckpt: close() of %s called inside close() (from a signal handler): it waits for the "
                 "accepted saves; the interrupted close() stops the threads when the handler returns", shown)
        deadline = None if timeout is None else monotonic() + timeout
        for h in tuple(self._saves.handles):
            if not h.wait(_left(deadline)):
                raise TimeoutError(f"close(): save of step {h.step} not durable after {timeout} s")

    def _close_at_exit(self, timeout: Optional[float], forgotten: bool) -> None:
        """The exit hook's close of this Checkpointer (once); a failure is logged (nobody can catch it)."""
        if self._close_finished or self._exit_tried or self._pid != os.getpid():
            return  # closed, given its time at exit already, or a fork's child's copy (no threads here)
        self._exit_tried = True
        shown, pending = canonical_root(self.root), self._saves.count
        if self._close_started:
            log.warning("nebula_ckpt: Checkpointer(%s): an earlier close() did not finish (%s); finishing it at exit: "
                        "its pending saves are being written now", shown,
                        self._close_cut or "it is still running on another thread")
        elif forgotten:
            log.warning("nebula_ckpt: Checkpointer(%s) was not closed; closing it at exit%s (call close() or use it as "
                        "a context manager)", shown, " so its pending saves are written" if pending else "")
        try:
            self.close(timeout=timeout)
        except BaseException as e:  # at exit nobody can catch it: log it loudly instead
            log.error("nebula_ckpt: closing Checkpointer(%s) at exit failed after %d save(s): %s: %s",
                      shown, pending, type(e).__name__, e)
