"""Reading a child process's output line by line, with a deadline (crash and compat tests)."""

from __future__ import annotations

import os
import select
import subprocess
import time
from typing import Iterator


def lines(proc: subprocess.Popen[str], deadline: float) -> Iterator[str]:
    """The lines ``proc`` writes to its stdout pipe until it closes or ``deadline``
    (``time.monotonic()``) passes; never blocks longer than half a second at a time."""
    assert proc.stdout is not None
    buf, fd = "", proc.stdout.fileno()
    while time.monotonic() < deadline:
        if not select.select([fd], [], [], 0.5)[0]:
            if proc.poll() is not None:
                return
            continue
        chunk = os.read(fd, 65536).decode(errors="replace")
        if not chunk:
            return
        buf += chunk
        while "\n" in buf:
            line, buf = buf.split("\n", 1)
            yield line


def reap(proc: subprocess.Popen[str]) -> None:
    """Kill ``proc`` if it still runs, wait for it and close its stdout pipe (a test's ``finally``)."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)
    if proc.stdout:
        proc.stdout.close()
