"""The training signal of one Checkpointer: from reports to durable health marks.

Called on the training thread: :meth:`HealthMonitor.report` after a step, :meth:`~HealthMonitor.saved`
after each ``save_async``, :meth:`~HealthMonitor.restored` after each restore. It decides:

- a step saved by this process is marked *healthy* once the next ``healthy_after`` reported steps
  had a finite loss (written in the background, by rank 0 only: one record per step; every rank
  follows its steps the same way, so that its retention keeps them before that mark is written:
  :meth:`HealthMonitor.held`);
- a bad report (a non-finite loss, or one the user's rule refuses) within ``suspect_within``
  reported steps after a restore from step S marks S *suspect*, and with it every step this
  process saved since (they carry S's state forward); a step saved after a bad report and before
  any finite one is suspect at once. Suspect marks are written before ``report`` returns, by the
  rank that saw the bad loss: in a multi-rank job each rank judges its own reports (no collective
  per step), and since every rank restored the same step and saved the same steps, the marks any
  rank writes are the job's;
- a finite loss with a non-finite ``grad_norm`` (a step an AMP loss scaler skipped) neither
  confirms nor blames anything.

A failure to write a record is logged (ERROR), never raised into the training loop. A suspect mark
that could not be written is kept and tried again (at a report or a save, at most every
``_RETRY_EVERY_S``; before ``close()`` copies a step to a persistent tier; at ``close()``): until it
is written, ``close()`` puts no copy of its step on a persistent tier (:meth:`HealthMonitor.suspect`,
asked by :func:`~nebula_ckpt.save.drain.flush_newest`), so a restart cannot find that step there unmarked.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Optional

from nebula_ckpt.errors import ValidationError
from nebula_ckpt.format.commit import committed_steps
from nebula_ckpt.format.health import BY_REPORT, HEALTHY, SUSPECT
from nebula_ckpt.health.book import HealthBook
from nebula_ckpt.health.policy import HealthPolicy
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.workers import Workers

log = logging.getLogger("nebula_ckpt")

#: steps waiting for their confirmation at most (a job that saves and never reports holds no more), and
#: saves since the restore followed at most (the newest: retention deleted older ones, but for milestones)
_MAX_PENDING = 64
#: the records of steps no tier holds are dropped at a Checkpointer's first mark and after every this many
#: more (the first: a restarted job's lifetimes may each write fewer than this many)
_PRUNE_EVERY = 16
#: the latest saves, whose steps keep their records while they may still be on their way to a tier
_RECENT_SAVES = 8
#: how long close() waits for the healthy marks still being written
_CLOSE_WAIT_S = 60.0
#: a suspect mark that failed is tried again at a report or a save at most this often (a blob store
#: that is down would otherwise hold every training step for its timeout)
_RETRY_EVERY_S = 10.0

#: a suspect mark: (generation, None: this writer's; step; reason; the write's save number, None: any write)
SuspectMark = tuple[Optional[int], int, str, Optional[int]]


def as_signal(value: Any, name: str, optional: bool = False) -> Optional[float]:
    """``value`` (a real number, or a one-element tensor or array) as a float.

    Raises:
        ValidationError: naming ``name``, for anything else.
    """
    if value is None and optional:
        return None
    if hasattr(value, "numel") and hasattr(value, "item"):  # a tensor: one element
        if value.numel() != 1 or value.is_complex():
            raise ValidationError(f"report(): {name} must be a real number or a one-element tensor, got a tensor "
                                  f"of shape {tuple(value.shape)} and dtype {value.dtype}")
        value = value.detach().item()
    elif hasattr(value, "item") and getattr(value, "size", None) == 1:  # a numpy scalar or array
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValidationError(f"report(): {name} must be a real number or a one-element tensor, got "
                              f"{type(value).__name__}")
    try:
        return float(value)
    except OverflowError:  # an int beyond float: as large a loss as can be
        return math.inf


@dataclass
class _Pending:
    """A checkpoint waiting for ``healthy_after`` finite reports (``generation`` None: this writer's;
    ``save``: its write's save number, None: not known)."""

    generation: Optional[int]
    step: int
    save: Optional[int] = None
    finite: int = 0
    first: Optional[int] = None


class HealthMonitor:
    """Turns one Checkpointer's reports into health marks (see the module docstring). Thread-safe.

    Args:
        book: the root's health records.
        policy: ``k``, ``N`` and the rule.
        rank: this process's rank (rank 0 writes the healthy marks).
        generation: this writer's generation (called once, when a mark of its own step is written).
    """

    def __init__(self, book: HealthBook, policy: HealthPolicy, rank: int, generation: Callable[[], int]) -> None:
        self.book = book
        self.policy = policy
        self.rank = rank
        self._generation = generation
        self._lock = threading.RLock()
        #: by step, oldest first (a dict: a save replaces its step's entry without a scan)
        self._pending: dict[int, _Pending] = {}
        self._restored: Optional[tuple[int, int, Optional[int]]] = None
        self._since_restore = 0
        #: the saves (step, save number) made since the restore
        self._descendants: list[tuple[int, Optional[int]]] = []
        self._bad: Optional[str] = None
        self._last_step: Optional[int] = None
        self._rule_failed = False
        self._workers: Optional[Workers] = None
        self._futures: list[Future[Any]] = []
        #: the records this process wrote
        self._written = 0
        #: the storages of the Checkpointer's tiers (set at its first save): the steps they hold keep their records
        self.tiers: list[Storage] = []
        self._recent: deque[int] = deque(maxlen=_RECENT_SAVES)
        self._confirmed: Optional[int] = None
        #: suspect marks not written yet (tried again), and the checkpoints marked suspect by this process
        self._unwritten: list[SuspectMark] = []
        self._suspects: set[tuple[int, int, Optional[int]]] = set()
        self._retry_at = 0.0
        #: whether this process reported anything yet
        self.reported = False

    # -- training thread ------------------------------------------------------------------------
    def report(self, step: int, loss: float, grad_norm: Optional[float]) -> None:
        """One reported step (validated numbers)."""
        with self._lock:
            if self._unwritten and time.monotonic() >= self._retry_at:
                self._retry(final=False)
            self.reported = True
            new = step != self._last_step
            self._last_step = step
            if new and self._restored is not None:
                self._since_restore += 1
                if self._since_restore > self.policy.suspect_within:  # the restore passed its window
                    self._restored, self._descendants = None, []
            why = self._judge(step, loss, grad_norm)
            if why is not None:
                self._on_bad(why)
            elif new and (grad_norm is None or math.isfinite(grad_norm)):
                self._on_finite(step)

    def saved(self, step: int, save: Optional[int] = None) -> None:
        """``save_async(step)`` was accepted, as the job's save number ``save`` (the write's marks name it)."""
        with self._lock:
            if self._unwritten and time.monotonic() >= self._retry_at:
                self._retry(final=False)
            if self._bad is not None:
                self._suspect([(None, step, f"saved after a bad report ({self._bad}) and before any finite one", save)])
                return
            self._recent.append(step)
            if self._restored is not None:  # bounded: a job that never reports never ends the window
                self._descendants = self._descendants[1 - _MAX_PENDING:] + [(step, save)]
            # every rank follows its steps (each judges its own reports, as rank 0 does): its
            # retention keeps them on its own tiers without waiting for rank 0's mark on the root
            pending = self._pending
            pending.pop(step, None)
            while len(pending) >= _MAX_PENDING:
                del pending[next(iter(pending))]
            pending[step] = _Pending(None, step, save)

    def restored(self, generation: int, step: int, state: str, save: Optional[int] = None) -> None:
        """The checkpoint ``(generation, step)`` (its write ``save``, None: not known), marked
        ``state``, was restored: reports from now on judge it (and a run from it begins: what was
        pending before is no longer followed)."""
        with self._lock:
            self._restored, self._since_restore, self._descendants = (generation, step, save), 0, []
            self._confirmed = None  # a run from the restored step begins; its marks are on the root
            self._bad, self._last_step = None, None
            follow = state not in (HEALTHY, SUSPECT)
            self._pending = {step: _Pending(generation, step, save)} if follow else {}

    def held(self, committed: list[int]) -> set[int]:
        """Of ``committed`` (a tier's steps), those retention keeps beside ``keep_last`` so that a
        good step is never deleted before it could be confirmed: the oldest one still waiting for
        its finite reports, and the newest this process confirmed healthy (its mark may still be
        on its way). A job that saves more often than it reports, or keeps one checkpoint, would
        otherwise delete every step before its mark, and be left with suspect ones only. Any thread."""
        on_tier = set(committed)
        with self._lock:
            waiting = next((s for s in self._pending if s in on_tier), None)
            return {s for s in (waiting, self._confirmed) if s is not None and s in on_tier}

    def settle(self) -> None:
        """Try the suspect marks not written yet again, now: called before ``close()`` copies a
        step to a persistent tier, so that the copy finds its mark on the root."""
        with self._lock:
            if self._unwritten:
                self._retry(final=False)

    def suspect(self, generation: int, step: int, save: Optional[int] = None) -> bool:
        """Whether this process marked the checkpoint ``(generation, step)`` suspect (its write
        ``save``; None: any write of it), or failed to so far (such a step is never copied to a
        persistent tier by ``close()``), unless a person marked it healthy since (the root's mark
        of it is healthy: a healthy mark from reports never clears a suspect one). Any thread."""
        with self._lock:
            marked: list[tuple[Optional[int], Optional[int]]] = [(g, v) for g, s, v in self._suspects if s == step]
            unwritten = [(g, v) for g, s, _, v in self._unwritten if s == step]

        def match(g: Optional[int], v: Optional[int]) -> bool:
            # a generation None: this writer's could not be had yet; whichever it is, the step is not copied
            return g in (generation, None) and (v is None or save is None or v == save)

        if any(match(g, v) for g, v in unwritten):
            return True
        return any(match(g, v) for g, v in marked) and self.book.view().mark(generation, step, save).state != HEALTHY

    # -- decisions --------------------------------------------------------------------------------
    def _judge(self, step: int, loss: float, grad_norm: Optional[float]) -> Optional[str]:
        """Why this report is bad, or None."""
        if not math.isfinite(loss):
            return f"loss {loss} at step {step}"
        if self.policy.rule is None:
            return None
        try:
            why = self.policy.rule(step, loss, grad_norm)
        except Exception as e:  # a broken rule never stops training; said once
            if not self._rule_failed:
                log.error("nebula_ckpt: the health rule raised %s: %s (its verdicts are ignored)", type(e).__name__, e)
            self._rule_failed = True
            return None
        return f"step {step}: {why}" if why else None

    def _on_bad(self, why: str) -> None:
        if self._restored is not None:
            g, s, v = self._restored
            n = self._since_restore
            marks: list[SuspectMark] = [
                (g, s, f"{why}, {n} reported step{'s' if n != 1 else ''} after a restore from it", v)]
            # every step saved since, the restored step saved again by this run included (its own
            # generation's checkpoint of that step carries the same state forward)
            marks += [(None, d, f"saved from step {s}, which went bad ({why})", dv) for d, dv in self._descendants]
            self._restored, self._descendants = None, []
            self._suspect(marks)
        self._pending = {}  # not confirmed: they stay unknown
        self._bad = why

    def _on_finite(self, step: int) -> None:
        self._bad = None
        done = []
        for p in self._pending.values():
            p.finite += 1
            p.first = step if p.first is None else p.first
            if p.finite >= self.policy.healthy_after:
                done.append(p)
        if done:
            self._confirmed = done[-1].step  # the newest saved of them (a save moves its step to the end)
        for p in done:
            del self._pending[p.step]
            if self.rank != 0:  # rank 0 writes the healthy marks: one record per step
                continue
            span = f"step {p.first}" if p.first == step else f"steps {p.first}-{step}"
            self._submit(p, f"the loss was finite at the {p.finite} reported step(s) after it ({span})")

    # -- writing ------------------------------------------------------------------------------------
    def _suspect(self, marks: list[SuspectMark]) -> None:
        """Write suspect marks now (before ``report`` returns): they are what stops a loop. One that
        fails is kept and tried again (:meth:`_retry`)."""
        for mark in marks:
            e = self._write_suspect(mark)
            if e is not None:
                log.error("nebula_ckpt: could not mark step %d suspect on %s (%s: %s): it is tried again at the next "
                          "report, save and at close(); meanwhile close() puts no copy of it on a persistent tier",
                          mark[1], self.book.storage.display_url, type(e).__name__, e)

    def _retry(self, final: bool) -> None:
        """Write the suspect marks that failed before; those that fail again stay (``final``: the
        last try, at close: each is said at ERROR, with the command that marks it by hand)."""
        marks, self._unwritten = self._unwritten, []
        for mark in marks:
            e = self._write_suspect(mark)
            if e is None:
                continue
            if final:
                log.error("nebula_ckpt: step %d is not marked suspect on %s (%s: %s): a restore may pick it again; "
                          "mark it with `nebula-ckpt mark ROOT --suspect %d`", mark[1], self.book.storage.display_url,
                          type(e).__name__, e, mark[1])
            else:
                log.debug("nebula_ckpt: step %d still not marked suspect: %s: %s", mark[1], type(e).__name__, e)

    def _write_suspect(self, mark: SuspectMark) -> Optional[Exception]:
        """Write one suspect mark; the failure (the mark is then kept in :attr:`_unwritten`), or None."""
        generation, step, reason, save = mark
        try:
            generation = self._generation() if generation is None else generation
            self.book.append(step=step, generation=generation, state=SUSPECT, by=BY_REPORT, rank=self.rank,
                             reason=reason, save=save)
        except Exception as e:
            self._unwritten.append((generation, step, reason, save))
            self._retry_at = time.monotonic() + _RETRY_EVERY_S
            return e
        self._suspects.add((generation, step, save))
        self._recorded()
        return None

    def _submit(self, p: _Pending, reason: str) -> None:
        """Write a healthy mark in the background."""
        self._background(self._write_healthy, p, reason)

    def _background(self, fn: Callable[..., None], *args: Any) -> None:
        with self._lock:
            if self._workers is None:
                self._workers = Workers(1, "nebula-health")
            self._futures = [f for f in self._futures if not f.done()]
            self._futures.append(self._workers.submit(fn, *args))

    def _write_healthy(self, p: _Pending, reason: str) -> None:
        try:
            g = self._generation() if p.generation is None else p.generation
            self.book.append(step=p.step, generation=g, state=HEALTHY, by=BY_REPORT, rank=self.rank, reason=reason,
                             save=p.save)
        except Exception as e:
            log.error("nebula_ckpt: could not mark step %d healthy on %s: %s: %s", p.step,
                      self.book.storage.display_url, type(e).__name__, e)
            return
        self._recorded()

    def _recorded(self) -> None:
        """One more record written: at the first and after every ``_PRUNE_EVERY`` more, rank 0 drops
        (in the background) the records of the steps no tier holds any more."""
        with self._lock:
            self._written += 1
            if self.rank == 0 and (self._written - 1) % _PRUNE_EVERY == 0:
                self._background(self._prune_records)

    def _prune_records(self) -> None:
        """Drop the records of the steps no tier holds (the root's, and every tier the Checkpointer
        opened) nor a recent save may still bring to one: bounded by retention, whatever it keeps."""
        try:
            with self._lock:
                root = self.book.storage
                tiers = [root, *(st for st in self.tiers if st.display_url != root.display_url)]
                held = set(self._recent)
            for st in tiers:
                held.update(committed_steps(st))
        except Exception as e:  # dropping old records is housekeeping: next time (never on a partial view)
            log.debug("nebula_ckpt: cannot list the tiers to drop old health records: %s", e)
            return
        self.book.prune(held)

    def close(self) -> None:
        """Try the suspect marks not written yet a last time; wait (a while) for the healthy marks
        still being written."""
        with self._lock:
            if self._unwritten:
                self._retry(final=True)
            futures, workers, self._workers, self._futures = self._futures, self._workers, None, []
        for f in futures:
            try:
                f.result(timeout=_CLOSE_WAIT_S)
            except Exception as e:  # _write_healthy logs its own failures; a timeout is said here
                log.warning("nebula_ckpt: a health mark was not written before close: %s: %s", type(e).__name__, e)
        if workers is not None:
            workers.shutdown(wait=False)
