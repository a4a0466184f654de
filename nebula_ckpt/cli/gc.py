"""``nebula-ckpt gc``: free memory tiers whose checkpoints are safe elsewhere (the policy is
:mod:`nebula_ckpt.tiers.memory.gc`; this is its command line)."""

from __future__ import annotations

import argparse
import json

from nebula_ckpt.cli.common import add_storage_options, human_bytes, note, out, progress
from nebula_ckpt.storage.urls import refuse_url_credentials, strip_credentials
from nebula_ckpt.tiers.memory import gc as memgc
from nebula_ckpt.tiers.roots import tier_for_root


def cmd_gc(args: argparse.Namespace) -> int:
    """Decide for every memory tier of this user (or of the run ``ROOT``), remove what may go
    (``--dry-run``: nothing). ``--force`` needs ``ROOT``: on an account several jobs share, every
    job's memory tier is this user's, and a bare ``--force`` would take their only copies too."""
    if args.force and args.root is None:
        note("nebula-ckpt gc: --force removes steps that exist only in memory; name the run whose memory tiers "
             "may lose them: nebula-ckpt gc ROOT --force (every job of this account has its tiers here, and a "
             "bare --force would reach theirs too)")
        return 2
    if args.storage_options is not None and args.root is None:
        note("nebula-ckpt gc: --storage-options are those of one root: name it (nebula-ckpt gc ROOT "
             "--storage-options JSON); without ROOT, each memory tier's root is reached with the credentials "
             "of the environment")
        return 2
    if args.root is not None:
        refuse_url_credentials(args.root)
        tier_for_root(args.root, args.storage_options)  # a local root with storage options: refused, as elsewhere
    if not args.root_timeout > 0:
        note(f"nebula-ckpt gc: --root-timeout must be a number of seconds above 0, got {args.root_timeout:g}")
        return 2
    decisions = memgc.collect(args.shm_dir, force=args.force, root=args.root, timeout=args.root_timeout,
                              storage_options=args.storage_options)
    done = []
    for d in progress(decisions, "gc", "tier", quiet=args.json):
        if d.remove and not args.dry_run:
            # decided again under the tier's lock: what it says happened
            d = memgc.remove(d, args.root_timeout, args.storage_options)
        done.append(d)
    if args.json:
        out(json.dumps([d.as_dict() for d in done], indent=2))
        return 0
    if not done:
        out("no memory tiers of this user" + (f" for {strip_credentials(args.root)}" if args.root else ""))
    for d in done:
        verb = ("would remove" if args.dry_run else ("removed" if d.removed else "kept")) if d.remove else "keep"
        root = d.found.owner.root if d.found.owner else None
        out(f"{verb:<12} {human_bytes(d.found.nbytes):>10}  {d.found.folder}  root={root}  ({d.reason})")
    return 0


def add_gc_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """The ``gc`` subcommand and its options."""
    sp = sub.add_parser("gc", help="free memory tiers (/dev/shm) whose checkpoints are safe on their root")
    sp.add_argument("root", nargs="?", default=None, metavar="ROOT",
                    help="only the memory tiers of this run (its checkpoint root; every rank's on this host)")
    sp.add_argument("--dry-run", action="store_true", help="show the decisions, remove nothing")
    sp.add_argument("--force", action="store_true",
                    help="with ROOT: also remove its tiers whose newest step is only in memory (the root lacks "
                         "it, is gone, or belongs to another run), losing those steps; a root that cannot be "
                         "checked keeps its tier even so")
    sp.add_argument("--shm-dir", default=None, help="the tmpfs to look in (default: NEBULA_SHM_DIR or /dev/shm)")
    sp.add_argument("--root-timeout", type=float, default=memgc.ROOT_TIMEOUT_S, metavar="SECONDS",
                    help="how long a memory tier's root (a mount, a blob store) may take to answer; a root that "
                         "does not answer in time is unknown, and its memory tier is kept (default: "
                         f"{memgc.ROOT_TIMEOUT_S:g})")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    add_storage_options(sp)
