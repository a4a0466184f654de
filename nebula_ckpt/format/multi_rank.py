"""The builders of a multi-rank manifest of format version 2: several ranks' records in one manifest.

Version 2 is what a rank's own tier (its memory tier: one rank, :func:`rank_manifest`) and the
DCP writer (every rank, :func:`ranks_manifest`) write; its fields are :mod:`nebula_ckpt.format.manifest`'s
plus ``world_size``, ``ranks`` and ``rank_tree``, keys prefixed ``r<R>/``. The checkpoint of a
multi-rank job on a shared tier is version 4 (:mod:`nebula_ckpt.format.rank_index`). The digest of
a tree or a summary (:func:`digest`), which version 4's records files and manifest name, is here
too: the ranks compare it before they write.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Optional

from nebula_ckpt.format.manifest import build_manifest


def digest(value: Any) -> str:
    """A short, order-independent hash of a summary or tree (equal on ranks that hold the same)."""
    text = json.dumps(sorted(value.items()) if isinstance(value, dict) and "t" not in value else value,
                      separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _ranks_field(world: int, ranks: list[int], rank_tree: dict[int, int]) -> dict[str, Any]:
    return {"world_size": world, "ranks": ranks, "rank_tree": {str(r): i for r, i in rank_tree.items()}}


def rank_manifest(*, step: int, generation: int, rank: int, world: int, shard: dict[str, Any],
                  tensors: dict[str, dict[str, Any]], aliases: dict[str, str], tree: Any,
                  stats: dict[str, Any]) -> dict[str, Any]:
    """The manifest of one rank's own checkpoint (its memory tier): only its state, keys prefixed."""
    p = f"r{rank}/"
    return build_manifest(step=step, generation=generation, shards=[shard],
                          tensors={p + k: v for k, v in tensors.items()},
                          aliases={p + a: p + b for a, b in aliases.items()},
                          tree={"t": "list", "v": [tree]}, stats=stats,
                          ranks=_ranks_field(world, [rank], {rank: 0}))


def stored_record(record: dict[str, Any], rank: int) -> dict[str, Any]:
    """A tensor record of rank ``rank``'s shard as a multi-rank manifest stores it (``shard``: its
    shard's index, left out for rank 0's)."""
    return dict(record, shard=rank) if rank else record


def ranks_manifest(*, step: int, generation: int, shards: list[dict[str, Any]], tensors: dict[str, dict[str, Any]],
                   aliases: dict[str, str], trees: list[Any], stats: dict[str, Any],
                   same_trees: Optional[list[bool]] = None, hashes: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """The manifest of a checkpoint every rank wrote a shard of (the DCP writer's).

    ``trees[r]``: rank ``r``'s typed tree; equal trees are stored once (``rank_tree`` maps each
    rank to its tree). ``same_trees[r]``: rank ``r``'s tree is known to be rank 0's (compared by
    digest), so it is not serialised again. ``tensors`` and ``aliases`` carry the ``r<R>/`` key prefixes;
    ``hashes`` (``sha256``): key -> SHA-256 hex of the stored tensors whose hash the writer took.
    """
    stored: list[Any] = []
    seen: dict[str, int] = {}
    rank_tree: dict[int, int] = {}
    for r, tree in enumerate(trees):
        if r and same_trees is not None and same_trees[r]:
            rank_tree[r] = 0
            continue
        text = json.dumps(tree, sort_keys=True, separators=(",", ":"))
        rank_tree[r] = seen.setdefault(text, len(stored))
        if rank_tree[r] == len(stored):
            stored.append(tree)
    return build_manifest(step=step, generation=generation, shards=shards, tensors=tensors, aliases=aliases,
                          tree={"t": "list", "v": stored}, stats=stats,
                          ranks=_ranks_field(len(trees), list(range(len(trees))), rank_tree), hashes=hashes)
