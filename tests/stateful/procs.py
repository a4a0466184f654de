"""Warm worker processes (:mod:`stateful.worker`) driven over a pipe, and a pool that keeps spares.

Starting Python and importing torch costs 1-2 s; a command over a pipe costs milliseconds. The
pool keeps ``spares`` processes started ahead (their imports overlap the driver's work), hands
one out per new part (a fresh job, a fresh tool) and starts the next. A process is never reused
after its part ends: a fresh job is a fresh process, as after a real restart.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import warm_python

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

#: seconds one command may take before the process counts as hung (a busy 2-core machine is slow)
COMMAND_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Hung(AssertionError):
    """A worker did not answer a command in time (a deadlock or a lost wake-up in the library)."""


class Proc:
    """One worker process. ``call`` returns its answer, or None when the process died (SIGKILL)."""

    def __init__(self, logdir: Path, n: int, env: dict[str, str]) -> None:
        self.log_path = logdir / f"worker-{n}.log"
        self._log = open(self.log_path, "w")
        self.p = warm_python.popen([sys.executable, "-u", str(HERE / "worker.py")], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=self._log, text=True, env=env, cwd=str(REPO))
        self.n = n
        self._buf = ""

    @property
    def alive(self) -> bool:
        return self.p.poll() is None

    def call(self, cmd: dict[str, Any], timeout: float = COMMAND_TIMEOUT_S) -> Optional[dict[str, Any]]:
        return self.recv(cmd, timeout) if self.send(cmd) else None

    def send(self, cmd: dict[str, Any]) -> bool:
        """Hand ``cmd`` over (False: the process is gone); :meth:`recv` reads the answer."""
        assert self.p.stdin is not None
        try:
            self.p.stdin.write(json.dumps(cmd) + "\n")
            self.p.stdin.flush()
        except (BrokenPipeError, OSError):
            self.p.wait(30)
            return False
        return True

    def recv(self, cmd: dict[str, Any], timeout: float = COMMAND_TIMEOUT_S) -> Optional[dict[str, Any]]:
        assert self.p.stdout is not None
        fd = self.p.stdout.fileno()
        deadline = time.monotonic() + timeout
        while "\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise Hung(f"worker {self.n} gave no answer to {cmd['op']} in {timeout:.0f} s "
                           f"(log: {self.log_path}):\n{self.tail()}")
            ready, _, _ = select.select([fd], [], [], min(left, 5.0))
            if not ready:
                continue
            chunk = os.read(fd, 1 << 20).decode()
            if not chunk:  # the process ended (killed at an injected point, or it crashed)
                self.p.wait(30)
                return None
            self._buf += chunk
        line, self._buf = self._buf.split("\n", 1)
        got = json.loads(line)
        if "crash" in got:
            raise AssertionError(f"worker {self.n}: {cmd['op']} raised {got['crash']}\n{got.get('trace', '')}")
        return got

    def ready(self, timeout: float) -> bool:
        """Whether an answer (or the process's end) is there to :meth:`recv` within ``timeout`` s."""
        assert self.p.stdout is not None
        deadline = time.monotonic() + timeout
        while "\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready, _, _ = select.select([self.p.stdout.fileno()], [], [], min(left, 1.0))
            if ready and not self._read_some():
                return True
        return True

    def _read_some(self) -> bool:
        """Read what the process wrote (it is readable); False when it ended."""
        assert self.p.stdout is not None
        chunk = os.read(self.p.stdout.fileno(), 1 << 20).decode()
        if not chunk:
            self.p.wait(30)
            return False
        self._buf += chunk
        return True

    def _answer(self, cmd: dict[str, Any]) -> Optional[dict[str, Any]]:
        if "\n" not in self._buf:
            return None
        line, self._buf = self._buf.split("\n", 1)
        got = json.loads(line)
        if "crash" in got:
            raise AssertionError(f"worker {self.n}: {cmd['op']} raised {got['crash']}\n{got.get('trace', '')}")
        return got

    def kill(self) -> None:
        if self.alive:
            self.p.send_signal(signal.SIGKILL)
        self.p.wait(30)

    def end(self) -> None:
        """Stop a process whose part is over (closing its stdin ends the command loop)."""
        if self.alive:
            try:
                assert self.p.stdin is not None
                self.p.stdin.close()
                self.p.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        self._log.close()

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text()[-n:]
        except OSError:
            return ""


class Pool:
    """Spare warm workers. ``take()`` hands one out and starts the next."""

    def __init__(self, logdir: Path, spares: int = 1, env: Optional[dict[str, str]] = None) -> None:
        self.logdir, self.spares = logdir, spares
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), str(REPO),
                                                                os.environ.get("PYTHONPATH", "")]),
                        OMP_NUM_THREADS="1", **(env or {}))
        self._n = 0
        self._ready: list[Proc] = []
        self.fill()

    def fill(self) -> None:
        while len(self._ready) < self.spares:
            self._n += 1
            self._ready.append(Proc(self.logdir, self._n, self.env))

    def take(self) -> Proc:
        if not self._ready:
            self.fill()
        p = self._ready.pop(0)
        self.fill()
        return p

    def close(self) -> None:
        for p in self._ready:
            p.end()
        self._ready.clear()


def everyone(procs: list[Proc], cmds: list[dict[str, Any]],
             timeout: float = COMMAND_TIMEOUT_S) -> list[Optional[dict[str, Any]]]:
    """Each process's command at once (the ranks of a job: collectives), then every answer. When
    one process dies (killed at a point) the others are killed at once: their job is over, and
    waiting for their collectives to time out would only cost time. None for each that died."""
    sent = [p.send(c) for p, c in zip(procs, cmds, strict=True)]
    out: list[Optional[dict[str, Any]]] = [None] * len(procs)
    pending = {i for i, ok in enumerate(sent) if ok}
    if len(pending) < len(procs):
        for i in pending:
            procs[i].kill()
        return out
    deadline = time.monotonic() + timeout
    while pending:
        for i in list(pending):
            got = procs[i]._answer(cmds[i])
            if got is not None:
                out[i] = got
                pending.discard(i)
        if not pending:
            break
        left = deadline - time.monotonic()
        if left <= 0:
            for i in pending:
                procs[i].kill()
            raise Hung(f"workers {[procs[i].n for i in pending]} gave no answer to {cmds[0]['op']} in {timeout:.0f} s")
        fds = {procs[i].p.stdout.fileno(): i for i in pending}  # type: ignore[union-attr]
        ready, _, _ = select.select(list(fds), [], [], min(left, 5.0))
        for fd in ready:
            i = fds[fd]
            if not procs[i]._read_some():  # died: the job is over
                for j in range(len(procs)):
                    procs[j].kill()
                return [out[j] if j not in pending else None for j in range(len(procs))]
    return out
