"""``nebula-ckpt verify``: the full checksum check of every committed step (or one); exit 1 on damage.

A step removed while verify runs (retention of a job that is saving, ``remove()``, ``gc``) is not
damage: its commit marker goes first, so a step whose check failed and whose marker is gone now is
left out (named on stderr). Nor is a step saved again meanwhile (its marker replaced by the new
write's before the old write's files go): its new write is checked. A step whose check failed
while the marker it started from is still there is ``DAMAGED``. A step that cannot be read though it
may be whole (the store did not answer, a timeout, this process refused its files) is ``UNCHECKED``,
never ``DAMAGED``: exit 3 when nothing is damaged (``EXIT_UNREADABLE``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Optional

from nebula_ckpt.cli.common import (
    EXIT_UNREADABLE,
    Listed,
    NotChecked,
    check_whole,
    commit_state,
    each_step,
    listed_committed,
    note,
    open_tiers,
    out,
    ranks_json,
    ranks_text,
    references_json,
    references_text,
    removed_meanwhile,
)
from nebula_ckpt.format import manifest as mf
from nebula_ckpt.format.commit import step_dirs
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.storage.urls import strip_credentials
from nebula_ckpt.tiers.base import Tier


def cmd_verify(args: argparse.Namespace) -> int:
    """Full checksum check of every committed step (or ``--step``) of every tier; exit 1 on any
    damage, or when there is nothing to check; else 3 when a step could not be read (an outage)."""
    return verify_tiers(open_tiers(args.root, args.storage_options), args)


def verify_step(tier: Tier, st: Storage, step: int) -> Optional[tuple[dict[str, Any], Optional[mf.Manifest]]]:
    """``verify --json``'s row of one committed step and its manifest (None when not healthy), or
    None when the step was removed since it was listed (its commit marker is gone). A step that
    could not be read (an outage) is neither healthy nor damaged: ``healthy`` None, ``unchecked`` why.

    Raises:
        SavedAgain: the step was saved again while each check of it ran (:func:`check_whole`).
    """
    try:
        return _verified_row(tier, st, step)
    except NotChecked as e:
        return ({"tier": tier.name, "step": step, "healthy": None, "problem": None, "unchecked": str(e),
                 **references_json(None), **ranks_json(None)}, None)


def _verified_row(tier: Tier, st: Storage, step: int) -> Optional[tuple[dict[str, Any], Optional[mf.Manifest]]]:
    """:func:`verify_step` of a step whose files answer.

    Raises:
        NotChecked: they do not (an outage).
    """
    committed, refused = commit_state(st, tier, step)
    if not committed:
        return None
    if refused:
        if removed_meanwhile(st, tier, step):
            return None
        ok, why, man = False, refused, None
    else:
        checked = check_whole(st, tier, step, "full")
        if checked is None:
            return None
        ok, why, man = checked
    return ({"tier": tier.name, "step": step, "healthy": ok, "problem": None if ok else why, "unchecked": None,
             **references_json(man), **ranks_json(man)}, man)


def verify_tiers(pairs: list[tuple[Tier, Storage]], args: argparse.Namespace) -> int:
    """``verify`` of the tiers ``pairs`` (each with its open storage), as ``args`` asks: the output
    and the exit code."""
    def listing() -> list[Listed]:
        return [(tier, st, step) for tier, st in pairs for step in step_dirs(st)
                if (args.step is None or step == args.step) and listed_committed(st, tier, step)]

    checked = each_step(listing, verify_step, "verify", "verifying", quiet=args.json)
    results = [r for r, _ in checked]
    if args.json:
        out(json.dumps(results, indent=2))
    else:
        for r, man in checked:
            job = f" ({ranks_text(man)}: every shard verified)" if ranks_text(man) else ""
            if references_text(man):
                job += f" ({references_text(man)}: verified)"
            label = {True: "OK     ", False: "DAMAGED", None: "UNCHECKED"}[r["healthy"]]
            out(f"{label} {r['tier']} step {r['step']}{job}"
                + ("" if r["healthy"] else f": {r['problem'] or r['unchecked']}"))
    if not results:
        which = "" if args.step is None else f" of step {args.step}"
        # with --json, stdout holds the JSON alone (``[]``)
        (note if args.json else out)(f"no committed checkpoint{which} under {strip_credentials(args.root)}")
        return 1
    if any(r["healthy"] is False for r in results):
        return 1
    return EXIT_UNREADABLE if any(r["healthy"] is None for r in results) else 0
