"""The commit of a multi-rank save in format version 4: each rank's self-checking records file, rank 0's two files.

Pure functions over metadata (no I/O, no collectives), used by the commit rounds
(:mod:`nebula_ckpt.save.rounds`) and the scale simulation; the format is
:mod:`nebula_ckpt.format.rank_index`'s:

* :func:`signature` / :func:`first_of_class` — each rank hashes what its DTensor records must
  agree on (dtype, global shape, placements, mesh); a rank sends the whole table only when no
  lower rank sent the same hash, so rank 0 receives one table per distinct layout (one for FSDP
  or DDP, one per pipeline stage), never one per rank; :func:`layout_tables` joins them;
* :func:`new_save_id` — the id rank 0 draws for one attempt at committing a step and sends every
  rank in the first round (each rank's records file carries it);
* :func:`split_payload` — a rank's records file (its shard entry, its share's records, its tied
  keys, its tree's digest, the earlier shards it refers to, sealed with its own CRC32C) and the
  small record it sends rank 0 in the durable round: its shard, its records file's name, size and
  CRC32C, its tree (None when it equals rank 0's) and the tree's digest, its statistics, its table
  (see above), whether its chunks sit on the grid, the earlier steps' shards it refers to and its
  count of saves since the last full one;
* :func:`split_manifest` — the ranks' DTensor tables checked against each other, then rank 0's
  ``manifest.json`` and ``ranks.json``, built by :func:`nebula_ckpt.format.split.split_manifest`.
"""

from __future__ import annotations

import secrets
from typing import Any, Callable, Optional

from nebula_ckpt.errors import PersistError
from nebula_ckpt.format.multi_rank import digest
from nebula_ckpt.format.names import records_name
from nebula_ckpt.format.rank_index import encode_split_records
from nebula_ckpt.format.rank_records import grid_of, spec_of
from nebula_ckpt.format.split import split_manifest as build_split_manifest


def signature(tensors: dict[str, dict[str, Any]]) -> dict[str, list[Any]]:
    """Logical key -> the agreed part of each DTensor record of a rank's tensor index."""
    return {k: spec_of(rec) for k, rec in tensors.items() if rec.get("dtensor") is not None}


def first_of_class(rank: int, digests: list[str]) -> bool:
    """Whether ``rank`` is the lowest rank with its digest (it then sends its table)."""
    return digests[rank] not in set(digests[:rank])


def layout_tables(parts: list[dict[str, Any]], step: int) -> dict[str, dict[str, Any]]:
    """The union of the ranks' DTensor tables (the manifest's ``dtensors``); PersistError when two
    disagree on a key."""
    table: dict[str, tuple[int, list[Any]]] = {}
    for r, part in enumerate(parts):
        for k, spec in (part.get("table") or {}).items():
            have = table.setdefault(k, (r, spec))
            if have[1] != spec:
                raise PersistError(f"step {step}: key '{k}' is a DTensor {spec} (dtype, global shape, placements, "
                                   f"mesh) on rank {r} but {have[1]} on rank {have[0]}: every rank must save the same "
                                   "model with the same sharding")
    return {k: {"dtype": s[0], "shape": s[1], "placements": s[2], "mesh": s[3]} for k, (_, s) in table.items()}


def new_save_id() -> str:
    """A fresh random save id (32 hex digits)."""
    return secrets.token_hex(16)


def split_payload(*, step: int, generation: int, rank: int, world: int, save_id: str, shard: dict[str, Any],
                  index: dict[str, dict[str, Any]], aliases: dict[str, str], meta: dict[str, Any],
                  send_tree: bool, send_table: bool, crc: Callable[[bytes], int],
                  refs: Optional[list[dict[str, Any]]] = None, hashes: Optional[dict[str, str]] = None,
                  tree_digest: Optional[str] = None, replicas: Optional[dict[str, int]] = None,
                  since_full: Optional[int] = None) -> tuple[str, bytes, dict[str, Any]]:
    """``(records file name, its bytes, what the rank sends in the durable round)``.

    ``index``: the tensor records of the rank's share (offsets in its shard, or ``shard`` j >= 1:
    in ``refs[j - 1]``, a shard of an earlier step); ``meta``: the staged snapshot's ``tensors``
    (every record, for the table and the grid), ``tree`` and ``stats``; ``hashes``: the SHA-256 of
    the share's tensors; ``tree_digest``: :func:`~nebula_ckpt.format.multi_rank.digest` of the tree
    (computed when not given); ``replicas``: the rank's keys whose bytes another rank stored (key
    -> that rank); ``since_full``: the rank's count of the tier's saves since its chain's last
    full one, this one included (:meth:`~nebula_ckpt.save.incremental.Incremental.since_full`;
    None: saves are not incremental), which rank 0's manifest records.
    """
    name = records_name(generation, rank)
    tree = tree_digest or digest(meta["tree"])
    data = encode_split_records(step=step, generation=generation, rank=rank, world=world, save_id=save_id,
                                shard=shard, tree=tree, tensors=index, aliases=aliases, refs=refs, hashes=hashes,
                                crc=crc, replicas=replicas)
    payload = {"step": step, "shard": shard, "refs": list(refs or []),
               "records": {"file": name, "bytes": len(data), "crc32c": crc(data)}, "tree_digest": tree,
               "tree": meta["tree"] if send_tree else None, "stats": meta["stats"],
               "table": signature(meta["tensors"]) if send_table else None,
               "grid": grid_of(meta["tensors"].values(), rank, world), "since_full": since_full}
    return name, data, payload


def split_manifest(*, step: int, generation: int, save_id: str, parts: list[dict[str, Any]],
                   owners: dict[str, int], crc: Callable[[bytes], int]) -> tuple[dict[str, Any], bytes]:
    """Rank 0's version 4 ``(manifest, bytes of ranks.json)`` from every rank's ``parts[r]``
    (:func:`split_payload`'s payloads); ``owners``: the owner of each replicated key.

    Raises:
        PersistError: the ranks' DTensor tables disagree (named key and ranks).
    """
    return build_split_manifest(step=step, generation=generation, save_id=save_id, parts=parts, owners=owners,
                                dtensors=layout_tables(parts, step), crc=crc)
