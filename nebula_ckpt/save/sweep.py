"""The sweep: the leftovers of saves that never committed, which files no live writer owns, and
their removal; shared by every writer of checkpoints (the tier writers, :mod:`nebula_ckpt.save.writer`,
and the DCP writer, :class:`nebula_ckpt.dcp.writer.NebulaStorageWriter`).

A file of an uncommitted step folder is *stale* (:meth:`Ownership.stale`) when no writer that may
still run owns it: a shard of an older generation, or of this very rank of this generation; a
manifest (or a temp file) when this rank is the one that commits on this storage. A same-generation
peer rank's shard is in flight, a newer generation's belongs to the writer that took over; neither
is ever removed. A committed step's files are never leftovers. Also: the steps ``remove()``
deferred while later steps referred to them, deleted once none does (:func:`drop_unreferenced`).

The commit itself, and the marker's whole life, is :mod:`nebula_ckpt.format.commit`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Container

from nebula_ckpt.format.commit import committed_steps, delete_checkpoint, referrers
from nebula_ckpt.format.names import COMMIT, shard_generation, shard_owner, step_dir
from nebula_ckpt.storage.base import Storage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ownership:
    """Who owns the files of uncommitted step folders, as one writer rank sees them.

    Args:
        generation: this writer's generation.
        rank: this writer's rank.
        commits_here: whether this rank writes the manifests on this storage (the coordinator
            on a shared tier; every rank on its own tier).
    """

    generation: int
    rank: int
    commits_here: bool

    def stale(self, name: str, ours_failed: bool = False) -> bool:
        """Whether file ``name`` of an uncommitted step belongs to no writer that may still run.

        ``ours_failed``: this generation's save of the step is known to have ended without a
        commit, so every rank's shard of this generation in it is stale too.
        """
        owner = shard_owner(name)
        if owner is None:  # the manifest (or a temp file) of whoever commits on this storage
            return self.commits_here
        if ours_failed and owner[0] == self.generation:
            return True
        return owner[0] < self.generation or owner == (self.generation, self.rank)


def leftover_steps(storage: Storage, steps: list[int], owner: Ownership, failed: Container[int] = ()) -> list[int]:
    """Those of the uncommitted ``steps`` whose every file is stale (``failed``: steps this
    generation's save of which ended without a commit)."""
    return [s for s in steps if all(owner.stale(n, s in failed) for n in storage.list(step_dir(s)))]


def abandoned_uploads(storage: Storage, generation: int) -> list[tuple[str, str]]:
    """Incomplete uploads (``(rel, upload id)``) of shards of ``generation`` or older: none of
    this writer's is in flight while it sweeps, and an older writer's never completes."""
    out = []
    for rel, upload_id in storage.incomplete_uploads():
        g = shard_generation(rel.rsplit("/", 1)[-1])
        if g is not None and g <= generation:
            out.append((rel, upload_id))
    return out


def remove_leftovers(storage: Storage, steps: list[int], uploads: list[tuple[str, str]], where: str) -> None:
    """Remove the leftover step folders ``steps`` and abort the abandoned ``uploads``
    (the caller checked its fence first)."""
    for s in steps:
        log.info("nebula_ckpt: %s: removing uncommitted leftovers of step %d", where, s)
        storage.remove_dir(step_dir(s))
    for rel, upload_id in uploads:
        log.info("nebula_ckpt: %s: aborting the abandoned upload of %s", where, rel)
        storage.abort_upload(rel, upload_id)


def discard_files(storage: Storage, step: int, doomed: Callable[[str], bool], where: str) -> None:
    """After a save of ``step`` that certainly did not commit: remove what it wrote (the files
    ``doomed`` names), then the folder if that left it empty. Nothing is removed from a folder
    holding a ``COMMIT`` (not this save's marker, but a checkpoint all the same). Each rank
    removes its own files and the last one removes the folder (``remove_empty_dir`` is atomic),
    so no empty folder is left behind. Best effort: a failure is logged."""
    d = step_dir(step)
    try:
        names = storage.list(d)
        if COMMIT in names:
            log.warning("nebula_ckpt: %s: %s holds a COMMIT; nothing of it is removed", where, d)
            return
        for n in names:
            if doomed(n):
                storage.remove(f"{d}/{n}")
        storage.remove_empty_dir(d)
    except Exception as e:
        log.warning("nebula_ckpt: %s: cannot remove the files of failed step folder %s: %s", where, d, e)


def drop_unreferenced(storage: Storage, deferred: set[int], may_go: Callable[[int], bool], tier: str) -> set[int]:
    """Delete the committed steps of ``deferred`` (``remove()`` asked for them while a later step
    referred to their bytes) that no committed step refers to any more and ``may_go`` lets go of
    (no save in flight builds on them); return the steps no longer deferred (deleted, or gone).
    Dropping one may free another (a base of the one dropped), so it repeats until none goes."""
    done: set[int] = set()
    while deferred - done:  # nothing deferred (the usual remove()): no listing, no manifest read
        committed = committed_steps(storage)
        done |= {s for s in deferred if s not in committed}
        free = [s for s in sorted(deferred - done) if not referrers(storage, committed, s) and may_go(s)]
        if not free:
            return done
        for s in free:
            log.info("nebula_ckpt: tier %s: removing step %d (remove() asked for it; nothing refers to it)", tier, s)
            delete_checkpoint(storage, s)
        done.update(free)
    return done
