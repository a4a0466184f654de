"""The health records of one root: read a checkpoint's mark, append a record, drop old ones.

The records (:mod:`nebula_ckpt.format.health`) live on the root's persistent storage. The marks
of one checkpoint are folded newest first (:func:`fold`): a person's mark (``nebula-ckpt mark``)
and a *suspect* mark from the training signal decide; a *healthy* mark from the training signal
never clears a suspect one (only a person does). Nothing here ever raises to a restore: a record
that cannot be listed, read or parsed is skipped with a warning, and a checkpoint whose marks
cannot be read is *unknown*, which restores as it would without any record.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Optional

from nebula_ckpt.format.commit import read_commit
from nebula_ckpt.format.health import (
    BY_REPORT,
    HEALTH_DIR,
    HEALTHY,
    MAX_RECORD_BYTES,
    SUSPECT,
    HealthRecord,
    RecordName,
    health_folder,
    parse_record,
)
from nebula_ckpt.format.names import parse_step_dir, step_dir
from nebula_ckpt.storage.base import Storage

log = logging.getLogger("nebula_ckpt")

UNKNOWN = "unknown"
#: a create-only write that finds its name taken tries again this many times, one ns later each
_CREATE_TRIES = 8


@dataclass(frozen=True)
class Mark:
    """What the records say of one checkpoint: ``state`` (``"healthy"``, ``"suspect"`` or
    ``"unknown"``), why (the deciding record's reason) and who decided (``"report"``, ``"user"``;
    None when unknown)."""

    state: str
    reason: str = ""
    by: Optional[str] = None


NO_MARK = Mark(UNKNOWN)


def fold(records: Iterable[HealthRecord]) -> Mark:
    """The mark of one checkpoint from its records, given newest first (an iterable: it is read
    only as far as needed). A suspect mark or a person's mark decides at once; healthy marks from
    reports only count when nothing else came before them."""
    confirmed: Optional[HealthRecord] = None
    for r in records:
        if r.by == BY_REPORT and r.state == HEALTHY:
            confirmed = confirmed or r
            continue
        return Mark(r.state, r.reason, r.by)
    return Mark(HEALTHY, confirmed.reason, BY_REPORT) if confirmed is not None else NO_MARK


class HealthView:
    """The marks of a root's checkpoints as read now (each folder listed once, each record read at
    most once); for one restore, one listing, one retention pass. Never raises."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._steps: Optional[set[str]] = None
        self._marks: dict[tuple[int, int, Optional[int]], Mark] = {}
        self._warned = False

    def mark(self, generation: int, step: int, save: Optional[int] = None) -> Mark:
        """The mark of the checkpoint ``(generation, step)``, of its write ``save`` (its marker's
        ``save``; None: any write, every mark of the checkpoint counts), ``unknown`` when nothing
        says more."""
        key = (generation, step, save)
        if key not in self._marks:
            try:
                self._marks[key] = self._read(generation, step, save)
            except Exception as e:  # a record store that cannot be read never fails a restore
                self._warn(f"cannot read the health records of step {step}: {type(e).__name__}: {e}")
                self._marks[key] = NO_MARK
        return self._marks[key]

    def has_records(self, step: int) -> bool:
        """Whether any record of ``step`` may exist (one listing of the records' folder, kept)."""
        if self._steps is None:
            self._steps = set(self.storage.list(HEALTH_DIR))
        return step_dir(step) in self._steps

    def _read(self, generation: int, step: int, save: Optional[int]) -> Mark:
        if not self.has_records(step):
            return NO_MARK
        folder = health_folder(step)
        named = [(n, RecordName.parse(n)) for n in self.storage.list(folder)]
        ours = sorted(((rn.time_ns, n) for n, rn in named if rn is not None and rn.generation == generation),
                      reverse=True)
        return fold(r for r in (self._record(folder, n, step) for _, n in ours) if r is not None and r.applies_to(save))

    def _record(self, folder: str, name: str, step: int) -> Optional[HealthRecord]:
        """One record, or None (skipped, with a warning) when it is not one we can trust."""
        rel = f"{folder}/{name}"
        try:
            if self.storage.size(rel) > MAX_RECORD_BYTES:
                raise ValueError(f"larger than {MAX_RECORD_BYTES} bytes")
            return parse_record(self.storage.read_small(rel, MAX_RECORD_BYTES), name, step)
        except Exception as e:  # torn, crafted, gone meanwhile, a link: not a record
            self._warn(f"ignoring health record {rel}: {type(e).__name__}: {e}")
            return None

    def _warn(self, text: str) -> None:
        (log.debug if self._warned else log.warning)("nebula_ckpt: %s", text)
        self._warned = True


class HealthBook:
    """The health records of one root (its persistent storage ``storage``). Thread-safe.

    Args:
        storage: the root's persistent storage (every rank of a job sees the same one).
    """

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._lock = threading.Lock()
        self._last_ns = 0

    def view(self) -> HealthView:
        """A fresh reader of the marks."""
        return HealthView(self.storage)

    def append(self, *, step: int, generation: int, state: str, by: str, rank: Optional[int],
               reason: str, save: Optional[int] = None) -> HealthRecord:
        """Create one record (create-only: never over another), durable on return; the record
        (``save``: the write marked, None: every write of ``(generation, step)``).

        The record is stamped after every record of that checkpoint already there, whatever the
        clocks of the machines that wrote them (a node whose clock ran ahead, a clock stepped back):
        a mark decides over every mark made before it.

        Raises:
            OSError (or a storage error): the record could not be written (or the records there
                could not be listed).
        """
        after = self._newest_ns(step, generation)
        for _ in range(_CREATE_TRIES):
            with self._lock:
                self._last_ns = max(self._last_ns + 1, time.time_ns(), after + 1)
                now = self._last_ns
            rec = HealthRecord(step=step, generation=generation, time_ns=now, state=state, by=by, rank=rank,
                               reason=reason, save=save)
            try:
                self.storage.write_small(rec.path, rec.to_bytes(), create_only=True)
            except FileExistsError:
                continue  # the same name at the same ns (another process of this rank): take the next ns
            log.log(logging.WARNING if state == SUSPECT else logging.INFO,
                    "nebula_ckpt: step %d (writer generation %d) marked %s: %s", step, generation, state, reason)
            return rec
        raise FileExistsError(f"{self.storage.display_url}: could not create a health record of step {step}")

    def _newest_ns(self, step: int, generation: int) -> int:
        """The time in the name of the newest record of ``(generation, step)`` there (0: none)."""
        named = (RecordName.parse(n) for n in self.storage.list(health_folder(step)))
        return max((rn.time_ns for rn in named if rn is not None and rn.generation == generation), default=0)

    def prune(self, held: set[int]) -> int:
        """Remove the records of every step below the newest of ``held`` (the steps some tier still
        holds, and those on their way to one) that is not in ``held``: its checkpoints are gone
        (a step above the newest may be one on its way). The folders removed. Best effort: a
        failure is logged."""
        gone = 0
        newest = max(held, default=-1)
        try:
            for name in self.storage.list(HEALTH_DIR):
                s = parse_step_dir(name)
                if s is not None and s < newest and s not in held:
                    self.storage.remove_dir(health_folder(s))
                    gone += 1
        except Exception as e:
            log.warning("nebula_ckpt: cannot drop old health records on %s: %s: %s", self.storage.display_url,
                        type(e).__name__, e)
        return gone


def newest_healthy(book: HealthBook, storage: Storage, committed: list[int]) -> set[int]:
    """The newest of ``committed`` (steps on ``storage``, oldest first) marked healthy, as a set (empty
    when none is): what retention keeps whatever ``keep_last`` says, so that the only good step is
    never deleted while newer suspect or unconfirmed ones stay. Never raises."""
    view = book.view()
    try:
        for s in reversed(committed):
            if not view.has_records(s):
                continue
            c = read_commit(storage, s, f"step {s}")
            if view.mark(c.generation, s, c.save).state == HEALTHY:
                return {s}
    except Exception as e:  # retention goes on without it
        log.debug("nebula_ckpt: cannot find the newest healthy step on %s: %s", storage.display_url, e)
    return set()
