"""The builder of a rank's own manifest in a multi-rank job (format version 2), and the digest of a tree.

Version 2 is what a rank's own tier writes (its memory tier, :func:`rank_manifest`): the fields
of :mod:`nebula_ckpt.format.manifest` plus ``world_size``, ``ranks`` (that one rank) and
``rank_tree``, keys prefixed ``r<R>/``. Every checkpoint of several ranks (a multi-rank job's save
to a shared tier, a drain of its memory tiers, a DCP save) is version 4
(:mod:`nebula_ckpt.format.rank_index`). The digest of a tree or a summary (:func:`digest`), which
version 4's records files and manifest name, is here too: the ranks compare it before they write.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

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
