"""The commit protocol's last step, shared by every writer of checkpoints.

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
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass
from typing import Optional

from nebula_ckpt.errors import PersistError
from nebula_ckpt.format.commit import Commit, committed_steps, read_commit
from nebula_ckpt.format.names import COMMIT, MANIFEST, RANKS_FILE, shard_owner, step_dir
from nebula_ckpt.format.references import referrers
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
