"""A training process that ends, or is disturbed, in one of many unusual ways (tests/save/test_lifecycle_edges.py).

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


class _Interrupter:
    """Raises ``KeyboardInterrupt`` in the main thread at the ``n``-th point where CPython runs a signal
    handler (a function's start, right after a call returns, a loop's jump back) inside the library or
    ``threading``: the points a Ctrl-C can land on, visited one by one (a real signal hits one at random)."""

    def __init__(self, n: int, files: tuple[str, ...] = ("nebula_ckpt", "threading.py"),
                 raises: "object | None" = None) -> None:
        import dis
        self._dis, self.n, self.seen, self._points, self._files = dis, n, 0, {}, files
        #: ``raises``: a SIGTERM handler's ``close()`` to call there first; then ``SystemExit(0)`` is raised
        self._close, self.message = raises, f"injected at point {n}"

    def _points_of(self, code: object) -> frozenset:
        pts = self._points.get(code)
        if pts is None:
            ins = list(self._dis.get_instructions(code))
            pts = frozenset([i.offset for i in ins if i.opname in ("RESUME", "JUMP_BACKWARD")]
                            + [b.offset for a, b in zip(ins, ins[1:], strict=False) if a.opname == "CALL"])
            self._points[code] = pts
        return pts

    def __call__(self, frame, event, arg):  # noqa: ANN001, ANN204 (sys.settrace's signature)
        f = frame.f_code.co_filename
        if event == "call" and any(part in f for part in self._files):
            frame.f_trace_opcodes = True
            return self._local
        return None

    def _local(self, frame, event, arg):  # noqa: ANN001, ANN202
        if event == "opcode" and frame.f_lasti in self._points_of(frame.f_code):
            self.seen += 1
            if self.seen == self.n:
                if self._close is None:
                    raise KeyboardInterrupt(self.message)
                sys.settrace(None)  # what the handler runs is not traced
                frame.f_trace_opcodes = False
                self._close()  # type: ignore[operator]
                raise SystemExit(self.message)
        return self._local


def _interrupt_everywhere(ck: object) -> None:
    """Ctrl-C at every point of ``wait()`` and of ``SaveHandle.result()`` with a save pending, one point per
    save (a small state: ``w`` is ``s`` everywhere); after each the next save and wait must work. The
    program then ends; the exit hook closes."""
    import torch
    s = 2
    for what in ("wait", "result"):
        n = 1
        while True:
            h = ck.save_async(s, {"w": torch.full((1000,), float(s)), "meta": {"step": s}})  # type: ignore[attr-defined]
            print(f"ACCEPTED {s}", flush=True)
            s += 1
            trap = _Interrupter(n)
            sys.settrace(trap)
            try:
                ck.wait() if what == "wait" else h.result()  # type: ignore[attr-defined]
                sys.settrace(None)
            except KeyboardInterrupt:
                sys.settrace(None)
                n += 1
                continue
            print(f"INTERRUPTED {what} at {n - 1} points", flush=True)
            break


def _say(line: str) -> None:
    """Print ``line`` with one ``write`` (no buffer a signal handler printing too could find in use)."""
    os.write(1, f"{line}\n".encode())


def _save_until_term(ck: object) -> None:
    """Save steps 2, 3, ... until the SIGTERM handler ends the program (it lands somewhere in this loop)."""
    for s in range(2, 10_000):
        st = state(s)
        ck.save_async(s, st)  # type: ignore[attr-defined]
        _say(f"ACCEPTED {s}")
    raise AssertionError("SIGTERM never came")


def _where(frame: object) -> str:
    """Where a signal handler interrupted :func:`_save_until_term` (``frame``: the frame it interrupted):
    ``<step> before`` its ``save_async`` call (the newest accepted save is ``step - 1``), ``<step> inside``
    (it raised to the loop: ``step - 1`` is, and ``step`` may be written) or ``<step> after`` it returned
    (``step`` was accepted, whether its ``ACCEPTED`` line came or not)."""
    import dis
    loop, f = _save_until_term.__code__, frame
    while f is not None and f.f_code is not loop:  # type: ignore[attr-defined]
        f = f.f_back  # type: ignore[attr-defined]
    if f is None or "s" not in f.f_locals:  # type: ignore[attr-defined]
        return "2 before"
    ins = list(dis.get_instructions(loop))
    at = next(i for i, x in enumerate(ins) if x.argval == "save_async")
    k = next(i for i in range(at, len(ins)) if ins[i].opname == "CALL")
    call, after = ins[k].offset, ins[k + 1].offset  # the call, and the instruction after it and its caches
    s, last = f.f_locals["s"], f.f_lasti  # type: ignore[attr-defined]
    if last < call:
        return f"{s} before"
    # the loop's last instruction is the CALL (or one of its caches) while inside it, and also when the
    # handler runs in the loop itself right after the call returned
    return f"{s} {'inside' if last < after and f is not frame else 'after'}"


def _interrupt_read(root: str, fresh_worker: bool) -> None:
    """Ctrl-C at every point of ``read()`` of a disk-tier step where it runs code of ``threading`` or of
    the copy path (:mod:`nebula_ckpt.native`, :mod:`nebula_ckpt.latch`), one point per read; after each
    the next read must work and return the step's bytes. ``fresh_worker`` (the pure-PyTorch path): each
    read finds no copy worker started yet, as the first copy of a process does, so the points inside
    starting it (``Thread.start()`` and its wait for the thread) are visited too."""
    import torch

    import nebula_ckpt as nc
    from nebula_ckpt import native
    from nebula_ckpt.copy_worker import CopyWorker
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as rd:
        n = 1
        while True:
            if fresh_worker:
                native._copies = CopyWorker()
            trap = _Interrupter(n, ("threading.py", "nebula_ckpt/native.py", "nebula_ckpt/copy_worker.py",
                                    "nebula_ckpt/latch.py"))
            sys.settrace(trap)
            try:
                got = rd.read(1)[1]
                sys.settrace(None)
            except KeyboardInterrupt:
                sys.settrace(None)
                n += 1
                continue
            want = state(1)
            assert torch.equal(got["w"], want["w"]) and torch.equal(got["i"], want["i"]), "step 1 read wrong"
            print(f"INTERRUPTED read{' fresh' if fresh_worker else ''} at {n - 1} points", flush=True)
            break


def _small(s: int) -> dict:
    """A small state for step ``s`` (``w`` is ``s`` everywhere)."""
    import torch
    return {"w": torch.full((1000,), float(s)), "meta": {"step": s}}


def _interrupt_first_save(root: str) -> None:
    """A signal handler's exception at every point of a fresh Checkpointer's first ``save_async`` (one point
    per Checkpointer, each on a root of its own: ``<root>-<way>-<point>``), two ways: ``ki`` (Ctrl-C): the
    interrupt comes out of ``save_async`` as it is, the next ``save_async`` works and ``close()`` writes it;
    ``exit`` (a SIGTERM handler that calls ``close()`` then ``sys.exit()``, in the second save of the
    Checkpointer): the ``SystemExit`` comes out as it is and the deferred close finishes. Prints what each
    try did for the test to check."""
    import random

    import nebula_ckpt as nc
    s = 2
    for how in ("ki", "exit"):
        # every `stride`-th point from a random offset printed here, so runs cover all of them in turn:
        # Ctrl-C every 8th (~700 points, most in the planning of a first save), exit every 2nd (~300);
        # NEBULA_INTERRUPT_STRIDE=S: every S-th and every max(1, S // 4)-th (1: every point, both ways)
        every = int(os.environ.get("NEBULA_INTERRUPT_STRIDE", "8"))
        stride = every if how == "ki" else max(1, every // 4)
        n = 1 + random.randrange(stride)
        print(f"OFFSET {how} {n} stride {stride}", flush=True)
        tried = 0
        while True:
            tried += 1
            faulthandler.dump_traceback_later(60, exit=True)  # one try hung: where, then the child ends
            # the memory tier (claimed at the first save) where the first save is cut; the disk tier alone
            # where the second save is cut, at its points in the library only: the test's time stays short
            ck = nc.Checkpointer(f"{root}-{how}-{n}", memory_tier=how == "ki")
            if how == "exit":
                ck.save_async(s, _small(s))
                print(f"ACCEPTED {how} {n} {s}", flush=True)
                s += 1
            trap = _Interrupter(n, ("nebula_ckpt",), raises=ck.close) if how == "exit" else _Interrupter(n)
            sys.settrace(trap)
            try:
                ck.save_async(s, _small(s))
                sys.settrace(None)
                print(f"{'SWALLOWED' if trap.seen >= n else 'CLEAN'} {how} {n} {s}", flush=True)
            except (KeyboardInterrupt, SystemExit) as e:
                sys.settrace(None)
                ok = type(e) is (SystemExit if how == "exit" else KeyboardInterrupt) and str(e) == trap.message
                print(f"{'RAISED' if ok else 'CHANGED'} {how} {n} {s} {type(e).__name__}: {e}", flush=True)
            except BaseException as e:  # noqa: BLE001 (printed: the test fails on it)
                sys.settrace(None)
                print(f"BECAME {how} {n} {s} {type(e).__name__}: {e}", flush=True)
            s += 1
            try:
                if how == "ki":
                    ck.save_async(s, _small(s))
                    print(f"ACCEPTED {how} {n} {s}", flush=True)
                    s += 1
                ck.close()
                print(f"CLOSED {how} {n} {ck.closed and not ck._close_unfinished}", flush=True)
            except BaseException as e:  # noqa: BLE001
                print(f"AFTER {how} {n} {type(e).__name__}: {e}", flush=True)
            if trap.seen < n:
                print(f"INTERRUPTED first_save {how} at {tried - 1} points of {trap.seen}", flush=True)
                break
            n += stride


def _interrupt_staging(root: str) -> None:
    """A Ctrl-C at every point of a later ``save_async`` inside the staging code (the slot taken, the
    copy enqueued, the snapshot made and handed to the stager), disk tier alone, on a root of its own
    per point (``<root>-<point>``): the interrupt comes out as it is, the next ``save_async`` is
    accepted (with one staging slot per state, a slot the cut kept would make it wait for ever) and
    ``close()`` writes it. Prints what each try did for the test to check."""
    import nebula_ckpt as nc
    files = tuple(f"nebula_ckpt{os.sep}save{os.sep}{m}.py" for m in ("pipeline", "buffers", "slots", "snapshot"))
    n, s = 1, 2
    while True:
        faulthandler.dump_traceback_later(60, exit=True)  # one try hung: where, then the child ends
        ck = nc.Checkpointer(f"{root}-{n}", memory_tier=False)
        ck.save_async(s, _small(s)).result()  # planned, its slot made and idle again
        s += 1
        trap = _Interrupter(n, files)
        sys.settrace(trap)
        try:
            ck.save_async(s, _small(s))
            sys.settrace(None)
            print(f"{'SWALLOWED' if trap.seen >= n else 'CLEAN'} staging {n} {s}", flush=True)
        except KeyboardInterrupt as e:
            sys.settrace(None)
            print(f"{'RAISED' if str(e) == trap.message else 'CHANGED'} staging {n} {s} {e}", flush=True)
        except BaseException as e:  # noqa: BLE001 (printed: the test fails on it)
            sys.settrace(None)
            print(f"BECAME staging {n} {s} {type(e).__name__}: {e}", flush=True)
        s += 1
        ck.save_async(s, _small(s))
        print(f"ACCEPTED staging {n} {s}", flush=True)
        s += 1
        ck.close()
        print(f"CLOSED staging {n} {ck.closed and not ck._close_unfinished}", flush=True)
        if trap.seen < n:
            print(f"INTERRUPTED staging at {n - 1} points", flush=True)
            break
        n += 1


class _Stop(BaseException):
    """What the SIGTERM handler raises after close() (as ``sys.exit`` would): it unwinds the interrupted call."""


#: the files of the Checkpointer's methods (the facade, its restore side)
FACADE = ("checkpointer.py", "restore/reads.py")
#: the methods a SIGTERM handler's close() is tried inside, with a loop that keeps the main thread in them
CLOSE_INSIDE = ("prepare", "remove", "load", "load_latest", "read", "wait", "stats")


def _as_without_close(method: str, got: object, into: dict, s: int) -> bool:
    """Whether a call of ``method`` (its loop iteration ``s``) returned what it returns undisturbed."""
    import torch
    if method in ("load", "load_latest"):
        return got == 1 and torch.equal(into["w"], state(1)["w"]) and torch.equal(into["i"], state(1)["i"])
    if method == "read":
        return got[0] == 1 and torch.equal(got[1]["w"], state(1)["w"])  # type: ignore[index]
    if method == "stats":
        return isinstance(got, dict) and got["saves"] >= 2
    if method == "remove":
        return got[1] == [s]  # type: ignore[index]
    if method == "wait":
        return got[2] is None and got[0].result() == got[0].tiers_written  # type: ignore[index]
    return got is None  # prepare


def _close_inside(root: str, method: str, unwind: bool) -> None:
    """A SIGTERM handler that calls close() (then raises, with ``unwind``, as ``sys.exit`` would) lands
    inside ``method`` of the Checkpointer it closes (a real signal, sent again until it lands there);
    prints where it landed, what the interrupted call returned and how the close ended."""
    import torch

    import nebula_ckpt as nc
    ck = nc.Checkpointer(root, keep_last=10_000)
    ck.save(0, state(0))
    ck.save(1, state(1))
    into = {"w": torch.empty(N), "i": torch.empty(N, dtype=torch.int64), "meta": {"step": -1}}
    landed: list[str] = []

    def on_term(signum: int, frame: object) -> None:
        f = frame
        while f is not None and not (f.f_code.co_name == method and f.f_code.co_filename.endswith(FACADE)):
            f = f.f_back  # type: ignore[attr-defined]
        if f is None or landed:  # between two calls (the next signal comes in 5 ms), or after the first
            return
        landed.append(f"{frame.f_code.co_name}:{frame.f_lineno}")  # type: ignore[attr-defined]
        ck.close()
        if unwind:
            raise _Stop

    def pelt() -> None:  # SIGTERM every 5 ms until one lands inside the method
        while not landed:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.005)

    signal.signal(signal.SIGTERM, on_term)
    threading.Timer(0.05, pelt).start()
    calls = {"prepare": lambda s: ck.prepare(state(1)), "load": lambda s: ck.load(1, into=into),
             "load_latest": lambda s: ck.load_latest(into=into), "read": lambda s: ck.read(1),
             "stats": lambda s: ck.stats(), "remove": lambda s: (ck.save(s, state(s)), ck.remove(s)),
             "wait": lambda s: (ck.save_async(s, state(s)), print(f"ACCEPTED {method} {s}", flush=True), ck.wait())}
    got: object = "unwound"
    try:
        for s in range(2, 100_000):
            got = calls[method](s)
            if landed:
                break
        else:
            raise AssertionError("SIGTERM never came")
    except _Stop:
        pass
    if not unwind:  # the interrupted call went on and returned what it returns without a close
        print(f"RETURNED {method} {'ok' if _as_without_close(method, got, into, s) else f'WRONG {got!r}'}", flush=True)
    time.sleep(0.02)  # a signal still in flight reaches the handler (which ignores it)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        ck.save_async(9, {"x": 1})
        after = "still open"
    except nc.NebulaError as e:
        after = f"refused: {e}"
    print(f"INSIDE {method} at {landed[0]}: closed={ck.closed}, finished={not ck._close_unfinished}, {after}",
          flush=True)


def _stack(frame: object) -> list[str]:
    """The names of the functions of ``frame`` and of its callers."""
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)  # type: ignore[attr-defined]
        frame = frame.f_back  # type: ignore[attr-defined]
    return names


def hooked_training(width: int = 2048) -> tuple:
    """A model (``width`` 2048: 32 MiB of weights, whose copy takes a while) and its optimizer, gradients
    set: each ``opt.step()`` changes every weight the same way (the parent replays it)."""
    import torch
    torch.manual_seed(0)
    model = torch.nn.Linear(width, 2 * width, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.weight.grad = torch.ones_like(model.weight)
    return model, opt


def _sigterm_in_step_hook(root: str) -> None:
    """The usual preemption handler (``close()`` then ``sys.exit(0)``), its SIGTERM sent while
    ``optimizer.step()``'s pre-hook waits for the overlapped copy (``snapshot="async"``) of the save just
    accepted: prints where it landed and each accepted step; the exit must not hang."""
    import nebula_ckpt as nc
    model, opt = hooked_training()
    ck = nc.Checkpointer(root, snapshot="async", memory_tier=False, keep_last=10_000)
    ck.save(0, {"model": model, "opt": opt})
    main = threading.get_ident()

    def on_term(signum: int, frame: object) -> None:
        names = _stack(frame)
        _say(f"TERM {'step' if 'confirm_inflight' in names else 'elsewhere ' + ','.join(names[:6])}")
        ck.close()
        sys.exit(0)

    def preempt() -> None:  # SIGTERM once the main thread waits for the copy inside opt.step()
        while True:
            names = _stack(sys._current_frames().get(main))
            if "finish_copy" in names and "save_async" not in names:
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.0002)

    signal.signal(signal.SIGTERM, on_term)
    threading.Thread(target=preempt, daemon=True).start()
    for s in range(1, 1000):
        ck.save_async(s, {"model": model, "opt": opt})
        _say(f"ACCEPTED {s}")
        opt.step()  # its pre-hook waits for the copy
    raise AssertionError("SIGTERM never came")


def _close_in_confirm_everywhere(root: str) -> None:
    """A SIGTERM handler's ``close()`` then ``sys.exit()`` at every point of the library's code inside
    ``optimizer.step()``, ``SaveHandle.wait_snapshot()`` and ``SaveHandle.result()`` while they confirm an
    overlapped copy (one point per Checkpointer, each on a root of its own: ``<root>-<what>-<point>``).
    Prints what each try did for the test to check."""
    import nebula_ckpt as nc
    for what in ("step", "wait_snapshot", "result"):
        n = 1
        while True:
            faulthandler.dump_traceback_later(60, exit=True)  # one try hung: where, then the child ends
            model, opt = hooked_training(64)
            ck = nc.Checkpointer(f"{root}-{what}-{n}", snapshot="async", memory_tier=False)
            h = ck.save_async(1, {"model": model, "opt": opt})
            call = {"step": opt.step, "wait_snapshot": h.wait_snapshot, "result": h.result}[what]
            trap = _Interrupter(n, ("nebula_ckpt",), raises=ck.close)
            sys.settrace(trap)
            try:
                call()
                sys.settrace(None)
                print(f"{'SWALLOWED' if trap.seen >= n else 'CLEAN'} {what} {n}", flush=True)
            except SystemExit as e:
                sys.settrace(None)
                print(f"{'RAISED' if str(e) == trap.message else 'CHANGED'} {what} {n}", flush=True)
            except BaseException as e:  # noqa: BLE001 (printed: the test fails on it)
                sys.settrace(None)
                print(f"BECAME {what} {n} {type(e).__name__}: {e}", flush=True)
            ck.close()  # nothing left to do when the handler's close finished
            print(f"CLOSED {what} {n} {ck.closed and not ck._close_unfinished}", flush=True)
            if trap.seen < n:
                print(f"INTERRUPTED {what} at {n - 1} points", flush=True)
                break
            n += 1


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
    if mode == "sigterm_in_step_hook":
        faulthandler.dump_traceback_later(60, exit=True)  # a deadlock shows where, then the child ends
        _sigterm_in_step_hook(root)
    if mode == "close_in_confirm_everywhere":
        _close_in_confirm_everywhere(root)
        return
    if mode == "close_inside_every_method":
        faulthandler.dump_traceback_later(90, exit=True)  # a deadlock shows where, then the child ends
        for method in CLOSE_INSIDE:
            for unwind in (True, False):
                _close_inside(f"{root}-{method}-{'unwind' if unwind else 'return'}", method, unwind)
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
            _say(f"TERM {_where(frame)}")
            ck.close()
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        _save_until_term(ck)
    if mode == "interrupt_staging":
        _interrupt_staging(root)
        return
    if mode == "interrupt_first_save":
        _interrupt_first_save(root + "-first")  # arms a hang's traceback per try
        return
    if mode in ("sigint_in_save", "sigint_in_wait", "sigint_in_close"):
        for s in (2, 3):
            ck.save_async(s, state(s))
            print(f"ACCEPTED {s}", flush=True)  # the signal may land in the first save below (a busy machine)
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
    if mode == "interrupt_everywhere":
        faulthandler.dump_traceback_later(90, exit=True)  # a hang shows where, then the child ends
        _interrupt_everywhere(ck)
        return
    if mode == "interrupt_read":
        faulthandler.dump_traceback_later(30, exit=True)  # a hang shows where, then the child ends
        from nebula_ckpt.native import describe
        for fresh in (True, False) if describe()["path"] == "pure-pytorch" else (False,):
            _interrupt_read(root, fresh)
        return
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
    if mode in ("close_timeout", "close_timeout_exit"):
        for s in (2, 3, 4):  # 32 MB more each: still being written when close() gives up
            ck.save_async(s, {**state(s), "pad": torch.full((8_000_000,), float(s))})
        try:
            ck.close(timeout=0.001)
        except TimeoutError as e:
            print(f"TIMEOUT {e}", flush=True)
        if mode == "close_timeout_exit":
            return  # the exit hook finishes that close
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
