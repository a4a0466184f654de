"""Tiers: where checkpoints are persisted, fastest first (memory, local disk, remote storage).

A :class:`Checkpointer` writes every accepted snapshot to each tier whose cadence wants it, each
tier on its own writer thread, all from the same host snapshot. Restore looks at every tier.

Defaults (``Checkpointer(root)``): a :class:`MemoryTier` in ``/dev/shm`` (survives a process
crash, not a reboot) and the ``root`` itself (a :class:`LocalTier` for a path, a
:class:`RemoteTier` for any other fsspec URL: :func:`tier_for_root`).

The package: :mod:`.base` (the settings every tier shares), :mod:`.local`, :mod:`.remote`,
:mod:`.memory` (everything of the memory tier: ``tier``: settings; ``shm``: its tmpfs folder;
``runtime``; ``gc``; its byte compare, page adoption, persist-memory and replicas),
:mod:`.roots` (a root's tiers), :mod:`.runtime` (what a tier does while a Checkpointer runs)
and :mod:`.factory` (settings -> runtime).
"""

from nebula_ckpt.storage.urls import canonical_root, refuse_url_credentials, strip_credentials
from nebula_ckpt.tiers.base import Tier
from nebula_ckpt.tiers.local import LocalTier
from nebula_ckpt.tiers.memory.tier import MemoryTier
from nebula_ckpt.tiers.remote import RemoteTier
from nebula_ckpt.tiers.roots import tier_for_root

__all__ = [
    "Tier", "MemoryTier", "LocalTier", "RemoteTier", "tier_for_root", "canonical_root",
    "refuse_url_credentials", "strip_credentials",
]
