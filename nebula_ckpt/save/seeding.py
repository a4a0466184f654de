"""The base a restarted job's first save on each tier builds on (:meth:`Incremental.seed`).

A restarted job has no base of its own yet; without one its first save on every tier is full.
After a restore it may build on:

* a persistent tier's restored step (the restore read it and checked every tensor's CRC32C; its
  equality then rests on the SHA-256 the manifest records): in a one-process job the manifest
  itself, in a multi-rank job on a shared tier this rank's share of it (:func:`rank_base`, what
  :meth:`~nebula_ckpt.save.incremental.Incremental.committed_share` keeps after a save), only when
  the world size is the same (a resharding restore starts full);
* the memory tier's restored step, only while the tier still holds that very committed step
  (:func:`still_committed`: an adopted step is gone from the tier);
* when the restore came from another tier, or adopted the memory tier's step, the memory tier's
  own newest committed step no newer than the step restored (:func:`newest_local`; after an
  adoption, typically the base the adopted step referred to). The memory tier compares the staged bytes with
  its base's bytes, byte for byte, so its equality needs no trust in a hash nor in the restore:
  a base whose bytes differ from the new state only makes those tensors written.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Optional

from nebula_ckpt.format.commit import committed_steps, references
from nebula_ckpt.format.manifest import Manifest
from nebula_ckpt.restore.open import read_main_manifest
from nebula_ckpt.save.incremental import SINCE_FULL

if TYPE_CHECKING:
    from nebula_ckpt.storage.base import Storage

log = logging.getLogger(__name__)


def seed_tier(writer: Any, man: Manifest, here: bool, shared: bool) -> None:
    """Make ``writer``'s (a :class:`~nebula_ckpt.save.writer.TierWriter`) next save build on the
    restart base of ``man`` (:func:`restart_base`; ``shared``: a shared tier of a multi-rank job),
    on the thread that writes that save: reading the tier must never hold the training thread. A
    failure (the tier unreachable, the root full) is logged, and that save is written whole."""
    co = writer.coordinator
    try:
        base = restart_base(writer.storage, man, here, writer.incremental.compare, shared, co.rank,
                            co.world_size, writer.name)
        inc = writer.incremental
        if base is None or not inc.enabled or inc.current()[0] is not None:
            return  # nothing to build on, or the tier has its own base already: no manifest is read
        if inc.seed(dataclasses.replace(base, generation=writer.fence.generation),
                    saves_since_full(writer.storage, base, writer.name)):
            log.info("nebula_ckpt: tier %s: the next save builds on restored step %d", writer.name, base.step)
    except Exception as e:
        log.warning("nebula_ckpt: tier %s: the next save is written whole, not on restored step %d (%s: %s)",
                    writer.name, man.step, type(e).__name__, e)


def restart_base(storage: "Storage", man: Manifest, here: bool, compare: bool, shared: bool, rank: int,
                 world: int, tier: str) -> Optional[Manifest]:
    """The base of a tier's first save after the restore of ``man`` (read from this tier:
    ``here``), or None (that save is full): see the module. ``compare``: the tier compares bytes
    (the memory tier); ``shared``: a shared tier of a multi-rank job."""
    if compare:  # restored here and still held, else (adopted, or restored elsewhere) the tier's own newest
        return (still_committed(storage, man, rank, world) if here else None) \
            or newest_local(storage, man.step, rank, world, tier)
    if not here:
        return None  # a persistent tier the restore did not read is not built on
    if world == 1:
        return None if man.multi_rank else man  # a resharded multi-rank step holds no share of this process
    return rank_base(man, rank, world) if shared else None


def saves_since_full(storage: "Storage", base: Manifest, tier: str) -> Optional[int]:
    """The saves of ``base``'s chain since its last full one, ``base`` included (its manifest's
    :data:`~nebula_ckpt.save.incremental.SINCE_FULL`; a rank's share of a multi-rank step: rank
    0's manifest's, :func:`rank_base`), or an upper bound: where the manifest does not record it
    (an older step, a drained one), ``base.step - F``, F
    the chain's last full save, found by following the oldest step referred to until one refers
    to none (a step refers only to earlier steps of its own chain, none older than that chain's
    last full save, and the saves of a chain have increasing steps). None where that cannot be
    read: the next save is full."""
    got = base.stats.get(SINCE_FULL)
    if type(got) is int and got >= 0:
        return got
    step, refs = base.step, {s.step for s in base.shards if s.step is not None}
    while refs:
        if min(refs) >= step:
            return None  # no chain refers forward
        step = min(refs)
        try:
            refs = references(read_main_manifest(storage, step, f"tier {tier} step {step}"))
        except Exception as e:  # gone or damaged: not known
            log.debug("nebula_ckpt: tier %s: step %d does not open: %s", tier, step, e)
            return None
    return base.step - step


def rank_base(man: Manifest, rank: int, world: int) -> Optional[Manifest]:
    """Rank ``rank``'s share of the multi-rank checkpoint ``man`` (its records loaded for this
    rank, as a restore of the same world size opens it) as the base of its next save on a shared
    tier: its own stored tensors without the ``r<R>/`` prefix (the replicated tensors other ranks
    stored are not its), shard 0 its own shard of that step and its references after it, and
    their SHA-256, and the step's count of saves since its chain's last full one (the manifest's
    :data:`~nebula_ckpt.save.incremental.SINCE_FULL`). None when ``man`` is of another layout
    (the save is full)."""
    if not man.multi_rank or man.world_size != world or rank not in man.ranks or rank >= len(man.shards):
        return None
    p = man.prefix(rank)
    mine = {k[len(p):]: rec for k, rec in man.tensors.items() if k.startswith(p)}
    if not mine:
        return None
    order = [rank] + sorted({rec.shard for rec in mine.values()} - {rank})
    at = {g: i for i, g in enumerate(order)}
    tensors = {k: dataclasses.replace(rec, key=k, shard=at[rec.shard]) for k, rec in mine.items()}
    hashes = {k[len(p):]: h for k, h in man.hashes.items() if k.startswith(p)}
    # the chain's count of saves since its last full one (rank 0's manifest): every rank's cadence goes on from it
    since = {k: v for k, v in man.stats.items() if k == SINCE_FULL}
    return Manifest(step=man.step, generation=man.generation, shards=tuple(man.shards[g] for g in order),
                    tensors=tensors, aliases={}, tree={}, hashes=hashes, stats=since)


def _own_layout(man: Manifest, rank: int, world: int) -> bool:
    """Whether ``man`` is a step of this process's own memory tier (its rank alone, same world)."""
    if world == 1:
        return not man.multi_rank
    return man.world_size == world and tuple(man.ranks) == (rank,)


def still_committed(storage: "Storage", man: Manifest, rank: int, world: int) -> Optional[Manifest]:
    """``man`` when ``storage`` still holds it as a committed step: its commit marker and
    manifest read again (the marker checks the manifest's size and CRC32C) name the same writer
    generation and the same shard files; None otherwise (adopted, removed or replaced since)."""
    if not _own_layout(man, rank, world):
        return None
    try:
        now = read_main_manifest(storage, man.step, f"{storage.display_url} step {man.step}")
    except Exception as e:  # gone (adopted, removed) or damaged: the first save is full
        log.debug("nebula_ckpt: step %d is no longer on %s: %s", man.step, storage.display_url, e)
        return None
    return man if now.generation == man.generation and now.shards == man.shards else None


def newest_local(storage: "Storage", step: int, rank: int, world: int, tier: str) -> Optional[Manifest]:
    """The manifest of the newest committed step of ``storage`` (a memory tier) no newer than
    ``step`` that opens, or None."""
    try:
        steps = [s for s in committed_steps(storage) if s <= step]
    except Exception as e:
        log.debug("nebula_ckpt: tier %s: cannot list its steps: %s", tier, e)
        return None
    for s in reversed(steps):
        try:
            man = read_main_manifest(storage, s, f"tier {tier} step {s}")
        except Exception as e:
            log.debug("nebula_ckpt: tier %s: step %d does not open: %s", tier, s, e)
            continue
        return man if _own_layout(man, rank, world) else None
    return None
