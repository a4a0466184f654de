"""Closes that overlap, a close cut short twice, and waits where no thread of the Checkpointer runs.

Two ``close()`` calls of one Checkpointer can overlap: a daemon thread's (a preemption watcher) and
the training loop's, or a SIGTERM handler's on the very thread that is inside ``close()``. Whichever
returns, the accepted saves are written by then (or its own timeout raised). Ctrl-C pressed twice
while ``close()`` waits leaves the close to the exit hook, which writes the save and says so. In a
process forked while a save persists, a wait on the parent's Checkpointer or handle raises instead
of blocking for ever. The save is held half written by a tier that pauses at the shard
(tests/faults.py) until the test lets it go: no timing decides what is pending. Real threads,
signals, forks and subprocesses, real files.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import nebula_ckpt as nc
import warm_python
from faults import FaultyTier

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)

#: a child with one save held at its shard write (the tier's gate opens it); ``names()``: the main
#: thread's stack, innermost first
CHILD_HEAD = """
import os, signal, sys, threading, time, torch
sys.path.insert(0, {tests!r})
import nebula_ckpt as nc
from faults import FaultyTier
tier = FaultyTier(sys.argv[1], pause_at="shard")
ck = nc.Checkpointer(sys.argv[1], tiers=[tier])
h = ck.save_async(1, {{"w": torch.arange(100_000, dtype=torch.float32)}})
assert tier.reached.wait(30)
main = threading.main_thread().ident

def names(frame=None):
    f, out = frame or sys._current_frames().get(main), []
    while f is not None:
        out.append(f.f_code.co_name)
        f = f.f_back
    return out

def until(cond):
    while not cond():
        time.sleep(0.002)
""".format(tests=TESTS)

SIGTERM_IN_CLOSE = CHILD_HEAD + """
handling = threading.Event()

def on_term(signum, frame):  # a preemption handler: make the checkpoints durable, then leave at once
    print("LANDED in close:", "close" in names(frame), "pending:", not h.done(), flush=True)
    handling.set()
    ck.close()
    print("DURABLE", h.done(), flush=True)
    os._exit(0)

def driver():
    until(lambda: ck.closed and "close" in names())
    os.kill(os.getpid(), signal.SIGTERM)
    handling.wait(30)
    time.sleep(0.2)  # the handler's close() is waiting by now: the write goes on
    tier.gate.set()

signal.signal(signal.SIGTERM, on_term)
threading.Thread(target=driver, daemon=True).start()
ck.close()  # the end of training: the main thread is inside close() when SIGTERM lands
print("MAIN CLOSE RETURNED", flush=True)
"""

CTRL_C_IN_CLOSE = CHILD_HEAD + """
def presser():  # the user presses Ctrl-C while close() waits
    until(lambda: ck.closed and "close" in names())
    os.kill(os.getpid(), signal.SIGINT)
    at_exit = lambda st: any("close_at_exit" in n for n in st)
    until(lambda: "close" not in names() or at_exit(names()))  # the interrupted close is over
    st = names()
    print("AFTER in the interrupted close:", "close" in st and not at_exit(st), "pending:", not h.done(), flush=True)
    until(lambda: any("close_at_exit" in n for n in names()))  # the exit hook: let the write go on
    tier.gate.set()

threading.Thread(target=presser, daemon=True).start()
ck.close()
"""


def _child(code: str, root: str, shm_dir: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    return warm_python.run([sys.executable, "-c", code, root], capture_output=True, text=True, timeout=120, env=env)


def _committed(root: str) -> list[int]:
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as rd:
        return rd.list()


def _held_save(root: str) -> tuple[FaultyTier, nc.Checkpointer, nc.SaveHandle]:
    """A Checkpointer whose save of step 1 is held at its shard write until ``tier.gate`` is set."""
    tier = FaultyTier(root, pause_at="shard")
    ck = nc.Checkpointer(root, tiers=[tier])
    h = ck.save_async(1, {"w": torch.arange(100_000, dtype=torch.float32)})
    assert tier.reached.wait(30)
    return tier, ck, h


def _other_thread_closing(ck: nc.Checkpointer) -> threading.Thread:
    """A daemon thread (a preemption watcher) inside ``ck.close()``, waiting for the held save."""
    closer = threading.Thread(target=ck.close, daemon=True)
    closer.start()
    deadline = time.monotonic() + 30
    while not ck.closed and time.monotonic() < deadline:
        time.sleep(0.001)
    assert ck.closed and closer.is_alive()
    return closer


def test_a_close_while_another_threads_close_waits_returns_once_the_save_is_written(root: str) -> None:
    tier, ck, h = _held_save(root)
    closer = _other_thread_closing(ck)
    second = threading.Thread(target=ck.close)  # the training loop's own close()
    second.start()
    second.join(0.5)
    assert second.is_alive(), "a second close() returned while the accepted save was still being written"
    tier.gate.set()
    second.join(60)
    closer.join(60)
    assert not second.is_alive() and not closer.is_alive()
    assert h.done() and h.result() == [tier.name]
    assert _committed(root) == [1]


def test_a_close_waiting_for_another_threads_close_honours_its_own_timeout(root: str) -> None:
    tier, ck, h = _held_save(root)
    closer = _other_thread_closing(ck)
    with pytest.raises(TimeoutError, match="close"):
        ck.close(timeout=0.2)
    assert not h.done()
    tier.gate.set()
    ck.close()  # waits for the other thread's close
    assert h.done() and not ck._close_unfinished
    closer.join(60)
    assert _committed(root) == [1]


def test_a_sigterm_handler_closing_inside_close_returns_once_the_save_is_written(root: str, shm_dir: str) -> None:
    """The handler runs ``ck.close(); os._exit(0)`` on the thread inside ``close()``: its close waits for the
    accepted save (and only for it: the interrupted close does the rest), so the save is committed."""
    r = _child(SIGTERM_IN_CLOSE, root, shm_dir)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "LANDED in close: True pending: True" in r.stdout, r.stdout + r.stderr
    assert "DURABLE True" in r.stdout, r.stdout + r.stderr
    assert _committed(root) == [1], r.stderr


def test_ctrl_c_in_close_leaves_the_save_to_the_exit_hook(root: str, shm_dir: str) -> None:
    """A Ctrl-C ends the wait for the saves and close() with it (no join of the threads, which would
    wait for the saves without a bound): the exit hook still knows the Checkpointer, writes the save
    and says so."""
    r = _child(CTRL_C_IN_CLOSE, root, shm_dir)
    assert r.returncode == -signal.SIGINT and "KeyboardInterrupt" in r.stderr, r.stdout + r.stderr
    assert "AFTER in the interrupted close: False pending: True" in r.stdout, r.stdout + r.stderr
    assert _committed(root) == [1], r.stderr
    assert "an earlier close() did not finish (it was interrupted); finishing it at exit" in r.stderr, r.stderr


# -- waits in a forked child ---------------------------------------------------------------------------

def test_waits_in_a_forked_child_raise_instead_of_blocking(root: str) -> None:
    """A child forked while a save persists has none of the threads that finish it: ``wait()``,
    ``handle.result()`` and ``handle.wait()`` there raise a NebulaError naming the fork at once."""
    tier, ck, h = _held_save(root)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what each wait did, then leave without any exit hook
        try:
            os.close(read_end)
            lines = []
            for name, call in (("wait", ck.wait), ("result", h.result), ("handle.wait", h.wait)):
                try:
                    call()
                    lines.append(f"{name}: returned")
                except nc.NebulaError as e:
                    lines.append(f"{name}: {type(e).__name__}: {e}")
            os.write(write_end, "\n".join(lines).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        deadline, hung = time.monotonic() + 30, True
        while time.monotonic() < deadline:
            if os.waitpid(pid, os.WNOHANG)[0]:
                hung = False
                break
            time.sleep(0.05)
        if hung:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        with os.fdopen(read_end, "rb") as f:
            lines = f.read().decode().splitlines()
    finally:
        tier.gate.set()
        ck.close()
    assert not hung, f"a wait in the forked child blocked (it said: {lines})"
    assert [line.split(":")[0] for line in lines] == ["wait", "result", "handle.wait"], lines
    assert all("NebulaError" in line and "forked" in line for line in lines), lines
    assert _committed(root) == [1]
