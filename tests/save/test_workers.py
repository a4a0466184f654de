"""The library's thread pool: the ThreadPoolExecutor behaviour it relies on, and work at exit."""

from __future__ import annotations

import sys
import threading

import pytest

import warm_python
from nebula_ckpt.workers import Workers


def test_results_in_order_and_exceptions_on_their_future() -> None:
    with Workers(3, thread_name_prefix="t") as ex:
        assert list(ex.map(lambda a, b: a * b, range(10), range(10))) == [i * i for i in range(10)]
        bad = ex.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            bad.result(timeout=10)
        assert ex.submit(lambda x, y=0: x + y, 2, y=3).result(timeout=10) == 5
    with pytest.raises(RuntimeError, match="after shutdown"):
        ex.submit(print)


def test_at_most_max_workers_threads_run_at_once() -> None:
    gate, lock, running, peak = threading.Event(), threading.Lock(), [0], [0]

    def task() -> None:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        gate.wait(10)
        with lock:
            running[0] -= 1

    ex = Workers(2)
    futures = [ex.submit(task) for _ in range(6)]
    threading.Timer(0.3, gate.set).start()
    for f in futures:
        f.result(timeout=20)
    ex.shutdown()
    assert peak[0] == 2


def test_cancel_futures_drops_what_has_not_started() -> None:
    gate = threading.Event()
    ex = Workers(1)
    first = ex.submit(gate.wait, 10)
    while not first.running() and not first.done():
        threading.Event().wait(0.01)
    rest = [ex.submit(lambda: None) for _ in range(3)]
    threading.Timer(0.2, gate.set).start()
    ex.shutdown(wait=True, cancel_futures=True)
    assert first.result() is True
    assert all(f.cancelled() for f in rest)


def test_it_runs_work_where_a_thread_pool_executor_refuses_it() -> None:
    code = """
import atexit
from concurrent.futures import ThreadPoolExecutor
from nebula_ckpt.workers import Workers

def late():
    try:
        ThreadPoolExecutor(2).submit(int)
        print("tpe accepted")
    except RuntimeError:
        print("tpe refused")
    with Workers(2) as ex:
        print("workers", sum(ex.map(lambda x: x, range(5))))

atexit.register(late)
"""
    r = warm_python.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["tpe refused", "workers 10"], r.stdout
