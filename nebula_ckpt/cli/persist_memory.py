"""``nebula-ckpt persist-memory ROOT``: the newest step this host's memory tiers hold onto the root,
for a job that ends for good or moves to other nodes (a job epilogue on every node, a node agent,
the scheduler's cleanup). The work is :func:`nebula_ckpt.tiers.memory.epilogue.persist_memory`; this is its
command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Callable, Optional

from nebula_ckpt.cli import common
from nebula_ckpt.cli.common import OPENED, human_bytes, out, root_tiers
from nebula_ckpt.errors import FencedError, ValidationError
from nebula_ckpt.tiers.memory.epilogue import persist_memory


def cmd_persist_memory(args: argparse.Namespace) -> int:
    """Exit 0 when nothing newer than the root is left only in this host's RAM (the step committed
    now, by this host or by another node's run that completed it; or nothing to do, with why; or
    a multi-rank step waiting for other nodes' parts, which says which), 1 when a copy is damaged
    or the root cannot be written (nothing of it committed), 2 when a live process writes a
    memory tier of the root here, or a newer job committed on the root meanwhile (nothing written
    by this run is visible); a ROOT that is a malformed URL is a usage error (2), one that is a
    file holds nothing (1)."""
    OPENED.append(root_tiers(args.root, args.storage_options)[1])  # either said before anything is read
    try:
        got = persist_memory(args.root, args.storage_options, on_part=None if args.json else _progress())
    except (ValidationError, FencedError) as e:
        sys.stderr.write(f"nebula-ckpt: {e}\n")
        return 2
    if args.json:
        out(json.dumps(got))
    elif got["copied"]:
        out(f"step {got['step']} is committed on the root: {got['why']}")
    else:
        out(f"nothing to copy: {got['why']}")
    return 0


def _progress() -> Optional[Callable[[int, int], None]]:
    """A line on stderr per rank's part written, where a terminal shows it and once the work has
    taken :data:`~nebula_ckpt.cli.common.PROGRESS_DELAY_S` (as the other commands' progress
    bars: a quick run prints its answer alone)."""
    if not sys.stderr.isatty():
        return None
    start = time.monotonic()

    def told(rank: int, nbytes: int) -> None:
        if time.monotonic() - start >= common.PROGRESS_DELAY_S:
            sys.stderr.write(f"persist-memory: rank {rank}'s part written ({human_bytes(nbytes)})\n")
    return told


def add_persist_memory_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]",
                              common: Callable[[argparse.ArgumentParser], None]) -> None:
    """The ``persist-memory`` subcommand (``common``: the root, ``--json``, ``--storage-options``)."""
    sp = sub.add_parser("persist-memory", help="put the newest step only in this host's memory tiers on the root "
                                               "(job epilogue, on every node)")
    common(sp)

