"""Format version 4: rank 0's manifest holds only what grows with the tensors; each rank's records check themselves.

A multi-rank checkpoint on a shared tier is, in format version 4::

    manifest.json           rank 0's: owners, DTensor table, the distinct trees, grid, save id,
                            world size, the steps the ranks refer to, and ranks.json's size + CRC32C
    ranks.json              rank 0's: per rank, its shard entry, its records file's size + CRC32C
                            and its tree's digest; then the earlier steps' shards the ranks refer to
    shard-g<G>-r<R>.safetensors, records-g<G>-r<R>.json   rank R's

``manifest.json`` carries no per-rank field (``shards``, ``tensors`` and ``aliases`` are empty;
no ``ranks``, ``rank_tree`` or ``records``): its size is that of the model, whatever the number of
ranks. A rank's records file (``records-g<G>-r<R>.json``: the name follows from the manifest's
generation and the rank) is a JSON object that checks itself::

    {"format": "nebula_ckpt.records", "version": 4, "step", "generation", "rank", "world_size",
     "save_id", "shard": {file, bytes, storage}, "tree": tree digest, "tensors", "aliases",
     "refs"?, "sha256"?, "crc32c": "<8 hex digits>"}

``crc32c`` is the CRC32C of the object's bytes without that last member (the bytes before
``,"crc32c":`` and the closing brace). What a reader trusts, and why: the ``COMMIT`` marker is
written last and names the manifest's size and CRC32C; the manifest names the save id rank 0
drew for this commit (sent to every rank in the first round, so a records file that an aborted
earlier attempt of the same step left behind carries another id) and ``ranks.json``'s size and
CRC32C. A records file is taken only when its embedded checksum holds and its step, generation,
rank, world size and save id are the manifest's and its name's: a garbled file, a stale one, or
another rank's file renamed into place is refused, naming the file, the rank and the field. So a
rank restoring at the same world size reads the manifest, its own records file and those of the
owners of the replicas it aliases, never ``ranks.json``; ``ls``, ``verify``, ``export``,
retention checks of shard files and resharding off the grid read ``ranks.json`` (which must agree
with every records file read beside it).
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional

from nebula_ckpt.format.checks import as_int, as_list, as_obj, as_str, bad, only_fields, short
from nebula_ckpt.format.dtensors import check_dtensors
from nebula_ckpt.format.names import RANKS_FILE, SPLIT_VERSION, records_name, shard_name
from nebula_ckpt.format.rank_records import (
    RECORDS_FORMAT,
    RanksLayout,
    RecordsRef,
    check_rank_trees,
    parse_tables,
    rank_aliases,
    records_body,
)
from nebula_ckpt.format.records import ShardRecord, TensorRecord

if TYPE_CHECKING:
    from nebula_ckpt.format.manifest import Manifest

RANKS_FORMAT = "nebula_ckpt.ranks"
SPLIT_FIELDS = ("save_id", "tree_digests", "references", "ranks_file")
_SEAL = re.compile(rb',"crc32c":"([0-9a-f]{8})"\}')
_SEAL_LEN = 21
_HEX = re.compile(r"[0-9a-f]{16,64}")
_RECORDS_FIELDS = ("format", "version", "step", "generation", "rank", "world_size", "save_id", "shard", "tree",
                   "tensors", "aliases", "refs", "sha256")


def seal(body: Mapping[str, Any], crc: Callable[[bytes], int]) -> bytes:
    """``body`` as compact JSON with its own CRC32C as the last member (``"crc32c": "<hex>"``)."""
    text = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    return text[:-1] + b',"crc32c":"%08x"}' % crc(text)


def unseal(data: bytes, crc: Callable[[bytes], int], w: str) -> dict[str, Any]:
    """The object of a sealed file, its embedded checksum checked first (``w`` names it in errors)."""
    m = _SEAL.fullmatch(data[-_SEAL_LEN:])
    if m is None:
        raise bad(w, "does not end with its crc32c member: truncated, garbled or not a version 4 records file")
    text = data[:-_SEAL_LEN] + b"}"
    if crc(text) != int(m.group(1), 16):
        raise bad(w, f"crc32c: its bytes do not match the checksum they carry ({m.group(1).decode()}): garbled")
    try:
        d = json.loads(text)
    except Exception as e:  # RecursionError, UnicodeDecodeError, ...
        raise bad(w, f"is not valid JSON ({type(e).__name__}: {e})") from None
    return as_obj(d, w, "the records file")


def encode_split_records(*, step: int, generation: int, rank: int, world: int, save_id: str,
                         shard: Mapping[str, Any], tree: str, tensors: Mapping[str, Any], aliases: Mapping[str, str],
                         refs: Optional[list[dict[str, Any]]], hashes: Optional[Mapping[str, str]],
                         crc: Callable[[bytes], int]) -> bytes:
    """The bytes of rank ``rank``'s version 4 records file (see the module docstring); ``tree``:
    the digest of the rank's tree; ``refs`` and ``hashes`` written only when not empty."""
    out: dict[str, Any] = {"format": RECORDS_FORMAT, "version": SPLIT_VERSION, "step": step, "generation": generation,
                           "rank": rank, "world_size": world, "save_id": save_id, "shard": dict(shard), "tree": tree,
                           "tensors": tensors, "aliases": aliases}
    if refs:
        out["refs"] = refs
    if hashes:
        out["sha256"] = dict(hashes)
    return seal(out, crc)


def encode_ranks_index(*, step: int, generation: int, save_id: str, ranks: list[Mapping[str, Any]],
                       refs: list[Mapping[str, Any]]) -> bytes:
    """The bytes of ``ranks.json``: ``ranks[r]`` is ``{"shard", "records", "tree"}`` of rank ``r``."""
    out = {"format": RANKS_FORMAT, "version": SPLIT_VERSION, "step": step, "generation": generation,
           "save_id": save_id, "world_size": len(ranks), "ranks": ranks, "refs": refs}
    return json.dumps(out, separators=(",", ":"), allow_nan=False).encode()


def parse_split(m: dict[str, Any], w: str, step: int, shards: tuple[ShardRecord, ...],
                tensors: Mapping[str, Any], aliases: Mapping[str, str], max_world: int) -> tuple[int, RanksLayout]:
    """``(world size, layout)`` of version 4 manifest ``m``: its per-rank fields are absent."""
    world = as_int(m.get("world_size"), w, "world_size", lo=2, hi=max_world)
    if shards or tensors or aliases or any(k in m for k in ("ranks", "rank_tree", "records", "sha256")):
        raise bad(w, f"a version {SPLIT_VERSION} manifest holds no per-rank field (shards, tensors and aliases "
                   "empty; no ranks, rank_tree, records or sha256): they are in ranks.json and the ranks' "
                   "records files")
    save_id = as_str(m.get("save_id"), w, "save_id")
    if not _HEX.fullmatch(save_id):
        raise bad(w, f"save_id {short(save_id)} is not 16 to 64 lowercase hex digits")
    tree = as_obj(m["tree"], w, "tree")
    if tree.get("t") != "list" or type(tree.get("v")) is not list or not tree["v"]:
        raise bad(w, "tree of a multi-rank checkpoint must be a list node of the ranks' state trees")
    digests = tuple(as_str(x, w, "tree_digests[]") for x in as_list(m.get("tree_digests"), w, "tree_digests"))
    if len(digests) != len(tree["v"]) or len(set(digests)) != len(digests):
        raise bad(w, f"tree_digests lists {len(digests)} distinct digest(s) for {len(tree['v'])} tree(s)")
    refs = frozenset(as_int(s, w, "references[]", hi=step - 1) for s in as_list(m.get("references", []), w,
                                                                                  "references"))
    rf = as_obj(m.get("ranks_file"), w, "ranks_file")
    only_fields(rf, ("file", "bytes", "crc32c"), f"{w}: ranks_file", "the ranks_file entry")
    if rf.get("file") != RANKS_FILE:
        raise bad(w, f"ranks_file names {short(rf.get('file'))}, not {RANKS_FILE!r}")
    ranks_file = RecordsRef(RANKS_FILE, as_int(rf.get("bytes"), w, "ranks_file.bytes", lo=2, hi=1 << 40),
                            as_int(rf.get("crc32c"), w, "ranks_file.crc32c", hi=2**32 - 1))
    owners, specs, grid = parse_tables(m, w, world)
    return world, RanksLayout((), owners, specs, grid, save_id=save_id,
                              tree_digests=digests, references=refs, ranks_file=ranks_file)


def with_index(man: "Manifest", data: bytes, read_crc: Callable[[bytes], int], where: str) -> "Manifest":
    """``man`` (version 4) completed from ``ranks.json`` (``data``): every rank's shard (rank
    order, then the earlier shards they refer to), records file entry and tree.

    Raises:
        CorruptCheckpointError: naming ranks.json, the rank and the field.
    """
    layout = man.layout
    assert layout is not None and layout.ranks_file is not None
    w = f"{where}: {RANKS_FILE}"
    if len(data) != layout.ranks_file.bytes or read_crc(data) != layout.ranks_file.crc32c:
        raise bad(w, f"size or checksum differs from the manifest's ({len(data)} bytes, manifest says "
                   f"{layout.ranks_file.bytes}): garbled or replaced")
    try:
        d = as_obj(json.loads(data), w, "ranks.json")
    except ValueError as err:
        raise bad(w, f"is not valid JSON ({err})") from None
    _check_head(d, man, w, RANKS_FORMAT, None)
    entries = as_list(d.get("ranks"), w, "ranks")
    if len(entries) != man.world_size:
        raise bad(w, f"lists {len(entries)} rank(s) for a {man.world_size}-rank job")
    shards: list[ShardRecord] = []
    records: list[RecordsRef] = []
    rank_tree: dict[int, int] = {}
    for r, raw in enumerate(entries):
        rw = f"{w}: ranks[{r}]"
        e = as_obj(raw, rw, "the rank entry")
        only_fields(e, ("shard", "records", "tree"), rw, "the rank entry")
        shards.append(_own_shard(e.get("shard"), man, r, rw))
        rec = as_obj(e.get("records"), rw, "records")
        if rec.get("file") != records_name(man.generation, r):
            raise bad(rw, f"records file {short(rec.get('file'))} is not {records_name(man.generation, r)}")
        records.append(RecordsRef(rec["file"], as_int(rec.get("bytes"), rw, "records.bytes", lo=2, hi=1 << 40),
                                  as_int(rec.get("crc32c"), rw, "records.crc32c", hi=2**32 - 1)))
        rank_tree[r] = _tree_index(e.get("tree"), layout, rw)
    for i, ref in enumerate(as_list(d.get("refs", []), w, "refs")):
        shards.append(_ref_shard(ref, man, f"{w}: refs[{i}]"))
    if len({(s.step, s.file) for s in shards}) != len(shards):
        raise bad(w, "lists a shard twice")
    lay = dataclasses.replace(layout, records=tuple(records), shard_of=types.MappingProxyType(
        {r: r for r in range(man.world_size)}), indexed=True)
    return dataclasses.replace(man, shards=tuple(shards), rank_tree=types.MappingProxyType(rank_tree), layout=lay)


def _check_head(d: Mapping[str, Any], man: "Manifest", w: str, fmt: str, rank: Optional[int]) -> None:
    """The fields saying whose file this is: format, version, step, generation, save id, world size (and rank)."""
    assert man.layout is not None
    if d.get("format") != fmt or d.get("version") != SPLIT_VERSION:
        raise bad(w, f"format / version are {short(d.get('format'))} / {short(d.get('version'))}, not "
                   f"{fmt!r} / {SPLIT_VERSION}")
    want = {"step": man.step, "generation": man.generation, "world_size": man.world_size,
            "save_id": man.layout.save_id}
    if rank is not None:
        want["rank"] = rank
    for k, v in want.items():
        if d.get(k) != v or type(d.get(k)) is not type(v):
            raise bad(w, f"{k} is {short(d.get(k))}, the manifest's is {v!r}: a file of another save, rank or "
                       "attempt (stale, moved or replaced)")


def _own_shard(raw: Any, man: "Manifest", rank: int, w: str) -> ShardRecord:
    sh = ShardRecord.parse(raw, f"{w}: shard")
    if sh.step is not None or sh.file != shard_name(man.generation, rank):
        raise bad(w, f"shard {short(sh.file)} is not rank {rank}'s shard of this step "
                   f"({shard_name(man.generation, rank)})")
    return sh


def _ref_shard(raw: Any, man: "Manifest", w: str) -> ShardRecord:
    assert man.layout is not None
    sh = ShardRecord.parse(raw, w)
    if sh.step is None or sh.step >= man.step:
        raise bad(w, f"({sh.file}) refers to step {short(sh.step)}, not an earlier step than {man.step}: "
                   "an incremental share refers only to the bytes of earlier checkpoints")
    if sh.step not in man.layout.references:
        raise bad(w, f"({sh.file}) refers to step {short(sh.step)}, which is not among the manifest's references "
                   f"{sorted(man.layout.references)[:8]}")
    return sh


def _tree_index(raw: Any, layout: RanksLayout, w: str) -> int:
    digest = as_str(raw, w, "tree")
    if digest not in layout.tree_digests:
        raise bad(w, f"tree digest {short(digest)} is none of the manifest's tree_digests")
    return layout.tree_digests.index(digest)


def load_split(man: "Manifest", read: Callable[[str], bytes], read_crc: Callable[[bytes], int],
               ranks: Iterable[int], where: str) -> "Manifest":
    """``man`` (version 4) holding the records of ``ranks`` and of the owners of the replicas
    they alias, each records file read with ``read(name)`` and checked (embedded CRC32C, save id,
    step, generation, rank, world size; against ``ranks.json`` too when ``man`` was completed
    from it by :func:`with_index`), then every field validated (:mod:`nebula_ckpt.format.rank_records`).

    Raises:
        CorruptCheckpointError: naming the file, the rank and the field.
    """
    layout = man.layout
    assert layout is not None
    focus = sorted(set(ranks))
    bad_ranks = [r for r in focus if not 0 <= r < man.world_size]
    if bad_ranks:
        raise bad(where, f"rank(s) {bad_ranks[:8]} are not ranks of this {man.world_size}-rank job")
    shards = list(man.shards)
    shard_of = dict(layout.shard_of)
    rank_tree = dict(man.rank_tree)
    at: dict[tuple[Optional[int], str], int] = {(s.step, s.file): i for i, s in enumerate(shards) if s.step is not None}
    raw: dict[int, tuple[dict[str, Any], list[int], tuple[ShardRecord, ...], str]] = {}
    for r in sorted(layout.providers(focus)):
        name = records_name(man.generation, r)
        w = f"{where}: {name} (rank {r})"
        data = read(name)
        if layout.indexed and (len(data) != layout.records[r].bytes or read_crc(data) != layout.records[r].crc32c):
            raise bad(w, "size or checksum differs from ranks.json's: garbled or replaced")
        d = unseal(data, read_crc, w)
        only_fields(d, _RECORDS_FIELDS, w, "the records file")
        _check_head(d, man, w, RECORDS_FORMAT, r)
        own = _own_shard(d.get("shard"), man, r, w)
        if r in shard_of and shards[shard_of[r]] != own:
            raise bad(w, f"its shard entry {own.to_json()} disagrees with ranks.json's")
        shard_of.setdefault(r, len(shards))
        if shard_of[r] == len(shards):
            shards.append(own)
        local, to_global = [own], [shard_of[r]]
        for j, ref_raw in enumerate(as_list(d.get("refs", []), w, "refs")):
            ref = _ref_shard(ref_raw, man, f"{w}: refs[{j}]")
            i = at.get((ref.step, ref.file))
            if i is None and layout.indexed:
                raise bad(w, f"refs[{j}]: {ref.file} of step {ref.step} is not among ranks.json's shards")
            if i is None:
                i = at[(ref.step, ref.file)] = len(shards)
                shards.append(ref)
            elif shards[i].bytes != ref.bytes:
                raise bad(w, f"refs[{j}]: {ref.file} of step {ref.step} has {ref.bytes} bytes, {shards[i].bytes} "
                           "elsewhere in this checkpoint")
            local.append(ref)
            to_global.append(i)
        tree = _tree_index(d.get("tree"), layout, w)
        if rank_tree.setdefault(r, tree) != tree:
            raise bad(w, "its tree digest disagrees with ranks.json's")
        raw[r] = (d, to_global, tuple(local), w)
    man = dataclasses.replace(man, shards=tuple(shards), rank_tree=types.MappingProxyType(rank_tree),
                              layout=dataclasses.replace(layout, shard_of=types.MappingProxyType(shard_of)))
    return _loaded(man, raw, focus, where)


def _loaded(man: "Manifest", raw: Mapping[int, tuple[dict[str, Any], list[int], tuple[ShardRecord, ...], str]],
            focus: list[int], where: str) -> "Manifest":
    """``man`` holding the tensors, aliases and hashes of the records files ``raw`` (headers checked)."""
    assert man.layout is not None
    tensors: dict[str, TensorRecord] = {}
    hashes: dict[str, str] = {}
    own_aliases: dict[int, dict[str, str]] = {}
    for r, (d, to_global, local, w) in raw.items():
        mine, own_aliases[r], sha = records_body(d, man, r, local, to_global, w)
        tensors.update(mine)
        hashes.update(sha)
    aliases: dict[str, str] = {}
    for r in focus:
        aliases.update(rank_aliases(man, r, tensors, own_aliases[r], where))
    check_rank_trees(man, focus, tensors, aliases, where)
    if len(focus) == man.world_size:
        check_dtensors(tensors, aliases, man.shards, man.world_size, True, f"{where}: records")
    return dataclasses.replace(man, tensors=types.MappingProxyType(tensors), aliases=types.MappingProxyType(aliases),
                               hashes=types.MappingProxyType(hashes),
                               layout=dataclasses.replace(man.layout, loaded=frozenset(focus)))
