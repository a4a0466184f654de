"""Tiers: where checkpoints are persisted, fastest first (memory, local disk, remote storage)."""

from nebula_ckpt.tiers.settings import LocalTier, MemoryTier, RemoteTier, Tier

__all__ = ["Tier", "MemoryTier", "LocalTier", "RemoteTier"]
