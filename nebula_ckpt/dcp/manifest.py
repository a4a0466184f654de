"""The files a DCP save commits, built by the coordinator from every rank's write results.

Each rank reports one :class:`~nebula_ckpt.dcp.plans.Written` per item it wrote; the coordinator
checks every rank's shard is on the root with the size it wrote, that every item of DCP's global
metadata was written by some rank, rebuilds each rank's typed tree from the paths of what it held,
and builds what the tier writers commit: a one-process manifest (format version 1), or for N ranks
format version 4, every rank's sealed records file, ``ranks.json`` and rank 0's manifest
(:mod:`nebula_ckpt.ranks.split`, the builders of the shared tier's commit). An item DCP stored
once for several ranks (its dedup) is, on each other rank holding it, a *replica*: its records
file names the rank that stored it (``replicas``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.storage import WriteResult

from nebula_ckpt.dcp.plans import Held, Written
from nebula_ckpt.dcp.tree import Box, Leaf, insert, optimizer_keys, to_node
from nebula_ckpt.dcp.values import decoded
from nebula_ckpt.errors import PersistError
from nebula_ckpt.format import manifest as mf
from nebula_ckpt.format.header import safetensors_header
from nebula_ckpt.format.names import RANKS_FILE, shard_name, step_dir
from nebula_ckpt.format.tree import Node
from nebula_ckpt.ranks.split import new_save_id, split_manifest, split_payload
from nebula_ckpt.storage.base import Storage

#: (fqn, chunk offsets) -> (rank, stored key) of every stored tensor piece
Pieces = dict[Held, tuple[int, str]]


@dataclasses.dataclass
class RankPlans:
    """What the coordinator recorded of every rank's local plan (index: the rank)."""

    held: list[tuple[Held, ...]] = dataclasses.field(default_factory=list)
    keys: list[dict[str, str]] = dataclasses.field(default_factory=list)
    paths: list[dict[str, tuple[Any, ...]]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class DcpSave:
    """One DCP save as the coordinator finishes it."""

    storage: Storage
    where: str               # the root and step, for messages
    step: int
    generation: int
    plans: RankPlans


@dataclasses.dataclass
class DcpCommit:
    """What the coordinator commits: ``files`` (the ranks' records files, then ``ranks.json``;
    none for one process), written before ``manifest``, whose ``COMMIT`` comes last."""

    manifest: dict[str, Any]
    files: list[tuple[str, bytes]]


@dataclasses.dataclass
class _Ranks:
    """Every rank's stored tensor records, tied keys and replicas (key -> the rank that stored it)."""

    stored: list[dict[str, dict[str, Any]]]
    tied: list[dict[str, str]]
    replicas: list[dict[str, int]]


def dcp_manifest(save: DcpSave, metadata: Metadata, results: list[list[WriteResult]],
                 crc: Callable[[bytes], int]) -> DcpCommit:
    """The files of ``save`` (raises :class:`PersistError` naming what is missing)."""
    written, save_id = _written(save, results)
    world = len(results)
    shards = _shards(save, written)
    pieces: Pieces = {}
    values: dict[str, Leaf] = {}
    ranks = _Ranks([{} for _ in written], [{} for _ in written], [{} for _ in written])
    for r, mine in enumerate(written):
        for w in mine:
            if w.node is not None:
                values[w.fqn] = (w.node, decoded(w.node))
                continue
            if w.alias_of is not None:
                ranks.tied[r][w.key] = w.alias_of
            else:
                assert w.record is not None
                ranks.stored[r][w.key] = dict(w.record)
            pieces[(w.fqn, w.offsets)] = (r, w.alias_of or w.key)
    _check_coverage(save.where, metadata, pieces, values)
    trees = [_tree(save, r, pieces, values, ranks) for r in range(world)]
    stats: dict[str, Any] = {"writer": "torch.distributed.checkpoint", "dcp_save_id": save_id or ""}
    stored_bytes = [sum(int(x["offsets"][1]) - int(x["offsets"][0]) for x in own.values()) for own in ranks.stored]
    if world == 1:
        return DcpCommit(mf.build_manifest(step=save.step, generation=save.generation, shards=shards,
                                           tensors=ranks.stored[0], aliases=ranks.tied[0], tree=trees[0],
                                           stats=dict(stats, tensor_bytes=stored_bytes[0])), [])
    save_id = save_id or new_save_id()  # no rank wrote an item (an empty state): the commit's own id
    files: list[tuple[str, bytes]] = []
    parts: list[dict[str, Any]] = []
    for r in range(world):
        own = ranks.stored[r]
        meta = {"tensors": own, "tree": trees[r], "stats": {"tensor_bytes": stored_bytes[r], "copy_seconds": 0.0}}
        name, data, part = split_payload(step=save.step, generation=save.generation, rank=r, world=world,
                                         save_id=save_id, shard=shards[r], index=own, aliases=ranks.tied[r],
                                         meta=meta, send_tree=True, send_table=True, crc=crc,
                                         replicas=ranks.replicas[r])
        files.append((name, data))
        parts.append(part)
    try:
        man, index = split_manifest(step=save.step, generation=save.generation, save_id=save_id, parts=parts,
                                    owners={}, crc=crc)
    except PersistError as e:
        raise PersistError(f"{save.where}: {e}") from None
    man["stats"].update(stats, ranks_bytes=[s["bytes"] for s in shards])
    return DcpCommit(man, files + [(RANKS_FILE, index)])


def _written(save: DcpSave, results: list[list[WriteResult]]) -> tuple[list[list[Written]], Optional[str]]:
    """Every rank's records (all of one save), and that save's id."""
    written: list[list[Written]] = []
    save_id: Optional[str] = None
    for r, wrs in enumerate(results):
        mine = []
        for wr in wrs:
            w = wr.storage_data
            if not isinstance(w, Written) or w.rank != r or (save_id is not None and w.save_id != save_id):
                raise PersistError(f"{save.where}: rank {r} reported a write of another save (cached plans are "
                                   "not supported)")
            save_id = w.save_id
            mine.append(w)
        written.append(mine)
    return written, save_id


def _shards(save: DcpSave, written: list[list[Written]]) -> list[dict[str, Any]]:
    """Every rank's shard record, each checked on the root (there, with the size written)."""
    gen, st = save.generation, save.storage
    empty = len(safetensors_header([])[0])
    shards: list[dict[str, Any]] = []
    for r, mine in enumerate(written):
        sh: dict[str, Any] = mine[0].shard if mine else {"file": shard_name(gen, r), "bytes": empty,
                                                         "storage": {"stored_bytes": empty}}
        if sh.get("file") != shard_name(gen, r) or "bytes" not in sh:
            raise PersistError(f"{save.where}: rank {r} wrote {sh.get('file')!r}, expected "
                               f"{shard_name(gen, r)} (another save's plan?)")
        try:
            size = st.size(f"{step_dir(save.step)}/{sh['file']}")
        except FileNotFoundError:
            raise PersistError(f"{save.where}: rank {r}'s shard {sh['file']} is not under {st.display_url}: every "
                               "rank must write to the same root (a path every node mounts, or a URL)") from None
        info = sh.get("storage")
        stored = int(info.get("stored_bytes", sh["bytes"])) if isinstance(info, dict) else int(sh["bytes"])
        if size != stored:
            raise PersistError(f"{save.where}: rank {r}'s shard {sh['file']} has {size} bytes, {stored} written")
        shards.append({"file": sh["file"], "bytes": sh["bytes"], "storage": sh.get("storage")})
    return shards


def _tree(save: DcpSave, r: int, pieces: Pieces, values: dict[str, Leaf], ranks: _Ranks) -> Node:
    """Rank ``r``'s typed tree from the paths of what it held; a held piece another rank stored
    (DCP's dedup) becomes a replica of that rank's copy (added to ``ranks.replicas[r]``)."""
    root = Box("dict")
    paths = save.plans.paths[r]
    for fqn, offsets in save.plans.held[r]:
        key = save.plans.keys[r][fqn]
        if offsets is None:
            if fqn not in values:
                raise PersistError(f"{save.where}: no rank wrote the value of '{fqn}'")
            leaf: Leaf = values[fqn]
        else:
            owner = pieces.get((fqn, offsets))
            if owner is None:
                raise PersistError(f"{save.where}: no rank wrote '{fqn}' at offsets {list(offsets)}")
            q = owner[0]
            if q != r and key not in ranks.stored[r]:
                theirs = save.plans.keys[q].get(fqn)
                if theirs != key:
                    raise PersistError(f"{save.where}: rank {r} holds '{fqn}' as key '{key}', but rank {q} "
                                       f"stored it as '{theirs}': every rank must flatten the state dict alike")
                ranks.replicas[r][key] = q  # rank q's key (stored, or tied to one it stored)
            leaf = ({"t": "tensor", "k": key}, None)
        insert(root, paths.get(fqn, (fqn,)), leaf, fqn)
    optimizer_keys(root)
    return to_node(root)


def _check_coverage(where: str, metadata: Metadata, pieces: Pieces, values: dict[str, Any]) -> None:
    """Every item of DCP's global metadata was written by some rank."""
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            if fqn not in values:
                raise PersistError(f"{where}: no rank wrote the value of '{fqn}'")
        elif isinstance(md, TensorStorageMetadata):
            for c in md.chunks:
                if (fqn, tuple(int(o) for o in c.offsets)) not in pieces:
                    raise PersistError(f"{where}: no rank wrote '{fqn}' at offsets {list(c.offsets)}")
