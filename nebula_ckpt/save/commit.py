"""The commit protocol's last step, and the sweep of what uncommitted saves left; shared by every
writer of checkpoints.

Both the tier writers (:mod:`nebula_ckpt.save.writer`, ``Checkpointer.save``) and the DCP
writer (:class:`nebula_ckpt.dcp.writer.NebulaStorageWriter`) commit a step the same way, once
every rank's shard of it is durable and the ranks agreed (the coordinator's rounds on a shared
tier, :mod:`nebula_ckpt.save.rounds`; DCP's own collectives for the DCP writer)::

    step-N/manifest.json   (the committing rank's; tmp + fsync + rename, or a new object)
    -- fence check: no newer writer took over this storage --
    step-N/COMMIT          (create-only, last; names the manifest's size and CRC32C)

:func:`commit_manifest` is that step. From the moment the marker's write begins, the step *may*
be committed (:attr:`CommitProgress.may_commit`): a write that reports an error may still have
created it (a lost response on a blob store, a failed directory fsync). Then nothing of the step
may be deleted: the writer reports :class:`CommitUncertain` (or says the step may have
committed), and a later writer of a newer generation removes the files if it never did.

The marker is written inside :meth:`~nebula_ckpt.ranks.fencing.TierFence.committing`: once the
writer is fenced none is written. A save fenced after some tier committed its step takes that
step back (:func:`retract_step`, called by the fence through the tier writers): a step of a writer
that was told it was fenced must never be listed or loaded.

**The sweep** (the rest of this module, used by the same writers): the leftovers of saves that
never committed, which files no live writer owns, and their removal. A file of an uncommitted
step folder is *stale* (:meth:`Ownership.stale`) when no writer that may still run owns it: a
shard of an older generation, or of this very rank of this generation; a manifest (or a temp
file) when this rank is the one that commits on this storage. A same-generation peer rank's shard
is in flight, a newer generation's belongs to the writer that took over; neither is ever removed.
A committed step's files are never leftovers. Also: the steps ``remove()`` deferred while later
steps referred to them, deleted once none does (:func:`drop_unreferenced`).
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass
from typing import Callable, Container, Optional

from nebula_ckpt.errors import PersistError
from nebula_ckpt.format.commit import Commit, committed_steps, delete_checkpoint, read_commit, referrers, step_dirs
from nebula_ckpt.format.names import COMMIT, MANIFEST, RANKS_FILE, shard_generation, shard_owner, step_dir
from nebula_ckpt.native import get_ops
from nebula_ckpt.ranks.fencing import TierFence
from nebula_ckpt.storage.base import Storage, never_created

log = logging.getLogger(__name__)


class CommitUncertain(PersistError):
    """A save whose ``COMMIT`` may exist although this rank could not confirm it (the
    coordinator died or timed out after every shard was durable, or the marker's own write
    reported an error). Nothing of the step is deleted: if it committed, it is whole; if not,
    its files are uncommitted leftovers that a later sweep removes."""


class PeerSkipped(PersistError):
    """Another rank did not write this save on a shared tier (its cadence skipped it, or a newer
    save replaced it there): the save is dropped on that tier, not failed."""


@dataclass
class CommitProgress:
    """How far the commit of one step got (decides what its failure path may remove)."""

    #: the step's COMMIT may exist (or still appear): a failure deletes nothing of the step
    may_commit: bool = False


def commit_manifest(storage: Storage, fence: TierFence, step: int, mbytes: bytes,
                    progress: CommitProgress, tier: str, save: Optional[int] = None) -> None:
    """Write ``step``'s manifest (``mbytes``, atomic), check the fence, then create its ``COMMIT``.

    ``tier`` names the storage in the logs; ``save``: the number of the save that wrote the step
    in its generation (the marker records it: :attr:`~nebula_ckpt.format.commit.Commit.write`).
    ``progress.may_commit`` is set once the marker's write begins, and cleared again only when a
    failed write certainly created nothing (:func:`~nebula_ckpt.storage.base.never_created`).

    Raises:
        FencedError: a newer writer took over ``storage`` (nothing was committed).
        FileExistsError: the step already has a ``COMMIT`` (another writer's).
        OSError and others: the storage's errors, as they come.
    """
    d = step_dir(step)
    log.debug("nebula_ckpt: phase=manifest tier=%s step=%d", tier, step)
    storage.write_small(f"{d}/{MANIFEST}", mbytes)
    fence.check(f"commit step {step}")
    log.debug("nebula_ckpt: phase=commit tier=%s step=%d", tier, step)
    commit = Commit(step, fence.generation, len(mbytes), get_ops().crc32c_bytes(mbytes), save)
    with fence.committing(f"commit step {step}"):  # refused once fenced; stop() waits for it
        progress.may_commit = True
        try:
            storage.write_small(f"{d}/{COMMIT}", commit.to_bytes(), create_only=True)
        except BaseException:
            progress.may_commit = not never_created(storage, f"{d}/{COMMIT}")
            raise


def is_committed(storage: Storage, step: int, generation: int) -> bool:
    """Whether ``generation``'s ``COMMIT`` of ``step`` is on ``storage`` (read back; False when unsure)."""
    try:
        c = read_commit(storage, step, f"{storage.display_url}/{step_dir(step)}")
    except Exception as e:  # missing, unreadable: not known to be committed
        log.debug("nebula_ckpt: %s: no readable COMMIT of step %d: %s", storage.display_url, step, e)
        return False
    return c.step == step and c.generation == generation


def retract_step(storage: Storage, step: int, generation: int, tier: str) -> bool:
    """Take back ``generation``'s committed ``step`` (a save of it ended fenced): its marker
    first, then the files of that generation (and the manifest, unless a newer writer's files
    are in the folder), then the folder if that left it empty. True when it was taken back.

    Never another generation's step of the same number: the marker is taken back only if it
    names ``generation``; on a local file system it is first renamed away (atomic) and its
    generation read from the renamed file, so a newer writer's marker written meanwhile is put
    back, never removed. A step that a committed step still refers to (an incremental one) is
    kept, with a warning. Best effort: an error is logged, never raised.
    """
    d = step_dir(step)
    try:
        if not storage.exists(f"{d}/{COMMIT}") or \
                read_commit(storage, step, f"{tier} step {step}").generation != generation:
            return False
        users = referrers(storage, committed_steps(storage), step)
        if users:
            log.warning("nebula_ckpt: tier %s: step %d of a fenced save is kept: step(s) %s refer to its bytes",
                        tier, step, users[:8])
            return False
        if not _take_marker(storage, f"{d}/{COMMIT}", generation):
            return False
        names = storage.list(d)
        newer = any((o := shard_owner(n)) is not None and o[0] > generation for n in names)
        for n in names:
            o = shard_owner(n)
            if (o is not None and o[0] == generation) or (not newer and n in (MANIFEST, RANKS_FILE)):
                storage.remove(f"{d}/{n}")
        storage.remove_empty_dir(d)
    except Exception as e:
        log.warning("nebula_ckpt: tier %s: cannot take back step %d of a fenced save: %s", tier, step, e)
        return False
    log.warning("nebula_ckpt: tier %s: step %d taken back: its save was fenced by a newer writer", tier, step)
    return True


def _take_marker(storage: Storage, marker: str, generation: int) -> bool:
    """Remove the commit marker ``marker`` if it names ``generation`` (see :func:`retract_step`)."""
    path = storage.local_path(marker)
    if path is None:  # a blob store: read, then remove (the fence's check-then-act window)
        storage.remove(marker)
        return True
    taken = f"{path}.taken-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(path, taken)
    except FileNotFoundError:
        return False
    try:
        with open(taken, "rb") as f:
            mine = Commit.parse(f.read(), path).generation == generation
    except Exception:  # unreadable now: not known to be ours, so it goes back
        mine = False
    if not mine:  # a newer writer's marker, written since it was read: back in place
        try:
            os.link(taken, path)
        except FileExistsError:
            pass
    os.unlink(taken)
    return mine


# -- the sweep: leftovers of saves that never committed -------------------------------------------


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


def scan_steps(storage: Storage) -> tuple[list[int], list[int]]:
    """``(committed, uncommitted)``: the step folders on ``storage`` with and without a ``COMMIT``,
    ascending."""
    committed: list[int] = []
    uncommitted: list[int] = []
    for s in step_dirs(storage):
        (committed if storage.exists(f"{step_dir(s)}/{COMMIT}") else uncommitted).append(s)
    return committed, uncommitted


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


def clear_step(storage: Storage, step: int, stale: Callable[[str], bool]) -> None:
    """Before writing ``step``: remove the files of its folder that ``stale`` names (leftovers of
    crashed writers of the step, never a live peer's)."""
    d = step_dir(step)
    for name in storage.list(d):
        if stale(name):
            storage.remove(f"{d}/{name}")


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
