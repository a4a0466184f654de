"""Tier runtimes: what a tier *does* while a Checkpointer runs, beside its plain settings.

A :class:`~nebula_ckpt.tiers.base.Tier` is configuration (cadence, retention, where). Its runtime,
made by :func:`nebula_ckpt.tiers.factory.runtime_for`, owns everything special about it (the memory
tier's is :class:`~nebula_ckpt.tiers.memory.runtime.MemoryTierRuntime`), so the orchestration
(:mod:`nebula_ckpt.checkpointer`, :mod:`nebula_ckpt.save.writer`, :mod:`nebula_ckpt.save.snapshot`)
loops over runtimes without asking which kind a tier is.

Call order, all on the thread that owns the Checkpointer unless said otherwise:

1. ``open(owner)`` at construction: may refuse (``False``, logged): the tier is then unused.
2. ``open_for_writing()`` at the first save: may refuse; the tier is still read on restore.
3. ``staging_dir()``: a folder where CPU saves may stage as files this tier can link.
4. the tier's writer thread writes each checkpoint to :attr:`TierRuntime.storage` directly
   (:func:`nebula_ckpt.save.tier_image.write_image`): what differs by tier there is said by the
   storage the tier hands out (the memory tier's turns a full tmpfs into
   :func:`~nebula_ckpt.tiers.memory.runtime.no_room_error`) and by its capabilities
   (``links_staged``); ``write_whole_instead(rel, write, error)`` when an incremental step's
   own shard failed.
5. ``close(runtimes)`` after the last write; ``release()`` last, always.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from nebula_ckpt.format.owner import Owner
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.tiers.base import Capabilities, Tier


def _nothing_more(committed: list[int]) -> set[int]:
    """What retention keeps beyond ``keep_last`` by default: nothing."""
    return set()


def _nothing_more_in(storage: Storage, committed: list[int]) -> set[int]:
    return set()


def _marker_says(storage: Storage, step: int) -> bool:
    """Whether committed ``step`` on ``storage`` would restore, by default: its marker says so."""
    return True


class TierRuntime:
    """A plain tier (local disk, remote store): writes bytes, nothing else to own.

    Args:
        tier: the tier's settings.
        storage: its backend (owned: closed by :meth:`release`).
    """

    #: hands the shard file it wrote to slower tiers (so the staging buffer is freed early)
    feeds_slower = False

    def __init__(self, tier: Tier, storage: Storage) -> None:
        self.tier = tier
        self.storage = storage
        self.name = tier.name
        #: ``keep_also(committed steps)``: those of them retention keeps on this tier beside
        #: ``keep_last`` (the newest healthy one, :mod:`nebula_ckpt.health`); the tier's writer thread
        self.keep_also: Callable[[list[int]], set[int]] = _nothing_more
        #: ``keep_also_in(storage, committed)``: as :attr:`keep_also`, of copies of this tier's steps
        #: that ``storage`` holds (the memory tier's replicas of a partner rank's steps)
        self.keep_also_in: Callable[[Storage, list[int]], set[int]] = _nothing_more_in
        #: ``restorable(storage, step)``: whether committed ``step`` on another tier's ``storage``
        #: would restore (set by the save pipeline: a size check of its files,
        #: :func:`~nebula_ckpt.restore.intact.restore_problem`); the memory tier frees a step at
        #: ``close()`` only when a persistent copy of it would
        self.restorable: Callable[[Storage, int], bool] = _marker_says
        #: a save is short of the host-memory budget and nothing else can be freed
        #: (:func:`~nebula_ckpt.save.drain.make_room`): :meth:`affords` keeps nothing beyond the newest step
        self.tight = False

    @property
    def capabilities(self) -> Capabilities:
        """What the tier can do beyond bytes (its kind's :class:`~nebula_ckpt.tiers.base.Capabilities`)."""
        return self.tier.capabilities

    @property
    def persistent(self) -> bool:
        """Whether the tier survives a reboot."""
        return self.tier.persistent

    def open(self, owner: Owner) -> bool:
        """Prepare to be used by the run ``owner``; False (logged) when this tier cannot be."""
        return True

    def open_for_writing(self) -> bool:
        """Prepare to be written (first save); False (logged) when this process may not write."""
        return True

    def admits(self, nbytes: int, step: int) -> bool:
        """Whether a save of ``nbytes`` (step ``step``) may go to this tier now (the training thread
        asks before each save; the memory tier checks its tmpfs's room)."""
        return True

    def affords(self, steps: set[int], ranked: list[int]) -> set[int]:
        """Of ``steps`` (what retention would keep beside ``keep_last`` of ``ranked``, the tier's
        committed steps oldest first), those the tier has room to keep (the writer's thread; the
        memory tier checks its tmpfs's room for them beside its next save, and gives them up while
        :attr:`tight`)."""
        return steps

    def unreadable(self, owner: Owner) -> Optional[str]:
        """Why a read-only tool (the CLI) must not read this tier for ``owner``; None if it may.

        Nothing is created, claimed or written.
        """
        return None

    def staging_dir(self) -> Optional[str]:
        """Folder where CPU saves stage as files this tier links instead of copying; or None."""
        return None

    def write_whole_instead(self, rel: str, write: Callable[[], dict[str, Any]],
                            error: OSError) -> Optional[dict[str, Any]]:
        """An incremental step's own shard at ``rel`` failed with ``error``: where this tier can,
        write the whole step there instead (``write()``, which writes it and returns its storage
        info) and return that info; else None (``error`` stands)."""
        return None

    def whole_fallbacks(self) -> int:
        """Incremental steps this tier wrote whole instead (:meth:`write_whole_instead`)."""
        return 0

    def dropped_cow_bytes(self) -> int:
        """Bytes of this tier's files that retention deleted while copy-on-write views a restore of
        this process made still map them (their pages stay allocated until those tensors go)."""
        return 0

    def fenced(self, handed_over: bool = False) -> None:
        """This writer was fenced (a newer writer owns the root): give back what lets it write.
        ``handed_over``: a newer Checkpointer of this process took the root over in order
        (:meth:`~nebula_ckpt.ranks.fencing.Fence.take_over`). Any thread."""

    def close(self, runtimes: list["TierRuntime"]) -> None:
        """After the last write of this Checkpointer (``runtimes``: every tier it wrote)."""

    def release(self) -> None:
        """Give back what :meth:`open` took and close the storage (idempotent)."""
        self.storage.close()
