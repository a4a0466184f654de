"""The edges of a Checkpointer's life and of the process's, tried like an unlucky operator would.

Each case runs a real training process (tests/save/lifecycle_child.py) that ends or is disturbed in an
unusual way with saves pending, then checks the promise on what it left: every committed step
restores bit-exact, the steps committed before the disturbance are all there, nothing partial is
listed, ``nebula_ckpt verify`` passes, and a restart saves and restores. Saves accepted before a
normal end (``sys.exit``, an unhandled exception, a SIGTERM handler that closes) are all written.
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
from nebula_ckpt.cli import main as cli_main
from nebula_ckpt.native import native_available
from save.lifecycle_child import state

CHILD = os.path.join(os.path.dirname(__file__), "lifecycle_child.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(CHILD)))


def _run(root: str, shm_dir: str, mode: str, timeout: float = 60, **env_extra: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir, **env_extra,
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, CHILD, root, mode], capture_output=True, text=True, timeout=timeout,
                          env=env)


def _accepted(r: subprocess.CompletedProcess[str]) -> int:
    """The newest step whose ``save_async`` returned in the child (it printed ``ACCEPTED <step>``)."""
    return max(int(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("ACCEPTED "))


def _assert_state(got: dict, step: int) -> None:
    want = state(step)
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["i"], want["i"]), f"step {step} restored wrong"
    assert got["meta"] == want["meta"]


def _check_root(root: str, *, must_have: range, restart: bool = True) -> list[int]:
    """Every listed step restores bit-exact (disk tier alone, then with the memory tier), the steps in
    ``must_have`` are listed, ``verify`` passes, and a restart saves and restores a new step."""
    for memory_tier in (False, True):
        with nc.Checkpointer(root, memory_tier=memory_tier, read_only=True) as ck:
            steps = ck.list()
            assert set(must_have) <= set(steps), (steps, list(must_have))
            for s in steps:
                _assert_state(ck.read(s)[1], s)
            latest, got = ck.read()
            assert latest in steps
            _assert_state(got, latest)
    assert cli_main(["verify", root]) == 0
    if restart:
        with nc.Checkpointer(root, keep_last=100) as ck:
            ck.save(100, state(100))
            _assert_state(ck.read(100)[1], 100)
    return steps


@pytest.mark.parametrize("mode,rc", [("sys_exit", 3), ("raise", 1)])
def test_pending_saves_are_written_when_the_program_ends_abnormally(root: str, shm_dir: str, mode: str,
                                                                   rc: int) -> None:
    r = _run(root, shm_dir, mode)
    assert r.returncode == rc, r.stderr
    steps = _check_root(root, must_have=range(2))
    assert steps[-1] == 4, (steps, r.stderr)


@pytest.mark.parametrize("mode,rc", [("os_exit", 5), ("sigterm_default", -signal.SIGTERM)])
def test_an_abrupt_end_keeps_what_was_committed(root: str, shm_dir: str, mode: str, rc: int) -> None:
    r = _run(root, shm_dir, mode)
    assert r.returncode == rc, r.stderr
    _check_root(root, must_have=range(2))


def test_sigterm_handler_that_closes_inside_save_async(root: str, shm_dir: str) -> None:
    """The handler calls ``close()`` then ``sys.exit(0)`` wherever the signal lands in a loop of saves: the
    program exits 0, and the newest save accepted (its ``save_async`` returned, also when the signal came
    before the child printed so) is the newest step written; the save the signal interrupted may be written
    instead (it raised, so older ones may have been dropped for it), never anything older."""
    r = _run(root, shm_dir, "sigterm_handler")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    term = [line.split() for line in r.stdout.splitlines() if line.startswith("TERM ")]
    assert len(term) == 1, r.stdout[-2000:]
    s, where = int(term[0][1]), term[0][2]
    accepted = s if where == "after" else s - 1
    printed = max([1] + [int(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("ACCEPTED ")])
    assert printed in ((s - 1, s) if where == "after" else (s - 1,)), r.stdout[-2000:]
    steps = _check_root(root, must_have=range(2))
    assert steps[-1] == accepted or (where == "inside" and steps[-1] == s), (steps, s, where, r.stderr)


@pytest.mark.parametrize("mode", ["sigint_in_save", "sigint_in_wait", "sigint_in_close"])
def test_ctrl_c_with_saves_pending(root: str, shm_dir: str, mode: str) -> None:
    r = _run(root, shm_dir, mode)
    assert r.returncode == -signal.SIGINT and "KeyboardInterrupt" in r.stderr, r.stderr
    last = _accepted(r)
    steps = _check_root(root, must_have=range(2))
    # the newest save accepted is written; in "sigint_in_save" the signal may land after save_async
    # returned and before the child printed so: that save is written too, never anything else
    assert steps[-1] == last or (mode == "sigint_in_save" and steps[-1] == last + 1), (steps, last, r.stderr)


def _ops_env(ops: str) -> dict[str, str]:
    """The child's environment for the copy path ``ops`` (``native`` skips without the extension)."""
    if ops == "native" and not native_available():
        pytest.skip("C++ extension not built")
    return {"NEBULA_DISABLE_NATIVE": "1" if ops == "fallback" else "0"}


@pytest.mark.parametrize("ops", ["native", "fallback"])
def test_ctrl_c_at_every_point_of_a_wait_leaves_nothing_held(root: str, shm_dir: str, ops: str) -> None:
    """A KeyboardInterrupt at each point where CPython can deliver one inside ``Checkpointer.wait()`` and
    ``SaveHandle.result()`` (one point per save, saves pending): every next save and wait works, and the
    exit hook writes them all. (A Ctrl-C right after ``Condition.__enter__`` took an ``Event``'s lock left
    it held: the tier writer finishing the save blocked in ``set()``, and so did every later wait.)"""
    r = _run(root, shm_dir, "interrupt_everywhere", **_ops_env(ops))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    points = {line.split()[1]: int(line.split()[3]) for line in r.stdout.splitlines() if line.startswith("INTERRUPTED")}
    assert points.keys() == {"wait", "result"} and min(points.values()) >= 5, r.stdout[-2000:]
    last = _accepted(r)
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
        steps = ck.list()
        assert steps[-1] == last and set(range(2)) <= set(steps), (steps, last)
        for s in steps:
            got = ck.read(s)[1]
            if s < 2:
                _assert_state(got, s)
            else:
                assert torch.equal(got["w"], torch.full((1000,), float(s))) and got["meta"] == {"step": s}


def test_interrupt_at_every_point_of_the_first_save(root: str, shm_dir: str) -> None:
    """A signal handler's exception at each point of a fresh Checkpointer's first ``save_async`` (where its
    tier writers and stager start and the memory tier is claimed) and of its second: a Ctrl-C comes out as
    it is, the next save works and ``close()`` writes it; a SIGTERM handler's ``close(); sys.exit()`` comes
    out as the ``SystemExit`` it raised (never as the save's failure) and the deferred close finishes,
    having written the save accepted before. (A Ctrl-C inside a thread's start left the stager unmade,
    and an interrupt while the save waited for its copy was taken for the copy's failure.) Ctrl-C
    lands at every eighth point and the handler's exit at every second, from a random offset (runs cover
    all in turn; NEBULA_INTERRUPT_STRIDE=1: every point in one run). A try that hangs for a minute ends
    the child with every thread's stack."""
    r = _run(root, shm_dir, "interrupt_first_save", timeout=570)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    lines = [line.split() for line in r.stdout.splitlines()]
    bad = [" ".join(x) for x in lines if x[0] in ("SWALLOWED", "CHANGED", "BECAME", "AFTER")
           or (x[0] == "CLOSED" and x[-1] != "True")]
    assert not bad, bad[:10]
    points = {x[2]: int(x[4]) for x in lines if x[:2] == ["INTERRUPTED", "first_save"]}
    assert points.keys() == {"ki", "exit"} and min(points.values()) >= 20, r.stdout[-2000:]
    raised = {how: sum(1 for x in lines if x[:2] == ["RAISED", how]) for how in points}
    assert raised == points, (raised, points)  # every point was reached and raised its exception
    lost = []
    for how, n, s in [(x[1], x[2], int(x[3])) for x in lines if x[0] == "ACCEPTED"]:
        sub = f"{root}-first-{how}-{n}"
        # a save the handler's exit cut may be written in place of the one accepted before it (a busy tier)
        if not any(os.path.exists(os.path.join(sub, f"step-{t}", "COMMIT")) for t in (s, s + 1)[:1 + (how == "exit")]):
            lost.append((sub, s))
        elif int(n) % 25 == 0:  # some of them read back
            with nc.Checkpointer(sub, memory_tier=False, read_only=True) as ck:
                step, got = ck.read()
                assert torch.equal(got["w"], torch.full((1000,), float(step))) and got["meta"] == {"step": step}
    assert not lost, lost


def test_ctrl_c_anywhere_in_staging_gives_the_slot_back(root: str, shm_dir: str) -> None:
    """A Ctrl-C at every point of a later ``save_async`` in the staging code (taking the slot, the copy,
    the snapshot's hand-over), disk tier alone: the interrupt comes out as it is, the next save is accepted
    and ``close()`` writes it. (A Ctrl-C right after the pool marked the slot in use, before the save held
    it, kept the slot for ever: with one staging slot, the next save waited for ever.)"""
    r = _run(root, shm_dir, "interrupt_staging", timeout=570)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    lines = [line.split() for line in r.stdout.splitlines()]
    bad = [" ".join(x) for x in lines if x[0] in ("SWALLOWED", "CHANGED", "BECAME")
           or (x[0] == "CLOSED" and x[-1] != "True")]
    assert not bad, bad[:10]
    tried = [int(x[3]) for x in lines if x[:2] == ["INTERRUPTED", "staging"]]
    assert tried and tried[0] >= 20, r.stdout[-2000:]
    raised = sum(1 for x in lines if x[0] == "RAISED")
    assert raised == tried[0], (raised, tried)  # every point was reached and raised its interrupt
    for n, s in [(x[2], int(x[3])) for x in lines if x[0] == "ACCEPTED"]:
        assert os.path.exists(os.path.join(f"{root}-{n}", f"step-{s}", "COMMIT")), (n, s)


@pytest.mark.parametrize("ops", ["native", "fallback"])
def test_ctrl_c_at_every_point_of_a_read_leaves_the_copy_path_usable(root: str, shm_dir: str, ops: str) -> None:
    """A KeyboardInterrupt at each point of ``read()`` of a disk-tier step where it runs the copy path's code
    or ``threading``'s (one point per read): every next read returns the step's bytes, and the program
    exits. On the pure-PyTorch path each point is tried once more with no copy worker started yet. (A
    thread started per copy job hung the exit: a Ctrl-C inside ``Thread.start()``'s wait for the thread
    left its ``_started`` event locked, the thread blocked before it ran, and the exit joined it.)"""
    r = _run(root, shm_dir, "interrupt_read", **_ops_env(ops))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    points = {" ".join(line.split()[1:-3]): int(line.split()[-2]) for line in r.stdout.splitlines()
              if line.startswith("INTERRUPTED")}
    want = {"read", "read fresh"} if ops == "fallback" else {"read"}
    assert points.keys() == want and min(points.values()) >= 10, r.stdout[-2000:]
    if ops == "fallback":  # the fresh worker's start is one point more
        assert points["read fresh"] > points["read"], points


def test_close_from_a_signal_handler_inside_every_method(root: str, shm_dir: str) -> None:
    """A SIGTERM handler that calls close() lands inside each public method of the same Checkpointer (a real
    signal, repeated until it lands inside): the close is deferred until that call returns; the call returns
    what it returns undisturbed (or the handler's exception unwinds it), then the close finishes."""
    from save.lifecycle_child import CLOSE_INSIDE
    r = _run(root, shm_dir, "close_inside_every_method")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    for method in CLOSE_INSIDE:
        inside = [line for line in r.stdout.splitlines() if line.startswith(f"INSIDE {method} at ")]
        assert len(inside) == 2 and all("closed=True, finished=True, refused: save_async() on a closed" in line
                                        for line in inside), (method, inside)
        assert f"RETURNED {method} ok" in r.stdout, r.stdout
        assert r.stderr.count(f"called inside {method}() (from a signal handler)") == 2, r.stderr
        for how in ("unwind", "return"):
            steps = _check_root(f"{root}-{method}-{how}", must_have=range(2), restart=False)
            if method == "wait":
                assert steps[-1] >= 2, steps  # the save the close was deferred behind was written


def test_sigterm_handler_that_closes_while_optimizer_step_waits_for_the_copy(root: str, shm_dir: str) -> None:
    """The usual preemption handler (``close()`` then ``sys.exit(0)``) whose SIGTERM lands while
    ``optimizer.step()``'s pre-hook waits for the overlapped copy (``snapshot="async"``) of the save just
    accepted: the close is deferred until the hook returns, the program exits 0 and the accepted save is
    written. (The hook waited holding the snapshot's lock, the handler's close waited for the save, and the
    stager waited for that lock: the process hung for good.)"""
    from save.lifecycle_child import hooked_training
    r = _run(root, shm_dir, "sigterm_in_step_hook", timeout=120)
    assert r.returncode == 0 and "TERM step" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    assert "called inside optimizer.step() (from a signal handler)" in r.stderr, r.stderr
    last = _accepted(r)
    assert cli_main(["verify", root]) == 0
    model, opt = hooked_training()
    for _ in range(last - 1):  # the steps the child took before its save `last`
        opt.step()
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
        assert ck.list()[-1] == last, (ck.list(), last)
        assert torch.equal(ck.read(last)[1]["model"]["weight"], model.weight)


def test_close_from_a_signal_handler_at_every_point_of_a_copy_confirmation(root: str, shm_dir: str) -> None:
    """A SIGTERM handler's ``close()`` then ``sys.exit()`` at each point of the library's code inside
    ``optimizer.step()``'s pre-hook, ``SaveHandle.wait_snapshot()`` and ``SaveHandle.result()`` confirming an
    overlapped copy: the ``SystemExit`` comes out as it is, the close finishes (deferred where the code holds
    a snapshot's lock) and the save is written. (A close there waited for the save while the interrupted
    code held the lock the stager needed: a hang.)"""
    r = _run(root, shm_dir, "close_in_confirm_everywhere", timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    lines = [line.split() for line in r.stdout.splitlines()]
    bad = [" ".join(x) for x in lines if x[0] in ("SWALLOWED", "CHANGED", "BECAME")
           or (x[0] == "CLOSED" and x[-1] != "True")]
    assert not bad, bad[:10]
    points = {x[1]: int(x[3]) for x in lines if x[0] == "INTERRUPTED"}
    assert points.keys() == {"step", "wait_snapshot", "result"} and min(points.values()) >= 10, r.stdout[-2000:]
    for what, n in [(x[1], x[2]) for x in lines if x[0] == "RAISED"]:
        assert os.path.exists(os.path.join(f"{root}-{what}-{n}", "step-1", "COMMIT")), (what, n)
    assert "called inside optimizer.step() (from a signal handler)" in r.stderr, r.stderr[-3000:]


#: a job whose disk write of step 2 never ends; Ctrl-C while ``close()`` waits for it
_STALLED_CLOSE = """
import os, signal, sys, threading
import torch
import nebula_ckpt as nc
from nebula_ckpt.storage.local import LocalStorage

def stalled(real):
    def write(self, rel, *args):
        if rel.startswith("step-2/"):
            threading.Event().wait()  # a store that never answers
        return real(self, rel, *args)
    return write

LocalStorage.write_buffer = stalled(LocalStorage.write_buffer)
LocalStorage.write_parts = stalled(LocalStorage.write_parts)
signal.signal(signal.SIGINT, signal.default_int_handler)
ck = nc.Checkpointer(sys.argv[1], memory_tier=False)
ck.save(1, {"w": torch.ones(4)})
ck.save_async(2, {"w": torch.ones(4) * 2})
threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
print("CLOSING", flush=True)
ck.close()
print("CLOSED", flush=True)
"""


def test_ctrl_c_while_close_waits_returns_and_leaves_the_bounded_close_to_the_exit_hook(root: str,
                                                                                       shm_dir: str) -> None:
    """A Ctrl-C while ``close()`` waits for a save that never ends raises ``KeyboardInterrupt`` at
    once (no join of the writer threads, which would wait without a bound); the exit hook then
    finishes the close within ``NEBULA_EXIT_TIMEOUT_S``, says so, and the process ends."""
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir, NEBULA_EXIT_TIMEOUT_S="1",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, "-c", _STALLED_CLOSE, root], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = p.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"the process hung after Ctrl-C in close():\n{out}\n{err[-3000:]}") from None
    assert p.returncode == -signal.SIGINT and "CLOSING" in out and "CLOSED" not in out, (p.returncode, out, err)
    assert "KeyboardInterrupt" in err, err[-3000:]
    assert "an earlier close() did not finish (it was interrupted); finishing it at exit" in err, err[-3000:]
    assert "at exit failed after 2 save(s): TimeoutError: save of step 2 not durable" in err, err[-3000:]
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
        assert ck.list() == [1]


def test_close_that_timed_out_is_finished_by_the_exit_hook(root: str, shm_dir: str) -> None:
    r = _run(root, shm_dir, "close_timeout_exit")
    assert r.returncode == 0, r.stderr
    assert "TIMEOUT" in r.stdout, r.stdout + r.stderr
    assert "was not closed" not in r.stderr, r.stderr
    assert "an earlier close() did not finish (it timed out); finishing it at exit: its pending saves are being " \
           "written now" in r.stderr, r.stderr
    assert _check_root(root, must_have=range(2))[-1] == 4, r.stderr


def test_daemon_thread_saving_while_the_main_thread_exits(root: str, shm_dir: str) -> None:
    r = _run(root, shm_dir, "daemon_thread")
    assert r.returncode == 0, r.stderr
    last = _accepted(r)
    steps = _check_root(root, must_have=range(2))
    assert steps[-1] == last, (steps, last, r.stderr)


@pytest.mark.parametrize("closed", [False, True], ids=["forgotten", "closed"])
def test_checkpointer_made_in_an_atexit_hook_registered_before_import(root: str, shm_dir: str,
                                                                     closed: bool) -> None:
    r = _run(root, shm_dir, "atexit_before_import" + ("_closed" if closed else ""))
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
        assert ck.list() == [2, 3], r.stderr
    _check_root(root, must_have=range(2, 4))


def test_close_with_a_tiny_timeout_then_close_again(root: str, shm_dir: str) -> None:
    r = _run(root, shm_dir, "close_timeout")
    assert r.returncode == 0, r.stderr
    assert "TIMEOUT" in r.stdout and "CLOSED True" in r.stdout, r.stdout + r.stderr
    steps = _check_root(root, must_have=range(2))
    assert steps[-1] == 4, (steps, r.stderr)  # the second close() waited for the rest


def test_forked_child_that_exits_normally_touches_nothing_of_the_parent(root: str, shm_dir: str) -> None:
    r = _run(root, shm_dir, "fork")
    assert r.returncode == 0, r.stderr
    assert "CHILD 0" in r.stdout, r.stdout + r.stderr
    assert "CHILD REFUSED save_async() on a forked (the parent process owns it) Checkpointer of " in r.stdout, r.stdout
    assert "was not closed" not in r.stderr, r.stderr  # the child's exit hook leaves the parent's copy alone
    assert _check_root(root, must_have=range(2))[-1] == 3, r.stderr


# -- in one process: threads, two checkpointers, folders pulled away ------------------------------------

def test_close_from_another_thread_while_saving(root: str) -> None:
    ck = nc.Checkpointer(root, keep_last=100)
    ck.save(0, state(0))
    for s in range(1, 4):
        ck.save_async(s, state(s))
    closer = threading.Thread(target=ck.close)
    closer.start()
    closer.join(timeout=60)
    assert not closer.is_alive(), "close() from another thread hung"
    with pytest.raises(nc.NebulaError, match="closed"):
        ck.save_async(4, state(4))
    assert _check_root(root, must_have=range(1))[-1] == 3


@pytest.mark.parametrize("first", [False, True], ids=["later_save", "first_save"])
def test_close_from_another_thread_while_it_is_inside_save_async(root: str, first: bool) -> None:
    """close() from another thread while a thread is inside save_async() (copying a 64 MiB state; or, on a
    fresh Checkpointer, starting the tier writers too): close waits for that call, and the save it accepted
    is written before close() returns. (The save was accepted, then dropped without a word: its handle never
    finished; a first save raised a bare AssertionError.)"""
    big = {"w": torch.randn(16 << 20)}
    ck = nc.Checkpointer(root, keep_last=100)
    if not first:
        ck.save(0, {"w": torch.zeros(16 << 20)})
    out: dict = {}

    def saver() -> None:
        try:
            out["h"] = ck.save_async(1, big)
        except BaseException as e:  # noqa: BLE001 (the test fails on it)
            out["e"] = e

    t = threading.Thread(target=saver)
    t.start()
    while t.is_alive():  # close once the saver is inside save_async
        f, names = sys._current_frames().get(t.ident or 0), []
        while f is not None:
            names.append(f.f_code.co_name)
            f = f.f_back
        if "save_async" in names:
            break
        time.sleep(0.0002)
    ck.close()
    t.join(timeout=60)
    assert "e" not in out and not t.is_alive(), out
    h = out["h"]
    assert h.done() and h.result(timeout=0) == h.tiers_written and h.tiers_written, h
    with nc.Checkpointer(root, read_only=True) as rd:
        assert rd.list()[-1] == 1 and torch.equal(rd.read(1)[1]["w"], big["w"])


def _wakeups(native_id: int) -> int:
    """Context switches of the thread ``native_id`` of this process so far (Linux)."""
    with open(f"/proc/self/task/{native_id}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["voluntary_ctxt_switches"]) + int(fields["nonvoluntary_ctxt_switches"])


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_idle_library_threads_sleep_until_there_is_work(root: str, ops_path: str) -> None:
    """With no save in flight the tier writers and the stager do not wake at all (a writer that re-checked
    its queue on a timer woke 20 times a second); the next save wakes them, and wait() returns."""
    with nc.Checkpointer(root, keep_last=100) as ck:
        for s in range(3):
            ck.save(s, state(s))
        ck.wait()
        time.sleep(0.2)  # a thread that just finished goes back to sleep
        threads = {t.name: t.native_id for t in threading.enumerate() if t.name.startswith("nebula-")}
        assert any("writer" in n for n in threads) and any("stager" in n for n in threads), threads
        before = {n: _wakeups(tid) for n, tid in threads.items() if tid is not None}
        time.sleep(0.5)
        woke = {n: _wakeups(threads[n]) - c for n, c in before.items()}
        assert all(w == 0 for w in woke.values()), woke
        ck.save_async(3, state(3))
        ck.wait()
        assert ck.list()[-1] == 3


def test_read_from_another_thread_while_saving(root: str) -> None:
    ck = nc.Checkpointer(root, keep_last=100)
    ck.save(0, state(0))
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set() and not errors:
            try:
                step, got = ck.read()
                _assert_state(got, step)
            except BaseException as e:  # noqa: BLE001 (reported by the main thread)
                errors.append(e)

    t = threading.Thread(target=reader)
    t.start()
    try:
        for s in range(1, 40):
            if errors:
                break
            ck.save_async(s, state(s))
    finally:
        stop.set()
        t.join()
        ck.close()
    assert not errors, errors


def test_dataloader_workers_forked_while_a_save_is_pending(root: str) -> None:
    ck = nc.Checkpointer(root, keep_last=100)
    ck.save(0, state(0))
    h = ck.save_async(1, state(1))
    loader = torch.utils.data.DataLoader(list(range(8)), num_workers=2, multiprocessing_context="fork")
    assert sorted(int(x) for x in loader) == list(range(8))
    h.result()
    ck.save(2, state(2))
    ck.close()
    assert _check_root(root, must_have=range(3)) == [0, 1, 2]


def test_restore_while_the_same_step_is_in_flight(root: str) -> None:
    with nc.Checkpointer(root, keep_last=100) as ck:
        ck.save(0, state(0))
        h = ck.save_async(1, state(1))
        step, got = ck.read()
        assert step in (0, 1)
        _assert_state(got, step)
        try:
            _assert_state(ck.read(1)[1], 1)
        except nc.NebulaError as e:  # refused: must say which step
            assert "1" in str(e)
        h.result()
        _assert_state(ck.read(1)[1], 1)


def test_second_checkpointer_on_the_same_root_does_not_corrupt_the_first(root: str) -> None:
    a = nc.Checkpointer(root, keep_last=100)
    a.save(0, state(0))
    b = nc.Checkpointer(root, keep_last=100)
    b.save(1, state(1))
    try:
        a.save(2, state(2))
    except nc.NebulaError as e:
        assert "writer" in str(e).lower() or "fenc" in str(e).lower(), e
    for ck in (a, b):
        try:
            ck.close()
        except nc.NebulaError:
            pass
    _check_root(root, must_have=range(2))


def test_second_process_on_the_same_root_does_not_corrupt_the_first(root: str, shm_dir: str) -> None:
    with nc.Checkpointer(root, keep_last=100) as ck:
        ck.save(5, state(5))
        r = _run(root, shm_dir, "sys_exit")  # another process takes the root over, saves 0..4
        assert r.returncode == 3, r.stderr
        try:
            ck.save(6, state(6))
        except nc.NebulaError as e:
            assert "writer" in str(e).lower() or "fenc" in str(e).lower(), e
    _check_root(root, must_have=range(5))


def test_memory_tier_folder_removed_under_a_live_job(root: str, shm_dir: str) -> None:
    import shutil
    with nc.Checkpointer(root, keep_last=100) as ck:
        ck.save(0, state(0))
        shutil.rmtree(shm_dir)
        for s in (1, 2):
            try:
                ck.save(s, state(s))
            except nc.NebulaError as e:
                assert shm_dir in str(e) or "memory" in str(e), e
    os.makedirs(shm_dir, exist_ok=True)
    _check_root(root, must_have=range(1))


def test_slot_files_deleted_under_a_live_job(root: str, shm_dir: str) -> None:
    with nc.Checkpointer(root, keep_last=100) as ck:
        ck.save(0, state(0))
        for dp, _, files in os.walk(shm_dir):
            if os.path.basename(dp) == ".slots":
                for f in files:
                    os.unlink(os.path.join(dp, f))
        ck.save(1, state(1))
        ck.save(2, state(2))
    assert _check_root(root, must_have=range(3)) == [0, 1, 2]


def test_disk_root_renamed_under_a_live_job(root: str) -> None:
    moved = root + "-moved"
    with nc.Checkpointer(root, memory_tier=False, keep_last=100) as ck:
        ck.save(0, state(0))
        os.rename(root, moved)
        try:
            ck.save(1, state(1))
        except nc.NebulaError as e:
            assert root in str(e), e
    _check_root(moved, must_have=range(1), restart=False)


def test_load_latest_on_a_root_with_only_partial_steps(root: str) -> None:
    with nc.Checkpointer(root, memory_tier=False, keep_last=100) as ck:
        ck.save(0, state(0))
        ck.save(1, state(1))
    for s in (0, 1):
        os.unlink(os.path.join(root, f"step-{s}", "COMMIT"))
    with nc.Checkpointer(root, memory_tier=False, keep_last=100) as ck:
        assert ck.list() == []
        assert ck.load_latest(into={}) is None


@pytest.mark.parametrize("incremental", [False, True], ids=["full", "incremental"])
def test_what_a_restore_returned_stays_as_read_while_the_same_process_saves_on(root: str,
                                                                                incremental: bool) -> None:
    """read() of a live writer's memory tier, then many saves that recycle its staging slot files:
    the tensors read keep the bytes of the step they came from (nothing stages into a file this
    process still maps)."""
    tiers = [nc.MemoryTier(), nc.LocalTier(root, every=1000)]  # step 1 exists on the memory tier only
    with nc.Checkpointer(root, tiers=tiers, incremental=incremental) as ck:
        ck.save(0, state(0))
        ck.save(1, state(1))
        step, got = ck.read()
        assert step == 1 and ck.last_restore["tier"].startswith("memory:")
        for s in range(2, 12):
            ck.save(s, state(s))
        _assert_state(got, 1)
        assert ck.read()[0] == 11
