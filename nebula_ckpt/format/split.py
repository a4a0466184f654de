"""The builder of a multi-rank manifest of format version 4: rank 0's ``manifest.json`` and ``ranks.json``.

Version 4 is what the ranks of a job commit on a shared tier (a save's commit rounds,
:mod:`nebula_ckpt.save.rounds`, and a drain of the memory tiers, :mod:`nebula_ckpt.save.drain`):
each rank writes its own sealed records file (:func:`nebula_ckpt.format.rank_index.encode_split_records`),
rank 0 the two files built here from what every rank sent it. The fields and what a reader checks
are :mod:`nebula_ckpt.format.rank_index`'s.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from nebula_ckpt.format.manifest import SINCE_FULL, build_manifest
from nebula_ckpt.format.names import RANKS_FILE, SPLIT_VERSION
from nebula_ckpt.format.rank_index import encode_ranks_index


def split_manifest(*, step: int, generation: int, save_id: str, parts: Sequence[Mapping[str, Any]],
                   owners: dict[str, int], dtensors: dict[str, dict[str, Any]],
                   crc: Callable[[bytes], int]) -> tuple[dict[str, Any], bytes]:
    """Rank 0's version 4 ``(manifest, bytes of ranks.json)``.

    ``parts[r]``: what rank ``r`` sent (its ``shard``, ``records`` entry, ``tree_digest``, ``tree``
    (None: rank 0's), ``refs``, ``stats``, ``grid`` and ``since_full``); ``owners``: the owner
    of each replicated key; ``dtensors``: the DTensor table the ranks agreed on. The manifest's
    ``stats`` record the largest of the ranks' ``since_full`` (the chain's saves since its last
    full one, an upper bound for every rank's share) where every rank sent one.
    """
    trees: list[Any] = []
    digests: list[str] = []
    for p in parts:  # the distinct trees, by digest (a rank sends its tree only when it is not rank 0's)
        if p["tree_digest"] not in digests:
            digests.append(p["tree_digest"])
            trees.append(parts[0]["tree"] if p.get("tree") is None else p["tree"])
    refs: dict[tuple[int, str], dict[str, Any]] = {}
    for p in parts:
        for ref in p.get("refs") or ():
            refs.setdefault((ref["step"], ref["file"]), ref)
    index = encode_ranks_index(step=step, generation=generation, save_id=save_id, ranks=[
        {"shard": p["shard"], "records": p["records"], "tree": p["tree_digest"]} for p in parts],
        refs=list(refs.values()))
    stats: dict[str, Any] = {"tensor_bytes": sum(int(p["stats"].get("tensor_bytes", 0)) for p in parts),
                             "copy_seconds": max(float(p["stats"].get("copy_seconds", 0.0)) for p in parts)}
    since = [n for n in (p.get("since_full") for p in parts) if type(n) is int and n >= 0]
    if len(since) == len(parts):  # every rank counted (a drained step's parts do not)
        stats[SINCE_FULL] = max(since)
    man = build_manifest(step=step, generation=generation, shards=[], tensors={}, aliases={},
                         tree={"t": "list", "v": trees}, stats=stats)
    man.update(version=SPLIT_VERSION, world_size=len(parts), save_id=save_id, tree_digests=digests, owners=owners,
               dtensors=dtensors, grid=all(bool(p.get("grid")) for p in parts),
               references=sorted({s for s, _ in refs}),
               ranks_file={"file": RANKS_FILE, "bytes": len(index), "crc32c": crc(index)})
    return man, index
