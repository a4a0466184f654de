"""The records of a multi-rank manifest of format version 4, as a reader checks them.

:mod:`nebula_ckpt.format.rank_index` reads version 4 (rank 0's ``manifest.json`` and
``ranks.json``, each rank's sealed records file); this module holds what it checks them with:

* :class:`RanksLayout`: the manifest's version 4 fields (the owners of the replicated tensors,
  the DTensor table, the grid, the save id, the trees' digests, the steps referred to,
  ``ranks.json``'s entry) and which ranks' records are loaded;
* :func:`parse_tables` (``owners``, ``dtensors``, ``grid``), :func:`records_body` (a rank's
  tensor records, tied keys and hashes), :func:`check_rank_dtensors`, :func:`rank_aliases` and
  :func:`check_rank_trees`: every field of a rank's records file checked against the manifest;
* :func:`grid_of` (the writer's side: whether a rank's chunks sit on the grid) and
  :func:`ranks_for` (the reader's: the ranks holding a region, by arithmetic).

A records file's keys are the rank's own (no ``r<R>/`` prefix); its records are those of a
manifest (:class:`~nebula_ckpt.format.records.TensorRecord`; ``shard`` left out or 0: the rank's
own shard of this step, j >= 1: ``refs[j - 1]``, a shard of an earlier step).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Sequence

from nebula_ckpt.format.checks import as_hashes, as_int, as_list, as_obj, as_str, bad, only_fields, short
from nebula_ckpt.format.dtypes import TENSOR_DTYPES
from nebula_ckpt.format.grid import Region, holders, on_grid
from nebula_ckpt.format.names import records_name
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
    """The version 4 fields of a manifest, and which ranks' records are loaded into it."""

    records: tuple[RecordsRef, ...]
    owners: Mapping[str, int]
    dtensors: Mapping[str, DTensorSpec]
    grid: bool
    loaded: frozenset[int] = frozenset()
    #: the save's id, the digests of the distinct trees (``tree_digests[i]`` is that of
    #: ``tree["v"][i]``), the steps the ranks refer to, ``ranks.json`` as the manifest names it,
    #: and where each loaded rank's own shard is in the manifest's ``shards``; ``records`` holds
    #: every rank's entry only once ``ranks.json`` was read (``indexed``)
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
        assert self.ranks_file is not None
        return {"save_id": self.save_id, "tree_digests": list(self.tree_digests), **tables,
                "references": sorted(self.references), "ranks_file": self.ranks_file.to_json()}

    def records_file(self, rank: int, generation: int) -> str:
        """The name of ``rank``'s records file."""
        return records_name(generation, rank)

    def providers(self, ranks: Iterable[int]) -> set[int]:
        """``ranks`` and the ranks whose records hold the replicated tensors they alias."""
        return set(ranks) | set(self.owners.values())


def parse_tables(m: dict[str, Any], w: str, world: int) -> tuple[Mapping[str, int], Mapping[str, DTensorSpec], bool]:
    """``owners``, ``dtensors`` and ``grid`` of manifest ``m``, validated."""
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
