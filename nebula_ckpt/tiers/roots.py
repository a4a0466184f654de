"""The tiers of a checkpoint root: its persistent tier, and the defaults a Checkpointer uses.

``Checkpointer(root)`` writes a :class:`~nebula_ckpt.tiers.memory.tier.MemoryTier` (bound to the
root and rank) and the root itself: a :class:`~nebula_ckpt.tiers.local.LocalTier` for a path or
``file://`` URL, a :class:`~nebula_ckpt.tiers.remote.RemoteTier` for any other fsspec URL.
"""

from __future__ import annotations

from typing import Any, Optional

from nebula_ckpt.errors import ValidationError
from nebula_ckpt.storage.urls import local_path, refuse_url_credentials
from nebula_ckpt.tiers.base import Tier
from nebula_ckpt.tiers.local import LocalTier
from nebula_ckpt.tiers.memory.tier import MemoryTier
from nebula_ckpt.tiers.remote import RemoteTier


def tier_for_root(root: str, storage_options: Optional[dict[str, Any]] = None, **kw: Any) -> Tier:
    """The persistent tier of ``root``: local for a path / file:// URL, remote otherwise.

    Raises:
        ValidationError: ``root`` carries a password (:func:`refuse_url_credentials`).
    """
    refuse_url_credentials(root)
    p = local_path(root)
    if p is not None:
        if storage_options:
            raise ValidationError(f"root '{root}' is a local path; storage_options are only for "
                                  "remote URLs (az://, s3://, ...)")
        return LocalTier(p, **kw)
    return RemoteTier(root, storage_options=storage_options, **kw)


def default_tiers(root: str, storage_options: Optional[dict[str, Any]] = None,
                  memory: bool = True, rank: int = 0) -> list[Tier]:
    """``[MemoryTier bound to root and rank, <root tier>]`` (or just the root tier)."""
    root_tier = tier_for_root(root, storage_options)
    if not memory:
        return [root_tier]
    mem = MemoryTier()
    mem.bind(root, rank)
    return [mem, root_tier]
