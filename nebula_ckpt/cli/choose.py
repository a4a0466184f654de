"""Which checkpoint ``inspect`` and ``export`` read: ``--step N``, ``--tag NAME`` or the newest.

Users name checkpoints by tag (``epoch-3``, Lightning's file name, DeepSpeed's ``global_step500``)
as often as by step: both are accepted, and with neither (or ``--step latest``) the newest
healthy step is read, as a restart would: the copies are tried in the restore's order
(:func:`~nebula_ckpt.restore.select.list_candidates`: the newest writer generation first, so a
run abandoned by a rollback never wins, then the newest step, then the fastest tier), the steps
marked suspect are skipped as ``load_latest`` skips them
(:class:`~nebula_ckpt.restore.select.HealthChoice`), and a damaged copy passes to the next (a
copy a job saved again while it was read is read again, its new write; one removed while it was
read, by a job's retention beside the command, is left out, and the root is listed again when
nothing else opened, as ``verify`` does). The skipped copies are named on stderr. ``--step N``
reads ``N`` whatever its mark (a suspect one is said so on stderr). A copy that cannot be read
though it may be whole (the store did not answer, a timeout, this process refused its files) is
never passed over for an older step, as ``load_latest`` raises it: the command stops, saying so
(:class:`~nebula_ckpt.cli.common.NotChecked`).

A multi-rank job's memory tier holds each rank's own part of a step (one rank's memory-tier
copy, the first copy in the restore's order): never the choice while a whole copy of the step is
on a shared tier, since a restart restores a step only where every rank holds it, which this
process cannot agree on with the other ranks, and that copy lacks their keys. It is named on
stderr as such, never as damage.
"""

from __future__ import annotations

import argparse
from typing import Callable, Optional, TypeVar, Union

from nebula_ckpt.cli.common import RELIST_ROUNDS, listed_committed, note, open_tiers, raise_if_outage, ranks_text
from nebula_ckpt.errors import NebulaError
from nebula_ckpt.format.commit import step_dirs
from nebula_ckpt.format.health import SUSPECT
from nebula_ckpt.health.book import HealthView
from nebula_ckpt.restore.open import read_main_manifest
from nebula_ckpt.restore.select import Candidate, HealthChoice, changed_meanwhile, list_candidates
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.storage.urls import strip_credentials
from nebula_ckpt.tiers.base import Tier

T = TypeVar("T")

#: ``--step`` value that means the newest healthy step
LATEST = "latest"


def step_arg(text: str) -> Union[int, str]:
    """argparse type of ``--step``: a step number or ``latest``."""
    if text == LATEST:
        return LATEST
    try:
        int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a step number nor 'latest'") from None
    return step_number(text)


def step_number(text: str) -> int:
    """argparse type of a step number (``verify --step``): an integer >= 0; anything else is a
    usage error (exit 2), as for ``inspect`` and ``export``."""
    try:
        step = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a step number") from None
    if step < 0:
        raise argparse.ArgumentTypeError(f"{step} is not a step number (>= 0)")
    return step


def add_choice_arguments(sp: argparse.ArgumentParser) -> None:
    """``--step N|latest`` and ``--tag NAME`` (at most one; neither: the newest healthy step)."""
    which = sp.add_mutually_exclusive_group()
    which.add_argument("--step", type=step_arg, default=None, metavar="N|latest",
                       help="the step to read (even one marked suspect), or 'latest' (the default: the newest "
                            "healthy step not marked suspect, the one a restart restores)")
    which.add_argument("--tag", default=None, metavar="NAME",
                       help="the newest healthy step saved with this tag (as `ls` shows it)")


def _asked(args: argparse.Namespace) -> str:
    if isinstance(args.step, int):
        return f"checkpoint of step {args.step}"
    if args.tag is not None:
        return f"checkpoint tagged {args.tag!r}"
    return "checkpoint"


def _committed(tier: Tier, st: Storage) -> list[int]:
    """The steps of one tier whose commit marker is there, ascending; a marker that cannot be
    checked safely (a symlink, never followed; unreadable) counts, so that its step is named as
    damaged rather than passed over unsaid; one the store does not answer for counts too (its
    marker's read raises the outage)."""
    return [s for s in step_dirs(st) if listed_committed(st, tier, s)]


def _where(c: Candidate) -> str:
    return f"tier {c.tier.name} step {c.step}"


def candidates(args: argparse.Namespace, tiers: list[tuple[Tier, Storage]],
               gone: Optional[list[Candidate]] = None) -> tuple[list[Candidate], list[str]]:
    """The copies that may answer ``--step`` / ``--tag`` / latest, in the order a restore tries them
    (:func:`~nebula_ckpt.restore.select.list_candidates`; ``--tag``: its newest step first, as
    ``load(tag=...)``), and the tags seen on the way (for the error when none matches). ``gone``:
    gets each step listed whose commit marker was removed before it was read (a job's retention).

    Raises:
        NotChecked: a manifest read for ``--tag`` met an outage (never passed over for an older step).
    """
    ordered = list_candidates(tiers, steps=_committed, unmarked=gone)
    if isinstance(args.step, int):
        return [c for c in ordered if c.step == args.step], []
    if args.tag is None:
        return ordered, []
    found: list[Candidate] = []
    tags: list[str] = []
    for c in ordered:
        try:
            tag = read_main_manifest(c.storage, c.step, _where(c)).tag
        except Exception as e:  # damaged: not found by its tag (ls and verify show it); an outage: raised
            raise_if_outage(e, _where(c))
            continue
        if tag == args.tag:
            found.append(c)
        elif tag is not None and tag not in tags:
            tags.append(tag)
    found.sort(key=lambda c: -c.step)  # stable: a step's writes stay in the restore's order
    return found, tags


def open_chosen(args: argparse.Namespace, opener: Callable[[Storage, int, str], T], one_rank_ok: bool = False) -> T:
    """``opener(storage, step, where)`` of the first healthy copy of what the user asked for
    (latest: the first not marked suspect either, as ``load_latest``).

    One rank's memory-tier copy (:func:`one_ranks_part`) is passed over for a whole copy of the
    job's step: this process cannot agree on it with the other ranks as a restart does, and it
    lacks their keys. It is named on stderr as what it is, never as damage. ``one_rank_ok``: a
    ``--step N`` that only such copies hold is read from the first of them, with a note (``inspect``);
    else it is refused, saying so (``export`` needs every rank's part). A copy removed while it
    was read (a job's retention beside the command) is left out, named on stderr, never as
    damage; when nothing opened and one was, the root is listed again (:data:`RELIST_ROUNDS`
    times at most), as ``verify`` does.

    Raises:
        NotChecked: a copy tried could not be read though it may be whole (an outage): never passed
            over for the next, as ``load_latest`` raises it.
        NebulaError: nothing healthy answers, naming every copy tried and why, or the tags
            there are when none matches ``--tag``; or what answered was removed while it was read.
    """
    tiers = open_tiers(args.root, args.storage_options)
    view = HealthView(tiers[-1][1]) if tiers else None  # the records are on the root's own tier (listed last)
    removed: list[Candidate] = []
    for _ in range(RELIST_ROUNDS):
        choice = HealthChoice(view, skip_suspect=not isinstance(args.step, int) and args.tag is None)
        gone: list[Candidate] = []
        found, tags = candidates(args, tiers, gone)
        # a marker that cannot be read is damage, named whatever the order says (as a restore does)
        errors = [f"{_where(c)}: {c.problem}" for c in found if c.problem is not None]
        parts: list[tuple[Candidate, str]] = []
        got = _first_whole(found, opener, choice, errors, parts, gone)
        if got is None and one_rank_ok and isinstance(args.step, int):
            got = _first_part(parts, opener, choice, errors, gone)
        if got is not None:
            return got[0]
        for c in gone:
            note(f"{_where(c)} was removed while it was read (retention, remove() or gc); left out")
        removed += gone
        if not gone:
            break
    if removed and not (errors or parts or choice.skipped):  # else the steps still there say why
        raise _removed(args, removed)
    raise _nothing(args, tiers, found, tags, errors, choice, parts)


def _first_whole(found: list[Candidate], opener: Callable[[Storage, int, str], T], choice: HealthChoice,
                 errors: list[str], parts: list[tuple[Candidate, str]],
                 gone: list[Candidate]) -> Optional[tuple[T]]:
    """``(opener(...),)`` of the first whole copy of ``found`` that opens (latest: not marked
    suspect); one rank's memory-tier copies go to ``parts``, each failure to ``errors``, a copy
    removed while it was read to ``gone``; None when none opens."""
    for c in found:
        if c.problem is not None or choice.skips(*c.order):
            continue
        held = one_ranks_part(c)
        if held is not None:
            parts.append((c, held))
            continue
        try:
            got = _open(c, opener, gone)
        except Exception as e:  # damaged: the next copy; an outage: raised, never an older step
            raise_if_outage(e, _where(c))
            errors.append(str(e))
            continue
        if got is not None:
            _say_skipped(errors, choice, c, parts)
            return got
    return None


def _first_part(parts: list[tuple[Candidate, str]], opener: Callable[[Storage, int, str], T],
                choice: HealthChoice, errors: list[str], gone: list[Candidate]) -> Optional[tuple[T]]:
    """``(opener(...),)`` of the first of one rank's memory-tier copies that opens (``--step N``
    that no whole copy holds, for ``inspect``), with a note saying what it is; None when none does."""
    for c, held in parts:
        try:
            got = _open(c, opener, gone)
        except Exception as e:  # damaged: the next copy; an outage: raised, never an older step
            raise_if_outage(e, _where(c))
            errors.append(str(e))
            continue
        if got is None:
            continue
        _say_skipped(errors, choice, c, [])
        note(f"no healthy whole copy of step {c.step} here: shown from {_where(c)}, one rank's memory-tier copy "
             f"({held}); the other ranks' parts and keys are not in it (`nebula-ckpt persist-memory ROOT` on "
             "every node puts the job's step on the root)")
        return got
    return None


def one_ranks_part(c: Candidate) -> Optional[str]:
    """What candidate ``c`` holds (``"rank(s) 0 of a 2-rank job"``) when it is one rank's
    memory-tier copy: a multi-rank step holding fewer ranks than its world size (each rank's own
    tier holds its own part); None for a whole checkpoint, or one whose manifest cannot be read
    (its open names the damage)."""
    try:
        man = read_main_manifest(c.storage, c.step, _where(c), index=False)
    except Exception:  # damaged: the opener says why
        return None
    if not man.multi_rank or len(man.ranks) == man.world_size:
        return None
    return ranks_text(man)


def _open(c: Candidate, opener: Callable[[Storage, int, str], T], gone: list[Candidate]) -> Optional[tuple[T]]:
    """``(opener(...),)`` of candidate ``c``, once more when it failed because a job saved the step
    again meanwhile (its marker names another write now, whose files replace the old write's): its
    new write, never taken for damage. None when the step was removed while it was read (or saved
    again during each read): appended to ``gone``, never taken for damage either."""
    try:
        return (opener(c.storage, c.step, _where(c)),)
    except Exception:
        now = changed_meanwhile(c)
        if now is None:  # the same write, unreadable: the failure stands
            raise
        if now is c:
            gone.append(c)
            return None
    try:
        return (opener(now.storage, now.step, _where(now)),)
    except Exception:
        if changed_meanwhile(now) is None:
            raise
        gone.append(c)
        return None


def _say_skipped(errors: list[str], choice: HealthChoice, chosen: Candidate,
                 parts: list[tuple[Candidate, str]]) -> None:
    """Name on stderr the copies passed over (damaged, marked suspect, one rank's memory-tier copy),
    and a chosen step that is marked suspect (one asked for by ``--step`` or ``--tag``)."""
    for skipped in errors:
        note(f"skipped (damaged): {skipped}")
    for (generation, step), why in choice.skipped.items():
        note(f"skipped step {step} (writer generation {generation}), marked suspect: {why} (load_latest skips it "
             f"too; `--step {step}` reads it anyway)")
    for c, held in parts:
        newer = (" (a restart restores it only where every rank's own tier holds it; `nebula-ckpt persist-memory "
                 "ROOT` on every node puts such a step on the root)" if c.step > chosen.step else "")
        note(f"skipped {_where(c)}: one rank's memory-tier copy ({held}), which this command cannot agree on with "
             f"the other ranks as a restart does; read {_where(chosen)}{newer}")
    mark = choice.mark(*chosen.order)
    if mark.state == SUSPECT:
        note(f"step {chosen.step} is marked suspect: {mark.reason} (load_latest skips it; "
             f"`nebula-ckpt mark ROOT --healthy {chosen.step}` clears the mark)")


def _nothing(args: argparse.Namespace, tiers: list[tuple[Tier, Storage]], found: list[Candidate],
             tags: list[str], errors: list[str], choice: HealthChoice,
             parts: list[tuple[Candidate, str]]) -> NebulaError:
    """The error for nothing healthy (and not suspect, for latest) answering what was asked."""
    root = strip_credentials(args.root)
    if args.tag is not None and not found:
        return NebulaError(f"no committed checkpoint tagged {args.tag!r} under {root}; tags there: {tags[-20:]}")
    if isinstance(args.step, int) and not found:
        steps = sorted({s for tier, st in tiers for s in step_dirs(st) if listed_committed(st, tier, s)})
        there = (f"committed steps there: {_steps_list(steps)}" if steps else "it holds no committed checkpoint")
        return NebulaError(f"no checkpoint of step {args.step} under {root}; {there}")
    damaged = f" ({'; '.join(errors)})" if errors else ""
    held = "; ".join(f"{_where(c)}: {what}" for c, what in parts[:4])
    which = f"step {args.step}" if isinstance(args.step, int) else "the other committed steps"
    partial = ("" if not parts else
               f". Only one rank's memory-tier copy holds {which} ({held}): this command reads a multi-rank step "
               "whole, as every rank restores it; `nebula-ckpt persist-memory ROOT` on every node puts the job's "
               "step on the root, and `nebula-ckpt inspect ROOT --step N` shows one rank's part")
    if choice.skipped:
        steps = sorted({s for _, s in choice.skipped}, reverse=True)
        return NebulaError(
            f"no checkpoint under {root} to read as the latest: every committed step that is not damaged{damaged} "
            f"is marked suspect (steps {_steps_list(steps)}), and load_latest skips those too. Read one anyway "
            f"with `--step N`, or clear its mark with `nebula-ckpt mark ROOT --healthy N`{partial}")
    return NebulaError(f"no healthy {_asked(args)} under {root}{damaged}{partial}")


def _removed(args: argparse.Namespace, removed: list[Candidate]) -> NebulaError:
    """The error for what answered having been removed while it was read, each time the root was listed."""
    steps = ", ".join(dict.fromkeys(_where(c) for c in removed))
    return NebulaError(
        f"no {_asked(args)} read under {strip_credentials(args.root)}: {steps} was removed while it was read, "
        f"each time the root was listed ({RELIST_ROUNDS} times at most). A job saving to this root removes its "
        "older steps as they are read (its retention: keep_last, keep_every), or remove() / `nebula-ckpt gc` ran: "
        "this is no damage. Run the command again, or once that job has stopped (`nebula-ckpt ls ROOT` lists the "
        "steps there now)")


def _steps_list(steps: list[int]) -> str:
    """``1, 2, 5`` (a long list: its first three and its newest twenty, with the count)."""
    if len(steps) <= 24:
        return ", ".join(map(str, steps))
    return (f"{', '.join(map(str, steps[:3]))}, ... {', '.join(map(str, steps[-20:]))} "
            f"({len(steps)} in all)")
