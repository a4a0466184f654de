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
     "replicas"?, "refs"?, "sha256"?, "crc32c": "<8 hex digits>"}

``replicas`` (key -> rank): the keys this rank holds whose bytes another rank stored under the
same key (the DCP writer's: DCP stores an item several ranks hold once); the manifest's
``owners`` says the same of a key every rank of the job holds.

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

This module encodes version 4's files and parses the manifest's version 4 fields; a manifest is
completed from ``ranks.json`` and loaded with the ranks' records in
:mod:`nebula_ckpt.format.split_records`.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Mapping, Optional

from nebula_ckpt.format.checks import as_int, as_list, as_obj, as_str, bad, load_object, only_fields, short
from nebula_ckpt.format.names import RANKS_FILE, SPLIT_VERSION
from nebula_ckpt.format.rank_records import (
    RECORDS_FORMAT,
    RanksLayout,
    RecordsRef,
    parse_tables,
)
from nebula_ckpt.format.records import ShardRecord

RANKS_FORMAT = "nebula_ckpt.ranks"
SPLIT_FIELDS = ("save_id", "tree_digests", "references", "ranks_file")
_SEAL = re.compile(rb',"crc32c":"([0-9a-f]{8})"\}')
_SEAL_LEN = 21
_HEX = re.compile(r"[0-9a-f]{16,64}")
#: the fields a records file may hold
RECORDS_FIELDS = ("format", "version", "step", "generation", "rank", "world_size", "save_id", "shard", "tree",
                  "tensors", "aliases", "replicas", "refs", "sha256")


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
    return load_object(text, w, "the records file")


def encode_split_records(*, step: int, generation: int, rank: int, world: int, save_id: str,
                         shard: Mapping[str, Any], tree: str, tensors: Mapping[str, Any], aliases: Mapping[str, str],
                         refs: Optional[list[dict[str, Any]]], hashes: Optional[Mapping[str, str]],
                         crc: Callable[[bytes], int], replicas: Optional[Mapping[str, int]] = None) -> bytes:
    """The bytes of rank ``rank``'s version 4 records file (see the module docstring); ``tree``:
    the digest of the rank's tree; ``replicas``, ``refs`` and ``hashes`` written only when not empty."""
    out: dict[str, Any] = {"format": RECORDS_FORMAT, "version": SPLIT_VERSION, "step": step, "generation": generation,
                           "rank": rank, "world_size": world, "save_id": save_id, "shard": dict(shard), "tree": tree,
                           "tensors": tensors, "aliases": aliases}
    if replicas:
        out["replicas"] = dict(replicas)
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
