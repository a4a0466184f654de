"""``nebula-ckpt ls`` (every step of every tier, its size and health) and ``nebula-ckpt inspect``
(the tensor table and the non-tensor structure of one step)."""

from __future__ import annotations

import argparse
import json
from typing import Any, Hashable, Mapping, Optional

from nebula_ckpt.cli import summary
from nebula_ckpt.cli.choose import open_chosen
from nebula_ckpt.cli.common import (
    EXIT_UNREADABLE,
    NotChecked,
    check_whole,
    commit_state,
    dir_bytes,
    each_step,
    human_bytes,
    note,
    open_any,
    open_tiers,
    out,
    ranks_json,
    ranks_text,
    references_json,
    references_text,
    removed_meanwhile,
)
from nebula_ckpt.format import manifest as mf
from nebula_ckpt.format.commit import read_commit, step_dirs
from nebula_ckpt.format.names import shard_owner
from nebula_ckpt.format.records import TensorRecord
from nebula_ckpt.health.book import NO_MARK, HealthView, Mark
from nebula_ckpt.integrations.pointers import find_root
from nebula_ckpt.restore.open import OpenCheckpoint
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.storage.urls import strip_credentials
from nebula_ckpt.tiers.base import Tier


def _compression(man: Optional[mf.Manifest]) -> tuple[Optional[str], Optional[float]]:
    """``(codec, raw / stored bytes of the shards)`` when the shards are compressed, else ``(None, None)``."""
    if man is None:
        return None, None
    codecs = {str((sh.storage or {}).get("compression")) for sh in man.shards if (sh.storage or {}).get("compression")}
    if not codecs:
        return None, None
    stored = sum(sh.stored_bytes for sh in man.shards)
    return ",".join(sorted(codecs)), (sum(sh.bytes for sh in man.shards) / stored if stored else None)


def _health(view: Optional[HealthView], st: Storage, step: int, committed: bool) -> Mark:
    """The health mark of the committed ``step`` on ``st`` (of the write its marker names)."""
    if view is None or not committed or not view.has_records(step):
        return NO_MARK
    try:
        commit = read_commit(st, step, f"step {step}")
    except Exception:  # an unreadable marker: the row says DAMAGED already
        return NO_MARK
    return view.mark(commit.generation, step, commit.save)


def _ls_row(tier: Tier, st: Storage, step: int, verify: str,
            view: Optional[HealthView] = None) -> Optional[tuple[dict[str, Any], Optional[mf.Manifest]]]:
    """The ``ls --json`` row of one step of one tier, and its manifest (None when not healthy); None
    for a committed step whose check failed because it was removed meanwhile (its marker is gone).
    A step that could not be read (an outage) is neither healthy nor damaged: ``healthy`` None,
    ``unchecked`` why (``committed`` None when its marker could not be read either).

    Raises:
        SavedAgain: the step was saved again while each check of it ran (:func:`check_whole`).
    """
    known: list[bool] = []  # the commit marker's state, once read
    try:
        return _checked_row(tier, st, step, verify, view, known)
    except NotChecked as e:
        return ({"tier": tier.name, "step": step, "tag": None, "health": None, "health_reason": None,
                 "committed": known[0] if known else None, "healthy": None, "verified": None, "bytes": None,
                 "raw_bytes": None,
                 "compression": None, "compression_ratio": None, "problem": None, "unchecked": str(e),
                 **references_json(None), **ranks_json(None)}, None)


def _checked_row(tier: Tier, st: Storage, step: int, verify: str,
                 view: Optional[HealthView],
                 known: list[bool]) -> Optional[tuple[dict[str, Any], Optional[mf.Manifest]]]:
    """:func:`_ls_row` of a step whose files answer (``known`` gets whether its marker is there).

    Raises:
        NotChecked: they do not (an outage).
        SavedAgain: as :func:`check_whole`.
    """
    committed, refused = commit_state(st, tier, step)
    known.append(committed)
    if refused:
        if removed_meanwhile(st, tier, step):
            return None
        healthy, why, man = False, refused, None
    elif committed:
        checked = check_whole(st, tier, step, verify)
        if checked is None:
            return None
        healthy, why, man = checked
    else:
        healthy, why, man = False, "no commit marker", None
    codec, ratio = _compression(man)
    mark = _health(view, st, step, committed)
    row = {"tier": tier.name, "step": step, "tag": man.tag if man is not None else None,
           "health": mark.state if committed else None, "health_reason": mark.reason or None,
           "committed": committed, "healthy": healthy, "verified": verify if committed else None,
           "bytes": dir_bytes(st, step), "raw_bytes": sum(s.bytes for s in man.shards) if man is not None else None,
           "compression": codec, "compression_ratio": ratio, "problem": None if healthy else why,
           "unchecked": None, **references_json(man), **ranks_json(man)}
    return row, man


def _ls_table(rows: list[dict[str, Any]], mans: list[Optional[mf.Manifest]], quick: bool) -> list[str]:
    """``ls``'s text: a header row, then one row per step of each tier. ``written``: the bytes of
    the step's own folder; ``referenced``: those it reads from earlier steps' folders (an
    incremental checkpoint), which ``needs`` names (``-``: a full checkpoint; ``?``: unknown, the
    step is damaged); ``state``: its checks; ``health``: its mark from the training signal."""
    cells = [("tier", "step", "written", "referenced", "needs", "tag", "state", "health")]
    for r, man in zip(rows, mans, strict=True):
        size = "?" if r["bytes"] is None else human_bytes(r["bytes"])
        if r["compression"]:
            size += f" ({r['compression']} x{r['compression_ratio']:.2f})"
        ok = "committed (not verified)" if quick else "verified"
        state = ok if r["healthy"] else ("DAMAGED: " + str(r["problem"]) if r["committed"] else "uncommitted")
        if r["unchecked"]:
            state = "UNCHECKED: " + r["unchecked"]
        if ranks_text(man):
            state += f" ({ranks_text(man)})"
        if man is None:
            refs, needs = ("?", "?") if r["committed"] is not False else ("-", "-")
        elif r["base_steps"]:
            refs, needs = human_bytes(r["referenced_bytes"]), ",".join(map(str, r["base_steps"]))
        else:
            refs, needs = "-", "-"
        health = "-" if r["health"] is None else r["health"] + (f" ({r['health_reason']})"
                                                                 if r["health"] == "suspect" else "")
        cells.append((r["tier"], str(r["step"]), size, refs, needs, r["tag"] if r["tag"] is not None else "-", state,
                      health))
    w = [max(len(c[i]) for c in cells) for i in range(7)]
    return [f"{a:<{w[0]}}  {b:>{w[1]}}  {c:>{w[2]}}  {d:>{w[3]}}  {e:<{w[4]}}  {f:<{w[5]}}  {g:<{w[6]}}  {h}"
            for a, b, c, d, e, f, g, h in cells]


def cmd_ls(args: argparse.Namespace) -> int:
    """Steps per tier with size and state; full checksums unless ``--quick`` (sizes only).

    Exit 1 when no committed checkpoint is there (leftovers of saves that never committed are
    listed, as ``uncommitted``) or a committed checkpoint is damaged (as ``verify``); else 3 when a
    step could not be read (an outage: ``UNCHECKED``, never ``DAMAGED``). ``ROOT`` may
    be a framework's path: a pointer file, Lightning's dirpath, a DeepSpeed save folder, an HF output_dir."""
    given, args.root = args.root, find_root(args.root)
    if args.root != given and not args.json:
        out(f"{given} -> checkpoint root {args.root}")
    return ls_tiers(open_tiers(args.root, args.storage_options), args)


def ls_tiers(pairs: list[tuple[Tier, Storage]], args: argparse.Namespace) -> int:
    """``ls`` of the tiers ``pairs`` (each with its open storage, the root's own last), as ``args``
    asks: the output and the exit code. A step removed while ls runs is left out (named on stderr)."""
    view = HealthView(pairs[-1][1]) if pairs else None  # the records are on the root's own tier (listed last)
    verify = "size" if args.quick else "full"
    listed = each_step(lambda: [(tier, st, step) for tier, st in pairs for step in step_dirs(st)],
                       lambda tier, st, step: _ls_row(tier, st, step, verify, view), "ls", "checking",
                       quiet=args.json)
    rows = [row for row, _ in listed]
    mans = [man for _, man in listed]
    if args.json:
        out(json.dumps(rows, indent=2))
    elif not rows:
        out(f"no checkpoints under {strip_credentials(args.root)}")
    else:
        for line in _ls_table(rows, mans, args.quick):
            out(line)
    committed = [r for r in rows if r["committed"] is not False]  # None: an outage hid its marker
    if rows and not committed:  # only folders a save left before its commit: nothing to restore
        note(f"no committed checkpoint under {strip_credentials(args.root)}")
    if not committed or any(r["healthy"] is False for r in committed):
        return 1
    return EXIT_UNREADABLE if any(r["healthy"] is None for r in committed) else 0


def _tree_text(node: Mapping[str, Any], indent: str = "") -> list[str]:
    t = node["t"]
    if t in ("dict", "odict"):
        lines = []
        for k, v in node["v"]:
            head = f"{indent}{k['v']!r}:"
            if v["t"] in ("dict", "odict", "list", "tuple", "stateful"):
                lines.append(head + (f"  <{v.get('cls')}>" if v["t"] == "stateful" else ""))
                lines += _tree_text(v["state"] if v["t"] == "stateful" else v, indent + "  ")
            else:
                lines.append(f"{head} {_leaf_text(v)}")
        return lines
    if t in ("list", "tuple"):
        return [f"{indent}[{i}] {_leaf_text(v)}" if v["t"] not in ("dict", "odict", "list", "tuple")
                else f"{indent}[{i}]:\n" + "\n".join(_tree_text(v, indent + "  "))
                for i, v in enumerate(node["v"])]
    if t == "stateful":
        return _tree_text(node["state"], indent)
    return [indent + _leaf_text(node)]


def _leaf_text(v: Mapping[str, Any]) -> str:
    t = v["t"]
    if t == "tensor":
        return f"<tensor {v['k']}>"
    if t == "float":
        return repr(float.fromhex(v["v"]))
    if t in ("list", "tuple"):
        return f"{t}[{len(v['v'])}]"
    if t == "none":
        return "None"
    if t == "ndarray":
        return f"<numpy {v['dtype']} array, tensor {v['v']['k']}>"
    if t == "npscalar":
        from nebula_ckpt.format.tree import decode

        return f"{decode(v, lambda k: None, False)!r} (numpy {v['dtype']})"
    return f"{v.get('v')!r} ({t})"


def _pieces_text(holders: list[tuple[int, str, TensorRecord]], man: mf.Manifest, limit: int = 6) -> str:
    """Which rank holds what of one logical tensor, and in whose shard it is stored."""
    parts = []
    for rank, full, rec in holders[:limit]:
        owner = (shard_owner(man.shards[rec.shard].file) or (0, rank))[1]
        where = "" if owner == rank and full == rec.key else f" in r{owner}'s shard"
        if rec.dtensor is not None:
            parts.append(f"r{rank} {rec.shape}@{rec.dtensor.offsets}{where}")
        else:
            parts.append(f"r{rank}{where}")
    more = f", ... (+{len(holders) - limit} ranks)" if len(holders) > limit else ""
    return ", ".join(parts) + more


def _inspect_multi(ck: OpenCheckpoint, as_json: bool) -> None:
    """inspect of a multi-rank checkpoint: global shapes, who stores what, per-rank shards."""
    from nebula_ckpt.restore.dcp_reader import logical_tensors

    man = ck.manifest
    logical = logical_tensors(man)
    if as_json:
        raw = man.to_json()
        info = {k: raw[k] for k in ("step", "generation", "tensors", "aliases", "tree", "world_size")}
        info.update(shards=[sh.to_json() for sh in man.shards], ranks=list(man.ranks),  # version 4: from ranks.json
                    rank_tree={str(r): i for r, i in man.rank_tree.items()})
        info.update(references_json(man))
        info["logical"] = {}
        for key, holders in logical.items():
            dt = holders[0][2].dtensor
            info["logical"][key] = {
                "dtype": holders[0][2].dtype, "shape": list(dt.shape if dt else holders[0][2].shape),
                "placements": list(dt.placements) if dt else None, "mesh": list(dt.mesh) if dt else None,
                "pieces": [{"rank": r, "key": full, "stored_as": rec.key, "shard": man.shards[rec.shard].file,
                            "shape": list(rec.shape), "offsets": list(rec.dtensor.offsets) if rec.dtensor else None}
                           for r, full, rec in holders]}
        out(json.dumps(info, indent=2))
        return
    out(f"step {man.step}  ({ck.where}, format v{man.version}, {ranks_text(man)}, {len(man.tensors)} tensors "
         f"stored, {len(man.aliases)} aliases)")
    out("shards:")
    for sh in man.shards:
        owner = shard_owner(sh.file)
        held = "" if sh.step is None else f"  (in step {sh.step})"
        out(f"  {sh.file:<40} rank {owner[1] if owner else '?':<6} {sh.bytes:>14} bytes{held}")
    out(f"\n{'key':<48} {'dtype':<10} {'global shape':<18} {'placement':<14} held by (local shape@offsets)")
    for key, holders in logical.items():
        rec = holders[0][2]
        dt = rec.dtensor
        shape = dt.shape if dt else rec.shape
        place = (",".join(dt.placements) + f" {list(dt.mesh)}") if dt else "plain"
        out(f"{key:<48} {rec.dtype:<10} {str(shape):<18} {place:<14} {_pieces_text(holders, man)}")
    users: dict[int, list[int]] = {}
    for r, i in sorted(man.rank_tree.items()):
        users.setdefault(i, []).append(r)
    for n, (i, ranks) in enumerate(sorted(users.items(), key=lambda x: x[1][0])):
        if n == 2:
            out(f"\n... {len(users) - 2} more distinct structure(s) (--json shows them all)")
            break
        shown = ",".join(map(str, ranks[:16])) + (",..." if len(ranks) > 16 else "")
        out(f"\nstructure (rank(s) {shown}):")
        for line in _tree_text(man.tree["v"][i], "  "):
            out(line)


def _summary(ck: OpenCheckpoint) -> list[str]:
    """``inspect``'s default: a row per top-level key (kind, tensors, bytes, other values)."""
    man = ck.manifest
    if not man.multi_rank:
        def record(k: str) -> tuple[Hashable, int]:
            rec = man.resolve(k)
            return (rec.shard, rec.start, rec.end), rec.nbytes
        tree = man.tree
    else:
        from nebula_ckpt.restore.dcp_reader import logical_tensors

        logical = logical_tensors(man)

        def record(k: str) -> tuple[Hashable, int]:  # a sharded tensor: every rank's piece
            pieces = {(shard_owner(man.shards[r.shard].file), r.shard, r.start, r.end): r.nbytes
                      for _rank, _full, r in logical.get(k, [])}
            return ("logical", k), sum(pieces.values())
        tree = man.job_tree()  # every rank's held here merged (one rank's own tier: that rank's)
    return summary.render(summary.rows(tree, record))


def cmd_inspect(args: argparse.Namespace) -> int:
    """A summary of one step (a row per top-level key), or with ``--full`` its tensor table and
    non-tensor structure (sizes checked, not checksums)."""
    ck = open_chosen(args, lambda st, step, where: open_any(st, step, "size", where), one_rank_ok=True)
    man: mf.Manifest = ck.manifest
    if not args.full and not args.json:
        tag = f", tag {man.tag}" if man.tag is not None else ""
        refs = f", {references_text(man)}" if references_text(man) else ""
        ranks = f", {ranks_text(man)}" if man.multi_rank else ""
        out(f"step {man.step}  ({ck.where}, format v{man.version}{ranks}, {len(man.tensors)} tensors stored"
            f"{tag}{refs})")
        for line in _summary(ck):
            out(line)
        out("(--full lists every tensor and value; --json gives them all as JSON)")
        return 0
    if man.multi_rank:
        _inspect_multi(ck, args.json)
        return 0
    if args.json:
        raw = man.to_json()
        info = {k: raw[k] for k in ("step", "generation", "tensors", "aliases", "tree", "shards")}
        info["tag"] = man.tag
        info.update(references_json(man))
        out(json.dumps(info, indent=2))
        return 0
    tag = f", tag {man.tag}" if man.tag is not None else ""
    refs = f", {references_text(man)}" if references_text(man) else ""
    out(f"step {man.step}  ({ck.where}, format v{man.version}, {len(man.tensors)} tensors{tag}{refs})")
    out(f"{'key':<60} {'dtype':<14} {'shape':<24} {'bytes':>12}  {'crc32c':<10}  stored in")
    for k, e in man.tensors.items():
        held = man.shards[e.shard].folder_step(man.step)
        out(f"{k:<60} {e.dtype:<14} {str(e.shape):<24} {e.nbytes:>12}  {e.crc32c:#010x}  step {held}")
    for a, b in man.aliases.items():
        out(f"{a:<60} -> {b} (tied)")
    out("\nstructure:")
    for line in _tree_text(man.tree, "  "):
        out(line)
    return 0
