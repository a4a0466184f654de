"""One long-lived process of the stateful test: one JSON command a line on stdin, one JSON answer a line.

The driver (:mod:`stateful.machine`) keeps such processes warm (Python and torch imported), so
that an operation costs a pipe round trip, not a new interpreter. A process plays one part at a
time: a *job* (``open`` a :class:`~nebula_ckpt.Checkpointer` on a root, ``restore``, ``save`` ...,
then ``close`` or ``exit`` like a crash) or a *tool* (``cli`` runs ``nebula-ckpt`` commands,
``audit`` reads every committed step of every tier on its own). It plays it on a simulated node:
``NEBULA_SHM_DIR`` (and ``NEBULA_NODE_ID``) are the node's, set by the command that gives the part.

``arm`` makes the process SIGKILL itself at a named point: the first (after ``skip``) library log
line that contains every string of ``at`` (the library's ``phase=...`` DEBUG lines and the lines
naming each step retention deletes). The kill is a real ``SIGKILL`` of this process, from the
thread that reached the point, before that point's action runs. ``save_begin`` holds the library
thread that logs a named line instead (:class:`PauseAt`) until ``save_end``: a save stopped
mid-way while the driver runs the operator's commands beside it.

Each node has its own wall clock (``clock``: how far it runs behind the machine's): ``time.time()``
and ``time.time_ns()`` of this process are shimmed before torch and nebula_ckpt are imported and
read the clock of the node the process plays on. ``open`` / ``restore`` with ``nofile`` restore
with only that many file descriptors to spare (``RLIMIT_NOFILE``, for ``load_latest`` alone).

The states saved are :mod:`stateful.states`' (every byte says which save and rank it belongs to).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from typing import Any, Optional

# the protocol owns the real stdout; anything else printed goes to stderr (the worker's log file)
_PROTO = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr

#: the simulated wall clock: this process's ``time.time()`` / ``time.time_ns()`` run ``OFFSET_NS[0]``
#: ns off the machine's (a node whose clock was stepped back), set per node by ``clock`` before
#: torch and nebula_ckpt are imported, so that every call the library makes reads it
_REAL_TIME, _REAL_TIME_NS = time.time, time.time_ns
OFFSET_NS = [0]


def _shifted_time() -> float:
    return _REAL_TIME() + OFFSET_NS[0] / 1e9


def _shifted_time_ns() -> int:
    return _REAL_TIME_NS() + OFFSET_NS[0]


time.time, time.time_ns = _shifted_time, _shifted_time_ns

import torch  # noqa: E402

torch.set_num_threads(1)

import nebula_ckpt as nc  # noqa: E402
from stateful.states import blank_state, decode, live_state, make_state  # noqa: E402

make_state(0, 0, 0)  # a spare pays now for what the first optimizer imports (torch._dynamo: seconds)


class KillAt(logging.Handler):
    """SIGKILL this process at the first library log line containing every string of ``at``
    (after ``skip`` such lines). Attached to the ``nebula_ckpt`` logger; armed by ``arm``."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.at: Optional[list[str]] = None
        self.skip = 0

    def emit(self, record: logging.LogRecord) -> None:
        if self.at is None:
            return
        msg = record.getMessage()
        if all(s in msg for s in self.at):
            if self.skip > 0:
                self.skip -= 1
                return
            os.kill(os.getpid(), signal.SIGKILL)


class PauseAt(logging.Handler):
    """Hold the library thread that logs the first line containing every string of ``at`` until
    :meth:`release`: a save stopped mid-way (its other threads go on) while the operator's commands
    run beside it. ``handle`` is overridden so that the held thread keeps no handler lock (other
    threads' log lines pass)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.at: Optional[list[str]] = None
        self.reached, self.go = threading.Event(), threading.Event()

    def arm(self, at: Optional[list[str]]) -> None:
        self.reached.clear()
        self.go.clear()
        self.at = at

    def release(self) -> None:
        self.at = None
        self.go.set()

    def handle(self, record: logging.LogRecord) -> bool:  # type: ignore[override]
        at = self.at
        if at is None or not all(s in record.getMessage() for s in at):
            return False
        self.at = None
        self.reached.set()
        self.go.wait(PAUSE_MAX_S)  # never for good: a driver that died must not leave the thread held
        return True

    def emit(self, record: logging.LogRecord) -> None:
        pass


#: seconds a paused library thread waits for ``save_end`` at most
PAUSE_MAX_S = 600.0
KILL = KillAt()
PAUSE = PauseAt()
_lib_log = logging.getLogger("nebula_ckpt")
_lib_log.addHandler(KILL)
_lib_log.addHandler(PAUSE)
_to_log = logging.StreamHandler(sys.stderr)  # the worker's log file: what the library said, for a failure's report
_to_log.setLevel(logging.INFO)
_to_log.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(levelname)s %(message)s"))
_lib_log.addHandler(_to_log)
_lib_log.setLevel(logging.INFO)


class Worker:
    def __init__(self) -> None:
        self.ck: Optional[nc.Checkpointer] = None
        #: earlier Checkpointers of this job on its root, still open (``op_reopen``): closed after ``ck``
        self.older: list[nc.Checkpointer] = []
        self.rank = 0
        self._root = ""
        self._tiers: dict[str, Any] = {}
        self.pending: Optional[Any] = None  # the handle of a save begun by ``save_begin``
        self.live: Optional[dict[str, Any]] = None  # the state of the last `save` (states.live_state)
        #: each node's wall clock: ns its clock runs behind the machine's (``clock``); None: no node yet
        self.clocks: dict[str, int] = {}
        self._node: Optional[str] = None
        #: the read of ``read_begin``: its thread, what lets it go on, what it found
        self._reader: Optional[threading.Thread] = None
        self._reader_go = threading.Event()
        self._reader_out: dict[str, Any] = {}
        self._unhook: Any = None

    # -- parts -------------------------------------------------------------------------------
    def node(self, cmd: dict[str, Any]) -> None:
        """Live on node ``cmd["node"]`` (its memory-tier folder ``cmd["shm"]``)."""
        os.environ["NEBULA_SHM_DIR"] = cmd["shm"]
        os.environ["NEBULA_NODE_ID"] = str(cmd["node"])
        if not os.path.lexists(cmd["shm"]):  # a file there stays (a node whose NEBULA_SHM_DIR is not a folder)
            os.makedirs(cmd["shm"], exist_ok=True)
        if "clocks" in cmd:
            self.clocks = {k: int(v) for k, v in cmd["clocks"].items()}
        self._node = str(cmd["node"])
        OFFSET_NS[0] = self.clocks.get(self._node, 0)

    def op_clock(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Set each node's wall clock (``offsets``: node -> ns off the machine's clock): the commands
        run on a node from now on read its clock (a job's process: its own node's, at once)."""
        self.clocks = {k: int(v) for k, v in cmd["offsets"].items()}
        if self._node is not None:
            OFFSET_NS[0] = self.clocks.get(self._node, 0)
        return {"time": time.time()}

    def op_arm(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Die at the point ``at`` (None: nowhere)."""
        KILL.at = None if cmd["at"] is None else [_as_remote(a) if self._tiers.get("zstd") else a for a in cmd["at"]]
        KILL.skip = int(cmd.get("skip", 0))
        _lib_log.setLevel(logging.INFO if KILL.at is None else logging.DEBUG)
        return {}

    def op_arm_call(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Die on entering ``cmd["call"]`` (``module:attribute`` or ``module:Class.method``), after
        ``skip`` calls: a point that logs no line of its own (a replicas' round, the keep round)."""
        import importlib

        module, _, name = cmd["call"].partition(":")
        owner: Any = importlib.import_module(module)
        *path, attr = name.split(".")
        for p in path:
            owner = getattr(owner, p)
        real = getattr(owner, attr)
        left = [int(cmd.get("skip", 0))]

        def dying(*a: Any, **kw: Any) -> Any:
            if left[0] <= 0:
                os.kill(os.getpid(), signal.SIGKILL)
            left[0] -= 1
            return real(*a, **kw)
        setattr(owner, attr, dying)
        return {}

    def op_open(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Become a job on ``root``: ``tiers`` = {"memory_keep", "disk_keep", "disk_every"}; then
        restore the newest checkpoint (``load_latest``) into a blank state."""
        self.node(cmd)
        os.environ.update(cmd.get("env", {}))
        for where, value in cmd.get("constants", {}).items():  # module:NAME -> value
            module, _, name = where.partition(":")
            setattr(importlib.import_module(module), name, value)
        if os.environ.get("STATEFUL_TRACE_OPEN"):
            import faulthandler
            faulthandler.dump_traceback_later(float(os.environ["STATEFUL_TRACE_OPEN"]), file=sys.stderr)
        if cmd.get("dist"):
            self._init_dist(cmd)
        self._root, self._tiers = cmd["root"], cmd["tiers"]
        self.ck = self._checkpointer()
        return self.op_restore(cmd)

    def _checkpointer(self) -> nc.Checkpointer:
        t = self._tiers
        disk_kw = {"keep_last": t["disk_keep"], "every": t["disk_every"], "every_seconds": t.get("disk_seconds")}
        # ``zstd``: the root folder's disk tier written compressed, through a file:// RemoteTier
        disk = nc.RemoteTier("file://" + os.path.abspath(self._root), compression="zstd", **disk_kw) \
            if t.get("zstd") else nc.LocalTier(self._root, **disk_kw)
        tiers = [nc.MemoryTier(keep_last=t["memory_keep"], replicas=t.get("replicas", 0)), disk]
        # ``budget``: a host-memory budget in bytes (a save waits for room, or says why none can come)
        budget = {"host_memory_budget": t["budget"], "on_full": "wait"} if t.get("budget") else {}
        return nc.Checkpointer(self._root, tiers=tiers, snapshot=t.get("snapshot", "auto"), **budget)

    @property
    def extra(self) -> int:
        """The elements of the state's plain tensor (``tiers["extra"]``; a large state under a budget)."""
        return int(self._tiers.get("extra", 5))

    def op_reopen(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """A second Checkpointer on the job's root while the first stays open (a framework that
        re-creates its plugin): it restores as ``op_open`` does; the saves from now on are its (the
        first one hands the root over at its first write)."""
        assert self.ck is not None
        self.older.append(self.ck)
        self.ck = self._checkpointer()
        return self.op_restore(cmd)

    def op_open_again(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """A new Checkpointer on the job's root in this process once the job's were closed (a
        framework that closes its plugin and makes another): it restores as ``op_open`` does."""
        assert self.ck is None
        self.ck = self._checkpointer()
        return self.op_restore(cmd)

    def _init_dist(self, cmd: dict[str, Any]) -> None:
        import torch.distributed as dist

        self.rank = int(cmd["rank"])
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cmd['port']}", rank=self.rank,
                                world_size=int(cmd["world"]))

    def op_restore(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.ck is not None
        st = blank_state(self.rank, int(cmd.get("into_extra", self.extra)))  # into_extra: an `into` that mismatches
        latest = self.ck.latest()  # what load_latest tries first, named without reading it (this rank's tiers)
        try:
            with _few_descriptors(cmd.get("nofile")):
                step = self.ck.load_latest(into=st)
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}", "listed": self._listed(), "latest": latest}
        got = {"step": step, "listed": self._listed(), "latest": latest}
        if step is not None:
            got["parts"] = decode(st, self.rank)
            got["tier"] = _as_local((self.ck.last_restore or {}).get("tier"))
            got["source"] = (self.ck.last_restore or {}).get("source")
        return got

    def _listed(self) -> dict[str, list[int]]:
        assert self.ck is not None
        return {_as_local(k).split(":")[0]: v for k, v in self.ck.list(detailed=True).items()}

    def op_save(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.ck is not None
        # the live objects of the save before, refilled (states.live_mode): the plan cache reused
        st = self.live = live_state(self.live, int(cmd["sid"]), int(cmd["fid"]), self.rank, self.extra)
        try:
            h = self.ck.save_async(int(cmd["step"]), st)
        except Exception as e:
            return {"ok": False, "error": f"{type(e).__name__}: {e}", "written": [], "dropped": []}
        out = _outcome(h)
        if self._tiers.get("zstd") and "local" in out["written"]:  # zstd frames in the step's shard(s)
            folder = os.path.join(self._root, f"step-{int(cmd['step'])}")
            shards = [os.path.join(folder, f) for f in os.listdir(folder) if f.startswith("shard")]
            out["zstd"] = any(b"\x28\xb5\x2f\xfd" in open(f, "rb").read() for f in shards)
        return out

    def op_save_begin(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """``save_async`` of step ``cmd["step"]``, its library thread held at the log line of ``pause``
        (:class:`PauseAt`): the answer comes once that thread is held (``paused``) or the save has
        finished without reaching the line (a tier its cadence skips, no retention to run).
        ``save_end`` lets it go on."""
        assert self.ck is not None and self.pending is None
        st = make_state(int(cmd["sid"]), int(cmd["fid"]), self.rank, self.extra)
        pause = cmd.get("pause")
        PAUSE.arm([_as_remote(a) for a in pause] if pause and self._tiers.get("zstd") else pause)
        _lib_log.setLevel(logging.DEBUG)
        try:
            h = self.ck.save_async(int(cmd["step"]), st)
        except Exception as e:
            self._unpause()
            return {"accepted": False, "error": f"{type(e).__name__}: {e}"}
        self.pending = h
        # the training thread confirms the copy (as its next step's hook would): the tier writers
        # wait for that before they commit (a failure of it is the handle's: save_end reports it)
        with contextlib.suppress(Exception):
            h.wait_snapshot()
        while not PAUSE.reached.wait(0.01) and not h.done():
            pass
        return {"accepted": True, "paused": PAUSE.reached.is_set()}

    def op_save_end(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Let the save ``save_begin`` held go on; its outcome as ``save``'s."""
        h, self.pending = self.pending, None
        self._unpause()
        assert h is not None
        return _outcome(h, HANDLE_WAIT_S)

    def _unpause(self) -> None:
        PAUSE.release()
        _lib_log.setLevel(logging.INFO if KILL.at is None else logging.DEBUG)

    def op_save_close_race(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """``save_async`` of step ``cmd["step"]`` on this thread (the training thread) while
        ``closers`` other threads call ``close()`` at once, ``delay`` s after all start (a negative
        delay: the save waits that long instead). The save is accepted and then written whole, or
        refused with a NebulaError; the closes return either way (``close``: an error, ``"hung"`` when
        one did not return in time; ``early``: one returned before the accepted save was written).
        The earlier Checkpointers of the job are closed after it (``open_again`` makes the next)."""
        ck = self.ck
        assert ck is not None
        st = make_state(int(cmd["sid"]), int(cmd["fid"]), self.rank, self.extra)
        delay, closers = float(cmd["delay"]), int(cmd.get("closers", 1))
        start = threading.Barrier(1 + closers)
        errors: list[Optional[str]] = []
        made: list[Any] = []  # the handle, once save_async returned it
        early: list[bool] = []  # a close() that returned while the accepted save was not written

        def closer() -> None:
            start.wait()
            time.sleep(max(delay, 0.0))
            errors.append(_error_of(ck.close))
            early.append(bool(made) and not made[0].done())

        threads = [threading.Thread(target=closer, name=f"stateful-closer-{i}", daemon=True) for i in range(closers)]
        for t in threads:
            t.start()
        start.wait()
        time.sleep(max(-delay, 0.0))
        h = None
        try:
            h = ck.save_async(int(cmd["step"]), st)
            made.append(h)
        except Exception as e:
            got: dict[str, Any] = {"accepted": False, "error": f"{type(e).__name__}: {e}",
                                   "nebula_error": isinstance(e, nc.NebulaError)}
        for t in threads:
            t.join(HANDLE_WAIT_S)
        hung = any(t.is_alive() for t in threads)
        if h is not None:  # every close() returns only once the accepted save is written (else "early")
            got = {"accepted": True, "early": any(early) or (not hung and not h.done()), **_outcome(h, HANDLE_WAIT_S)}
        got["close"] = "hung" if hung else next((e for e in errors if e), None)
        got["older"] = self._close_older()
        return got

    def op_close_in_step(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """The usual preemption handler's ``close()`` (a SIGTERM handler, less its exit) landing while
        ``optimizer.step()``'s pre-hook confirms the overlapped copy (``snapshot="async"``) of the save
        just accepted: the SIGTERM is sent from inside the hook, just before (``at="before"``) or just
        after (``"after"``) it waits for the copy, so the handler runs there (a real signal, at the
        next bytecode); ``at="save_async"``: inside ``save_async`` confirming the copy of the save
        before. Where that code does not run (no copy left to confirm: a copy made on the spot) it
        is sent after ``step()`` instead (``where`` says which). The close is deferred until the hook returns;
        the save must be written whole (the bytes from before the step), nothing may hang. The
        earlier Checkpointers of the job are closed after it (``open_again`` makes the next)."""
        from nebula_ckpt.save import snapshot as snapshot_mod  # the copy confirmation: where the signal lands

        ck = self.ck
        assert ck is not None
        st = make_state(int(cmd["sid"]), int(cmd["fid"]), self.rank, self.extra)
        for p in st["model"].parameters():
            p.grad = torch.ones_like(p)
        main, at, sent = threading.get_ident(), cmd.get("at", "before"), threading.Event()
        landed: dict[str, Any] = {}
        real = snapshot_mod.Snapshot.finish_copy

        def on_term(signum: int, frame: Any) -> None:
            names = _frames(frame)
            landed["where"] = "in save_async()" if "save_async" in names else \
                "in the step hook" if "_hook" in names else "after step()"
            landed["error"] = _error_of(ck.close)

        def finish_copy(snap: Any) -> None:
            names = _frames(sys._getframe())
            here = threading.get_ident() == main and not sent.is_set() and "confirm_inflight" in names and \
                ("save_async" in names) == (at == "save_async")
            if here and at != "after":
                sent.set()
                os.kill(os.getpid(), signal.SIGTERM)
            real(snap)
            if here and at == "after":
                sent.set()
                os.kill(os.getpid(), signal.SIGTERM)

        old = signal.signal(signal.SIGTERM, on_term)
        snapshot_mod.Snapshot.finish_copy = finish_copy  # type: ignore[method-assign]
        try:
            try:
                h = ck.save_async(int(cmd["step"]), st)
            except Exception as e:
                return {"accepted": False, "error": f"{type(e).__name__}: {e}", "older": self._close_older()}
            st["optim"].step()  # its pre-hook confirms the copy (with an overlapped snapshot)
            if not sent.is_set():
                os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(10_000):  # the handler runs on this thread at its next bytecode
                if "where" in landed:
                    break
                time.sleep(0.001)
        finally:
            snapshot_mod.Snapshot.finish_copy = real  # type: ignore[method-assign]
            signal.signal(signal.SIGTERM, old)
        got = {"accepted": True, **_outcome(h, HANDLE_WAIT_S), "where": landed.get("where"),
               "close": landed.get("error", "never ran"), "closed": ck.closed}
        got["older"] = self._close_older()
        return got

    def _close_older(self) -> Optional[str]:
        """Close the job's earlier Checkpointers (the newest first); the first error."""
        errs = [_error_of(ck.close) for ck in reversed(self.older)]
        self.ck, self.older = None, []
        return next((e for e in errs if e), None)

    def op_load(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """An in-process rollback: ``ck.load(step, into=...)`` into a blank state (what a loop that
        goes back to step ``cmd["step"]`` does); the step, which save each part holds and its tier."""
        assert self.ck is not None
        st = blank_state(self.rank, self.extra)
        try:
            step = self.ck.load(int(cmd["step"]), into=st)
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"}
        return {"step": step, "parts": decode(st, self.rank), "tier": (self.ck.last_restore or {}).get("tier")}

    def op_loop(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """A training loop under :class:`nebula_ckpt.LoopState` (a shuffled ``DataLoader``, draws from
        ``random``, NumPy and torch each batch) on the scratch root ``cmd["root"]`` (this node's memory
        tier and a disk tier of ``tiers``), saving every step, which at step ``at`` loads step ``back``
        (``ck.load``) and goes on (``mode`` "continue") or leaves the epoch (``"break"``); beside it
        the same loop without a checkpoint (``want``). What each batch saw, the tier of the load."""
        if "shm" in cmd:  # a tool process: on that node
            self.node(cmd)
        t = cmd["tiers"]
        mem = nc.MemoryTier(keep_last=t["memory_keep"])
        tiers = [mem, nc.LocalTier(cmd["root"], keep_last=t["disk_keep"], every=t["disk_every"])]
        out: dict[str, Any] = {"want": _loop_run(None, 0, 0, "")}
        ck = nc.Checkpointer(cmd["root"], tiers=tiers)
        try:
            out["seen"] = _loop_run(ck, int(cmd["at"]), int(cmd["back"]), cmd["mode"], out)
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"
        finally:
            ck.close()
            if mem.path:  # the scratch root's memory tier goes with it
                shutil.rmtree(mem.path, ignore_errors=True)
        return out

    def op_report(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """``ck.report(step, loss=...)`` for each ``[step, finite]`` of ``cmd["reports"]`` (NaN when not finite)."""
        assert self.ck is not None
        try:
            for step, finite in cmd["reports"]:
                self.ck.report(int(step), loss=1.0 if finite else float("nan"))
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"}
        return {}

    def op_remove(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """``ck.remove(step)``: the steps removed, or the error."""
        assert self.ck is not None
        try:
            return {"removed": self.ck.remove(int(cmd["step"]))}
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"}

    def op_close(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Close the job's Checkpointers; ``destroy_first``: destroy the process group before (the
        slip of a script that ends its job in that order)."""
        assert self.ck is not None
        if cmd.get("destroy_first"):
            import torch.distributed as dist

            dist.destroy_process_group()
        err = None
        for ck in [self.ck, *reversed(self.older)]:  # the newest first; the older ones handed over
            try:
                ck.close()
            except Exception as e:
                err = err or f"{type(e).__name__}: {e}"
        self.ck, self.older = None, []
        return {"error": err}

    def op_exit(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """End like a crash that leaves no time for anything (nothing is closed, no exit hook runs)."""
        _PROTO.write(json.dumps({"ok": True}) + "\n")
        _PROTO.flush()
        os._exit(0)

    # -- a reader beside the job (``stateful.damage_ops``) -------------------------------------
    def op_read_begin(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """A read-only ``Checkpointer(root, tiers=[LocalTier(root)])`` in a thread of this process:
        ``load_latest`` into a blank state (``what="load"``), or ``latest()`` (``"latest"``);
        held the first time it reads a file of a step (``stage``: ``"marker"``, its commit marker;
        ``"files"``, another of its files). The answer comes once it is held (``held``: the file) or
        done; ``read_end`` lets it go on and puts the storage's methods back (the tool process serves
        other commands meanwhile, unheld)."""
        from nebula_ckpt.storage.local import LocalStorage

        self.node(cmd)
        held: list[str] = []
        reached, go = threading.Event(), threading.Event()
        self._reader_go = go
        small, buffer = LocalStorage.read_small, LocalStorage.read_buffer
        def unhook() -> None:
            LocalStorage.read_small, LocalStorage.read_buffer = small, buffer  # type: ignore[method-assign]
        self._unhook = unhook

        def maybe(rel: str) -> None:  # the reader's thread only: this process serves other commands meanwhile
            if threading.current_thread().name != "reader":
                return
            if not held and rel.startswith("step-") and rel.endswith("/COMMIT") == (cmd["stage"] == "marker"):
                held.append(rel)
                reached.set()
                go.wait(PAUSE_MAX_S)

        def read_small(st: Any, rel: str, *a: Any, **kw: Any) -> Any:
            maybe(rel)
            return small(st, rel, *a, **kw)

        def read_buffer(st: Any, rel: str, *a: Any, **kw: Any) -> Any:
            maybe(rel)
            return buffer(st, rel, *a, **kw)

        LocalStorage.read_small, LocalStorage.read_buffer = read_small, read_buffer  # type: ignore[method-assign]
        out: dict[str, Any] = {}

        def read() -> None:
            try:
                with nc.Checkpointer(cmd["root"], tiers=[nc.LocalTier(cmd["root"])], read_only=True) as ck:
                    if cmd["what"] == "latest":
                        out["latest"] = ck.latest()
                    else:
                        st = blank_state(0, int(cmd.get("extra", 5)))  # the state's plain tensor, as saved
                        out["step"] = ck.load_latest(into=st)
                        if out["step"] is not None:
                            out["parts"] = decode(st, 0)
            except Exception as e:
                out["error"] = f"{type(e).__name__}: {e}"
            finally:
                reached.set()

        self._reader = threading.Thread(target=read, name="reader", daemon=True)
        self._reader_out = out
        self._reader.start()
        reached.wait(PAUSE_MAX_S)
        return {"held": held[0] if held and self._reader.is_alive() else None}

    def op_read_end(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Let the read ``read_begin`` held go on; what it found (``latest``, ``step`` and ``parts``) or its error."""
        self._reader_go.set()
        assert self._reader is not None
        self._reader.join(HANDLE_WAIT_S)
        self._unhook()
        if self._reader.is_alive():
            return {"error": "hung: the read did not end"}
        return self._reader_out

    # -- tools -------------------------------------------------------------------------------
    def op_cli(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """``nebula-ckpt ARGV`` in this process: its exit code, stdout and stderr."""
        from nebula_ckpt.cli import main

        self.node(cmd)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code_ = main(list(cmd["argv"]))
            except SystemExit as e:
                code_ = int(e.code or 0)
        return {"code": code_, "stdout": out.getvalue(), "stderr": err.getvalue()[-4000:]}

    def op_export(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """``nebula-ckpt export ROOT --step S --to FILE`` (a ``.pt`` file), then which save each part of
        the file holds as rank ``cmd["rank"]``'s state (``parts``), read with plain ``torch.load``."""
        path = cmd["to"]
        got = self.op_cli({**cmd, "argv": ["export", cmd["root"], "--step", str(cmd["step"]), "--to", path]})
        if got["code"] == 0:
            try:
                got["parts"] = decode(torch.load(path, weights_only=True), int(cmd["rank"]))
            except Exception as e:
                got["unreadable"] = f"{type(e).__name__}: {e}"
            os.unlink(path)
        return got

    def op_restore_alone(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """One process restores a job's root at world size 1 (an evaluation run, a job moved to one
        node): ``Checkpointer(root, read_only=True).load_latest(into=...)`` into a blank state, as
        rank ``cmd["rank"]``; then which save each part holds (``parts``), the step and its tier."""
        self.node(cmd)
        st = blank_state(int(cmd["rank"]))
        try:
            with nc.Checkpointer(cmd["root"], read_only=True) as ck:
                step = ck.load_latest(into=st)
                tier = (ck.last_restore or {}).get("tier")
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"}
        got: dict[str, Any] = {"step": step, "tier": tier}
        if step is not None:
            got["parts"] = decode(st, int(cmd["rank"]))
        return got

    def op_dcp_read(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """The root read two ways, as this node: ``load_latest`` of a read-only Checkpointer of its
        persistent tier (``latest``) and ``torch.distributed.checkpoint.load`` through
        ``NebulaStorageReader(root)`` (``dcp``, its step chosen by the reader); each the step and
        which save each part holds, or the error."""
        import torch.distributed.checkpoint as dcp

        from nebula_ckpt.restore.dcp_reader import NebulaStorageReader

        self.node(cmd)
        root, extra = cmd["root"], int(cmd.get("extra", 5))
        out: dict[str, Any] = {}
        st = blank_state(0, extra)
        try:
            with nc.Checkpointer(root, tiers=[nc.LocalTier(root)], read_only=True) as ck:
                step = ck.load_latest(into=st)
            out["latest"] = {"step": step, **({"parts": decode(st, 0)} if step is not None else {})}
        except Exception as e:
            out["latest"] = {"error": f"{type(e).__name__}: {e}"}
        ref = make_state(0, 0, 0, extra)  # a state dict of the saved keys, holding no save's bytes
        sd = {"model": ref["model"].state_dict(), "optim": ref["optim"].state_dict(), "extra": ref["extra"],
              "frozen": ref["frozen"], "meta": {"sid": -1, "fid": -1}}
        try:
            with NebulaStorageReader(root) as reader:
                step = reader.step
                dcp.load(sd, storage_reader=reader)
            out["dcp"] = {"step": step, "parts": decode(sd, 0)}
        except Exception as e:
            out["dcp"] = {"error": f"{type(e).__name__}: {e}"}
        return out

    def op_audit(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Every step committed on each tier of ``root`` as this node sees it (the memory tier and the
        disk tier, each opened alone, read-only): the writer generation of its commit marker and which
        save each part of it came from (or why it cannot be read)."""
        from nebula_ckpt.format.commit import read_commit
        from nebula_ckpt.storage.local import LocalStorage

        self.node(cmd)
        root = cmd["root"]
        out: dict[str, Any] = {}
        if not os.path.isdir(root):
            return {"tiers": out}
        for kind, tier in (("memory", nc.MemoryTier()), ("local", nc.LocalTier(root))):
            with nc.Checkpointer(root, tiers=[tier], read_only=True) as ck:
                steps: dict[str, Any] = {}
                folder = LocalStorage(tier.path if kind == "memory" else root, private=True, fsync=False)
                for s in ck.list():
                    entry: dict[str, Any] = {}
                    try:
                        entry["gen"] = read_commit(folder, s, "audit").generation
                        _, state = ck.read(s)
                        entry["parts"] = decode(state, 0)
                    except Exception as e:
                        entry["error"] = f"{type(e).__name__}: {e}"
                    steps[str(s)] = entry
                out[kind] = steps
        verify = self.op_cli({**cmd, "argv": ["verify", root, "--json"]})
        text = verify["stdout"].strip() or "[]"  # with nothing committed a line of text follows the JSON
        return {"tiers": out, "verify": json.JSONDecoder().raw_decode(text)[0]}


#: seconds a save's handle may take to finish before the worker reports it unfinished
HANDLE_WAIT_S = 120.0


def _outcome(h: Any, timeout: Optional[float] = None) -> dict[str, Any]:
    """What a save's handle says once it finished: ok, its error, the tiers written and dropped."""
    try:
        h.result(timeout)
        err = None
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    return {"ok": err is None, "error": err,
            "written": sorted({_as_local(t).split(":")[0] for t in h.tiers_written}),
            "dropped": sorted({_as_local(t).split(":")[0] for t in h.tiers_dropped}), "done": h.done()}


def _as_local(name: Optional[str]) -> Optional[str]:
    """A tier's name as the driver knows it: the root folder's zstd ``RemoteTier`` is its disk tier."""
    return "local:" + name[len("remote:file://"):] if name and name.startswith("remote:file://") else name


def _as_remote(at: str) -> str:
    """A kill point's log string for the disk tier when it is the root folder's ``RemoteTier``."""
    return at.replace("tier=local", "tier=remote").replace("tier local", "tier remote")


#: the loop of ``op_loop``: items of its dataset, per batch, epochs
LOOP_ITEMS, LOOP_BATCH, LOOP_EPOCHS = 10, 2, 2


def _loop_run(ck: Optional[nc.Checkpointer], at: int, back: int, mode: str,
              out: Optional[dict[str, Any]] = None) -> list[list[Any]]:
    """``op_loop``'s loop (``ck`` None: without a checkpoint): per batch (epoch, batch, step, items, a
    NumPy, a ``random`` and a torch draw); ``out["tier"]``: the tier the rollback read."""
    import random

    import numpy as np

    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    data = torch.utils.data.TensorDataset(torch.arange(LOOP_ITEMS, dtype=torch.float32))
    loop = nc.LoopState(torch.utils.data.DataLoader(data, batch_size=LOOP_BATCH, shuffle=True))
    state = {"loop": loop}
    seen: list[list[Any]] = []
    for epoch in loop.epochs(LOOP_EPOCHS):
        for (batch,) in loop:
            seen.append([epoch, loop.batch, loop.step, batch.tolist(), float(np.random.normal()), random.random(),
                         float(torch.rand(()))])
            if ck is None:
                continue
            ck.save_async(loop.step, state).result()
            if loop.step == at and len(seen) == at:
                ck.load(back, into=state)
                if out is not None:
                    out["tier"] = (ck.last_restore or {}).get("tier")
                    out["step_after_load"] = loop.step
                if mode == "break":
                    break
    return seen


@contextlib.contextmanager
def _few_descriptors(spare: Optional[int]) -> Any:
    """With ``spare`` (an int): the process may open only ``spare`` file descriptors more than it holds
    now (``RLIMIT_NOFILE``), until the block ends: a restore that runs out of them (``EMFILE``)."""
    if spare is None:
        yield
        return
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held = len(os.listdir("/proc/self/fd")) - 1  # less the listing's own
    resource.setrlimit(resource.RLIMIT_NOFILE, (held + int(spare), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _error_of(fn: Any) -> Optional[str]:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def _frames(frame: Any) -> list[str]:
    """The function names of ``frame``'s stack, innermost first."""
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return names


def main() -> None:
    w = Worker()
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            got = getattr(w, "op_" + cmd["op"])(cmd)
        except BaseException as e:  # an error of the test's own making: the driver shows it
            got = {"crash": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-4000:]}
        _PROTO.write(json.dumps(got, default=str) + "\n")
        _PROTO.flush()


if __name__ == "__main__":
    main()
