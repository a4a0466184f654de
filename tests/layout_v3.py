"""The tests' writer of format version 3 (the package reads it; its commit rounds write version 4,
:mod:`nebula_ckpt.ranks.split`, whose :func:`~nebula_ckpt.ranks.split.signature` and
:func:`~nebula_ckpt.ranks.split.layout_tables` this writer shares). Pure functions over metadata:

* :func:`records_payload` — a rank's records file (its share's tensor records and its tied keys,
  :func:`~nebula_ckpt.format.rank_records.encode_records`) and the small record it sends rank 0
  in the durable round: its shard, its records file's name, size and CRC32C, its tree (None when
  it equals rank 0's), its statistics, its table (see above), whether its chunks sit on the grid
  and, for an incremental share, the earlier steps' shards it refers to (``refs``: its records
  file holds the records pointing at them and the SHA-256 of its tensors);
* :func:`layout_manifest` — rank 0's manifest from those records: it grows with the number of
  ranks (one shard and one records entry each, plus the shards they refer to, listed once each)
  plus the number of tensors (owners, DTensor table), never their product. Disagreeing DTensor
  tables refuse the commit, naming the key and the ranks. The rest of the manifest is built by
  :func:`nebula_ckpt.format.multi_rank.ranks_manifest`, the builder of version 2.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from nebula_ckpt.format.multi_rank import ranks_manifest
from nebula_ckpt.format.names import LAYOUT_VERSION, records_name
from nebula_ckpt.format.rank_records import encode_records, grid_of
from nebula_ckpt.ranks.split import layout_tables, signature


def records_payload(*, step: int, generation: int, rank: int, world: int, shard: dict[str, Any],
                    index: dict[str, dict[str, Any]], aliases: dict[str, str], meta: dict[str, Any],
                    send_tree: bool, send_table: bool, crc: Callable[[bytes], int],
                    refs: Optional[list[dict[str, Any]]] = None,
                    hashes: Optional[dict[str, str]] = None) -> tuple[str, bytes, dict[str, Any]]:
    """``(records file name, its bytes, what the rank sends in the durable round)``.

    ``index``: the tensor records of the rank's share (offsets in its shard, or ``shard`` j >= 1:
    in ``refs[j - 1]``, a shard of an earlier step); ``meta``: the staged snapshot's ``tensors``
    (every record, for the table and the grid), ``tree`` and ``stats``; ``hashes``: the SHA-256
    of the share's tensors (key -> hex), for the next incremental save.
    """
    name = records_name(generation, rank)
    data = encode_records(step, rank, index, aliases, refs, hashes)
    payload = {"step": step, "shard": shard, "refs": list(refs or []),
               "records": {"file": name, "bytes": len(data), "crc32c": crc(data)},
               "tree": meta["tree"] if send_tree else None, "stats": meta["stats"],
               "table": signature(meta["tensors"]) if send_table else None,
               "grid": grid_of(meta["tensors"].values(), rank, world)}
    return name, data, payload


def layout_manifest(*, step: int, generation: int, parts: list[dict[str, Any]],
                    owners: dict[str, int]) -> dict[str, Any]:
    """Rank 0's version 3 manifest from every rank's ``parts[r]`` (:func:`records_payload`'s
    payloads); ``owners``: the owner of each replicated key (:func:`nebula_ckpt.ranks.shards.assign`).
    ``shards`` lists every rank's shard, then the earlier shards the ranks refer to (once each).

    Raises:
        PersistError: the ranks' DTensor tables disagree (named key and ranks).
    """
    table = layout_tables(parts, step)
    tree0 = parts[0]["tree"]
    trees: list[Any] = [tree0 if p.get("tree") is None else p["tree"] for p in parts]
    shards = [p["shard"] for p in parts]
    refs: dict[tuple[int, str], dict[str, Any]] = {}
    for p in parts:  # each rank refers to its own base shard(s): O(ranks) entries, each listed once
        for ref in p.get("refs") or ():
            refs.setdefault((ref["step"], ref["file"]), ref)
    stats: dict[str, Any] = {"tensor_bytes": sum(int(p["stats"].get("tensor_bytes", 0)) for p in parts),
                             "ranks_bytes": [s["bytes"] for s in shards],
                             "copy_seconds": max(float(p["stats"].get("copy_seconds", 0.0)) for p in parts)}
    man = ranks_manifest(step=step, generation=generation, shards=shards + list(refs.values()), tensors={},
                         aliases={}, trees=trees,
                         stats=stats, same_trees=[p.get("tree") is None for p in parts])
    man.update(version=LAYOUT_VERSION, records=[p["records"] for p in parts], owners=owners, dtensors=table,
               grid=all(bool(p.get("grid")) for p in parts))
    return man
