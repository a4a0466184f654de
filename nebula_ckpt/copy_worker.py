"""Internal: the one thread that runs the pure-PyTorch path's copy jobs (:mod:`nebula_ckpt.native`).

Jobs run in the order they came, on one thread started on demand; a Ctrl-C anywhere on the
caller's side leaves nothing locked, and :meth:`CopyWorker.drain` (run at interpreter exit) waits
for every job queued so far, so no copy is ever cut half way.
"""

from __future__ import annotations

import _thread
import logging
import os
import queue
import threading
from typing import Any

from nebula_ckpt.latch import Latch

log = logging.getLogger("nebula_ckpt.native")


class CopyWorker:
    """The one thread that runs the pure-PyTorch path's copy jobs, in the order they came.

    A job is queued (one C call) before a worker is made sure of; the thread that copies holds
    ``_role`` for its life, so at most one thread ever copies, and one that finds it held ends.

    A Ctrl-C can land anywhere on the caller's side. ``threading.Thread.start()`` waits for the
    new thread on an ``Event``, where a Ctrl-C can leave the stdlib's lock held (the thread then
    blocks for good before it runs, and a non-daemon one hangs the exit) or turn into a
    ``RuntimeError``; so the worker is started by ``_thread.start_new_thread``, one C call that
    waits for nothing: a Ctrl-C lands before it (no thread; the next job starts one) or after it
    (the thread runs). Such a thread is not joined at exit, like a daemon; interpreter exit still
    never tears a copy down half way (that aborts the process): :meth:`drain` runs from an
    ``atexit`` hook and waits for every job queued so far.
    """

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        """Fresh state (also in a fork's child: the parent's worker and locks do not exist there)."""
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._role = threading.Lock()  # held by the thread that copies, for its life
        self._asked = False  # a worker was asked for (drain has something to wait for)

    def submit(self, job: Any) -> None:
        """Queue ``job`` (anything with ``run()``) and make sure a worker runs."""
        self._queue.put(job)
        if not self._role.locked():  # none yet, or one started that has not taken the role yet
            self._asked = True
            _thread.start_new_thread(self._work, ())

    def _work(self) -> None:
        if not self._role.acquire(blocking=False):
            return  # another thread copies
        while True:
            job = self._queue.get()
            try:
                job.run()
            except BaseException:  # a job keeps its own errors: this is a bug, the worker goes on
                log.exception("nebula_ckpt: copy job %r failed outside its own handling", job)
            del job  # an idle worker keeps no job (nor its buffer) alive

    def drain(self) -> None:
        """Block until every job queued so far has finished (no-op when none ever was)."""
        if not self._asked:
            return
        barrier = Barrier()
        self.submit(barrier)
        barrier.done.wait()


class Barrier:
    """A queued no-op: once it ran, the jobs queued before it have finished (one worker, in order)."""

    def __init__(self) -> None:
        self.done = Latch()

    def run(self) -> None:
        self.done.set()
