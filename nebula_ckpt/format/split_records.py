"""Format version 4 read: a manifest completed from ``ranks.json`` and holding some ranks' records.

A version 4 manifest (:mod:`nebula_ckpt.format.rank_index`) parses to a
:class:`~nebula_ckpt.format.manifest.Manifest` whose ``tensors`` are empty: :func:`with_index`
completes it from ``ranks.json`` (every rank's shard, records file entry and tree) and
:func:`load_split` loads the records files of the ranks a reader needs, each checked (embedded
CRC32C, save id, step, generation, rank, world size; against ``ranks.json`` when it was read),
then every field validated against the manifest: the tensor records (:func:`records_body`), the
DTensor table and grid (:func:`check_rank_dtensors`), the replicated keys' owners, the keys
another rank stored for a rank and the tied keys (:func:`rank_aliases`), the trees
(:func:`check_rank_trees`) and, with every rank loaded, the coverage of each DTensor.
"""

from __future__ import annotations

import dataclasses
import itertools
import types
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from nebula_ckpt.format.checks import as_hashes, as_int, as_list, as_obj, as_str, bad, load_object, only_fields, short
from nebula_ckpt.format.dtensors import check_dtensors
from nebula_ckpt.format.grid import on_grid
from nebula_ckpt.format.manifest import Manifest
from nebula_ckpt.format.names import RANKS_FILE, SPLIT_VERSION, records_name, shard_name
from nebula_ckpt.format.rank_index import RANKS_FORMAT, RECORDS_FIELDS, unseal
from nebula_ckpt.format.rank_records import RECORDS_FORMAT, RanksLayout, RecordsRef
from nebula_ckpt.format.records import ShardRecord, TensorRecord
from nebula_ckpt.format.tree import check_tree


def with_index(man: Manifest, data: bytes, read_crc: Callable[[bytes], int], where: str) -> Manifest:
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
    d = load_object(data, w, "ranks.json")
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


def _check_head(d: Mapping[str, Any], man: Manifest, w: str, fmt: str, rank: Optional[int]) -> None:
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


def _own_shard(raw: Any, man: Manifest, rank: int, w: str) -> ShardRecord:
    sh = ShardRecord.parse(raw, f"{w}: shard")
    if sh.step is not None or sh.file != shard_name(man.generation, rank):
        raise bad(w, f"shard {short(sh.file)} is not rank {rank}'s shard of this step "
                   f"({shard_name(man.generation, rank)})")
    return sh


def _ref_shard(raw: Any, man: Manifest, w: str) -> ShardRecord:
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


def load_split(man: Manifest, read: Callable[[str], bytes], read_crc: Callable[[bytes], int],
               ranks: Iterable[int], where: str) -> Manifest:
    """``man`` (version 4) holding the records of ``ranks`` and of the ranks storing what they
    alias (the owners of the job's replicated keys, then the ranks their ``replicas`` name), each
    records file read with ``read(name)`` and checked (embedded CRC32C, save id, step, generation,
    rank, world size; against ``ranks.json`` too when ``man`` was completed from it by
    :func:`with_index`), then every field validated (:mod:`nebula_ckpt.format.rank_records`).

    Raises:
        CorruptCheckpointError: naming the file, the rank and the field.
    """
    layout = man.layout
    assert layout is not None
    focus = sorted(set(ranks))
    bad_ranks = [r for r in focus if not 0 <= r < man.world_size]
    if bad_ranks:
        raise bad(where, f"rank(s) {bad_ranks[:8]} are not ranks of this {man.world_size}-rank job")
    reading = _Reading(man, read, read_crc, where)
    for r in sorted(layout.providers(focus)):
        reading.add(r)
    # the ranks storing the replicas the focus ranks name: read too (a replica is never a chain)
    for q in sorted({q for r in focus for q in reading.files[r].replicas.values()} - set(reading.files)):
        reading.add(q)
    man = dataclasses.replace(man, shards=tuple(reading.shards), rank_tree=types.MappingProxyType(reading.rank_tree),
                              layout=dataclasses.replace(layout, shard_of=types.MappingProxyType(reading.shard_of)))
    return _loaded(man, reading.files, focus, where)


@dataclasses.dataclass
class _RankFile:
    """A rank's parsed records file: its object, its records' shard indices mapped to the
    manifest's (``to_global``), the shards they name (``local``), its name for messages (``w``)
    and its ``replicas`` (checked)."""

    d: dict[str, Any]
    to_global: list[int]
    local: tuple[ShardRecord, ...]
    w: str
    replicas: dict[str, int]


class _Reading:
    """The records files read so far and the shards, trees and shard indices they add to ``man``."""

    def __init__(self, man: Manifest, read: Callable[[str], bytes], read_crc: Callable[[bytes], int],
                 where: str) -> None:
        assert man.layout is not None
        self.man, self.read, self.read_crc, self.where = man, read, read_crc, where
        self.shards = list(man.shards)
        self.shard_of = dict(man.layout.shard_of)
        self.rank_tree = dict(man.rank_tree)
        self.at: dict[tuple[Optional[int], str], int] = {(s.step, s.file): i for i, s in enumerate(self.shards)
                                                         if s.step is not None}
        self.files: dict[int, _RankFile] = {}

    def add(self, r: int) -> None:
        """Read and check rank ``r``'s records file (its head, shard, refs, tree and replicas)."""
        man, layout = self.man, self.man.layout
        assert layout is not None
        name = records_name(man.generation, r)
        w = f"{self.where}: {name} (rank {r})"
        data = self.read(name)
        if layout.indexed and (len(data) != layout.records[r].bytes or
                               self.read_crc(data) != layout.records[r].crc32c):
            raise bad(w, "size or checksum differs from ranks.json's: garbled or replaced")
        d = unseal(data, self.read_crc, w)
        only_fields(d, RECORDS_FIELDS, w, "the records file")
        _check_head(d, man, w, RECORDS_FORMAT, r)
        own = _own_shard(d.get("shard"), man, r, w)
        if r in self.shard_of and self.shards[self.shard_of[r]] != own:
            raise bad(w, f"its shard entry {own.to_json()} disagrees with ranks.json's")
        self.shard_of.setdefault(r, len(self.shards))
        if self.shard_of[r] == len(self.shards):
            self.shards.append(own)
        local, to_global = [own], [self.shard_of[r]]
        for j, ref_raw in enumerate(as_list(d.get("refs", []), w, "refs")):
            ref = _ref_shard(ref_raw, man, f"{w}: refs[{j}]")
            i = self.at.get((ref.step, ref.file))
            if i is None and layout.indexed:
                raise bad(w, f"refs[{j}]: {ref.file} of step {ref.step} is not among ranks.json's shards")
            if i is None:
                i = self.at[(ref.step, ref.file)] = len(self.shards)
                self.shards.append(ref)
            elif self.shards[i].bytes != ref.bytes:
                raise bad(w, f"refs[{j}]: {ref.file} of step {ref.step} has {ref.bytes} bytes, "
                           f"{self.shards[i].bytes} elsewhere in this checkpoint")
            local.append(ref)
            to_global.append(i)
        tree = _tree_index(d.get("tree"), layout, w)
        if self.rank_tree.setdefault(r, tree) != tree:
            raise bad(w, "its tree digest disagrees with ranks.json's")
        self.files[r] = _RankFile(d, to_global, tuple(local), w, _replicas(d.get("replicas", {}), r, man.world_size,
                                                                           w))


def _replicas(raw: Any, rank: int, world: int, w: str) -> dict[str, int]:
    """A records file's ``replicas`` (key -> the rank storing it), each naming another rank of the job."""
    out = {}
    for k, q in as_obj(raw, w, "replicas").items():
        out[as_str(k, w, "replicas key")] = q = as_int(q, w, f"replicas[{short(k)}]", hi=world - 1)
        if q == rank:
            raise bad(w, f"replicas[{short(k)}] names rank {rank} itself: a rank's own tensors are in its tensors")
    return out


def _loaded(man: Manifest, files: Mapping[int, _RankFile], focus: list[int], where: str) -> Manifest:
    """``man`` holding the tensors, aliases and hashes of the records files ``files`` (headers checked)."""
    assert man.layout is not None
    tensors: dict[str, TensorRecord] = {}
    hashes: dict[str, str] = {}
    own_aliases: dict[int, dict[str, str]] = {}
    for r, f in files.items():
        mine, own_aliases[r], sha = records_body(f.d, man, r, f.local, f.to_global, f.w)
        tensors.update(mine)
        hashes.update(sha)
    aliases: dict[str, str] = {}
    for r in focus:
        aliases.update(rank_aliases(man, r, tensors, own_aliases, files[r].replicas, where))
    check_rank_trees(man, focus, tensors, aliases, where)
    if len(focus) == man.world_size:
        check_dtensors(tensors, aliases, man.shards, man.world_size, True, f"{where}: records")
    return dataclasses.replace(man, tensors=types.MappingProxyType(tensors), aliases=types.MappingProxyType(aliases),
                               hashes=types.MappingProxyType(hashes),
                               layout=dataclasses.replace(man.layout, loaded=frozenset(focus)))


def records_body(d: dict[str, Any], man: Manifest, rank: int, local: Sequence[ShardRecord],
                 to_global: Sequence[int], w: str) -> tuple[dict[str, TensorRecord], dict[str, str], dict[str, str]]:
    """The tensors (keys prefixed ``r<R>/``, ``shard``: an index of ``man.shards`` through
    ``to_global``), own aliases and prefixed SHA-256 hashes of rank ``rank``'s parsed records file
    ``d`` (``local``: the shards its records' ``shard`` indices name), every field checked."""
    p = f"r{rank}/"
    tensors = {}
    for k, v in as_obj(d.get("tensors"), w, "tensors").items():
        rw = f"{w}: tensors[{short(k)}]"
        as_obj(v, rw, "the tensor entry")
        rec = TensorRecord.parse(as_str(k, rw, "key"), v, tuple(local), rw)
        tensors[p + k] = dataclasses.replace(rec, key=p + k, shard=to_global[rec.shard])
    check_rank_dtensors(tensors, man, rank, w)
    aliases = {as_str(a, w, "aliases key"): as_str(b, w, f"aliases[{short(a)}]")
               for a, b in as_obj(d.get("aliases", {}), w, "aliases").items()}
    hashes = as_hashes(d.get("sha256", {}), {k.partition("/")[2] for k in tensors}, w)
    return tensors, aliases, {p + k: h for k, h in hashes.items()}


def check_rank_dtensors(tensors: dict[str, TensorRecord], man: Manifest, rank: int, w: str) -> None:
    """Each DTensor record agrees with the manifest's ``dtensors`` table and, on the grid, sits
    where the grid puts it; spans inside the shard never overlap."""
    assert man.layout is not None
    specs, grid = man.layout.dtensors, man.layout.grid
    for full, rec in tensors.items():
        key = full.partition("/")[2]
        spec = specs.get(key)
        if rec.dtensor is None:
            if spec is not None:
                raise bad(w, f"key '{key}' is a plain tensor on rank {rank} but a DTensor in the manifest's dtensors")
            continue
        info = rec.dtensor
        if spec is None or (rec.dtype, info.shape, info.placements, info.mesh) != \
                (spec.dtype, spec.shape, spec.placements, spec.mesh):
            raise bad(w, f"key '{key}': the DTensor record of rank {rank} ({rec.dtype} {list(info.shape)} "
                       f"{list(info.placements)} mesh {list(info.mesh)}) disagrees with the manifest's dtensors "
                       f"({'nothing' if spec is None else spec.to_json()})")
        if grid and not on_grid(info.shape, info.placements, info.mesh, rank, man.world_size, info.offsets,
                                rec.shape):
            raise bad(w, f"key '{key}': rank {rank}'s chunk {list(rec.shape)} at {list(info.offsets)} is not where "
                       "the grid the manifest declares puts it")
    spans = sorted((t.shard, t.start, t.end, k) for k, t in tensors.items() if t.nbytes)
    for (s0, _, e0, k0), (s1, b1, _, k1) in itertools.pairwise(spans):
        if s0 == s1 and b1 < e0:
            raise bad(w, f"tensors {k0!r} and {k1!r} overlap in {man.shards[s0].file}; every tensor must own "
                       "its bytes")


def rank_aliases(man: Manifest, r: int, tensors: dict[str, TensorRecord], tied: Mapping[int, Mapping[str, str]],
                 replicas: Mapping[str, int], where: str) -> dict[str, str]:
    """Rank ``r``'s aliases, prefixed: the job's replicated keys it did not store, the keys another
    rank stored for it (its ``replicas``: that rank's key, stored or tied to one it stored; ``tied``:
    each loaded rank's own aliases), then its tied keys."""
    assert man.layout is not None
    p = f"r{r}/"
    mine = f"{where}: {man.layout.records_file(r, man.generation)} (rank {r})"
    out: dict[str, str] = {}
    for k, q in man.layout.owners.items():
        if q == r:
            if p + k not in tensors:
                raise bad(mine, f"owners names rank {r} for '{k}', which its records lack")
        else:
            if p + k in tensors:
                raise bad(mine, f"'{k}' is stored by rank {r} but owned by rank {q} in the manifest")
            if f"r{q}/{k}" not in tensors:
                raise bad(f"{where}: {man.layout.records_file(q, man.generation)} (rank {q})",
                          f"owners names rank {q} for '{k}', which its records lack")
            out[p + k] = f"r{q}/{k}"
    for k, q in replicas.items():
        if p + k in tensors or p + k in out:
            raise bad(mine, f"replicas[{short(k)}]: '{k}' is {'stored by this rank' if p + k in tensors else 'owned'}"
                      " already")
        target = f"r{q}/{tied.get(q, {}).get(k, k)}"
        if target not in tensors:
            raise bad(f"{where}: {man.layout.records_file(q, man.generation)} (rank {q})",
                      f"rank {r}'s replicas names rank {q} for '{k}', which it does not store")
        info, rec = tensors[target].dtensor, tensors[target]
        if man.layout.grid and info is not None and not on_grid(info.shape, info.placements, info.mesh, r,
                                                                 man.world_size, info.offsets, rec.shape):
            raise bad(mine, f"replicas[{short(k)}]: rank {q}'s chunk {list(rec.shape)} at {list(info.offsets)} is "
                      f"not the one the grid the manifest declares gives rank {r}")
        out[p + k] = target
    for a, b in tied.get(r, {}).items():
        target = out.get(p + b, p + b)
        if p + a in tensors or p + a in out or target not in tensors:
            what = "a stored key" if p + a in tensors else "no such tensor"
            raise bad(mine, f"aliases[{short(a)}] -> {short(b)}: {what}")
        out[p + a] = target
    return out


def check_rank_trees(man: Manifest, focus: list[int], tensors: dict[str, TensorRecord], aliases: dict[str, str],
                 where: str) -> None:
    """Each loaded rank's tree against the keys it holds (a tree shared by several ranks is walked
    once; the others' keys and dtypes must equal the first's)."""
    held: dict[int, dict[str, str]] = {r: {} for r in focus}
    for k in itertools.chain(tensors, aliases):  # one pass: every key starts with a loaded rank's prefix
        head, _, rest = k.partition("/")
        mine = held.get(int(head[1:]))
        if mine is not None:
            mine[rest] = tensors[aliases.get(k, k)].dtype
    seen: dict[int, dict[str, str]] = {}
    for r in focus:
        keys = held[r]
        i = man.rank_tree[r]
        if i not in seen:
            check_tree(man.tree["v"][i], keys, f"{where}: tree[{i}] (rank {r})")
            seen[i] = keys
        elif keys != seen[i]:
            missing = sorted(set(seen[i]) ^ set(keys))[:3]
            raise bad(where, f"rank {r} holds other tensors than the ranks sharing its tree[{i}] "
                       f"(e.g. {missing}, or another dtype)")
