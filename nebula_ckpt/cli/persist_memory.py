"""``nebula-ckpt persist-memory ROOT``: the memory tier's newest step onto the root, for a job
that ends for good (a job epilogue, a node agent). The work is
:func:`nebula_ckpt.save.epilogue.persist_memory`; this is its command line."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from nebula_ckpt.cli.common import out
from nebula_ckpt.errors import ValidationError
from nebula_ckpt.save.epilogue import persist_memory


def cmd_persist_memory(args: argparse.Namespace) -> int:
    """Exit 0 when the newest memory-tier step is on the root (copied now or already), 1 when it is
    damaged (nothing written), 2 when the root is multi-rank or a live process writes the tier."""
    try:
        got = persist_memory(args.root, args.storage_options)
    except ValidationError as e:
        sys.stderr.write(f"nebula-ckpt: {e}\n")
        return 2
    out(json.dumps(got) if args.json else
        (f"copied step {got['step']} to the root" if got["copied"] else f"nothing to copy: {got['why']}"))
    return 0


def add_persist_memory_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]",
                              common: Callable[[argparse.ArgumentParser], None]) -> None:
    """The ``persist-memory`` subcommand (``common``: the root, ``--json``, ``--storage-options``)."""
    sp = sub.add_parser("persist-memory", help="put the memory tier's newest step on the root (job epilogue)")
    common(sp)
