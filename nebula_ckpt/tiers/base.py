"""The settings every tier shares: cadence, retention, restore check, where it lives, what it can do.

A tier is plain configuration. What a kind of tier can do beyond writing bytes is its
:class:`Capabilities`, declared by the kind (:attr:`Tier.capabilities`); the generic code (save,
restore) asks the one capability it needs, never which kind a tier is. What it *does* while a
Checkpointer runs is its runtime
(:mod:`nebula_ckpt.tiers.runtime`), made from the settings by :func:`nebula_ckpt.tiers.factory.runtime_for`;
the settings never know their runtime (the memory tier's settings take only the storage they hand
out from its runtime's module, which in turn names them by their shape and does not import them).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional

from nebula_ckpt.errors import ValidationError
from nebula_ckpt.storage.base import Storage


@dataclass(frozen=True)
class Capabilities:
    """What a kind of tier can do beyond writing, reading and deleting bytes; the generic code asks
    these, never the tier's kind or class (a plain tier declares none of them).

    Args:
        per_rank: each rank of a job writes a folder of its own (its keys ``r<R>/`` in a multi-rank
            job, its own commits, no rank rounds) rather than one folder every rank sees.
        keeps_base_in_ram: its base (the last step it committed) stays in host memory in files on a
            local file system, so an incremental save compares the staged bytes with it byte for
            byte instead of hashing them (:class:`nebula_ckpt.save.tier_image.BaseBytes`), and that
            compare spares the other tiers' hashes (:func:`nebula_ckpt.save.tier_image.staged_hashes`).
        hands_pages_to_restart: a restarted process may take the pages of its files instead of
            copying them (:mod:`nebula_ckpt.tiers.memory.adopt`).
        replicas: copies of each rank's steps kept on partner nodes (0: none;
            :mod:`nebula_ckpt.tiers.memory.replicas`).
        links_staged: a whole shard staged in a file (a CPU save in the tier's ``staging_dir()``)
            is written as a hard link of that file, no bytes copied
            (:func:`nebula_ckpt.save.tier_image.write_whole_shard`).
    """

    per_rank: bool = False
    keeps_base_in_ram: bool = False
    hands_pages_to_restart: bool = False
    replicas: int = 0
    links_staged: bool = False

    @property
    def has_replicas(self) -> bool:
        """Whether copies of this tier's steps are kept on partner nodes."""
        return self.replicas > 0


#: what a plain tier (local disk, remote store) can do beyond bytes: nothing
PLAIN = Capabilities()


@dataclass
class Tier:
    """Common settings of a tier.

    Args:
        every: persist every N-th save of the checkpointer (1 = every save).
        every_seconds: persist at most once per this many seconds (``None`` = no time limit).
        keep_last: committed checkpoints to keep on this tier (``None``: the checkpointer's).
        keep_every: also keep forever every step divisible by this (milestones).
        verify: restore check: ``"full"`` (sizes + every checksum), ``"size"`` (sizes only).
    """

    every: int = 1
    every_seconds: Optional[float] = None
    keep_last: Optional[int] = None
    keep_every: Optional[int] = None
    verify: str = "full"
    kind: str = field(default="local", init=False)

    def bind(self, root_url: str, rank: int = 0) -> None:
        """Resolve settings that depend on the Checkpointer's root and rank (called by it)."""

    def validate(self) -> None:
        """Raise :class:`ValidationError` on bad settings."""
        if not isinstance(self.every, int) or self.every < 1:
            raise ValidationError(f"tier {self.name}: every must be an int >= 1, got {self.every!r}")
        if self.every_seconds is not None and self.every_seconds < 0:
            raise ValidationError(f"tier {self.name}: every_seconds must be >= 0")
        if self.keep_last is not None and (not isinstance(self.keep_last, int) or self.keep_last < 1):
            raise ValidationError(f"tier {self.name}: keep_last must be an int >= 1 (the newest "
                                  f"checkpoint is never deleted), got {self.keep_last!r}")
        if self.keep_every is not None and (not isinstance(self.keep_every, int) or self.keep_every < 1):
            raise ValidationError(f"tier {self.name}: keep_every must be an int >= 1")
        if self.verify not in ("full", "size"):
            raise ValidationError(f"tier {self.name}: verify must be 'full' or 'size'")

    @property
    def persistent(self) -> bool:
        """Whether the tier survives a reboot (``close()`` leaves the newest step on every such tier)."""
        return True

    @property
    def capabilities(self) -> Capabilities:
        """What this kind of tier can do beyond bytes (:class:`Capabilities`); a plain tier: nothing."""
        return PLAIN

    @property
    def shared(self) -> bool:
        """Whether every rank of a job sees this tier (one manifest for all ranks, committed by the
        coordinator) rather than each rank its own (``capabilities.per_rank``, e.g. the memory tier)."""
        return not self.capabilities.per_rank

    @property
    def name(self) -> str:
        """Short name for logs: ``memory``, ``local:/path``, ``remote:s3://b/p``."""
        return f"{self.kind}:{self.display_url}"

    @property
    def display_url(self) -> str:
        """Location without credentials."""
        raise NotImplementedError

    def make_storage(self) -> Storage:
        """Create the storage backend of this tier."""
        raise NotImplementedError


def now() -> float:
    """Clock for cadences."""
    return time.monotonic()


class Cadence:
    """Which saves a tier takes: every ``every``-th save, at most once per ``every_seconds``.

    The training thread asks (:meth:`wants`) and records a save that really goes ahead (:meth:`took`:
    it got a staging buffer).

    Args:
        tier: the tier's settings.
        shared_by_ranks: the ranks of a job commit the tier's checkpoints together (a shared tier of
            several ranks): ``every_seconds`` then counts windows of the wall clock, alike on every
            rank. Each rank's own time since its last save let one late save put the ranks a save
            apart for good, every later save of the tier dropped.
    """

    def __init__(self, tier: Tier, shared_by_ranks: bool) -> None:
        self.every = tier.every
        self.every_seconds = tier.every_seconds
        self._windows = bool(self.every_seconds) and shared_by_ranks
        self._last: Optional[float] = None

    def wants(self, save_index: int, now: float) -> bool:
        """Whether the tier takes the ``save_index``-th save (0-based) at ``now`` (:func:`now`); no state change."""
        if save_index % self.every:
            return False
        if self.every_seconds is None or self._last is None:
            return True
        if self._windows:  # another window, also one before the last (the wall clock stepped back)
            return self._clock(now) != self._last
        return self._clock(now) - self._last >= self.every_seconds

    def took(self, now: float) -> None:
        """A save went ahead on the tier at ``now``: its ``every_seconds`` window starts."""
        self._last = self._clock(now)

    def _clock(self, now: float) -> float:
        """``now``, or the number of the wall clock's ``every_seconds`` window."""
        return float(math.floor(time.time() / (self.every_seconds or 1))) if self._windows else now
