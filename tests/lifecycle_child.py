"""A training process that ends, or is disturbed, in one of many unusual ways (tests/test_attack_lifecycle.py).

``python lifecycle_child.py ROOT MODE``: saves steps 0 and 1 synchronously (committed before any
disturbance), prints ``READY``, then does what ``MODE`` names. The state of step ``s`` is
:func:`state` so that the parent can check every restored byte.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import signal
import sys
import threading
import time

N = 300_000  # 1.2 MB per tensor: a save is still pending when the program ends right after it


def state(step: int) -> dict:
    """The state saved as ``step`` (bit patterns unique to it)."""
    import torch
    return {"w": torch.full((N,), float(step)), "i": torch.arange(N, dtype=torch.int64) + step,
            "meta": {"step": step}}


def _raise(e: BaseException) -> None:
    raise e


def _late_checkpointer(root: str, close: bool) -> None:
    """An ``atexit`` hook registered before nebula_ckpt was imported: it runs after the library's hooks."""
    import nebula_ckpt as nc
    ck = nc.Checkpointer(root, keep_last=10_000)
    for s in (2, 3):
        ck.save_async(s, state(s))
    if close:
        ck.close()


def main() -> None:  # noqa: C901 (one branch per mode, read top to bottom)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung child shows where: kill -USR1
    # an ignored signal is inherited across exec: a test run whose process ignores SIGINT (some
    # library earlier in the session set it so) must not make Ctrl-C a no-op in the child
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    root, mode = sys.argv[1], sys.argv[2]
    if mode.startswith("atexit_before_import"):
        atexit.register(_late_checkpointer, root, mode.endswith("closed"))
        import nebula_ckpt  # noqa: F401  (its exit hooks are registered after ours: they run first)
        print("READY", flush=True)
        return
    import torch

    import nebula_ckpt as nc
    ck = nc.Checkpointer(root, keep_last=10_000)
    ck.save(0, state(0))
    ck.save(1, state(1))
    print("READY", flush=True)

    ends = {"sys_exit": lambda: sys.exit(3), "os_exit": lambda: os._exit(5),
            "raise": lambda: _raise(RuntimeError("training diverged")),
            "sigterm_default": lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(30))}
    if mode in ends:  # saves pending, then the program ends that way
        for s in (2, 3, 4):
            ck.save_async(s, state(s))
        ends[mode]()
    if mode == "sigterm_handler":
        def on_term(signum: int, frame: object) -> None:
            ck.close()
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        for s in range(2, 10_000):  # the signal lands somewhere inside save_async
            ck.save_async(s, state(s))
            print(f"ACCEPTED {s}", flush=True)
        raise AssertionError("SIGTERM never came")
    if mode in ("sigint_in_save", "sigint_in_wait", "sigint_in_close"):
        for s in (2, 3):
            ck.save_async(s, state(s))
        if mode == "sigint_in_save":
            threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
            for s in range(4, 10_000):  # the signal lands in save_async or in waiting for the save
                h = ck.save_async(s, state(s))
                print(f"ACCEPTED {s}", flush=True)
                h.result()
        ck.save_async(4, state(4))
        print("ACCEPTED 4", flush=True)
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
        if mode == "sigint_in_wait":
            while True:
                ck.wait()
        ck.close()
        time.sleep(30)
        raise AssertionError("SIGINT never came")
    if mode == "daemon_thread":
        def loop() -> None:
            s = 2
            while True:
                try:
                    ck.save_async(s, state(s))
                    print(f"ACCEPTED {s}", flush=True)
                except Exception as e:  # closed by the exit hook: expected, anything else is printed
                    print(f"DAEMON {type(e).__name__}: {e}", flush=True)
                    return
                s += 1
        threading.Thread(target=loop, daemon=True).start()
        time.sleep(0.5)
        return  # the main thread ends; the daemon thread is still saving
    if mode == "close_timeout":
        for s in (2, 3, 4):  # 32 MB more each: still being written when close() gives up
            ck.save_async(s, {**state(s), "pad": torch.full((8_000_000,), float(s))})
        try:
            ck.close(timeout=0.001)
        except TimeoutError as e:
            print(f"TIMEOUT {e}", flush=True)
        ck.close()  # a second close: waits for the rest
        print(f"CLOSED {ck.closed}", flush=True)
        return
    if mode == "fork":
        ck.save_async(2, state(2))
        pid = os.fork()
        if pid == 0:  # the child ends normally: its atexit hooks run on the parent's copies
            try:
                ck.save_async(9, {"x": 1})  # (no torch op: its thread pool does not survive fork)
            except nc.NebulaError as e:
                print(f"CHILD REFUSED {e}", flush=True)
            sys.exit(0)
        _, status = os.waitpid(pid, 0)
        print(f"CHILD {os.waitstatus_to_exitcode(status)}", flush=True)
        ck.save(3, state(3))
        ck.close()
        return
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
