"""The candidates of a restore: a committed step on one tier, with the write its commit marker
names, and the one order of "the newest checkpoint" (:func:`list_candidates`, every marker read;
:func:`~nebula_ckpt.restore.select.newest_first` reads them lazily in that same order).

The order: the newest writer generation first (a checkpoint of a stale writer, fenced since, never
wins over a newer writer's, whatever its step number and tier), then the newest step, then the
later write of a step saved twice (its commit marker's save number), then, for one write, the
fastest tier. A marker that cannot be read sorts after every one that can.

The end of this module holds what a restore says when the candidates give it no checkpoint
(all damaged, or removed while read), when a rank's store did not answer, and about the steps
its health marks made it skip (:func:`say`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from nebula_ckpt.errors import CorruptCheckpointError, NebulaError
from nebula_ckpt.format.commit import Write, committed_steps, read_commit
from nebula_ckpt.format.health import SUSPECT
from nebula_ckpt.ranks.coordinator import Coordinator
from nebula_ckpt.restore.unreadable import outage
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.tiers.base import Tier

log = logging.getLogger(__name__)

#: ``steps(tier, storage)``: the committed steps of one tier, ascending (see :func:`list_candidates`)
Lister = Callable[[Tier, Storage], list[int]]


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


def sort_key(c: Candidate, tier_index: int) -> tuple[int, int, int, int]:
    """Where ``c`` (on the ``tier_index``-th tier, fastest first) sorts: ascending is newest first."""
    return (-c.generation, -c.step, -c.save, tier_index)


def unreadable_marker(tier: Tier, storage: Storage, step: int, e: BaseException) -> Candidate:
    """The candidate of ``step`` whose commit marker could not be read (``e``: why): damage, sorted last."""
    why = str(e) if isinstance(e, CorruptCheckpointError) else f"commit marker is unreadable ({type(e).__name__}: {e})"
    return Candidate(step, tier, storage, -1, why, -1)


def list_candidates(tiers: list[tuple[Tier, Storage]], steps: Optional[Lister] = None,
                    unlisted: Optional[list[BaseException]] = None,
                    unmarked: Optional[list[Candidate]] = None) -> list[Candidate]:
    """Every committed step on every tier: newest writer generation first, then newest step, then
    fastest tier (the order of ``tiers``), every commit marker read.

    The generation comes first because a writer fenced by a newer one may have gone on committing
    higher steps on a tier the newer one never wrote (its memory tier): those steps are a run
    that was abandoned, never the one to resume. This is the one order of "the newest
    checkpoint": a restore's, and ``nebula-ckpt inspect`` / ``export``'s.

    ``steps``: lists a tier's committed steps (None: the steps with a commit marker,
    :func:`~nebula_ckpt.format.commit.committed_steps`); a step listed whose marker cannot be read
    is a candidate with its ``problem``; one whose marker is gone by then was removed since listed
    (a job's retention deleting it as it is read: each deletion takes the marker first): left out,
    and given to ``unmarked`` (a :class:`Candidate` without its write), when given. ``unlisted``:
    gets the error of each tier that cannot be listed (None: logged only); see :func:`check_listed`.
    """
    cands: list[tuple[tuple[int, int, int, int], Candidate]] = []
    for i, (tier, st) in enumerate(tiers):
        try:
            listed = committed_steps(st) if steps is None else steps(tier, st)
        except Exception as e:
            log.warning("nebula_ckpt: cannot list tier %s: %s", tier.name, e)
            if unlisted is not None:
                unlisted.append(e)
            continue
        for s in listed:
            try:
                (g, _, w) = read_commit(st, s, f"step {s}").write
                c = Candidate(s, tier, st, g, None, w)
            except FileNotFoundError:  # removed since listed: neither committed nor damaged
                if unmarked is not None:
                    unmarked.append(Candidate(s, tier, st))
                continue
            except Exception as e:  # unreadable, garbled
                c = unreadable_marker(tier, st, s, e)
            cands.append((sort_key(c, i), c))
    return [c for _, c in sorted(cands, key=lambda x: x[0])]


def check_listed(unlisted: list[BaseException], c: Optional[Candidate] = None) -> None:
    """Raise the error of a tier that could not be listed (``unlisted``), which may hold a newer step
    than candidate ``c`` (None: than nothing), unless ``c`` is on the memory tier (a tier lost on a
    reboot), which every save of this node reaches first: an unreachable tier is neither empty nor damaged."""
    if unlisted and (c is None or c.tier.persistent):
        log.error("nebula_ckpt: not restoring: a tier could not be listed, so the newest checkpoint is not "
                  "known; retry once it answers (%s)", unlisted[0])
        raise unlisted[0]


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


# -- what a restore says ---------------------------------------------------------------------------


#: How often a restore of the newest step lists the tiers again when it opened nothing because
#: steps were removed while it read them (a job's retention beside it), as ``verify`` does.
RELIST_ROUNDS = 3


def list_again(listing: int, unmarked: list[Candidate], before: Optional[list[tuple[str, int]]],
               removed: bool) -> bool:
    """Whether a restore of the newest step drops its listing number ``listing`` (from 0) and lists
    the tiers again, before it goes on to an older step: ``removed``, a candidate was removed while
    read, or the listing met a step folder without its marker that the listing ``before`` (None:
    none) did not: a step removed since it was listed (a job's retention beside takes each marker
    first), so newer steps may have come too, or a save begun since (met again by the next listing,
    which then goes on). The last of the :data:`RELIST_ROUNDS` listings goes on whatever it meets."""
    if listing >= RELIST_ROUNDS - 1:
        return False
    return removed or any((c.tier.name, c.step) not in (before or []) for c in unmarked)


def removed_error(removed: list[Candidate], skipped: list[str]) -> NebulaError:
    """The error for a restore of the newest step whose candidates were all removed while read."""
    steps = ", ".join(dict.fromkeys(f"tier {c.tier.name} step {c.step}" for c in removed))
    roots = ", ".join(dict.fromkeys(c.storage.display_url for c in removed))
    damaged = f"; skipped as damaged: {'; '.join(skipped)}" if skipped else ""
    return NebulaError(
        f"nothing restored from {roots}: {steps} was removed (or saved again) while it was read, each time the "
        f"tiers were listed ({RELIST_ROUNDS} times at most){damaged}. Another process changes the committed steps "
        "there as they are read: a job saving to this root, whose retention (keep_last, keep_every) removes its "
        "older steps, or remove() / `nebula-ckpt gc`. This is no damage and not an empty root: restore again, or "
        "once that job has stopped (`nebula-ckpt ls ROOT` lists the steps there now)")


def all_damaged_message(tiers: list[tuple[Tier, Storage]], step: Optional[int], skipped: list[str]) -> str:
    """The error for committed candidates (of ``step``) that are all damaged (``skipped``: why each)."""
    roots = ", ".join(sorted({t.name for t, _ in tiers}))
    listing = "\n".join(f"  - {s}" for s in skipped)
    return (f"no healthy checkpoint{f' of step {step}' if step is not None else ''}: all "
            f"{len(skipped)} committed candidate(s) are damaged:\n{listing}\n"
            f"Check them first with `nebula-ckpt verify ROOT` (tiers: {roots}): when it reports them healthy, "
            "the checkpoints are fine and the reasons above are this process's (a device, memory, permissions). "
            "Only a step that verify reports DAMAGED is: restore an older copy of its folder, or move it aside "
            "to resume from an older step.")


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
