"""Which checkpoint a restore opens: the candidates, their order, the agreement of the ranks.

Candidates are every committed step on every tier: the newest writer generation first (a checkpoint
of a stale writer, fenced since, never wins over a newer writer's, whatever its step number and
tier), then the newest step, then the later write of a step saved twice (its commit marker's save
number), then, for one write, the fastest tier. Each is opened and verified
(:func:`~nebula_ckpt.restore.open.open_checkpoint`); on any damage the next candidate is tried
(:func:`find_and_open`). In a multi-rank job every rank opens the same step, the newest that every
rank can open (:func:`open_agreed`): the same *write* of it, ``(generation, step, save)``, so that
a rank whose fastest tier holds the second write of a step saved twice and a rank that has only the
first never restore a mix of the two.

**The health marks** (the end of this module: :class:`HealthChoice`): what a restore makes of
them (:mod:`nebula_ckpt.health`), which step it skips and what it says about the step it
restores. A restore of the newest step (``load_latest``, ``read()``) skips every checkpoint marked
*suspect* and restores the newest one that is not: *healthy* or *unknown* alike, so that a job
whose newest step has not been confirmed yet (it crashed right after the save, the common case of
a hardware failure) loses no work; if that step is bad, the loss goes bad soon after the restore,
the step is marked suspect and the next restore skips it. A restore of a given step or tag
restores it whatever its mark (a warning says when it is suspect). In a multi-rank job rank 0
reads the marks and leaves the suspect steps out of the steps it offers to the ranks' agreement,
so every rank restores rank 0's choice; one exchange then tells every rank what rank 0 skipped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

from nebula_ckpt.errors import CorruptCheckpointError, OtherRanksError, ValidationError
from nebula_ckpt.format.commit import Write, committed_steps, read_commit
from nebula_ckpt.format.health import SUSPECT
from nebula_ckpt.health.book import NO_MARK, HealthView, Mark
from nebula_ckpt.ranks.coordinator import Coordinator
from nebula_ckpt.restore.open import NotThisLayout, OpenCheckpoint, open_checkpoint
from nebula_ckpt.restore.unreadable import outage, refused_here
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.tiers.base import Tier

log = logging.getLogger(__name__)

#: prepares the restore of one opened candidate (see :func:`~nebula_ckpt.restore.apply.stage_restore`)
Stage = Callable[[OpenCheckpoint], None]

#: ``(tier name, writer generation, step, save)`` of a copy whose every checksum this process
#: checked during this restore (a memory-tier copy, by the replicas' recover round): opened
#: checking sizes only, so its bytes are not checked twice. Copies on other tiers, or of other
#: writes, are not.
Checked = Optional[tuple[str, int, int, int]]

#: ``skip(generation, step)``: whether a restore leaves that checkpoint out (its health mark)
Skip = Callable[[int, int, int], bool]

#: ``steps(tier, storage)``: the committed steps of one tier, ascending (see :func:`list_candidates`)
Lister = Callable[[Tier, Storage], list[int]]

#: What :func:`find_and_open` does when committed checkpoints exist but none is healthy.
ON_ALL_DAMAGED = ("raise", "warn")


@dataclass(frozen=True)
class Candidate:
    """A committed step on one tier, with the writer generation and save number its commit marker
    names (generation -1 when the marker cannot be read: ``problem`` then says why, and the
    candidate is reported as damaged, never opened; save -1: not recorded)."""

    step: int
    tier: Tier
    storage: Storage
    generation: int = -1
    problem: Optional[str] = None
    save: int = -1

    @property
    def order(self) -> Write:
        """What makes a candidate newer: its writer generation first, then its step, then its save
        number; also which write of the step it is (:attr:`~nebula_ckpt.format.commit.Commit.write`)."""
        return (self.generation, self.step, self.save)


def list_candidates(tiers: list[tuple[Tier, Storage]], steps: Optional[Lister] = None,
                    unlisted: Optional[list[BaseException]] = None) -> list[Candidate]:
    """Every committed step on every tier: newest writer generation first, then newest step, then
    fastest tier (the order of ``tiers``).

    The generation comes first because a writer fenced by a newer one may have gone on committing
    higher steps on a tier the newer one never wrote (its memory tier): those steps are a run
    that was abandoned, never the one to resume. This is the one order of "the newest
    checkpoint": a restore's, and ``nebula-ckpt inspect`` / ``export``'s.

    ``steps``: lists a tier's committed steps (None: the steps with a commit marker,
    :func:`~nebula_ckpt.format.commit.committed_steps`); a step listed whose marker cannot be read
    is a candidate with its ``problem``. ``unlisted``: gets the error of each tier that cannot be
    listed (None: logged only); see :func:`check_listed`.
    """
    cands: list[tuple[int, int, int, int, Candidate]] = []
    for i, (tier, st) in enumerate(tiers):
        try:
            listed = committed_steps(st) if steps is None else steps(tier, st)
        except Exception as e:
            log.warning("nebula_ckpt: cannot list tier %s: %s", tier.name, e)
            if unlisted is not None:
                unlisted.append(e)
            continue
        for s in listed:
            (g, _, w), problem = _commit_write(st, s)
            cands.append((-g, -s, -w, i, Candidate(s, tier, st, g, problem, w)))
    return [c for *_, c in sorted(cands, key=lambda x: x[:4])]


def check_listed(unlisted: list[BaseException], c: Optional[Candidate] = None) -> None:
    """Raise the error of a tier that could not be listed (``unlisted``), which may hold a newer step
    than candidate ``c`` (None: than nothing), unless ``c`` is on the memory tier (a tier lost on a
    reboot), which every save of this node reaches first: an unreachable tier is neither empty nor damaged."""
    if unlisted and (c is None or c.tier.persistent):
        log.error("nebula_ckpt: not restoring: a tier could not be listed, so the newest checkpoint is not "
                  "known; retry once it answers (%s)", unlisted[0])
        raise unlisted[0]


def _commit_write(storage: Storage, step: int) -> tuple[Write, Optional[str]]:
    """The write ``(generation, step, save)`` the commit marker of ``step`` names, or
    ``((-1, step, -1), why)`` when the marker cannot be read (missing since listed, unreadable, garbled)."""
    try:
        return read_commit(storage, step, f"step {step}").write, None
    except Exception as e:
        return (-1, step, -1), str(e) if isinstance(e, CorruptCheckpointError) else \
            f"commit marker is unreadable ({type(e).__name__}: {e})"


def find_and_open(tiers: list[tuple[Tier, Storage]], step: Optional[int] = None,
                  verify: Optional[str] = None, on_all_damaged: str = "raise", rank: Optional[int] = None,
                  world: int = 1, stage: Optional[Stage] = None,
                  generation: Optional[int] = None, checked: Checked = None,
                  save: Optional[int] = None, skip: Optional[Skip] = None,
                  layouts: Optional[list[str]] = None) -> Optional[OpenCheckpoint]:
    """Open the newest healthy checkpoint (or the healthy copy of ``step``).

    Every candidate that fails to open is skipped with a warning, but an outage is raised (:func:`check_listed`).

    Args:
        tiers: ``(tier, storage)`` pairs, fastest first.
        step: only this step; None: the newest healthy one (newest writer generation first).
        generation, save: only checkpoints of this writer generation and save number (with ``step``: the
            write the ranks agreed on).
        checked: the copy this process checked already (see :data:`Checked`).
        verify: ``"full"`` or ``"size"``; None: each tier's own setting.
        on_all_damaged: when committed candidates exist but none is healthy: ``"raise"`` a
            :class:`CorruptCheckpointError` listing them, or ``"warn"`` (log) and return None.
        rank, world: the restoring process's rank and world size (see
            :func:`~nebula_ckpt.restore.open.open_checkpoint`).
        stage: called with each candidate opened (checksums deferred to it, see
            :func:`~nebula_ckpt.restore.apply.stage_restore`); a candidate it finds damaged is
            skipped like one that fails to open, before anything was restored from it. Its ``ValidationError`` (``into``
            does not match) is raised.
        skip: ``skip(generation, step, save)``: leave that write out (marked suspect, see
            :class:`HealthChoice`); not counted as damaged.
        layouts: gets why each candidate of another layout (not damaged) was passed over.

    Returns:
        The open checkpoint; None when nothing (of ``step``) is committed, or all is damaged (and "warn").
    """
    if on_all_damaged not in ON_ALL_DAMAGED:
        raise ValidationError(f"on_all_damaged must be one of {ON_ALL_DAMAGED}, got {on_all_damaged!r}")
    skipped: list[str] = []
    unlisted: list[BaseException] = []
    cands = [c for c in list_candidates(tiers, unlisted=unlisted) if step is None or c.step == step]
    for c in cands:  # a marker that cannot be read is damage, reported whatever the order says
        if c.problem is not None:
            why = f"tier {c.tier.name} step {c.step}: {c.problem}"
            log.warning("nebula_ckpt: skipping %s", why)
            skipped.append(why)
    for c in cands:
        if c.problem is not None or (generation is not None and c.generation != generation) or \
                (save is not None and c.save != save) or (skip is not None and skip(c.generation, c.step, c.save)):
            continue
        check_listed(unlisted if step is None else [], c)  # a tier not listed may hold a newer step
        how = verify or ("size" if checked == (c.tier.name, *c.order) else c.tier.verify)
        ck = _open_candidate(c, how, rank, world, stage, skipped, layouts)
        if ck is not None:
            log.info("nebula_ckpt: restoring step %d from tier %s%s", c.step, c.tier.name,
                     f" (skipped {len(skipped)} damaged candidate(s))" if skipped else "")
            return ck
    check_listed(unlisted)  # an outage is never "nothing committed" nor "all damaged"
    if skipped:
        msg = _all_damaged_message(tiers, step, skipped)
        if on_all_damaged == "raise":
            raise CorruptCheckpointError(msg)
        log.warning("nebula_ckpt: %s", msg)
    return None


def _open_candidate(c: Candidate, verify: str, rank: Optional[int], world: int, stage: Optional[Stage],
                    skipped: list[str], layouts: Optional[list[str]] = None,
                    again_ok: bool = True) -> Optional[OpenCheckpoint]:
    """Open (and stage) candidate ``c``; None when it is damaged (why appended to ``skipped``), of a
    layout this process cannot restore (why appended to ``layouts``, when given), or removed while
    it was read; a step saved again while it was read is opened again, as its new write
    (:func:`changed_meanwhile`; ``again_ok``: not yet), by one process; a rank of several leaves
    it to the ranks' next agreement (:func:`open_agreed`), which takes the new write where every
    rank lists it, and opens only a write whose marker still names it once its files are open.

    Raises:
        ValidationError: ``stage`` found that ``into`` does not match (every candidate would say so).
    """
    where = f"tier {c.tier.name} step {c.step}"
    try:
        ck = open_checkpoint(c.storage, c.step, verify, where, rank, world,
                             defer_verify=stage is not None)
        if world > 1 and changed_meanwhile(c) is not None:
            # A rank must read the very write the ranks agreed on: its marker still naming it
            # after the open (a marker never names a write again once replaced) means the files
            # open are that write's; else this rank may hold another write, which it never restores.
            return None
        ck.tier_name = c.tier.name
        ck.storage, ck.save = c.storage, c.save
        if stage is not None:
            stage(ck)
    except ValidationError:
        raise  # the caller's `into` does not match: every candidate would say the same
    except NotThisLayout as e:
        log.info("nebula_ckpt: not restoring %s", e)
        if layouts is not None:
            layouts.append(str(e))
        return None
    except Exception as e:  # KeyError, OverflowError, struct.error, OSError...: all mean damaged
        if outage(e):  # but a store that did not answer, or a file this process cannot read: may be whole
            better = refused_here(e, where)
            if better is not None:
                raise better from e
            raise
        again = changed_meanwhile(c) if world > 1 or again_ok else None
        if again is not None:  # saved again or removed while it was read: not damaged
            # the ranks agree again on what each lists now (open_agreed): the new write or an older step
            return None if again is c or world > 1 else \
                _open_candidate(again, verify, rank, world, stage, skipped, layouts, False)
        why = str(e) if isinstance(e, CorruptCheckpointError) else \
            f"{where}: cannot read it ({type(e).__name__}: {e})"
        log.warning("nebula_ckpt: skipping %s", why)
        skipped.append(why)
        return None
    return ck


def changed_meanwhile(c: Candidate) -> Optional[Candidate]:
    """After candidate ``c`` failed to open: None when its marker still names the write listed (or
    cannot be read): the failure is damage. Else the step was removed (``c`` itself: left out) or
    saved again while it was read (a job replaces the marker with the new write's, then removes the
    old write's files): the candidate of its new write, opened in its place by one process (the
    ranks of a job open only the write they agreed on: they agree again)."""
    try:
        now = read_commit(c.storage, c.step, f"tier {c.tier.name} step {c.step}")
    except FileNotFoundError:
        log.info("nebula_ckpt: tier %s step %d was removed while it was read; left out", c.tier.name, c.step)
        return c
    except Exception as e:  # unreadable now: the failure stands as damage
        if outage(e):
            raise  # unless the store did not answer: neither damage nor a new write
        return None
    if now.write == c.order:
        return None
    log.info("nebula_ckpt: tier %s step %d was saved again while it was read; reading its new write",
             c.tier.name, c.step)
    return replace(c, generation=now.generation, save=-1 if now.save is None else now.save)


def _all_damaged_message(tiers: list[tuple[Tier, Storage]], step: Optional[int], skipped: list[str]) -> str:
    roots = ", ".join(sorted({t.name for t, _ in tiers}))
    listing = "\n".join(f"  - {s}" for s in skipped)
    return (f"no healthy checkpoint{f' of step {step}' if step is not None else ''}: all "
            f"{len(skipped)} committed candidate(s) are damaged:\n{listing}\n"
            f"Check them first with `nebula-ckpt verify ROOT` (tiers: {roots}): when it reports them healthy, "
            "the checkpoints are fine and the reasons above are this process's (a device, memory, permissions). "
            "Only a step that verify reports DAMAGED is: restore an older copy of its folder, or move it aside "
            "to resume from an older step.")


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


def stop_together(co: Coordinator, said: list[Optional[str]], own: Optional[BaseException]) -> None:
    """Raise on every rank when a rank's store did not answer (``said``: each rank's error or None;
    ``own``: this rank's, raised as it is): the ranks stop together, never one waiting on the others."""
    lost = own or next((f"rank {r}: {why}" for r, why in enumerate(said) if why), None)
    if isinstance(lost, str):
        from nebula_ckpt.storage.remote.errors import RemoteUnavailableError  # loaded on first use
        raise RemoteUnavailableError(f"rank {co.rank}: not restoring: another rank could not read the checkpoint, "
                                     f"which is not damage ({lost}); retry once it can")
    if lost is not None:
        raise lost


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


def say(outcome: dict[str, Any], step: Optional[int], root: str) -> None:
    """Log what the restore skipped and why (WARNING), and a restored step that is suspect."""
    skipped = outcome.get("skipped") or []
    if skipped:
        lines = "; ".join(f"step {x['step']} (writer generation {x['generation']}): {x['reason']}" for x in skipped)
        got = f"restoring step {step}" if step is not None else "restoring nothing"
        log.warning("nebula_ckpt: %s of %s; skipped %d step(s) marked suspect: %s%s", got, root, len(skipped), lines,
                    _same_failure_hint(skipped))
    if step is not None and outcome.get("health") == SUSPECT:
        log.warning("nebula_ckpt: restoring step %d of %s, which is marked suspect (%s); `nebula-ckpt mark --healthy "
                    "%d ROOT` clears the mark", step, root, outcome.get("health_reason"), step)


def _same_failure_hint(skipped: list[dict[str, Any]]) -> str:
    """When two skipped steps went bad at the same step, the cause is likely there, not in them."""
    at = [x["reason"].split(",")[0] for x in skipped if "after a restore from it" in x["reason"]]
    if len(at) >= 2 and len(set(at)) == 1:
        return (f". Restores from {len(at)} different steps went bad the same way ({at[0]}): the cause is likely "
                "the data or the code at that step, not a checkpoint; older steps will likely go bad too")
    return ""
