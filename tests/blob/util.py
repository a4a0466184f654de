"""Helpers shared by the blob test modules."""

from __future__ import annotations

import logging
import traceback
from contextlib import contextmanager
from typing import Iterator


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
