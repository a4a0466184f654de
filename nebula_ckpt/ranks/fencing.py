"""Writer generations: how a stale writer is kept from touching a newer run's checkpoints.

Every writer takes a generation number before its first write, by *creating* the object
``_nebula/writers/g-<n>.json`` in the root with create-only semantics (``link`` on file systems,
``If-None-Match: *`` on blob stores): two writers can never get the same number. Before its first
write to any other tier, the writer records its generation there too. Shard files carry the
generation in their name, so writers never overwrite each other's data. Before writing a shard,
a manifest, the commit marker and before any deletion, a writer checks *that tier* for a higher
generation; if one exists, it raises :class:`~nebula_ckpt.errors.FencedError` and stops. Checking
each tier on its own storage keeps a fast tier working while a remote root is unreachable.

A writer fenced on one tier is fenced on all of them: the first :class:`FencedError` stops it
for good (every later check, on every tier, raises), and it gives back what it holds (the memory
tier's lock), so it commits nothing more anywhere. A fast tier that the newer writer never wrote
(a memory tier whose lock the stale writer held) would otherwise go on taking the stale writer's
steps. Every commit marker is written inside :meth:`TierFence.committing`, which refuses once the
writer is fenced, and :meth:`Fence.stop` waits for a marker being written, so from then on
nothing of this writer commits anywhere.

A save that ends in :class:`FencedError` must leave nothing behind that ``list()`` or ``load(N)``
would show: before it gives the memory tier's lock back, :meth:`Fence.stop` asks every tier
writer to take back the steps of the saves still in flight (:meth:`Fence.retract_with`), which
removes each one that carries this writer's generation (never a newer writer's step of the same
number: :func:`nebula_ckpt.format.commit.retract_step`). What it committed in saves that completed
carries its older generation, and restore never prefers an older generation's checkpoint to a
newer one's (:func:`nebula_ckpt.restore.select.list_candidates`).

The check and the commit are two operations, so a takeover in between can still race; then the
stale writer's manifest may replace the new one's, which the commit marker's manifest checksum
detects: that checkpoint is skipped on restore, never loaded torn.

A *past* writer generation (:meth:`Fence.past`) is how ``persist-memory`` writes a step that lives
only in the memory tiers: under the generation that made it, taken long ago by the job that is
gone. It takes no generation and records none, so it fences nobody; its check refuses once a
newer generation has *committed* a step on the tier (that job's steps supersede the memory step:
a restore prefers the newest generation's, :func:`nebula_ckpt.restore.select.list_candidates`).
A newer generation that has committed nothing yet loses nothing: its first commit outranks the
step written under the older generation.

Two writers of one process on one root (a framework that builds a second engine, or re-creates
its plugin, while the first one's ``Checkpointer`` is still open and persisting) *hand over*
instead (:meth:`Fence.take_over`): before the newer one takes its generation (or writes at all),
every older writer of this process on that root finishes the saves it has handed to its tiers
(its step committed on the memory tier reaches disk too), then stops as if fenced, with nothing
in flight to take back, and gives the memory tier's lock back, so that the newer one writes that
tier and finds every checkpoint the older one committed.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
import weakref
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Protocol

from nebula_ckpt.errors import CorruptCheckpointError, FencedError, NebulaError, PersistError
from nebula_ckpt.format.commit import Write, committed_steps, committed_writes, read_commit
from nebula_ckpt.format.names import (
    COMMIT,
    MAX_GENERATION,
    RUN_FILE,
    WRITERS_DIR,
    is_foreign_writer_record,
    step_dir,
    writer_generation,
    writer_record,
)
from nebula_ckpt.format.root_records import (
    MAX_ROOT_RECORD_BYTES,
    RUN_FIX,
    WriterRecord,
    encode_run_record,
    encode_writer_record,
    parse_run_record,
)
from nebula_ckpt.ranks.coordinator import Coordinator, LocalCoordinator
from nebula_ckpt.storage.base import Storage

log = logging.getLogger(__name__)

_KEEP_RECORDS = 16
#: how long a writer taking a root over waits for an older writer of this process on it to finish
#: the saves it has handed to its tiers (:meth:`Fence.take_over`)
HAND_OVER_TIMEOUT_S = 600.0

#: the writers of this process by root (:meth:`Fence.take_over`); a writer goes at :meth:`Fence.retire`
_WRITERS: dict[str, "weakref.WeakSet[Fence]"] = {}
_WRITERS_LOCK = threading.Lock()


def read_run_id(storage: Storage) -> Optional[str]:
    """The run id recorded on a persistent root, or ``None``: no run has opened it yet, or its run
    record is not one (a warning names the file, what is wrong and the fix; a reader treats it as
    no record, and a writer's :func:`run_id` refuses the root)."""
    rid, why = _run_record(storage)
    if why:
        log.warning("nebula_ckpt: %s", why)
    return rid


def _run_record(storage: Storage) -> tuple[Optional[str], str]:
    """``(run id, "")`` of the root's run record, ``(None, "")`` when there is none, and
    ``(None, why)`` when it is no run record (garbled, too large, a folder or a FIFO: never read)."""
    where = f"{storage.display_url}: {RUN_FILE}"
    try:
        raw = storage.read_small(RUN_FILE, MAX_ROOT_RECORD_BYTES)
    except FileNotFoundError:
        return None, ""
    except CorruptCheckpointError as e:  # no regular file, or too large: never read
        return None, f"{e}; {where} must be the regular file nebula_ckpt wrote: {RUN_FIX}"
    try:
        return parse_run_record(raw, where), ""
    except CorruptCheckpointError as e:  # names the file and the fix
        return None, str(e)


def run_id(storage: Storage, new: Optional[str] = None) -> str:
    """The run id of the persistent root ``storage``, recorded there (create-only) on first use
    (``new``: the id to record then; default a fresh one).

    It ties fast tiers (the memory tier) to this incarnation of the root: a root deleted and
    started again gets a new id, so checkpoints of the earlier run left in memory never come back.
    """
    have = _run_record(storage)[0]
    if have is not None:
        return have
    new = new or uuid.uuid4().hex
    try:
        storage.write_small(RUN_FILE, encode_run_record(new, socket.gethostname(), time.time()), create_only=True)
    except FileExistsError:  # another process created it first: theirs is the run's id
        have, why = _run_record(storage)
        if have is None:
            raise NebulaError(why or f"{storage.display_url}: {RUN_FILE} exists but is unreadable; {RUN_FIX}") from None
        return have
    return new


class Retractor(Protocol):
    """A tier writer, as :meth:`Fence.stop` sees it: the steps it has in flight, and how it
    takes back a step a fenced save committed on its tier."""

    def in_flight(self) -> set[int]:
        """The steps of the saves this tier is writing or holds pending."""

    def retract(self, steps: set[int]) -> None:
        """Remove this writer's commits of ``steps`` from the tier (best effort, never raises)."""

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """Wait until nothing is pending or being written on the tier; False on timeout."""


def generations(storage: Storage, warn: bool = False) -> list[int]:
    """The writer generations recorded on ``storage`` (``_nebula/writers/g-<n>.json``), ascending
    (the one listing of them). A name no writer writes (:func:`is_foreign_writer_record`: leading
    zeros, a number beyond :data:`MAX_GENERATION`) records none; ``warn``: say so, naming it."""
    names = storage.list(WRITERS_DIR)
    if warn:
        for n in filter(is_foreign_writer_record, names):
            log.warning("nebula_ckpt: %s: %s/%s is no writer generation record (its number is not one a writer "
                        "takes: at most %d, without leading zeros), so it is ignored; remove it", storage.display_url,
                        WRITERS_DIR, n, MAX_GENERATION)
    return sorted(g for g in map(writer_generation, names) if g is not None)


def newer_commit(storage: Storage, generation: int, scan: bool = False) -> Optional[tuple[int, int]]:
    """``(generation, step)`` of a committed step on ``storage`` whose writer generation is newer
    than ``generation``, or None. Only listed when a newer generation is recorded at all, or
    ``scan``: steps copied in without their writer records name generations none records."""
    gens = generations(storage)
    if not scan and (not gens or gens[-1] <= generation):
        return None
    for s in reversed(committed_steps(storage)):
        try:
            g = read_commit(storage, s, f"{storage.display_url} step {s}").generation
        except Exception as e:  # an unreadable marker is no commit of anyone's
            log.debug("nebula_ckpt: %s step %d: %s", storage.display_url, s, e)
            continue
        if g > generation:
            return g, s
    return None


def _no_generation_left(storage: Storage, gens: list[int], newest: Optional[Write]) -> str:
    """Why no writer generation is left to take on ``storage``: the newest one there (a writer
    record or a committed step) is :data:`MAX_GENERATION` already; names that file and the fix."""
    if gens and (newest is None or gens[-1] >= newest[0]):
        where, what = f"{WRITERS_DIR}/g-{gens[-1]}.json", "remove that file"
    else:
        assert newest is not None
        where, what = f"{step_dir(newest[1])}/{COMMIT}", f"move step {newest[1]} out of the root"
    return (f"{storage.display_url}: {where} names writer generation {MAX_GENERATION}, the largest there is, so "
            f"this writer has no newer one to take and writes nothing. A writer takes one generation per job "
            f"start, so no run gets near it: {what}")


class Fence:
    """The generation of one writer (one job: every rank shares it) on one root storage. Thread-safe.

    Args:
        storage: the persistent root.
        coordinator: takes the generation once per job and shares it with every rank.
        root: the canonical root of a Checkpointer's writer: before it takes its generation,
            the older writers of this process on that root hand over (:meth:`take_over`).
    """

    def __init__(self, storage: Storage, coordinator: Optional[Coordinator] = None, root: Optional[str] = None) -> None:
        self.storage = storage
        self._root = root
        self._coordinator = coordinator or LocalCoordinator()
        self._generation: Optional[int] = None
        #: a past generation's fence (:meth:`past`): never takes one, checks for newer commits
        self.is_past = False
        self._lock = threading.Lock()
        self._fenced: Optional[str] = None
        self._on_fenced: list[Callable[[], None]] = []
        self._retractors: list[Retractor] = []
        #: held while a commit marker is written (:meth:`TierFence.committing`) and while
        #: :meth:`stop` marks the writer fenced: no marker is written after that
        self._commit_lock = threading.RLock()
        #: :meth:`stop` came from a newer writer of this process taking the root over (:meth:`take_over`)
        self.handed_over = False
        self._root_key: Optional[str] = None  # the root this writer is registered under (take_over)

    @classmethod
    def past(cls, storage: Storage, generation: int) -> "Fence":
        """The fence of ``generation``, a writer generation that exists on ``storage`` already
        (the module docstring's *past* generation): writing under it takes and records no
        generation; its :meth:`TierFence.check` raises :class:`FencedError` once a newer
        generation has committed a step on the tier checked."""
        fence = cls(storage)
        fence._generation = generation
        fence.is_past = True
        return fence

    @property
    def fenced(self) -> Optional[str]:
        """Why this writer is fenced (the first :class:`FencedError`'s message), or None."""
        return self._fenced

    def on_fenced(self, action: Callable[[], None]) -> None:
        """Run ``action`` (once) when this writer is fenced: give back what it holds."""
        self._on_fenced.append(action)

    def retract_with(self, retractor: Retractor) -> None:
        """Let :meth:`stop` take back, through ``retractor`` (a tier writer), what the saves in
        flight committed on its tier."""
        with self._lock:
            self._retractors.append(retractor)

    def stop(self, why: str, handed_over: bool = False) -> None:
        """Record that this writer is fenced (``why``); take back what the saves in flight
        committed (on every tier, this generation's only), then run the :meth:`on_fenced`
        actions (give the memory tier's lock back), once. ``handed_over``: a newer writer of this
        process took the root over in order (:meth:`take_over`; logged at INFO, not as an error)."""
        with self._commit_lock:  # a marker being written is complete; none is written after this
            with self._lock:
                if self._fenced is not None:
                    return
                self._fenced = why
                self.handed_over = handed_over
                actions, self._on_fenced = self._on_fenced, []
                retractors = list(self._retractors)
        log.log(logging.INFO if handed_over else logging.ERROR, "nebula_ckpt: %s", why)
        steps: set[int] = set()
        for r in retractors:
            steps |= r.in_flight()
        if steps:
            for r in retractors:
                r.retract(steps)
        for action in actions:
            try:
                action()
            except Exception as e:  # giving back is best effort: the writer is stopped anyway
                log.warning("nebula_ckpt: a fenced writer could not give back what it holds: %s", e)

    def take_over(self, root: str, timeout: float = HAND_OVER_TIMEOUT_S) -> None:
        """This writer is about to write the root ``root`` (its canonical form): every older writer
        of this process on it hands over first (:meth:`hand_over`), then this one is registered
        as the root's writer here. Call it before the generation is taken or anything is written
        (on every rank, before the collective that takes the generation: a rank's older writer
        must be done before rank 0 records the newer generation). Idempotent; no I/O."""
        with _WRITERS_LOCK:
            if self._root_key is not None:
                return
            self._root_key = root
            live = _WRITERS.setdefault(root, weakref.WeakSet())
            older = [f for f in live if f.fenced is None and not f.is_past]
            live.add(self)
        for f in older:
            f.hand_over(root, timeout)

    def take_root(self) -> None:
        """:meth:`take_over` of this writer's own root (given when it was made; else nothing)."""
        if self._root is not None and not self.is_past:
            self.take_over(self._root)

    def hand_over(self, root: str, timeout: float = HAND_OVER_TIMEOUT_S) -> None:
        """A newer writer of this process takes the root ``root`` over: finish the saves handed to
        the tiers (up to ``timeout`` seconds), then stop writing (:meth:`stop`, with nothing in
        flight to take back) and give back what this writer holds (the memory tier's lock)."""
        with self._lock:
            retractors = list(self._retractors)
        deadline = time.monotonic() + timeout
        late = [r for r in retractors if not r.wait_idle(max(0.0, deadline - time.monotonic()))]
        if late:
            log.warning("nebula_ckpt: %s: an older Checkpointer of this process on this root has not finished its "
                        "saves after %.0f s; a newer one takes the root over now, and those saves end fenced",
                        root, timeout)
        self.stop(f"{root}: a newer writer, a newer Checkpointer of this process (pid {os.getpid()}), took this root "
                  "over; this one writes nothing more (every checkpoint it committed stays, and the newer one reads "
                  "it). Close the older Checkpointer (or engine) when a new one replaces it", handed_over=not late)

    def retire(self) -> None:
        """This writer is closed: no newer writer of this process needs it to hand over."""
        with _WRITERS_LOCK:
            if self._root_key is not None:
                _WRITERS.get(self._root_key, weakref.WeakSet()).discard(self)
                if not _WRITERS.get(self._root_key):
                    _WRITERS.pop(self._root_key, None)

    @property
    def generation(self) -> int:
        """This writer's generation, taken on first use (by a Checkpointer's writer: after the
        older writers of this process on its root handed over, :meth:`take_over`)."""
        if self._generation is None:
            self.take_root()  # no-op once done (at the first write, or in a job's constructor)
        with self._lock:
            if self._generation is None:
                self._generation = self._coordinator.shared_generation(self._acquire)
            return self._generation

    def _acquire(self) -> int:
        info = encode_writer_record(WriterRecord(socket.gethostname(), os.getpid(), time.time()))
        # above every committed step's too: steps copied in without their writer records (a sync of
        # step-* only) must never outrank this writer's in a restore or in retention
        newest = max(committed_writes(self.storage), default=None)
        for attempt in range(100):
            gens = generations(self.storage, warn=attempt == 0)
            g = max(gens[-1] if gens else 0, newest[0] if newest else 0) + 1
            if g > MAX_GENERATION:
                raise PersistError(_no_generation_left(self.storage, gens, newest))
            try:
                self.storage.write_small(writer_record(g), info, create_only=True)
            except FileExistsError:
                continue  # another writer took g at the same moment: take the next one
            for old in gens[:-_KEEP_RECORDS]:
                self.storage.remove(writer_record(old))
            log.info("nebula_ckpt: writer generation %d on %s", g, self.storage.display_url)
            return g
        raise FencedError(f"{self.storage.display_url}: could not take a writer generation after 100 tries")

    def for_tier(self, storage: Storage) -> "TierFence":
        """The fence of one tier (checks that tier's own storage)."""
        return TierFence(self, storage)


class TierFence:
    """A writer's generation as seen on one tier's storage."""

    def __init__(self, fence: Fence, storage: Storage) -> None:
        self._fence = fence
        self.storage = storage
        self._recorded = storage is fence.storage
        #: a past fence read every marker of the tier once (steps copied in without writer records)
        self._scanned = False

    @property
    def generation(self) -> int:
        """The writer's generation (taken from the root on first use)."""
        return self._fence.generation

    @contextmanager
    def committing(self, what: str) -> Iterator[None]:
        """Write a commit marker inside this: it raises :class:`FencedError` once this writer is
        fenced, and :meth:`Fence.stop` waits for a marker written inside it, so that stop's
        take-back sees every step this writer committed."""
        with self._fence._commit_lock:
            fenced = self._fence.fenced
            if fenced is not None:
                raise FencedError(f"{self.storage.display_url}: this writer does not {what}: it was fenced ({fenced})")
            yield

    def retract_with(self, retractor: Retractor) -> None:
        """See :meth:`Fence.retract_with`."""
        self._fence.retract_with(retractor)

    def _trim(self, g: int) -> None:
        """Remove this tier's writer records older than the newest :data:`_KEEP_RECORDS` below ``g``
        (as the root's are when a generation is taken): one per job would pile up. Best effort."""
        try:
            for old in [x for x in generations(self.storage) if x < g][:-_KEEP_RECORDS]:
                self.storage.remove(writer_record(old))
        except Exception as e:  # housekeeping: the next writer tries again
            log.debug("nebula_ckpt: %s: old writer records not removed: %s", self.storage.display_url, e)

    def check(self, what: str) -> None:
        """Raise :class:`FencedError` if a newer writer wrote to this tier, or this writer was
        fenced on any tier before (``what``: the action)."""
        fenced = self._fence.fenced
        if fenced is not None:
            raise FencedError(f"{self.storage.display_url}: this writer does not {what}: it was fenced ({fenced})")
        g = self.generation
        if self._fence.is_past:
            newer = newer_commit(self.storage, g, scan=not self._scanned)
            self._scanned = True
            if newer is not None:
                raise FencedError(f"{self.storage.display_url}: step {newer[1]} of writer generation {newer[0]} is "
                                  f"committed there, newer than generation {g}, so nothing of generation {g} is "
                                  f"written (not to {what}): a newer job's steps supersede it")
            return
        if not self._recorded:
            try:
                self.storage.write_small(writer_record(g), b"{}", create_only=True)
            except FileExistsError:
                pass
            self._recorded = True
            self._trim(g)
        gens = generations(self.storage)
        if gens and gens[-1] > g:
            why = (f"{self.storage.display_url}: a newer writer (generation {gens[-1]}) took over this "
                   f"checkpoint root, so this writer (generation {g}) does not {what}, nor write anything "
                   "more on any tier. This happens when a stale process keeps running after its job was "
                   "restarted; stop it.")
            self._fence.stop(why)
            raise FencedError(why)
