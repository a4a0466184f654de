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
import math
import types
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

from nebula_ckpt.format.checks import as_int, as_obj, as_str, bad, only_fields, short
from nebula_ckpt.format.dtypes import TENSOR_DTYPES
from nebula_ckpt.format.grid import Region, holders, on_grid
from nebula_ckpt.format.names import records_name
from nebula_ckpt.format.records import DTensorInfo, as_shape

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
    shape = as_shape(d.get("shape"), where)
    # DTensorInfo checks placements and mesh (against a whole, unsharded chunk of this shape)
    info = DTensorInfo.parse({"shape": list(shape), "offsets": [0] * len(shape), "placements": d.get("placements"),
                              "mesh": d.get("mesh")}, shape, where)
    return DTensorSpec(dtype, shape, info.placements, info.mesh)


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
