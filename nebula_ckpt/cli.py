"""The ``nebula-ckpt`` command line: ls, verify, inspect, export, gc, bench.

Multi-rank checkpoints (format v2) are understood everywhere: ls and verify show the job's
world size and check every rank's shard, inspect shows global shapes and which rank stores
what, export gathers one full, unsharded file (keys without the ``r<R>/`` rank prefix).

Exit codes: 0 success; 1 damage found (verify) or nothing to act on; 2 bad usage.
ls, verify, inspect and export take ``--json`` for scripts and ``--storage-options JSON`` for
remote roots; gc takes ``--json`` too (bench has options of its own: ``nebula-ckpt bench --help``).
``ls`` verifies every checksum like ``verify`` (``ls --quick`` checks sizes only) and shows
each checkpoint's tag. ``export --key model`` writes only what the state held under ``model``,
named by the module's own ``state_dict()`` keys (what Hugging Face's ``from_pretrained`` loads).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, Mapping, Optional, Sequence

from nebula_ckpt.errors import CorruptCheckpointError, NebulaError
from nebula_ckpt.format import manifest as mf
from nebula_ckpt.format.commit import step_dirs
from nebula_ckpt.format.names import COMMIT, shard_owner, step_dir
from nebula_ckpt.format.records import TensorRecord
from nebula_ckpt.ranks.fencing import read_run_id
from nebula_ckpt.restore.apply import materialize
from nebula_ckpt.restore.open import NotThisLayout, OpenCheckpoint, open_checkpoint, read_manifest
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.storage.urls import canonical_root, refuse_url_credentials, strip_credentials
from nebula_ckpt.tiers.base import Tier
from nebula_ckpt.tiers.factory import runtime_for
from nebula_ckpt.tiers.memory.shm import Owner
from nebula_ckpt.tiers.roots import default_tiers

log = logging.getLogger(__name__)


def _out(text: str) -> None:
    sys.stdout.write(text + "\n")


#: storages a command opened; main() closes them all when the command ends, however it ends
_opened: list[Storage] = []


def _tiers(root: str, storage_options: Optional[dict[str, Any]]) -> list[tuple[Tier, Storage]]:
    """The tiers of ``root`` a restart would read (read only: nothing is claimed or written)."""
    tiers = default_tiers(root, storage_options)
    root_storage = tiers[-1].make_storage()
    owner = Owner(canonical_root(root), read_run_id(root_storage))
    out = []
    for t in tiers:
        rt = runtime_for(t, root_storage if t is tiers[-1] else t.make_storage())
        why = rt.unreadable(owner)
        if why:
            log.info("nebula_ckpt: tier %s not shown: %s", t.name, why)
            rt.release()
            continue
        out.append((t, rt.storage))
        _opened.append(rt.storage)
    return out


def _dir_bytes(st: Storage, step: int) -> int:
    """Bytes stored in the folder of ``step``; a file that cannot be sized (gone, a folder, a
    symlink the storage refuses to follow) counts nothing: the step's check reports why."""
    d = step_dir(step)
    total = 0
    for n in st.list(d):
        try:
            total += st.size(f"{d}/{n}")
        except OSError:
            pass
    return total


def _commit_state(st: Storage, tier: Tier, step: int) -> tuple[bool, Optional[str]]:
    """``(committed, problem)`` of ``step``: whether its commit marker is there, and why the step
    cannot be trusted when that cannot be checked safely. A marker or a step folder that is a
    symlink (never followed), or one that cannot be read, counts as committed and damaged: the
    step is there by name and must not pass for an uncommitted leftover."""
    try:
        st.size(f"{step_dir(step)}/{COMMIT}")
    except FileNotFoundError:
        return False, None
    except OSError as e:
        return True, f"tier {tier.name} step {step}: {type(e).__name__}: {e}"
    return True, None


def _storage_options(text: str) -> dict[str, Any]:
    """argparse type of ``--storage-options``: a JSON object. Errors never echo the value."""
    try:
        value = json.loads(text)
    except Exception:  # ValueError, RecursionError: the text may hold account keys, never show it
        raise argparse.ArgumentTypeError("not valid JSON (value not shown: it may hold credentials)") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object such as {\"account_name\": ...} "
                                         "(value not shown: it may hold credentials)")
    return value


def _open_any(st: Storage, step: int, verify: str, where: str) -> OpenCheckpoint:
    """Open (and verify) ``step`` whatever it holds: a one-process checkpoint, a whole multi-rank
    job, or the ranks of one that a rank's own memory tier holds (each rank's part is checked)."""
    try:
        return open_checkpoint(st, step, verify, where)
    except NotThisLayout:
        man = read_manifest(st, step, where)
        ck = None
        for r in man.ranks:
            ck = open_checkpoint(st, step, verify, where, rank=r, world=man.world_size)
        assert ck is not None  # Manifest.parse: a multi-rank manifest holds at least one rank
        return ck


def _ranks_json(man: Optional[mf.Manifest]) -> dict[str, Any]:
    """World size, ranks held and shards (with the rank that wrote each) of a manifest."""
    if man is None:
        return {"world_size": None, "ranks": None, "shards": None}
    return {"world_size": man.world_size, "ranks": list(man.ranks),
            "shards": [{"file": sh.file, "rank": (shard_owner(sh.file) or (0, 0))[1], "bytes": sh.bytes}
                       for sh in man.shards]}


def _ranks_text(man: Optional[mf.Manifest]) -> str:
    """``"4-rank job, 4 shards"`` / ``"rank 1 of a 4-rank job"``; ``""`` for one process."""
    if man is None or not man.multi_rank:
        return ""
    if len(man.ranks) == man.world_size:
        return f"{man.world_size}-rank job, {len(man.shards)} shard(s)"
    return f"rank(s) {','.join(map(str, man.ranks[:8]))} of a {man.world_size}-rank job"


def _check(st: Storage, tier: Tier, step: int, verify: str) -> tuple[bool, str, Optional[mf.Manifest]]:
    where = f"tier {tier.name} step {step}"
    try:
        ck = _open_any(st, step, verify, where)
    except CorruptCheckpointError as e:
        return False, str(e), None
    except Exception as e:  # unreadable counts as damaged, with the reason
        return False, f"{where}: {type(e).__name__}: {e}", None
    return True, "ok", ck.manifest


def cmd_ls(args: argparse.Namespace) -> int:
    """Steps per tier with size and state; full checksums unless ``--quick`` (sizes only)."""
    from tqdm import tqdm

    todo = [(tier, st, step) for tier, st in _tiers(args.root, args.storage_options) for step in step_dirs(st)]
    verify = "size" if args.quick else "full"
    rows: list[dict[str, Any]] = []
    for tier, st, step in tqdm(todo, desc="checking", unit="ckpt", disable=args.json or args.quick or not todo):
        committed, refused = _commit_state(st, tier, step)
        if refused:
            healthy, why, man = False, refused, None
        elif committed:
            healthy, why, man = _check(st, tier, step, verify)
        else:
            healthy, why, man = False, "no commit marker", None
        raw = sum(s.bytes for s in man.shards) if man is not None else None
        stored = _dir_bytes(st, step)
        rows.append({"tier": tier.name, "step": step, "tag": man.tag if man is not None else None,
                     "committed": committed, "healthy": healthy,
                     "verified": verify if committed else None, "bytes": stored, "raw_bytes": raw,
                     "compression_ratio": (raw / stored) if raw and stored else None,
                     "problem": None if healthy else why, **_ranks_json(man), "_man": man})
    mans = [r.pop("_man") for r in rows]
    if args.json:
        _out(json.dumps(rows, indent=2))
    else:
        if not rows:
            _out(f"no checkpoints under {strip_credentials(args.root)}")
        for r, man in zip(rows, mans, strict=True):
            cr = r["compression_ratio"]
            ratio = f"  x{cr:.2f}" if cr and cr > 1.01 else ""
            job = f"  ({_ranks_text(man)})" if _ranks_text(man) else ""
            tag = f"  tag={r['tag']}" if r["tag"] is not None else ""
            ok = "committed (not verified)" if args.quick else "healthy"
            state = ok if r["healthy"] else ("DAMAGED: " + str(r["problem"]) if r["committed"] else "uncommitted")
            _out(f"{r['tier']:<60} step {r['step']:>8}  {r['bytes'] / 2**20:10.1f} MiB{ratio}{job}{tag}  {state}")
    # like verify: exit 1 when nothing is there or a committed checkpoint is damaged
    return 0 if rows and not any(r["committed"] and not r["healthy"] for r in rows) else 1


def cmd_verify(args: argparse.Namespace) -> int:
    """Full checksum check of every committed step (or ``--step``); exit 1 on any damage."""
    from tqdm import tqdm

    todo = []
    for tier, st in _tiers(args.root, args.storage_options):
        for step in step_dirs(st):
            if args.step is not None and step != args.step:
                continue
            committed, refused = _commit_state(st, tier, step)
            if committed:
                todo.append((tier, st, step, refused))
    results = []
    for tier, st, step, refused in tqdm(todo, desc="verifying", unit="ckpt", disable=args.json or not todo):
        ok, why, man = (False, refused, None) if refused else _check(st, tier, step, "full")
        results.append({"tier": tier.name, "step": step, "healthy": ok, "problem": None if ok else why,
                        **_ranks_json(man), "_man": man})
    mans = [r.pop("_man") for r in results]
    if args.json:
        _out(json.dumps(results, indent=2))
    else:
        for r, man in zip(results, mans, strict=True):
            job = f" ({_ranks_text(man)}: every shard verified)" if _ranks_text(man) else ""
            _out(f"{'OK     ' if r['healthy'] else 'DAMAGED'} {r['tier']} step {r['step']}{job}"
                 + ("" if r["healthy"] else f": {r['problem']}"))
    if not results:
        which = "" if args.step is None else f" of step {args.step}"
        _out(f"no committed checkpoint{which} under {strip_credentials(args.root)}")
        return 1
    return 0 if all(r["healthy"] for r in results) else 1


def _open_step(args: argparse.Namespace, verify: str) -> OpenCheckpoint:
    """The first tier's healthy copy of ``--step`` (a rank's memory-tier part of a multi-rank
    checkpoint included)."""
    errors = []
    for tier, st in _tiers(args.root, args.storage_options):
        if args.step not in step_dirs(st):
            continue
        try:
            return _open_any(st, args.step, verify, f"tier {tier.name} step {args.step}")
        except Exception as e:
            errors.append(str(e))
    raise NebulaError(f"no healthy checkpoint of step {args.step} under {strip_credentials(args.root)}"
                      + (f" ({'; '.join(errors)})" if errors else ""))


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
    from nebula_ckpt.dcp.reader import logical_tensors

    man = ck.manifest
    logical = logical_tensors(man)
    if as_json:
        raw = man.to_json()
        info = {k: raw[k] for k in ("step", "generation", "tensors", "aliases", "tree", "shards",
                                    "world_size", "ranks", "rank_tree")}
        info["logical"] = {}
        for key, holders in logical.items():
            dt = holders[0][2].dtensor
            info["logical"][key] = {
                "dtype": holders[0][2].dtype, "shape": list(dt.shape if dt else holders[0][2].shape),
                "placements": list(dt.placements) if dt else None, "mesh": list(dt.mesh) if dt else None,
                "pieces": [{"rank": r, "key": full, "stored_as": rec.key, "shard": man.shards[rec.shard].file,
                            "shape": list(rec.shape), "offsets": list(rec.dtensor.offsets) if rec.dtensor else None}
                           for r, full, rec in holders]}
        _out(json.dumps(info, indent=2))
        return
    _out(f"step {man.step}  ({ck.where}, format v{man.version}, {_ranks_text(man)}, {len(man.tensors)} tensors "
         f"stored, {len(man.aliases)} aliases)")
    _out("shards:")
    for sh in man.shards:
        owner = shard_owner(sh.file)
        _out(f"  {sh.file:<40} rank {owner[1] if owner else '?':<6} {sh.bytes:>14} bytes")
    _out(f"\n{'key':<48} {'dtype':<10} {'global shape':<18} {'placement':<14} held by (local shape@offsets)")
    for key, holders in logical.items():
        rec = holders[0][2]
        dt = rec.dtensor
        shape = dt.shape if dt else rec.shape
        place = (",".join(dt.placements) + f" {list(dt.mesh)}") if dt else "plain"
        _out(f"{key:<48} {rec.dtype:<10} {str(shape):<18} {place:<14} {_pieces_text(holders, man)}")
    users: dict[int, list[int]] = {}
    for r, i in sorted(man.rank_tree.items()):
        users.setdefault(i, []).append(r)
    for n, (i, ranks) in enumerate(sorted(users.items(), key=lambda x: x[1][0])):
        if n == 2:
            _out(f"\n... {len(users) - 2} more distinct structure(s) (--json shows them all)")
            break
        shown = ",".join(map(str, ranks[:16])) + (",..." if len(ranks) > 16 else "")
        _out(f"\nstructure (rank(s) {shown}):")
        for line in _tree_text(man.tree["v"][i], "  "):
            _out(line)


def cmd_inspect(args: argparse.Namespace) -> int:
    """Tensor table and non-tensor structure of one step (sizes checked, not checksums)."""
    ck = _open_step(args, "size")
    man: mf.Manifest = ck.manifest
    if man.multi_rank:
        _inspect_multi(ck, args.json)
        return 0
    if args.json:
        raw = man.to_json()
        info = {k: raw[k] for k in ("step", "generation", "tensors", "aliases", "tree", "shards")}
        info["tag"] = man.tag
        _out(json.dumps(info, indent=2))
        return 0
    tag = f", tag {man.tag}" if man.tag is not None else ""
    _out(f"step {man.step}  ({ck.where}, format v{man.version}, {len(man.tensors)} tensors{tag})")
    _out(f"{'key':<60} {'dtype':<14} {'shape':<24} {'bytes':>12}  crc32c")
    for k, e in man.tensors.items():
        _out(f"{k:<60} {e.dtype:<14} {str(e.shape):<24} {e.nbytes:>12}  {e.crc32c:#010x}")
    for a, b in man.aliases.items():
        _out(f"{a:<60} -> {b} (tied)")
    _out("\nstructure:")
    for line in _tree_text(man.tree, "  "):
        _out(line)
    return 0


def _export_source(args: argparse.Namespace) -> tuple[Any, int, Any, mf.Manifest]:
    """What to export from the first tier with a healthy copy of ``--step``: for a one-process
    checkpoint its verified open checkpoint, for a multi-rank one every tensor gathered whole
    (``(ck_or_None, step, full_tensors_or_None, manifest)``)."""
    from nebula_ckpt.restore.reshard import gather_full

    errors = []
    for tier, st in _tiers(args.root, args.storage_options):
        if args.step not in step_dirs(st):
            continue
        where = f"tier {tier.name} step {args.step}"
        try:
            man = read_manifest(st, args.step, where)
            if not man.multi_rank:
                ck = open_checkpoint(st, args.step, "full", where)
                return ck, ck.step, None, ck.manifest
            if len(man.ranks) != man.world_size:
                raise NebulaError(f"{where}: holds only {_ranks_text(man)} (a rank's memory tier); "
                                  "export needs every rank's shard")
            return None, man.step, gather_full(st, args.step, man, verify=True), man
        except Exception as e:
            errors.append(str(e))
    raise NebulaError(f"no healthy checkpoint of step {args.step} under {strip_credentials(args.root)}"
                      + (f" ({'; '.join(errors)})" if errors else ""))


def _subtree(tree: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """The node of ``tree`` at the saved key path ``key`` (``"model"``, ``"state/model"``):
    through dict keys (as text) and list indices, looking through stateful objects."""
    node = tree
    walked: list[str] = []
    for part in key.split("/"):
        while node["t"] == "stateful":
            node = node["state"]
        found: Optional[Mapping[str, Any]] = None
        if node["t"] in ("dict", "odict"):
            found = next((v for k, v in node["v"] if str(k["v"]) == part), None)
        elif node["t"] in ("list", "tuple") and part.isdigit() and int(part) < len(node["v"]):
            found = node["v"][int(part)]
        if found is None:
            here = "/".join(walked) or "the top level"
            keys = [str(k["v"]) for k, _ in node["v"]][:20] if node["t"] in ("dict", "odict") else []
            raise NebulaError(f"export: --key {key!r}: the checkpoint has no key {part!r} at {here}"
                              + (f" (keys there: {keys})" if keys else f" (a {node['t']} is there)"))
        walked.append(part)
        node = found
    return node


def _owned_copy(v: Any) -> Any:
    """An owned CPU copy of a tensor view over shard bytes (byte copy: any dtype)."""
    import torch

    return v.reshape(-1).view(torch.uint8).clone().view(v.dtype).reshape(v.shape)


def cmd_export(args: argparse.Namespace) -> int:
    """Write one fully verified step as a torch.save or safetensors file (a multi-rank
    checkpoint gathered into full, unsharded tensors).

    ``--key K`` exports only what the state held under ``K`` (a module saved as ``{"model":
    model, ...}``: ``--key model``), each tensor named by its key below ``K``: for a module, its
    own ``state_dict()`` keys, so ``transformers``' ``from_pretrained`` loads the file (safetensors
    metadata ``format: pt`` included). Tied weights are written as separate copies under each name.
    """
    import torch
    from tqdm import tqdm

    from nebula_ckpt.format.tree import decode
    from nebula_ckpt.restore.walk import tensor_keys

    to = args.to
    folder = os.path.dirname(os.path.abspath(to))
    if not os.path.isdir(folder):
        raise NebulaError(f"export: folder {folder} (of --to) does not exist; create it first")
    key = None if args.key is None else args.key.strip("/")
    if key == "":
        raise NebulaError("export: --key must name a key of the saved state, e.g. --key model")
    ck, step, full, man = _export_source(args)
    tree = man.rank_tree_of(min(man.ranks)) if full is not None else ck.tree
    node = tree if key is None else _subtree(tree, key)
    fmt = args.format or ("safetensors" if to.endswith(".safetensors") else "torch")
    if fmt == "safetensors":
        from safetensors.torch import save_file

        meta = {"format": "pt", "nebula_step": str(step)}
        if key is not None:
            prefix = key + "/"
            keys = tensor_keys(node, [])
            outside = [k for k in keys if not k.startswith(prefix)]
            if not keys or outside:
                raise NebulaError(f"export: --key {key!r} holds {'no tensors' if not keys else 'a tensor itself'}; "
                                  "name the dict or module whose tensors to export (e.g. --key model)")
            made: dict[str, Any] = {}
            tensors = {}
            for k in tqdm(keys, desc="export", unit="tensor", disable=args.json):
                if full is not None:
                    tensors[k[len(prefix):]] = full[k].clone()
                    continue
                real = ck.resolve(k).key
                if real in made:  # tied: a copy of its own (safetensors refuses shared memory)
                    tensors[k[len(prefix):]] = made[real].clone()
                else:
                    tensors[k[len(prefix):]] = made[real] = _owned_copy(ck.view(k))
            meta.update(nebula_key=key)
        elif full is not None:
            tensors = full
            meta.update(nebula_aliases="{}", nebula_world_size=str(man.world_size))
        else:
            tensors = {}
            for k in tqdm(ck.keys(), desc="export", unit="tensor", disable=args.json):
                tensors[k] = _owned_copy(ck.view(k))
            meta["nebula_aliases"] = json.dumps(dict(man.aliases))
        save_file(tensors, to, metadata=meta)
    else:
        if full is not None:
            state = decode(node, full.__getitem__, args.allow_pickle)
        elif key is None:
            state = materialize(ck, map_location="cpu", allow_pickle=args.allow_pickle)
        else:
            owned: dict[str, Any] = {}

            def tensor(k: str) -> Any:
                real = ck.resolve(k).key
                if real not in owned:
                    owned[real] = _owned_copy(ck.view(k))
                return owned[real]

            state = decode(node, tensor, args.allow_pickle, key)
        torch.save(state, to)
    info = {"step": step, "to": to, "format": fmt}
    if key is not None:
        info["key"] = key
    if full is not None:
        info["world_size"] = man.world_size
    _out(json.dumps(info) if args.json else
         f"exported step {step} to {to} ({fmt}{', gathered from ' + _ranks_text(man) if full is not None else ''})")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    """Free memory tiers whose checkpoints are safe elsewhere (policy: :mod:`nebula_ckpt.tiers.memory.gc`)."""
    from tqdm import tqdm

    from nebula_ckpt.tiers.memory import gc as memgc

    decisions = memgc.collect(args.shm_dir, force=args.force)
    rows = []
    for d in tqdm(decisions, desc="gc", unit="tier", disable=args.json or len(decisions) < 2, file=sys.stderr):
        if d.remove and not args.dry_run:
            d = memgc.remove(d)  # decided again under the tier's lock: what it says is what happened
        rows.append(d.as_dict())
    if args.json:
        _out(json.dumps(rows, indent=2))
        return 0
    if not rows:
        _out("no memory tiers of this user")
    for r in rows:
        verb = ("would remove" if args.dry_run else ("removed" if r.get("removed") else "kept")) \
            if r["remove"] else "keep"
        _out(f"{verb:<12} {r['bytes'] / 2**20:10.1f} MiB  {r['folder']}  root={r['root']}  ({r['reason']})")
    return 0


def cmd_bench(argv: Sequence[str]) -> int:
    from benchmarks.runner import main as bench_main

    return int(bench_main(list(argv)) or 0)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nebula-ckpt", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("root", help="checkpoint root: a path or fsspec URL")
        sp.add_argument("--json", action="store_true", help="machine-readable output")
        sp.add_argument("--storage-options", type=_storage_options, default=None, metavar="JSON",
                        help="fsspec storage options for a remote root, as JSON")

    sp = sub.add_parser("ls", help="steps per tier, sizes, healthy/DAMAGED (checksums verified)")
    common(sp)
    sp.add_argument("--quick", action="store_true",
                    help="check sizes only, not checksums (rows say 'committed (not verified)')")
    sp = sub.add_parser("verify", help="full checksum check; exit 1 on damage")
    common(sp)
    sp.add_argument("--step", type=int, default=None)
    sp = sub.add_parser("inspect", help="tensor table and non-tensor structure of a step")
    common(sp)
    sp.add_argument("--step", type=int, required=True)
    sp = sub.add_parser("export", help="write a step as one torch.save or safetensors file")
    common(sp)
    sp.add_argument("--step", type=int, required=True)
    sp.add_argument("--to", required=True, help="output file (.safetensors -> safetensors, else torch.save)")
    sp.add_argument("--format", choices=["torch", "safetensors"], default=None)
    sp.add_argument("--key", default=None, metavar="KEY",
                    help="export only what the state held under KEY (e.g. 'model'), named by the keys below it: "
                         "a module's own state_dict() keys, as Hugging Face's from_pretrained expects")
    sp.add_argument("--allow-pickle", action="store_true", help="allow pickled leaves (trusted checkpoints only)")
    sp = sub.add_parser("gc", help="free memory tiers (/dev/shm) whose checkpoints are safe on their root")
    sp.add_argument("--dry-run", action="store_true", help="show the decisions, remove nothing")
    sp.add_argument("--force", action="store_true",
                    help="also remove tiers whose newest step is only in memory (the root lacks it, is gone, "
                         "or belongs to another run), losing those steps; a root that cannot be checked keeps "
                         "its tier even so")
    sp.add_argument("--shm-dir", default=None, help="the tmpfs to look in (default: NEBULA_SHM_DIR or /dev/shm)")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sub.add_parser("bench", help="benchmark against torch.save and peers (see --help)", add_help=False)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``nebula-ckpt``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        return cmd_bench(argv[1:])
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        refuse_url_credentials(getattr(args, "root", None))  # before the root is parsed, logged or shown
        return {"ls": cmd_ls, "verify": cmd_verify, "inspect": cmd_inspect, "export": cmd_export,
                "gc": cmd_gc}[args.cmd](args)
    except (NebulaError, OSError) as e:
        sys.stderr.write(f"nebula-ckpt: {e}\n")
        return 1
    except Exception as e:  # damaged input must never end in a traceback; -v shows it
        if args.verbose:
            raise
        sys.stderr.write(f"nebula-ckpt: {type(e).__name__}: {e} (run with -v for the traceback)\n")
        return 1
    finally:
        while _opened:
            _opened.pop().close()


if __name__ == "__main__":
    sys.exit(main())
