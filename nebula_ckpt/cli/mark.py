"""``nebula-ckpt mark ROOT --healthy STEP`` / ``--suspect STEP``: a person's health mark of a step.

The mark is a health record (:mod:`nebula_ckpt.format.health`) written on the root, by ``user``:
it decides over every mark the training signal made before it (``--healthy`` clears a suspect
mark, so the next ``load_latest`` may restore the step again; ``--suspect`` makes it skip the
step). A later suspect mark from the training signal still overrides it. Every committed copy of
the step on the root's tiers is marked (each write holding it: its writer generation and save
number); a write that later replaces the step is another checkpoint, with no mark. Nothing else
changes.
"""

from __future__ import annotations

import argparse
import getpass
import json
import socket
import sys
from typing import Callable, Optional

from nebula_ckpt.cli.common import open_tiers, out, raise_if_outage
from nebula_ckpt.format.commit import read_commit
from nebula_ckpt.format.health import BY_USER, HEALTHY, SUSPECT, clean_reason
from nebula_ckpt.format.names import COMMIT, step_dir
from nebula_ckpt.health.book import HealthBook
from nebula_ckpt.integrations.pointers import find_root
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.tiers.base import Tier


def _writes(pairs: list[tuple[Tier, Storage]], step: int) -> tuple[set[tuple[int, Optional[int]]], list[str]]:
    """The writes ``(generation, save)`` of the committed copies of ``step`` on the root's tiers
    ``pairs``, and what could not be read (damaged markers).

    Raises:
        NotChecked: a marker could not be read though it may be whole (an outage): nothing is marked,
            rather than some of the step's copies, or "no committed step".
    """
    gens: set[tuple[int, Optional[int]]] = set()
    problems: list[str] = []
    for tier, st in pairs:
        try:
            if not st.exists(f"{step_dir(step)}/{COMMIT}"):
                continue
            c = read_commit(st, step, f"tier {tier.name} step {step}")
            gens.add((c.generation, c.save))
        except Exception as e:  # an unreadable marker: that copy cannot be named, the others can
            raise_if_outage(e, f"tier {tier.name} step {step}")  # one that may be whole: none marked
            problems.append(f"tier {tier.name}: {type(e).__name__}: {e}")
    return gens, problems


def cmd_mark(args: argparse.Namespace) -> int:
    """Mark ``--healthy STEP`` or ``--suspect STEP``; exit 1 when the root holds no committed ``STEP``,
    2 for a negative step."""
    state, step = (HEALTHY, args.healthy) if args.healthy is not None else (SUSPECT, args.suspect)
    if step < 0:
        sys.stderr.write(f"nebula-ckpt: STEP must be a non-negative int, got {step}\n")
        return 2
    pairs = open_tiers(find_root(args.root), args.storage_options)
    gens, problems = _writes(pairs, step)
    for p in problems:
        sys.stderr.write(f"nebula-ckpt: cannot read the commit marker of step {step}: {p}\n")
    if not gens:
        sys.stderr.write(f"nebula-ckpt: no committed step {step} under {args.root}; nothing marked "
                         "(`nebula-ckpt ls ROOT` lists the steps)\n")
        return 1
    who = f"{getpass.getuser()}@{socket.gethostname()}"
    reason = clean_reason(args.reason) if args.reason else f"marked {state} by {who} (nebula-ckpt mark)"
    book = HealthBook(pairs[-1][1])  # the root's own tier: listed last
    written = [book.append(step=step, generation=g, state=state, by=BY_USER, rank=None, reason=reason, save=v)
               for g, v in sorted(gens, key=lambda w: (w[0], -1 if w[1] is None else w[1]))]
    if args.json:
        out(json.dumps([{"step": r.step, "generation": r.generation, "health": r.state, "reason": r.reason,
                         "record": r.path} for r in written], indent=2))
    else:
        for r in written:
            out(f"step {r.step} (writer generation {r.generation}) marked {r.state}: {r.reason}")
    return 0


def add_mark_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]",
                    common: Callable[[argparse.ArgumentParser], None]) -> None:
    """The ``mark`` subcommand (``common``: the root, ``--json``, ``--storage-options``)."""
    sp = sub.add_parser("mark", help="mark a step healthy (clears a suspect mark) or suspect (restores skip it)")
    common(sp)
    which = sp.add_mutually_exclusive_group(required=True)
    which.add_argument("--healthy", type=int, metavar="STEP", help="mark STEP healthy: a restore may pick it again")
    which.add_argument("--suspect", type=int, metavar="STEP", help="mark STEP suspect: load_latest skips it")
    sp.add_argument("--reason", default=None, help="why (shown by ls and in the restore's log)")
