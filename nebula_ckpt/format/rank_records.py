"""Format version 3: each rank's tensor records in a file of its own, beside its shard.

A multi-rank checkpoint on a shared tier is ``manifest.json`` (written by rank 0) plus, per rank
``R``, ``shard-g<G>-r<R>.safetensors`` and ``records-g<G>-r<R>.json`` (written by rank ``R``)::

    records-g<G>-r<R>.json  {"format": "nebula_ckpt.records", "version": 3, "step", "rank",
                             "tensors": {key: record}, "aliases": {tied key: key},
                             "refs": [shard entry], "sha256": {key: hex}}

Keys are the rank's own (no ``r<R>/`` prefix); records are those of a manifest
(:class:`~nebula_ckpt.format.records.TensorRecord`; ``shard`` left out or 0: the rank's own shard of
this step). An incremental share also has ``refs``, the shards of earlier steps holding its unchanged
tensors (``{"file", "bytes", "storage", "step"}``; a record with ``shard`` j >= 1 lies in
``refs[j - 1]``), and ``sha256``, the SHA-256 of the rank's stored tensors (what its next save
compares against); both are optional. The main manifest's ``shards`` lists every rank's own shard
(rank order) and then every shard the ranks refer to (with ``step``, once each), so the steps a
checkpoint needs are known from the main manifest alone
(:func:`~nebula_ckpt.format.references.references`). The main manifest grows with the number of
ranks and the number of tensors, never their product:

* ``records``: per rank, the file's name, size and CRC32C (checked before it is parsed);
* ``owners``: replicated key -> the rank that stored it (every other rank's key of that name is
  an alias of it: DDP's replicas cost one entry each, not one per rank);
* ``dtensors``: logical key -> dtype, global shape, placements and mesh of every DTensor (the
  ranks' records must agree with it);
* ``grid``: every rank's DTensor chunks sit where DTensor's layout puts them
  (:mod:`nebula_ckpt.format.grid`): they then tile each tensor by construction, and a reader
  finds the ranks holding a region without reading the others' records.

``tensors``, ``aliases`` and ``sha256`` of the main manifest are empty. :func:`parse_layout` validates these
fields when the manifest is parsed; :func:`with_records` reads the records of some ranks (each
one validated like the records of a version 2 manifest, plus the checks above) and returns the
manifest as a version 2 reader knows it, holding those ranks' tensors (their records' shard
indices mapped onto the main manifest's ``shards``) and hashes.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional, Sequence

from nebula_ckpt.format.checks import as_hashes, as_int, as_list, as_obj, as_str, bad, only_fields, short
from nebula_ckpt.format.dtensors import check_dtensors
from nebula_ckpt.format.dtypes import TENSOR_DTYPES
from nebula_ckpt.format.grid import Region, holders, on_grid
from nebula_ckpt.format.names import LAYOUT_VERSION, is_records_name, records_name
from nebula_ckpt.format.records import DTensorInfo, ShardRecord, TensorRecord
from nebula_ckpt.format.tree import check_tree

if TYPE_CHECKING:
    from nebula_ckpt.format.manifest import Manifest

RECORDS_FORMAT = "nebula_ckpt.records"
LAYOUT_FIELDS = ("records", "owners", "dtensors", "grid")


@dataclass(frozen=True)
class RecordsRef:
    """A rank's records file as the main manifest names it."""

    file: str
    bytes: int
    crc32c: int

    def to_json(self) -> dict[str, Any]:
        """The manifest's JSON object."""
        return {"file": self.file, "bytes": self.bytes, "crc32c": self.crc32c}


@dataclass(frozen=True)
class DTensorSpec:
    """What every rank's record of one DTensor must agree on."""

    dtype: str
    shape: tuple[int, ...]
    placements: tuple[str, ...]
    mesh: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        """The manifest's JSON object."""
        return {"dtype": self.dtype, "shape": list(self.shape), "placements": list(self.placements),
                "mesh": list(self.mesh)}


def spec_of(rec: Mapping[str, Any]) -> list[Any]:
    """The agreed part of a writer's DTensor record (JSON), as :meth:`DTensorSpec.to_json` lists it."""
    dt = rec["dtensor"]
    return [rec["dtype"], list(dt["shape"]), list(dt["placements"]), list(dt["mesh"])]


@dataclass(frozen=True)
class RanksLayout:
    """The version 3 fields of a manifest, and which ranks' records are loaded into it."""

    records: tuple[RecordsRef, ...]
    owners: Mapping[str, int]
    dtensors: Mapping[str, DTensorSpec]
    grid: bool
    loaded: frozenset[int] = frozenset()
    #: format version 4 (:mod:`nebula_ckpt.format.rank_index`): the save's id, the digests of the
    #: distinct trees (``tree_digests[i]`` is that of ``tree["v"][i]``), the steps the ranks refer
    #: to, ``ranks.json`` as the manifest names it, and where each loaded rank's own shard is in
    #: the manifest's ``shards``; ``records`` then holds every rank's entry only once
    #: ``ranks.json`` was read (``indexed``)
    version: int = 3
    save_id: str = ""
    tree_digests: tuple[str, ...] = ()
    references: frozenset[int] = frozenset()
    ranks_file: Optional[RecordsRef] = None
    shard_of: Mapping[int, int] = dataclasses.field(default_factory=dict)
    indexed: bool = False

    def to_json(self) -> dict[str, Any]:
        """The main manifest's fields."""
        tables = {"owners": dict(self.owners), "dtensors": {k: s.to_json() for k, s in self.dtensors.items()},
                  "grid": self.grid}
        if self.version < 4:
            return {"records": [r.to_json() for r in self.records], **tables}
        assert self.ranks_file is not None
        return {"save_id": self.save_id, "tree_digests": list(self.tree_digests), **tables,
                "references": sorted(self.references), "ranks_file": self.ranks_file.to_json()}

    def records_file(self, rank: int, generation: int) -> str:
        """The name of ``rank``'s records file."""
        return self.records[rank].file if self.version < 4 else records_name(generation, rank)

    def providers(self, ranks: Iterable[int]) -> set[int]:
        """``ranks`` and the ranks whose records hold the replicated tensors they alias."""
        return set(ranks) | set(self.owners.values())


def encode_records(step: int, rank: int, tensors: Mapping[str, Any], aliases: Mapping[str, str],
                   refs: Optional[list[dict[str, Any]]] = None, hashes: Optional[Mapping[str, str]] = None) -> bytes:
    """The bytes of rank ``rank``'s records file (compact JSON). ``tensors``: records without
    ``shard`` (the rank's own shard) or with ``shard`` j >= 1 (``refs[j - 1]``, an earlier step's
    shard); ``refs`` and ``hashes`` (``sha256``) are written only when not empty."""
    out: dict[str, Any] = {"format": RECORDS_FORMAT, "version": LAYOUT_VERSION, "step": step, "rank": rank,
                           "tensors": tensors, "aliases": aliases}
    if refs:
        out["refs"] = refs
    if hashes:
        out["sha256"] = dict(hashes)
    return json.dumps(out, separators=(",", ":"), allow_nan=False).encode()


def parse_layout(m: dict[str, Any], w: str, shards: tuple[ShardRecord, ...], world: int,
                 ranks: tuple[int, ...]) -> RanksLayout:
    """Validate the version 3 fields of manifest ``m`` (``w`` names it in errors)."""
    own = [s for s in shards if s.step is None]
    if world < 2 or ranks != tuple(range(world)) or len(own) != world or any(s.step is None for s in shards[world:]):
        raise bad(w, f"a version {LAYOUT_VERSION} manifest holds every rank of its job in order, with one shard "
                   f"each (then the earlier steps' shards they refer to): ranks {short(list(ranks))}, "
                   f"{len(own)} own shard(s), world_size {world}")
    if m.get("tensors") or m.get("aliases"):
        raise bad(w, f"tensors / aliases must be empty in a version {LAYOUT_VERSION} manifest (each rank's "
                   "records are in its records file)")
    refs = []
    for r, d in enumerate(as_list(m.get("records"), w, "records")):
        where = f"{w}: records[{r}]"
        d = as_obj(d, where, "the records entry")
        only_fields(d, ("file", "bytes", "crc32c"), where, "the records entry")
        name = as_str(d.get("file"), where, "file")
        if not is_records_name(name) or not name.endswith(f"-r{r}.json"):
            raise bad(where, f"file {short(name)} is not rank {r}'s records file (records-g<G>-r{r}.json)")
        refs.append(RecordsRef(name, as_int(d.get("bytes"), where, "bytes", lo=2, hi=1 << 40),
                               as_int(d.get("crc32c"), where, "crc32c", hi=2**32 - 1)))
    if len(refs) != world:
        raise bad(w, f"records lists {len(refs)} file(s) for {world} ranks")
    owners, specs, grid = parse_tables(m, w, world)
    return RanksLayout(tuple(refs), owners, specs, grid)


def parse_tables(m: dict[str, Any], w: str, world: int) -> tuple[Mapping[str, int], Mapping[str, DTensorSpec], bool]:
    """``owners``, ``dtensors`` and ``grid`` of manifest ``m`` (versions 3 and 4), validated."""
    owners = {as_str(k, w, "owners key"): as_int(v, w, f"owners[{short(k)}]", hi=world - 1)
              for k, v in as_obj(m.get("owners", {}), w, "owners").items()}
    specs = {as_str(k, w, "dtensors key"): _spec(v, f"{w}: dtensors[{short(k)}]")
             for k, v in as_obj(m.get("dtensors", {}), w, "dtensors").items()}
    grid = m.get("grid", False)
    if type(grid) is not bool:
        raise bad(w, f"grid must be true or false, got {short(grid)}")
    return types.MappingProxyType(owners), types.MappingProxyType(specs), grid


def _spec(v: Any, where: str) -> DTensorSpec:
    d = as_obj(v, where, "the dtensor spec")
    only_fields(d, ("dtype", "shape", "placements", "mesh"), where, "the dtensor spec")
    dtype = as_str(d.get("dtype"), where, "dtype")
    if dtype not in TENSOR_DTYPES:
        raise bad(where, f"dtype {short(dtype)} is not a storable torch dtype")
    shape = tuple(as_int(x, where, "shape[]") for x in as_list(d.get("shape"), where, "shape"))
    # DTensorInfo checks placements and mesh (against a whole, unsharded chunk of this shape)
    info = DTensorInfo.parse({"shape": list(shape), "offsets": [0] * len(shape), "placements": d.get("placements"),
                              "mesh": d.get("mesh")}, shape, where)
    return DTensorSpec(dtype, shape, info.placements, info.mesh)


def parse_records(data: bytes, man: "Manifest", rank: int, read_crc: Callable[[bytes], int],
                  where: str) -> tuple[dict[str, TensorRecord], dict[str, str], dict[str, str]]:
    """Rank ``rank``'s records file ``data``, checked against its entry in ``man``: its tensors
    (keys prefixed ``r<R>/``, shard: an index of ``man.shards``), its aliases (the rank's own
    keys) and the SHA-256 of its stored tensors (keys prefixed)."""
    assert man.layout is not None
    ref = man.layout.records[rank]
    w = f"{where}: {ref.file} (rank {rank})"
    if len(data) != ref.bytes or read_crc(data) != ref.crc32c:
        raise bad(w, f"size or checksum differs from the manifest's ({len(data)} bytes, manifest says "
                   f"{ref.bytes}): garbled or replaced")
    try:
        d = json.loads(data)
    except Exception as e:  # RecursionError, UnicodeDecodeError, ...
        raise bad(w, f"is not valid JSON ({type(e).__name__}: {e})") from None
    d = as_obj(d, w, "the records file")
    only_fields(d, ("format", "version", "step", "rank", "tensors", "aliases", "refs", "sha256"), w,
                "the records file")
    if d.get("format") != RECORDS_FORMAT or d.get("version") != LAYOUT_VERSION:
        raise bad(w, f"format / version are {short(d.get('format'))} / {short(d.get('version'))}, not "
                   f"{RECORDS_FORMAT!r} / {LAYOUT_VERSION}")
    if as_int(d.get("step"), w, "step") != man.step or as_int(d.get("rank"), w, "rank") != rank:
        raise bad(w, f"is of step {short(d.get('step'))} rank {short(d.get('rank'))}, expected step {man.step} "
                   f"rank {rank} (moved or replaced)")
    local, to_global = _shards(d.get("refs", []), man, rank, w)
    return records_body(d, man, rank, local, to_global, w)


def records_body(d: dict[str, Any], man: "Manifest", rank: int, local: Sequence[ShardRecord],
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


def _shards(raw: Any, man: "Manifest", rank: int, w: str) -> tuple[tuple[ShardRecord, ...], list[int]]:
    """A records file's shards (0: the rank's own, j >= 1: ``refs[j - 1]``) and, for each, its
    index in the main manifest's ``shards`` (which lists every referenced shard, by step and file)."""
    at = {(s.step, s.file): i for i, s in enumerate(man.shards) if s.step is not None}
    local, to_global = [man.shards[rank]], [rank]
    for j, r in enumerate(as_list(raw, w, "refs"), start=1):
        rw = f"{w}: refs[{j - 1}]"
        ref = ShardRecord.parse(r, rw)
        if ref.step is None or ref.step >= man.step:
            raise bad(rw, f"({ref.file}) refers to step {short(ref.step)}, not an earlier step than {man.step}: "
                       "an incremental share refers only to the bytes of earlier checkpoints")
        i = at.get((ref.step, ref.file))
        if i is None or man.shards[i].bytes != ref.bytes:
            raise bad(rw, f"{ref.file} of step {ref.step} ({ref.bytes} bytes) is not among the manifest's shards "
                       "(every shard a rank refers to is listed there, with its size)")
        local.append(ref)
        to_global.append(i)
    return tuple(local), to_global


def check_rank_dtensors(tensors: dict[str, TensorRecord], man: "Manifest", rank: int, w: str) -> None:
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


def with_records(man: "Manifest", read: Callable[[str], bytes], read_crc: Callable[[bytes], int],
                 ranks: Iterable[int], where: str) -> "Manifest":
    """``man`` (version 3) holding the records of ``ranks`` (and of the owners of the replicated
    tensors they alias), each file read with ``read(name)`` and validated; the trees of ``ranks``
    are checked against their keys. With every rank loaded, the DTensor chunks are checked to
    cover each tensor exactly (as a version 2 manifest's are).

    Raises:
        CorruptCheckpointError: naming the file, the rank and the field.
    """
    layout = man.layout
    assert layout is not None
    focus = sorted(set(ranks))
    tensors: dict[str, TensorRecord] = {}
    hashes: dict[str, str] = {}
    own_aliases: dict[int, dict[str, str]] = {}
    for r in sorted(layout.providers(focus)):
        recs, al, sha = parse_records(read(layout.records[r].file), man, r, read_crc, where)
        tensors.update(recs)
        hashes.update(sha)
        own_aliases[r] = al
    aliases: dict[str, str] = {}
    for r in focus:
        aliases.update(rank_aliases(man, r, tensors, own_aliases[r], where))
    check_rank_trees(man, focus, tensors, aliases, where)
    complete = len(focus) == man.world_size
    if complete:
        check_dtensors(tensors, aliases, man.shards, man.world_size, True, f"{where}: records")
    return dataclasses.replace(man, tensors=types.MappingProxyType(tensors), aliases=types.MappingProxyType(aliases),
                               hashes=types.MappingProxyType(hashes),
                               layout=dataclasses.replace(layout, loaded=frozenset(focus)))


def rank_aliases(man: "Manifest", r: int, tensors: dict[str, TensorRecord], own: dict[str, str],
                  where: str) -> dict[str, str]:
    """Rank ``r``'s aliases, prefixed: the replicated keys it did not store, then its tied keys."""
    assert man.layout is not None
    p = f"r{r}/"
    out: dict[str, str] = {}
    for k, q in man.layout.owners.items():
        if q == r:
            if p + k not in tensors:
                raise bad(f"{where}: {man.layout.records_file(r, man.generation)} (rank {r})",
                          f"owners names rank {r} for '{k}', which its records lack")
        else:
            if p + k in tensors:
                raise bad(f"{where}: {man.layout.records_file(r, man.generation)} (rank {r})",
                          f"'{k}' is stored by rank {r} but owned by rank {q} in the manifest")
            if f"r{q}/{k}" not in tensors:
                raise bad(f"{where}: {man.layout.records_file(q, man.generation)} (rank {q})",
                          f"owners names rank {q} for '{k}', which its records lack")
            out[p + k] = f"r{q}/{k}"
    for a, b in own.items():
        target = out.get(p + b, p + b)
        if p + a in tensors or p + a in out or target not in tensors:
            raise bad(f"{where}: {man.layout.records_file(r, man.generation)} (rank {r})",
                      f"aliases[{short(a)}] -> {short(b)}: {'a stored key' if p + a in tensors else 'no such tensor'}")
        out[p + a] = target
    return out


def check_rank_trees(man: "Manifest", focus: list[int], tensors: dict[str, TensorRecord], aliases: dict[str, str],
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


def grid_of(records: Iterable[Mapping[str, Any]], rank: int, world: int) -> bool:
    """Whether every DTensor record (writer's JSON) of ``rank`` sits on the grid."""
    for rec in records:
        dt = rec.get("dtensor")
        if dt is not None and math.prod(rec["shape"]) and not on_grid(
                dt["shape"], dt["placements"], dt["mesh"], rank, world, dt["offsets"], rec["shape"]):
            return False
    return True


def ranks_for(layout: RanksLayout, regions: Mapping[str, Region]) -> Optional[set[int]]:
    """The ranks whose records a reader of ``regions`` (logical DTensor key -> ``(offsets, shape)``
    in the global tensor) needs, found on the grid without reading any records (plus the owners of
    the replicated tensors); None when the checkpoint is not on the grid (then: every rank).
    The work is the number of chunks overlapping the regions, whatever the number of ranks."""
    if not layout.grid:
        return None
    out = set(layout.owners.values())
    for key, region in regions.items():
        spec = layout.dtensors[key]
        out.update(r for r, _ in holders(spec.shape, spec.placements, spec.mesh, region))
    return out
