"""Internal: the SaveHandle, the two waitables of one asynchronous save.

``wait_snapshot()`` returns once the state has been copied to host memory (safe to change the
weights); ``result()`` once every tier that took the save has made it durable, raising the first
failure with its traceback chained.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from time import monotonic
from typing import Any, Callable, Optional

from nebula_ckpt.errors import FencedError, NebulaError, PersistError
from nebula_ckpt.latch import Latch

log = logging.getLogger(__name__)


def unguarded(name: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)``: the guard of a handle (or save pipeline) that no Checkpointer guards."""
    return fn(*args)


@dataclass(frozen=True)
class SaveMetrics:
    """What one save cost, as :attr:`SaveHandle.metrics` reports it (seconds from the start of
    ``save_async``; ``None`` while not known yet).

    Attributes:
        step: the step saved.
        bytes: size of the snapshot (the shard image: tensors plus header).
        blocked_s: time the training thread lost: the ``save_async`` call plus, for an overlapped
            copy, the wait of the next ``optimizer.step()`` / forward (or ``wait_snapshot()``) for it.
        snapshot_s: until the copy into host memory was done (safe to change the state).
        durable_s: tier name -> until the checkpoint was committed there (written tiers only).
        tiers_dropped: tiers that skipped it for a newer save; ``failed``: tiers that failed.
        written_bytes: tier name -> bytes of the shard this save wrote there (less than ``bytes``
            for an incremental save, which writes only the tensors that changed).
    """

    step: int
    bytes: int
    blocked_s: Optional[float]
    snapshot_s: Optional[float]
    durable_s: dict[str, float] = field(default_factory=dict)
    tiers_dropped: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()
    written_bytes: dict[str, int] = field(default_factory=dict)

    def throughput(self, tier: str) -> Optional[float]:
        """Bytes per second from the start of the save until durable on ``tier`` (None if not written)."""
        t = self.durable_s.get(tier)
        return self.bytes / t if t else None

    def to_dict(self) -> dict[str, Any]:
        """Plain values (JSON-ready), throughput per written tier included."""
        return {"step": self.step, "bytes": self.bytes, "blocked_s": self.blocked_s, "snapshot_s": self.snapshot_s,
                "durable_s": dict(self.durable_s),
                "throughput_bytes_per_s": {t: self.throughput(t) for t in self.durable_s},
                "tiers_dropped": list(self.tiers_dropped), "failed": list(self.failed),
                "written_bytes": dict(self.written_bytes)}

    def summary(self) -> str:
        """One line for a log: ``step 100: 1.49 GB, blocked 12.1 ms, snapshot 12.1 ms, durable memory 0.41 s, ...``."""
        def secs(v: Optional[float]) -> str:
            return "?" if v is None else (f"{v * 1e3:.1f} ms" if v < 1 else f"{v:.2f} s")
        parts = [f"step {self.step}: {self.bytes / 1e9:.3f} GB", f"blocked {secs(self.blocked_s)}",
                 f"snapshot {secs(self.snapshot_s)}"]
        for t, v in self.durable_s.items():
            parts.append(f"durable on {t} {secs(v)} ({self.bytes / v / 1e9:.2f} GB/s)" if v else f"durable on {t}")
        parts += [f"dropped by {t}" for t in self.tiers_dropped] + [f"FAILED on {t}" for t in self.failed]
        return ", ".join(parts)


class SaveHandle:
    """Handle of one :meth:`Checkpointer.save_async` call.

    Attributes:
        step: the step saved.
        tag: the tag given to ``save_async`` (None without one).
        tiers_written: names of the tiers where this checkpoint committed.
        tiers_dropped: tiers that skipped it because they were still busy with an older save
            (a slow tier never queues saves; it takes the newest one when it is free).
        skipped: reason if nothing was saved (no tier's cadence wanted it, or no free staging
            buffer with ``on_full="skip"``), else ``None``.
    """

    def __init__(self, step: int, tiers: list[str], tag: Optional[str] = None) -> None:
        self.step = step
        self.tag = tag
        self.tiers_written: list[str] = []
        self.tiers_dropped: list[str] = []
        self.skipped: Optional[str] = None
        self._errors: dict[str, BaseException] = {}
        self._pending = set(tiers)
        self._confirm: Optional[Callable[[], None]] = None
        self._guard: Callable[..., Any] = unguarded
        self._settled: Optional[Callable[[str], None]] = None
        # Latches, not Events: a Ctrl-C in a wait on them never leaves a lock held (nebula_ckpt.latch)
        self._snapshot = Latch()
        self._snapshot_error: Optional[BaseException] = None
        self._durable = Latch()
        self._lock = threading.Lock()
        self._pid = os.getpid()  # the process whose threads finish it (a fork's child has none of them)
        #: whether the caller has seen this save's outcome (set by result() / wait_snapshot() / the
        #: checkpointer raising it), so a failure is raised once
        self.seen = False
        self._t0 = monotonic()
        self._bytes = 0
        self._blocked: Optional[float] = None
        self._stalled = 0.0
        self._snapshot_at: Optional[float] = None
        self._durable_at: dict[str, float] = {}
        self._written: dict[str, int] = {}
        self._finished: Optional[Callable[["SaveHandle"], None]] = None
        #: the save pipeline's side of this handle (not for users: see :class:`SaveProgress`)
        self.progress = SaveProgress(self)
        if not tiers:
            self._snapshot.set()
            self._durable.set()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"SaveHandle(step={self.step}, {state}, written={self.tiers_written})"

    # -- public -------------------------------------------------------------------------------
    def wait_snapshot(self, timeout: Optional[float] = None) -> None:
        """Block until the snapshot copy has finished; after this, changing the state is safe.

        Raises:
            ConsistencyError: a tensor was modified in place while it was being copied.
            TimeoutError: not finished within ``timeout`` seconds.
            NebulaError: not finished, in a process forked from the one that made the save.
        """
        self._check_here("wait_snapshot", self._snapshot)
        finish = self._confirm
        if finish is not None and timeout is None:
            self._guard("SaveHandle.wait_snapshot", self._confirm_timed, finish)
        if not self._snapshot.wait(timeout):
            raise TimeoutError(f"snapshot of step {self.step} not finished after {timeout} s")
        if self._snapshot_error is not None:
            self.seen = True
            raise self._snapshot_error

    @property
    def metrics(self) -> SaveMetrics:
        """What this save cost so far (:class:`SaveMetrics`): complete once :meth:`done`."""
        with self._lock:
            blocked = None if self._blocked is None else self._blocked + self._stalled
            return SaveMetrics(self.step, self._bytes, blocked,
                               None if self._snapshot_at is None else self._snapshot_at - self._t0,
                               {t: at - self._t0 for t, at in self._durable_at.items()},
                               tuple(self.tiers_dropped), tuple(self._errors), dict(self._written))

    def done(self) -> bool:
        """Whether the save has finished on every tier (successfully or not)."""
        return self._durable.is_set()

    def result(self, timeout: Optional[float] = None) -> list[str]:
        """Wait until durable on every tier that took it; return the tiers written.

        Raises:
            PersistError: a tier failed (``failures`` maps tier -> exception; cause chained).
            ConsistencyError: the snapshot was torn by an in-place change.
            TimeoutError: not finished within ``timeout`` seconds.
            NebulaError: not finished, in a process forked from the one that made the save.
        """
        self._check_here("result", self._durable)
        confirm = self._confirm
        if confirm is not None:
            self._guard("SaveHandle.result", confirm)
        if not self._durable.wait(timeout):
            raise TimeoutError(f"save of step {self.step} not durable after {timeout} s")
        self.seen = True
        if self._snapshot_error is not None:
            raise self._snapshot_error
        if self._errors:
            raise self.error()  # type: ignore[misc]
        return list(self.tiers_written)

    def error(self) -> Optional[NebulaError]:
        """The failure of this save, if any (without raising)."""
        if self._snapshot_error is not None:
            return self._snapshot_error if isinstance(self._snapshot_error, NebulaError) else \
                PersistError(f"step {self.step}: snapshot failed: {self._snapshot_error}")
        if not self._errors:
            return None
        parts = "; ".join(f"{t}: {type(e).__name__}: {e}" for t, e in self._errors.items())
        # A fenced tier means another writer owns the root: say so by type, not only in the text.
        cls = FencedError if any(isinstance(e, FencedError) for e in self._errors.values()) else PersistError
        err = cls(f"step {self.step}: persisting failed on {len(self._errors)} tier(s): {parts}", self._errors)
        err.__cause__ = next(iter(self._errors.values()))
        return err

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait until every tier that took the save is done (written, dropped or failed); False on
        timeout. Unlike :meth:`result` it raises nothing and does not mark a failure as seen, so
        the checkpointer still raises it from the next ``save_async`` / ``wait`` / ``close``.
        In a process forked from the one that made the save, a save not finished raises :class:`NebulaError`."""
        self._check_here("wait", self._durable)
        return self._durable.wait(timeout)

    def _check_here(self, what: str, over: Latch) -> None:
        """Refuse a wait that would never end: ``over`` is not set and only another process's threads set it."""
        if self._pid != os.getpid() and not over.is_set():
            raise NebulaError(f"SaveHandle.{what}() of step {self.step} in a forked process: the parent process owns "
                              "the save and only its threads finish it; wait for it in the parent (done() here says "
                              "only whether it had finished when the process forked)")

    def _confirm_timed(self, finish: Callable[[], None]) -> None:
        t = monotonic()
        finish()  # waits for the copy itself (GIL released), not for the stager thread
        self.progress.add_stall(monotonic() - t)

    def _settle(self, tiers: "list[str]") -> None:
        if self._settled is not None:
            for t in tiers:
                self._settled(t)

    def _report(self) -> None:
        """The save is over on every tier: one INFO line, and the checkpointer's counters."""
        m = self.metrics
        if m.durable_s or m.failed:
            log.info("nebula_ckpt: %s", m.summary())
        if self._finished is not None:
            try:
                self._finished(self)
            except Exception as e:  # counters must never break a save
                log.debug("nebula_ckpt: save metrics callback failed: %s", e)


class SaveCounters:
    """The finished saves of one Checkpointer, counted for its ``stats()``: :meth:`add` each
    handle whose save is over (a writer thread), :meth:`get` a copy of the counters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: dict[str, Any] = {"saves_finished": 0, "bytes_saved": 0, "bytes_written": {}, "blocked_s_total": 0.0,
                                   "blocked_s_max": 0.0, "durable_s_last": {}, "last_save": None}

    def add(self, handle: SaveHandle) -> None:
        """The save of ``handle`` is over on every tier: fold its metrics in."""
        m = handle.metrics
        with self._lock:
            c = self._c
            c["saves_finished"] += 1
            c["bytes_saved"] += m.bytes
            for t, n in m.written_bytes.items():
                c["bytes_written"][t] = c["bytes_written"].get(t, 0) + n
            if m.blocked_s is not None:
                c["blocked_s_total"] += m.blocked_s
                c["blocked_s_max"] = max(c["blocked_s_max"], m.blocked_s)
            c["durable_s_last"].update(m.durable_s)
            c["last_save"] = m.to_dict()

    def get(self) -> dict[str, Any]:
        """The counters (copies)."""
        with self._lock:
            return {**self._c, "durable_s_last": dict(self._c["durable_s_last"]),
                    "bytes_written": dict(self._c["bytes_written"])}


class SaveProgress:
    """The save pipeline's side of one :class:`SaveHandle` (``handle.progress``): what the
    pipeline (:mod:`nebula_ckpt.save.pipeline`), the snapshot, the fan-out and the tier writers
    report on the save as it goes. Users read the outcome through the handle itself.
    """

    def __init__(self, handle: SaveHandle) -> None:
        self._h = handle
        #: the job's number of this save (its commit markers' ``save``; None: not numbered)
        self.save: Optional[int] = None

    def begin(self, t0: float, nbytes: int, finished: Optional[Callable[[SaveHandle], None]] = None) -> None:
        """When ``save_async`` started (monotonic), the snapshot's size, and who hears of the end."""
        h = self._h
        h._t0, h._bytes, h._finished = t0, nbytes, finished

    def bind_confirm(self, confirm: Callable[[], None], guard: Callable[..., Any] = unguarded) -> None:
        """The training-thread check ``wait_snapshot()`` / ``result()`` run first, through ``guard``
        (``guard(name, fn, *args)``: the Checkpointer's, so a ``close()`` from a signal handler that
        lands in the check, which takes the snapshot's lock, is deferred until it returns)."""
        self._h._confirm, self._h._guard = confirm, guard

    def bind_settled(self, settled: Callable[[str], None]) -> None:
        """Called with a tier's name once the save is over on that tier, however it ended
        (the pipeline tells the ranks' protocol that this rank is done with the save there)."""
        self._h._settled = settled

    def returned(self) -> None:
        """``save_async`` is returning to the training thread now."""
        self._h._blocked = monotonic() - self._h._t0

    def add_stall(self, seconds: float) -> None:
        """The training thread waited ``seconds`` for this save's copy (a hook, ``wait_snapshot``)."""
        with self._h._lock:
            self._h._stalled += seconds

    def snapshot_failure(self) -> Optional[BaseException]:
        """Why the snapshot failed, or None (tier writers check it before committing)."""
        return self._h._snapshot_error

    def snapshot_settled(self) -> bool:
        """Whether the copy's verdict is in."""
        return self._h._snapshot.is_set()

    def fail_snapshot(self, error: BaseException) -> None:
        """A later check (the training-thread confirmation) found the snapshot torn; keep the first."""
        if self._h._snapshot_error is None:
            self._h._snapshot_error = error

    def set_snapshot(self, error: Optional[BaseException] = None) -> None:
        """The copy is done (``error``: it failed, and so did the save on every tier)."""
        h = self._h
        if h._snapshot_at is None:
            h._snapshot_at = monotonic()
        h._snapshot_error = error
        h._snapshot.set()
        if error is not None:
            h._durable.set()
            h._settle(list(h._pending))

    def tier_done(self, tier: str, error: Optional[BaseException] = None, dropped: bool = False,
                  written: Optional[int] = None) -> None:
        """The save is over on ``tier``: written (``written``: the bytes of its shard there), failed
        with ``error``, or ``dropped`` for a newer one."""
        h = self._h
        with h._lock:
            if dropped:
                h.tiers_dropped.append(tier)
            elif error is not None:
                h._errors[tier] = forget_locals(error)
            else:
                h.tiers_written.append(tier)
                h._durable_at[tier] = monotonic()
                if written is not None:
                    h._written[tier] = written
            h._pending.discard(tier)
            last = not h._pending
        if last:
            h._report()
            h._durable.set()
        h._settle([tier])

    def part_done(self, part: str, error: Optional[BaseException] = None, dropped: bool = False) -> None:
        """A part of the save that is not a tier writer (the memory tier's ``replicas``, named with
        the tiers when the save began) is over, as :meth:`tier_done` says; ignored when the save
        is over already (skipped, aborted)."""
        with self._h._lock:
            if part not in self._h._pending:
                return
        self.tier_done(part, error, dropped)

    def abort(self, error: BaseException) -> None:
        """``save_async`` itself failed after the copy was enqueued (the pipeline has waited for
        the copy and taken the snapshot back): the save is over, with ``error``, and nothing of
        it is in flight. The caller got ``error`` raised, so it counts as seen. A signal
        handler's exception (``KeyboardInterrupt``, ``SystemExit``) is kept as a
        :class:`NebulaError` that says the save was interrupted."""
        h = self._h
        if not isinstance(error, Exception):
            error = NebulaError(f"step {h.step}: save_async() was interrupted ({type(error).__name__}) before it "
                                "returned: this save was not made")
        with h._lock:
            self.fail_snapshot(error)
            h._pending.clear()
            h.seen = True
        h._snapshot.set()
        h._durable.set()

    def skip(self, reason: str) -> None:
        """Nothing is saved, for ``reason`` (no tier's cadence wanted it, no free staging buffer)."""
        h = self._h
        h.skipped = reason
        h._bytes = 0  # no snapshot was taken
        h._settle(list(h._pending))
        h._pending.clear()
        h._snapshot.set()
        h._durable.set()


def forget_locals(error: BaseException) -> BaseException:
    """``error``, its frames' local variables dropped (the traceback still says where it was
    raised): a handle keeps its errors as long as the caller keeps it, and a tier writer's frames
    hold the snapshot, whose staging buffer (a slot file's tmpfs pages) would stay allocated with
    them. The frames still running (the caller's) are left out of the traceback."""
    seen: set[int] = set()
    exc: Optional[BaseException] = error
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            try:
                tb.tb_frame.clear()
            except RuntimeError:  # still running: its entry goes, as its locals cannot
                exc.__traceback__ = tb.tb_next
            tb = tb.tb_next
        exc = exc.__cause__ or exc.__context__
    return error
