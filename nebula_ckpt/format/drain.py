"""A drained step's parts: what ``persist-memory`` leaves beside each rank's shard on the shared tier.

A step that lives only in the memory tiers of a multi-rank job (each rank's own copy, and the
replicas partners hold) is written to the shared tier by the drain of every node that holds a
part of it (:mod:`nebula_ckpt.save.drain`), in format version 4 (:mod:`nebula_ckpt.format.rank_index`).
Beside each rank's ``shard-g<G>-r<R>.safetensors`` and ``records-g<G>-r<R>.json`` a drain writes
the *part record* ``records-g<G>-r<R>.json.drain`` (:func:`~nebula_ckpt.format.names.drain_part_name`):
what the commit needs of that rank and the shard and records files cannot say (the rank's typed
tree, its DTensor table, whether its chunks sit on the grid, its statistics, the time the step was
saved), sealed like a records file (its own CRC32C as the last member)::

    {"format": "nebula_ckpt.drain_part", "version": 1, "step", "generation", "save", "rank",
     "world_size", "save_id", "payload": {...what the rank sends rank 0 in a save's durable round...},
     "crc32c": "<8 hex digits>"}

Every drain of one write builds every file of it byte for byte alike (:func:`drain_save_id` is
derived from the write, the shard image and its records are canonical), so concurrent drains of
it may write the same names in any order. A part counts once its records file (written last)
matches the part record's size and CRC32C and names the write's save id. The part records are
removed once the step is committed; until then a folder holding them is no checkpoint (no
``COMMIT``) and a newer writer generation's sweep removes it like any uncommitted leftover.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Mapping

from nebula_ckpt.format.checks import as_int, as_obj, bad, short
from nebula_ckpt.format.rank_index import seal, unseal

PART_FORMAT = "nebula_ckpt.drain_part"
PART_VERSION = 1
#: the fields of a payload the commit reads (:func:`nebula_ckpt.ranks.split.split_manifest`)
_PAYLOAD = ("step", "shard", "refs", "records", "tree_digest", "tree", "stats", "table", "grid", "time")


def drain_save_id(run_id: str, generation: int, step: int, save: int) -> str:
    """The save id of a drained write (32 hex digits): the same for every drain of it, never one
    a save draws (those are random), so a records file of an aborted save of the same step is not
    taken for a part of the drained one."""
    return hashlib.sha256(f"nebula_ckpt.drain/{run_id}/{generation}/{step}/{save}".encode()).hexdigest()[:32]


def encode_part(*, step: int, generation: int, save: int, rank: int, world: int, save_id: str,
                payload: Mapping[str, Any], crc: Callable[[bytes], int]) -> bytes:
    """The bytes of rank ``rank``'s part record (see the module docstring)."""
    return seal({"format": PART_FORMAT, "version": PART_VERSION, "step": step, "generation": generation,
                 "save": save, "rank": rank, "world_size": world, "save_id": save_id,
                 "payload": {k: payload[k] for k in _PAYLOAD}}, crc)


def parse_part(data: bytes, crc: Callable[[bytes], int], where: str, *, step: int, generation: int, save: int,
               rank: int, world: int, save_id: str) -> dict[str, Any]:
    """The payload of a part record, its seal and its head checked (the write, rank and world it
    must be of); its tree and table are checked with the manifest built from it.

    Raises:
        CorruptCheckpointError: naming ``where`` and the field.
    """
    d = unseal(data, crc, where)
    want: dict[str, Any] = {"format": PART_FORMAT, "version": PART_VERSION, "step": step, "generation": generation,
                            "save": save, "rank": rank, "world_size": world, "save_id": save_id}
    for k, v in want.items():
        if d.get(k) != v or type(d.get(k)) is not type(v):
            raise bad(where, f"{k} is {short(d.get(k))}, not {v!r}: the part record of another write or rank")
    p = as_obj(d.get("payload"), where, "payload")
    missing = [k for k in _PAYLOAD if k not in p]
    if missing:
        raise bad(where, f"payload lacks {missing}")
    if p["step"] != step or p["refs"] != []:
        raise bad(where, "payload is not of a whole share of this step")
    rec = as_obj(p["records"], where, "payload.records")
    as_int(rec.get("bytes"), where, "payload.records.bytes")
    as_int(rec.get("crc32c"), where, "payload.records.crc32c", hi=2**32 - 1)
    shard = as_obj(p["shard"], where, "payload.shard")
    as_int(shard.get("bytes"), where, "payload.shard.bytes")
    return p


def check_records(data: bytes, crc: Callable[[bytes], int], where: str, *, step: int, generation: int, rank: int,
                  world: int, save_id: str) -> None:
    """Raise unless ``data`` is a sealed records file of rank ``rank``'s share of this drained
    write (its step, generation, rank, world size and save id).

    Raises:
        CorruptCheckpointError: naming ``where`` and the field.
    """
    d = unseal(data, crc, where)
    want: dict[str, Any] = {"step": step, "generation": generation, "rank": rank, "world_size": world,
                            "save_id": save_id}
    for k, v in want.items():
        if d.get(k) != v or type(d.get(k)) is not type(v):
            raise bad(where, f"{k} is {short(d.get(k))}, not {v!r}: a records file of another save or rank")
