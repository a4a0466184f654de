"""Helpers shared by the blob test modules."""

from __future__ import annotations

import logging
import threading
import time
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional


@contextmanager
def backoff(first_s: float, most_s: Optional[float] = None) -> Iterator[None]:
    """Within the block, a remote tier's retries wait ``first_s`` first (doubling up to ``most_s``,
    if given): the constants of :mod:`nebula_ckpt.storage.remote.retry`, set back after."""
    from nebula_ckpt.storage.remote import retry

    saved = retry.REMOTE_BACKOFF_S, retry.REMOTE_BACKOFF_MAX_S
    retry.REMOTE_BACKOFF_S = first_s
    if most_s is not None:
        retry.REMOTE_BACKOFF_MAX_S = most_s
    try:
        yield
    finally:
        retry.REMOTE_BACKOFF_S, retry.REMOTE_BACKOFF_MAX_S = saved


@contextmanager
def captured_logs() -> Iterator[list[str]]:
    """Formatted records (with tracebacks) of the nebula_ckpt loggers."""
    lines: list[str] = []

    class H(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(logging.Formatter("%(name)s %(levelname)s %(message)s").format(record))

    lg = logging.getLogger("nebula_ckpt")
    h = H(level=logging.DEBUG)
    old = lg.level
    lg.addHandler(h)
    lg.setLevel(logging.DEBUG)
    try:
        yield lines
    finally:
        lg.removeHandler(h)
        lg.setLevel(old)


def exc_text(exc: BaseException) -> str:
    return "\n".join([str(exc), repr(exc), "".join(traceback.format_exception(exc))])


def outage_after_first_part(st: Any, take_down: Callable[[], None],
                            bring_back: Optional[Callable[[], None]] = None,
                            after_s: float = 0.0) -> threading.Event:
    """Hook ``st``: once part 0 is accepted, another thread calls ``take_down()`` (and, after
    ``after_s`` s, ``bring_back()``). The uploading thread waits until the server is down, so the
    remaining parts meet the outage deterministically. Returns the "down" event."""
    fired, down = threading.Event(), threading.Event()

    def stopper() -> None:
        if not fired.wait(60):
            return
        take_down()
        down.set()
        if bring_back is not None:
            time.sleep(after_s)
            bring_back()

    threading.Thread(target=stopper, daemon=True).start()

    def hook(rel: str, index: int) -> None:
        if not fired.is_set():
            fired.set()
            down.wait(30)

    st.on_part_uploaded = hook
    return down
