"""Child processes of the tests: their output line by line with a deadline (crash and compat tests),
their last line as JSON (:func:`json_child`)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from typing import Any, Iterator, Sequence

import warm_python


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


def json_child(cmd: Sequence[str], env: dict[str, str], what: str, timeout: float = 120) -> dict[str, Any]:
    """Run ``cmd``; its last line of output as JSON, with its stderr under ``"log"``. A child still
    running after ``timeout`` (a save that waits for ever) fails the test (``what`` says which)
    instead of hanging it; one that exits non-zero fails it with its stderr."""
    try:
        r = warm_python.run(list(cmd), capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{what}: never ended: {str(e.stderr)[-3000:]}") from e
    assert r.returncode == 0, r.stderr[-3000:]
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    out["log"] = r.stderr
    return out
