"""``nebula-ckpt verify``: the full checksum check of every committed step (or one); exit 1 on damage."""

from __future__ import annotations

import argparse
import json

from nebula_ckpt.cli.common import (
    check,
    commit_state,
    open_tiers,
    out,
    progress,
    ranks_json,
    ranks_text,
    references_json,
    references_text,
)
from nebula_ckpt.format.commit import step_dirs
from nebula_ckpt.storage.urls import strip_credentials


def cmd_verify(args: argparse.Namespace) -> int:
    """Full checksum check of every committed step (or ``--step``) of every tier; exit 1 on any
    damage, or when there is nothing to check."""
    todo = []
    for tier, st in open_tiers(args.root, args.storage_options):
        for step in step_dirs(st):
            if args.step is not None and step != args.step:
                continue
            committed, refused = commit_state(st, tier, step)
            if committed:
                todo.append((tier, st, step, refused))
    results = []
    mans = []
    for tier, st, step, refused in progress(todo, "verifying", "ckpt", quiet=args.json):
        ok, why, man = (False, refused, None) if refused else check(st, tier, step, "full")
        results.append({"tier": tier.name, "step": step, "healthy": ok, "problem": None if ok else why,
                        **references_json(man), **ranks_json(man)})
        mans.append(man)
    if args.json:
        out(json.dumps(results, indent=2))
    else:
        for r, man in zip(results, mans, strict=True):
            job = f" ({ranks_text(man)}: every shard verified)" if ranks_text(man) else ""
            if references_text(man):
                job += f" ({references_text(man)}: verified)"
            out(f"{'OK     ' if r['healthy'] else 'DAMAGED'} {r['tier']} step {r['step']}{job}"
                + ("" if r["healthy"] else f": {r['problem']}"))
    if not results:
        which = "" if args.step is None else f" of step {args.step}"
        out(f"no committed checkpoint{which} under {strip_credentials(args.root)}")
        return 1
    return 0 if all(r["healthy"] for r in results) else 1
