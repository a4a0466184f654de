"""Which checkpoint a restore opens: the candidates, their order, the agreement of the ranks.

Candidates are every committed step on every tier, newest first in the one order of
:mod:`~nebula_ckpt.restore.candidates` (writer generation, step, save, tier). Each is opened and
verified (:func:`~nebula_ckpt.restore.open.open_checkpoint`); on any damage the next candidate is tried
(:func:`find_and_open`), the markers read lazily in that order (:func:`newest_first`): a restore reads a
few markers, not every step's. In a multi-rank job every rank opens the same step, the newest that every
rank can open (:func:`open_agreed`): the same *write* of it, ``(generation, step, save)``, so that a
rank whose fastest tier holds the second write of a step saved twice and a rank that has only the first
never restore a mix of the two.

**The health marks** (:class:`HealthChoice`, :mod:`nebula_ckpt.health`): a restore of the newest step
(``load_latest``, ``read()``) skips every checkpoint marked *suspect* and restores the newest one that is
not: *healthy* or *unknown* alike, so that a job whose newest step has not been confirmed yet (it crashed
right after the save, the common case of a hardware failure) loses no work; if that step is bad, the loss
goes bad soon after the restore, the step is marked suspect and the next restore skips it. A restore of a
given step or tag restores it whatever its mark (a warning says when it is suspect). In a multi-rank job
rank 0 reads the marks and leaves the suspect steps out of what it offers to the ranks' agreement; one
exchange tells every rank what rank 0 skipped.
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from nebula_ckpt.errors import CorruptCheckpointError, OtherRanksError, ValidationError
from nebula_ckpt.format.commit import Write, read_commit, step_dirs
from nebula_ckpt.format.health import SUSPECT
from nebula_ckpt.format.names import WRITERS_DIR, writer_generation
from nebula_ckpt.health.book import NO_MARK, HealthView, Mark
from nebula_ckpt.ranks.coordinator import Coordinator
from nebula_ckpt.restore.candidates import (
    RELIST_ROUNDS,
    Candidate,
    all_damaged_message,
    changed_meanwhile,
    check_listed,
    list_again,
    list_candidates,
    removed_error,
    sort_key,
    stop_together,
    unreadable_marker,
)
from nebula_ckpt.restore.candidates import say as say  # a name of the restore's choice, read from here too
from nebula_ckpt.restore.open import NotThisLayout, OpenCheckpoint, open_checkpoint
from nebula_ckpt.restore.unreadable import outage, refused_here
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.tiers.base import Tier

log = logging.getLogger(__name__)

#: prepares the restore of one opened candidate (see :func:`~nebula_ckpt.restore.apply.stage_restore`)
Stage = Callable[[OpenCheckpoint], None]

#: ``(tier name, writer generation, step, save)`` of a copy whose every checksum this process checked
#: during this restore (a memory-tier copy, by the replicas' recover round): opened checking sizes
#: only, so its bytes are not checked twice. Copies on other tiers, or of other writes, are not.
Checked = Optional[tuple[str, int, int, int]]

#: ``skip(generation, step)``: whether a restore leaves that checkpoint out (its health mark)
Skip = Callable[[int, int, int], bool]

#: What :func:`find_and_open` does when committed checkpoints exist but none is healthy.
ON_ALL_DAMAGED = ("raise", "warn")


def newest_first(tiers: list[tuple[Tier, Storage]], step: Optional[int] = None,
                 unlisted: Optional[list[BaseException]] = None,
                 on_problem: Optional[Callable[[Candidate], None]] = None,
                 unmarked: Optional[list[Candidate]] = None) -> Iterator[Candidate]:
    """The candidates of :func:`list_candidates`, in its very order, reading each commit marker
    only when the order needs it: a restore that opens the first one reads one marker per tier or
    so, however many steps the root keeps.

    Each tier is listed once (its step folders, and its writer records, ``_nebula/writers/``); the
    markers are read from the highest step down, and a candidate is given once no marker not read
    yet can be newer: every writer generation of a tier's markers is recorded there (a writer
    records its own before it writes a tier), so no marker outranks the newest generation recorded
    on any tier. A tier without records (steps copied in without their ``_nebula/`` folder), or a
    marker naming a generation above every record, makes the rest of the order read every marker.

    ``step``: only that step (one marker per tier). ``unlisted``, ``unmarked`` (here also a save
    not committed yet): as for :func:`list_candidates`. ``on_problem``: told each candidate whose
    marker cannot be read, when read (given too, after every readable one, as sorted there).
    """
    pending: list[list[int]] = []  # per tier: its step folders not read yet, ascending
    for tier, st in tiers:
        try:
            dirs = step_dirs(st)
        except Exception as e:
            log.warning("nebula_ckpt: cannot list tier %s: %s", tier.name, e)
            if unlisted is not None:
                unlisted.append(e)
            dirs = []
        pending.append([s for s in dirs if step is None or s == step])
    bound = _newest_recorded([st for (_, st), left in zip(tiers, pending, strict=True) if left])
    read: list[tuple[tuple[int, int, int, int], Candidate]] = []
    while True:
        tops = [(i, left[-1]) for i, left in enumerate(pending) if left]
        if read and all(bound is not None and (read[0][1].generation, read[0][1].step) > (bound, s) for _, s in tops):
            yield heapq.heappop(read)[1]
            continue
        if not tops:
            return
        i = max(tops, key=lambda t: (t[1], -t[0]))[0]  # the highest step not read, fastest tier first
        s = pending[i].pop()
        try:
            c = _marker(*tiers[i], s)
        except Exception as e:  # the store did not answer: what the tier holds is not known, as if not listed
            log.warning("nebula_ckpt: cannot read tier %s: %s", tiers[i][0].name, e)
            if unlisted is not None:
                unlisted.append(e)
            pending[i] = []
            continue
        if c is None:  # no marker: not committed (or removed since listed)
            if unmarked is not None:
                unmarked.append(Candidate(s, *tiers[i]))
            continue
        if c.problem is not None and on_problem is not None:
            on_problem(c)
        if bound is not None and c.generation > bound:
            log.info("nebula_ckpt: tier %s step %d names writer generation %d, which no writer record does; every "
                     "commit marker is read", c.tier.name, c.step, c.generation)
            bound = None
        heapq.heappush(read, (sort_key(c, i), c))


def _marker(tier: Tier, st: Storage, step: int) -> Optional[Candidate]:
    """The candidate of ``step`` on one tier, as its commit marker names it; None: it has none."""
    try:
        g, _, w = read_commit(st, step, f"step {step}").write
    except FileNotFoundError:
        return None
    except Exception as e:  # unreadable, garbled, a folder: damage; a store that did not answer: raised
        if outage(e) and refused_here(e, "") is None:
            raise
        return unreadable_marker(tier, st, step, e)
    return Candidate(step, tier, st, g, None, w)


def _newest_recorded(storages: list[Storage]) -> Optional[int]:
    """The newest writer generation recorded on any of ``storages``; None when one of them records
    none or cannot be listed (its markers are then bounded by nothing)."""
    newest: Optional[int] = None
    for st in storages:
        try:
            gens = [g for g in map(writer_generation, st.list(WRITERS_DIR)) if g is not None]
        except Exception as e:  # read every marker instead
            log.debug("nebula_ckpt: %s: writer records not listed: %s", st.display_url, e)
            return None
        if not gens:
            return None
        newest = max(gens) if newest is None else max(newest, *gens)
    return newest


def find_and_open(tiers: list[tuple[Tier, Storage]], step: Optional[int] = None,
                  verify: Optional[str] = None, on_all_damaged: str = "raise", rank: Optional[int] = None,
                  world: int = 1, stage: Optional[Stage] = None,
                  generation: Optional[int] = None, checked: Checked = None,
                  save: Optional[int] = None, skip: Optional[Skip] = None,
                  layouts: Optional[list[str]] = None) -> Optional[OpenCheckpoint]:
    """Open the newest healthy checkpoint (or the healthy copy of ``step``).

    Every candidate that fails to open is skipped with a warning, but an outage is raised (:func:`check_listed`).
    For the newest step, a candidate removed while read or a step gone since listed (a job's retention beside)
    lists the tiers again (:data:`RELIST_ROUNDS` times at most; the last listing goes on to older steps); nothing
    opened, removed each time: a ``NebulaError``, never None for a root that held committed steps.

    Args:
        tiers: ``(tier, storage)`` pairs, fastest first.
        step: only this step; None: the newest healthy one (newest writer generation first).
        generation, save: only checkpoints of this writer generation and save number (with ``step``: agreed).
        checked: the copy this process checked already (see :data:`Checked`).
        verify: ``"full"`` or ``"size"``; None: each tier's own setting.
        on_all_damaged: when committed candidates exist but none is healthy: ``"raise"`` a
            :class:`CorruptCheckpointError` listing them, or ``"warn"`` (log) and return None.
        rank, world: the restoring process's rank and world size (:func:`~nebula_ckpt.restore.open.open_checkpoint`).
        stage: called with each candidate opened (checksums deferred to it, see
            :func:`~nebula_ckpt.restore.apply.stage_restore`); a candidate it finds damaged is skipped like one
            that fails to open, before anything was restored from it. Its ``ValidationError`` is raised.
        skip: ``skip(generation, step, save)``: leave that write out (marked suspect, see
            :class:`HealthChoice`); not counted as damaged.
        layouts: gets why each candidate of another layout (not damaged) was passed over.

    Returns:
        The open checkpoint; None when nothing (of ``step``) is committed, or all is damaged (and "warn").
    """
    if on_all_damaged not in ON_ALL_DAMAGED:
        raise ValidationError(f"on_all_damaged must be one of {ON_ALL_DAMAGED}, got {on_all_damaged!r}")
    search = _Search(tiers, step, verify, rank, world, stage, checked, layouts, lambda c: (
        (generation is not None and c.generation != generation) or (save is not None and c.save != save)
        or (skip is not None and skip(c.generation, c.step, c.save))))
    before: Optional[list[tuple[str, int]]] = None
    for rnd in range(RELIST_ROUNDS if step is None else 1):
        removed = len(search.removed)
        ck, unmarked = search.first(rnd, before)
        if ck is not None:
            return ck
        # a folder listed without its marker may be a save not committed yet: listed again while that changes
        if len(search.removed) == removed and (not unmarked or unmarked == before):
            break
        before = unmarked
        log.info("nebula_ckpt: a step was removed while it was read (a job's retention?): listing the tiers again")
    check_listed(search.unlisted)  # an outage is never "nothing committed" nor "all damaged"
    if search.removed and step is None:
        raise removed_error(search.removed, search.skipped)
    if search.skipped:
        msg = all_damaged_message(tiers, step, search.skipped)
        if on_all_damaged == "raise":
            raise CorruptCheckpointError(msg)
        log.warning("nebula_ckpt: %s", msg)
    return None


@dataclass
class _Search:
    """One :func:`find_and_open`: what it opens, and what it met on its way, across listings:
    ``skipped`` (why each damaged candidate was), ``unlisted`` (the error of each tier not listed),
    ``failed`` (``(tier name, write)`` of each that failed to open: not opened again on a new
    listing), ``removed`` (each removed, or saved again each time, while it was read)."""

    tiers: list[tuple[Tier, Storage]]
    step: Optional[int]
    verify: Optional[str]
    rank: Optional[int]
    world: int
    stage: Optional[Stage]
    checked: Checked
    layouts: Optional[list[str]]
    left_out: Callable[[Candidate], bool]
    skipped: list[str] = field(default_factory=list)
    unlisted: list[BaseException] = field(default_factory=list)
    failed: set[tuple[str, Write]] = field(default_factory=set)
    removed: list[Candidate] = field(default_factory=list)

    def damaged(self, c: Candidate, why: Optional[str] = None) -> None:
        """Candidate ``c`` is damaged (``why``; None: its marker cannot be read): reported once, not opened again."""
        why = why or f"tier {c.tier.name} step {c.step}: {c.problem}"
        self.failed.add((c.tier.name, c.order))
        if why not in self.skipped:
            log.warning("nebula_ckpt: skipping %s", why)
            self.skipped.append(why)

    def first(self, listing: int, before: Optional[list[tuple[str, int]]]
              ) -> tuple[Optional[OpenCheckpoint], list[tuple[str, int]]]:
        """The first candidate, as listed now (listing number ``listing``), that opens, and ``(tier name,
        step)`` of each step folder listed without its marker; for the newest step none where
        :func:`list_again` says so against the listing ``before``."""
        unmarked: list[Candidate] = []
        gone = len(self.removed)
        for c in newest_first(self.tiers, self.step, self.unlisted, self.damaged, unmarked):
            if self.step is None and list_again(listing, unmarked, before, len(self.removed) > gone):
                break
            if c.problem is not None or (c.tier.name, c.order) in self.failed or self.left_out(c):
                continue
            check_listed(self.unlisted if self.step is None else [], c)  # a tier not listed may hold a newer step
            how = self.verify or ("size" if self.checked == (c.tier.name, *c.order) else c.tier.verify)
            ck = _open_candidate(c, how, self)
            if ck is not None:
                log.info("nebula_ckpt: restoring step %d from tier %s%s", ck.step, ck.tier_name,
                         f" (skipped {len(self.skipped)} damaged candidate(s))" if self.skipped else "")
                return ck, []
        return None, [(c.tier.name, c.step) for c in unmarked]


def _open_candidate(c: Candidate, verify: str, search: _Search, again_ok: bool = True) -> Optional[OpenCheckpoint]:
    """Open (and stage) candidate ``c``; None when it is damaged, of a layout this process cannot
    restore, or removed while it was read (noted in ``search``); a step saved again while it was
    read is opened again, its new write (:func:`changed_meanwhile`; ``again_ok``: not yet; saved
    again once more: as removed), by one process; a rank of several leaves it to the ranks' next
    agreement (:func:`open_agreed`), which takes the new write where every rank lists it, and
    opens only a write whose marker still names it once its files are open.

    Raises:
        ValidationError: ``stage`` found that ``into`` does not match (every candidate would say so).
    """
    where, world = f"tier {c.tier.name} step {c.step}", search.world
    try:
        ck = open_checkpoint(c.storage, c.step, verify, where, search.rank, world,
                             defer_verify=search.stage is not None)
        if world > 1 and changed_meanwhile(c) is not None:
            # A rank must read the very write the ranks agreed on: its marker still naming it
            # after the open (a marker never names a write again once replaced) means the files
            # open are that write's; else this rank may hold another write, which it never restores.
            return None
        ck.tier_name, ck.storage, ck.save = c.tier.name, c.storage, c.save
        if search.stage is not None:
            search.stage(ck)
    except ValidationError:
        raise  # the caller's `into` does not match: every candidate would say the same
    except NotThisLayout as e:
        log.info("nebula_ckpt: not restoring %s", e)
        search.failed.add((c.tier.name, c.order))
        if search.layouts is not None:
            search.layouts.append(str(e))
        return None
    except Exception as e:  # KeyError, OverflowError, struct.error, OSError...: all mean damaged
        if outage(e):  # but a store that did not answer, or a file this process cannot read: may be whole
            better = refused_here(e, where)
            if better is not None:
                raise better from e
            raise
        again = changed_meanwhile(c)
        if again is c or (again is not None and not again_ok):  # not damaged: left out, the tiers listed again
            search.removed.append(c)
            return None
        if again is not None:  # saved again while it was read: not damaged
            # the ranks agree again on what each lists now (open_agreed): the new write or an older step
            return None if world > 1 else _open_candidate(again, verify, search, False)
        why = str(e) if isinstance(e, CorruptCheckpointError) else \
            f"{where}: cannot read it ({type(e).__name__}: {e})"
        search.damaged(c, why)
        return None
    return ck


def open_tagged(tiers: list[tuple[Tier, Storage]], steps: list[int], tag: str, root: str,
                stage: Optional[Stage] = None) -> Optional[OpenCheckpoint]:
    """One process: the newest of ``steps`` (those tagged ``tag``, newest first) that opens healthy
    (older ones with the same tag are the fallback, as for ``load_latest``); None when no step
    holds the tag.

    Raises:
        OtherRanksError: no step tagged ``tag`` is damaged, but those that are there hold other
            ranks' parts of a multi-rank save (a rank's own memory tier read by another process).
        CorruptCheckpointError: every step tagged ``tag`` is damaged (``root`` names where).
    """
    layouts: list[str] = []
    for s in steps:
        ck = find_and_open(tiers, step=s, on_all_damaged="warn", stage=stage, layouts=layouts)
        if ck is not None:
            return ck
    if steps and layouts:
        raise OtherRanksError(f"checkpoint tagged {tag!r} under {root} (steps {steps}) is a save by several ranks "
                              f"that this process cannot read alone: {layouts[0]}. Read it in a job of the ranks "
                              "that saved it (each rank reads its own part), or gather it whole with "
                              "`nebula-ckpt export` once it is on a shared tier")
    if steps:
        raise CorruptCheckpointError(f"every checkpoint tagged {tag!r} under {root} (steps {steps}) is damaged "
                                     "(the log names each copy); `nebula-ckpt verify ROOT` lists damage")
    return None


def open_agreed(tiers: list[tuple[Tier, Storage]], co: Coordinator, root: str, step: Optional[int],
                on_damaged: str, among: Optional[list[int]] = None,
                stage: Optional[Stage] = None, checked: Checked = None,
                agreed: Optional[Write] = None, skip: Optional[Skip] = None) -> Optional[OpenCheckpoint]:
    """Every rank opens the same write of a step: the newest that every rank can open from some
    tier (of ``among``, when given: the steps this rank sees with the tag asked for).

    Each round, the ranks intersect the steps committed on their tiers (minus those that failed
    on some rank) and take the newest; each rank opens it (its own memory tier, or its part of
    the shared tier); if any rank cannot, that write is dropped on all and the next round agrees
    again: on the step's new write where it was saved again meanwhile and every rank lists it,
    else on an older step (a rank never restores a write other than the one agreed). Runs on
    the training thread; collectives on ``co``'s control group. ``checked``: see :data:`Checked`.
    ``agreed``: the ``(writer generation, step, save)`` the ranks agreed on already, the same on
    every rank (the replicas' recover round: every rank has it on a tier): the first round opens it
    without exchanging the candidates, unless ``skip`` leaves it out on some rank (one exchange).
    ``skip``: this rank leaves those checkpoints out of what it offers (rank 0 with the health
    marks: no rank then restores a step it left out).
    """
    failed: list[Write] = []
    if agreed is not None and not co.all_true(skip is None or not skip(*agreed)):
        agreed = None  # rank 0 leaves it out: the ranks agree among the others
    while True:
        newest: Optional[Write]
        unl: list[BaseException] = []  # a tier this rank cannot list: it offers what check_listed lets by
        if agreed is not None:  # agreed on every rank alike: no exchange for it
            newest, agreed = agreed, None
        else:
            # (writer generation, step, save): a stale writer's steps never win over a newer
            # writer's, and the ranks agree on one write of a step saved twice
            have = {c.order for c in list_candidates(tiers, unlisted=unl) if (step is None or c.step == step)
                    and (among is None or c.step in among) and (skip is None or not skip(*c.order))
                    and (step is not None or not unl or not c.tier.persistent)}
            newest = co.agree_step(sorted(have - set(failed)))
        if newest is None:
            stop_together(co, co.exchange(str(unl[0]) if unl else None), unl[0] if unl else None)
            if failed and on_damaged == "raise":
                raise CorruptCheckpointError(
                    f"rank {co.rank}: no step is restorable on every rank of {root}: step(s) "
                    f"{sorted({s for _, s, _ in failed})} failed to open on some rank (see the ranks' logs for why); "
                    "`nebula-ckpt verify ROOT` lists damage")
            return None
        ck = _open_round(tiers, co, newest, stage, checked)
        if ck is not None:
            return ck
        log.warning("nebula_ckpt: step %d (writer generation %d, save %d) is not restorable on every rank; the "
                    "ranks agree again without that write (on the step's new write where it was saved again "
                    "meanwhile, else on an older step)", newest[1], newest[0], newest[2])
        failed.append(newest)


def _open_round(tiers: list[tuple[Tier, Storage]], co: Coordinator, newest: Write,
                stage: Optional[Stage], checked: Checked = None) -> Optional[OpenCheckpoint]:
    """One round of :func:`open_agreed`: every rank opens the write ``(generation, step, save)``;
    the checkpoint when every rank could, else None.

    Raises:
        ValidationError: some rank's ``into`` does not match (raised on every rank).
    """
    generation, agreed, save = newest
    mismatch: Optional[ValidationError] = None
    lost: Optional[BaseException] = None
    try:
        ck = find_and_open(tiers, step=agreed, on_all_damaged="warn", rank=co.rank, world=co.world_size,
                           stage=stage, generation=generation, checked=checked, save=save)
    except ValidationError as e:  # this rank's `into`: raised on every rank, after the round
        ck, mismatch = None, e
    except Exception as e:
        log.warning("nebula_ckpt: rank %d cannot open step %d: %s", co.rank, agreed, e)
        ck, lost = None, e if outage(e) else None
    said = co.exchange(None if mismatch is None else str(mismatch))  # one exchange, as all_true would be
    failed = next(((r, why) for r, why in enumerate(said) if why), None)
    if failed is not None:
        if mismatch is not None:
            raise ValidationError(f"rank {co.rank}: {mismatch}") from mismatch
        raise ValidationError(
            f"rank {co.rank}: restoring step {agreed} failed on rank {failed[0]} because its `into` does not "
            f"match the checkpoint; nothing was restored. Rank {failed[0]} said: {failed[1]}")
    # one exchange: whether every rank opened it, any rank's `into` that lays it out otherwise, an outage
    opened = co.exchange((ck is not None, None if ck is None else ck.other_layout, None if lost is None else str(lost)))
    stop_together(co, [said for *_, said in opened], lost)
    if not all(ok for ok, *_ in opened):
        return None
    other = next((f"rank {r}: {why}" for r, (_, why, _) in enumerate(opened) if why), None)
    if other is None:
        return ck
    return _open_whole(tiers, co, newest, checked, other)


def _open_whole(tiers: list[tuple[Tier, Storage]], co: Coordinator, newest: Write, checked: Checked,
                other: str) -> Optional[OpenCheckpoint]:
    """The write ``newest`` opened whole on every rank, to be resharded (``other``: why, the same
    on every rank: some rank's ``into`` lays its DTensors out otherwise than stored, though the
    world size is the same); None when some rank cannot open it so (then an older step is tried)."""
    generation, step, save = newest
    log.info("nebula_ckpt: step %d is resharded on every rank: %s", step, other)
    lost: Optional[BaseException] = None
    try:
        # rank None: the whole job's checkpoint (a tier holding every rank: the shared one)
        ck = find_and_open(tiers, step=step, on_all_damaged="warn", rank=None, world=co.world_size,
                           generation=generation, checked=checked, save=save)
    except Exception as e:
        log.warning("nebula_ckpt: rank %d cannot open step %d whole: %s", co.rank, step, e)
        ck, lost = None, e if outage(e) else None
    if ck is None:
        log.warning("nebula_ckpt: rank %d: step %d is resharded (%s), which needs it on a tier holding every "
                    "rank's part (a shared tier); none here does", co.rank, step, other)
    else:
        ck.other_layout = other
    got = co.exchange((ck is not None, None if lost is None else str(lost)))
    stop_together(co, [said for _, said in got], lost)
    return ck if all(ok for ok, _ in got) else None


# -- the health marks: which suspect step a restore skips -----------------------------------------


@dataclass
class HealthChoice:
    """The marks as one restore reads them, and the suspect checkpoints it skipped.

    Args:
        view: the marks (None: this rank does not read them; it follows rank 0's choice).
        skip_suspect: leave suspect checkpoints out (a restore of the newest step).
    """

    view: Optional[HealthView]
    skip_suspect: bool
    #: ``(generation, step)`` -> why, of every suspect checkpoint left out, in the order met
    skipped: dict[tuple[int, int], str] = field(default_factory=dict)

    def skips(self, generation: int, step: int, save: int = -1) -> bool:
        """Whether the restore leaves the checkpoint ``(generation, step)``, its write ``save``
        (-1: not known), out (remembered)."""
        if not self.skip_suspect or self.view is None:
            return False
        m = self.view.mark(generation, step, None if save < 0 else save)
        if m.state != SUSPECT:
            return False
        self.skipped.setdefault((generation, step), m.reason)
        return True

    def mark(self, generation: int, step: int, save: int = -1) -> Mark:
        """The mark of the checkpoint restored, its write ``save`` (unknown where this rank reads none)."""
        return NO_MARK if self.view is None else self.view.mark(generation, step, None if save < 0 else save)

    def outcome(self, ck_key: Optional[Write]) -> dict[str, Any]:
        """What ``last_restore`` says: the restored step's mark and what was skipped (plain data,
        the same on every rank once exchanged)."""
        m = NO_MARK if ck_key is None else self.mark(*ck_key)
        return {"health": m.state, "health_reason": m.reason,
                "skipped": [{"step": s, "generation": g, "reason": why} for (g, s), why in self.skipped.items()]}
