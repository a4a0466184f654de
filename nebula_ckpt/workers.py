"""Internal: a small thread pool that keeps working while the interpreter exits.

``concurrent.futures.ThreadPoolExecutor`` refuses every ``submit`` once interpreter shutdown has
begun (its own exit hook runs before ``atexit`` handlers), so a save accepted just before a
program ends, and written by ``Checkpointer``'s exit hook, would fail in whatever stage first used
a pool (hashing the staged bytes, comparing with the base, uploading parts). :class:`Workers` is the
subset of that API the library uses (``submit``, ``map``, ``shutdown``, a context manager), with
daemon threads started on demand, so it serves the exit hook like any other caller.

The asyncio loop of fsspec's async filesystems (s3fs, adlfs) resolves host names and reads
credentials on its *default executor*, a ``ThreadPoolExecutor`` with the same refusal: an upload
at exit would fail on its first new connection. :func:`serve_loop` gives such a loop a
:class:`Workers` instead (a ``ThreadPoolExecutor`` subclass for that reason only: asyncio accepts
no other type; none of the base class's machinery is used).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator, Optional, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

_STOP = None


class Workers(ThreadPoolExecutor):
    """A pool of up to ``max_workers`` daemon threads running submitted calls in order of submission.

    Args:
        max_workers: the most threads; one is started per submission until there are this many.
        thread_name_prefix: the threads' names are this plus ``-<n>``.
        initializer: called once in each thread before its first task (e.g. to lower its priority).
    """

    def __init__(self, max_workers: int, thread_name_prefix: str = "nebula-worker",  # noqa: D107
                 initializer: Optional[Callable[[], None]] = None) -> None:
        # the base class's __init__ is not called: none of its state is used
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._max = max_workers
        self._prefix = thread_name_prefix
        self._init = initializer
        self._tasks: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pool_threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> "Future[T]":
        """Run ``fn(*args, **kwargs)`` on a pool thread; its result or exception lands on the returned future."""
        fut: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("submit() after shutdown()")
            self._tasks.put((fut, fn, args, kwargs))
            if len(self._pool_threads) < self._max:
                t = threading.Thread(target=self._run, name=f"{self._prefix}-{len(self._pool_threads)}", daemon=True)
                self._pool_threads.append(t)
                t.start()
        return fut

    def map(self, fn: Callable[..., T], *iterables: Iterable[Any], timeout: Optional[float] = None,
            chunksize: int = 1) -> Iterator[T]:
        """``fn`` over ``zip(*iterables)`` in parallel; the results in order (the first exception is
        raised; ``timeout`` and ``chunksize`` are accepted for compatibility and not used)."""
        futures = [self.submit(fn, *args) for args in zip(*iterables, strict=False)]

        def results() -> Iterator[T]:
            for f in futures:
                yield f.result()
        return results()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop accepting work; ``cancel_futures``: drop what has not started; ``wait``: join the threads."""
        with self._lock:
            self._closed = True
            threads = list(self._pool_threads)
        if cancel_futures:
            while True:
                try:
                    item = self._tasks.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP:
                    item[0].cancel()
        for _ in threads:
            self._tasks.put(_STOP)
        if wait:
            for t in threads:
                if t is not threading.current_thread():
                    t.join()

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc: Any) -> Optional[bool]:
        self.shutdown(wait=True)
        return None

    def _run(self) -> None:
        if self._init is not None:
            try:
                self._init()
            except Exception as e:  # a failed nicety (priority) must not lose the thread's tasks
                log.debug("nebula_ckpt: %s initializer failed: %s", threading.current_thread().name, e)
        while True:
            item = self._tasks.get()
            if item is _STOP:
                return
            fut, fn, args, kwargs = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:
                fut.set_exception(e)


_served: "weakref.WeakSet[asyncio.AbstractEventLoop]" = weakref.WeakSet()
_served_lock = threading.Lock()


def serve_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Give ``loop`` (e.g. fsspec's I/O loop) a :class:`Workers` as its default executor, once.

    Its blocking helpers (name resolution, credential reads) then keep working while the
    interpreter exits. Set from the loop's own thread, before any call queued after this one.
    """
    with _served_lock:
        if loop in _served:
            return
        _served.add(loop)
    ex = Workers(min(32, (os.cpu_count() or 1) + 4), thread_name_prefix="nebula-io-executor")
    loop.call_soon_threadsafe(loop.set_default_executor, ex)
