"""A one-process write copied from a memory tier to a persistent tier under the generation that made it.

``close()`` and a save short of the host-memory budget (:func:`~nebula_ckpt.save.drain.flush_newest`),
and ``nebula-ckpt persist-memory``, put the memory tier's newest write of an earlier writer on a
persistent tier as that same write (:func:`copy_as_written`): its marker names the generation,
step and save that made it, so the marks on it still apply there. The persistent tier may hold
an older write of that step: the earlier writer saved the step again (it went back to an older
step) while the persistent tier's cadence skipped the second save. The copy then replaces that
write as a save of the step does (docs/format.md, "A step saved again"; the writer's
``_commit_step``): its files under names of its own (``-v<V>``) beside the committed ones, the
later steps that refer to the old write's bytes unlisted, ``COMMIT`` replaced in one atomic write,
then the old write's files removed (:mod:`nebula_ckpt.save.sweep`). A newer write of the step
there is never replaced. The persistent tier's copy of this very write is replaced the same way
when a restore cannot open it (a shard missing or cut short: a partial upload, a lost object;
:func:`~nebula_ckpt.restore.intact.restore_problem`): a marker alone never makes it "there already".
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from typing import Any, Callable, Optional

from nebula_ckpt.errors import NebulaError
from nebula_ckpt.format.commit import (
    Commit,
    CommitProgress,
    Write,
    WriterFence,
    commit_manifest,
    read_commit,
)
from nebula_ckpt.format.manifest import encode_manifest, whole_manifest
from nebula_ckpt.format.names import COMMIT, new_variant, shard_name, shard_owner, step_dir
from nebula_ckpt.ranks.fencing import Fence
from nebula_ckpt.restore.intact import restore_problem
from nebula_ckpt.restore.open import open_checkpoint
from nebula_ckpt.save import sweep
from nebula_ckpt.save.incremental import committed_whole
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.storage.local import fsync_dir

log = logging.getLogger(__name__)


def folder_problem(storage: Storage, write: Write, older_ok: bool = False) -> Optional[str]:
    """Why the step folder of ``write`` on ``storage`` cannot take it: another write committed
    there (``older_ok``: one newer than ``write``; an older one is replaced), or a newer
    generation's files (a live job writing that step); None when it can."""
    g, s, _ = write
    d = step_dir(s)
    names = storage.list(d)
    if COMMIT in names:
        try:
            have = read_commit(storage, s, f"{storage.display_url} step {s}").write
        except Exception as e:
            return f"step {s} holds an unreadable commit marker ({e})"
        if have != write and not (older_ok and have < write):
            why = (f"newer than generation {g}, save {write[2]}: a write is never replaced by an older one"
                   if older_ok else "a committed checkpoint is never replaced by persist-memory")
            return f"step {s} is committed there by another write (generation {have[0]}, save {have[2]}); {why}"
    newer = sorted({o[0] for o in map(shard_owner, names) if o is not None and o[0] > g})
    if newer:
        return f"writer generation {newer[-1]} is writing step {s} there (newer than generation {g})"
    return None


def write_whole(storage: Storage, rel: str, parts: list[memoryview]) -> dict[str, Any]:
    """Write ``parts`` back to back as ``rel``, which no reader ever sees partly written: on a file
    system under a temporary name renamed into place (atomic; a killed writer leaves the temporary
    file, named like the shard so sweeps know whose it is), on a blob store as one upload (an
    object appears whole). The storage info."""
    path = storage.local_path(rel)
    if path is None:
        return storage.write_parts(rel, parts)
    tmp = f"{rel}.drain-{uuid.uuid4().hex[:12]}"
    try:
        info = storage.write_parts(tmp, parts)
        tmp_path = storage.local_path(tmp)
        assert tmp_path is not None
        os.replace(tmp_path, path)
        fsync_dir(os.path.dirname(path))
    except BaseException:
        try:
            storage.remove(tmp)
        except OSError as e:
            log.debug("nebula_ckpt: persist-memory: %s", e)
        raise
    return info


def copy_as_written(storage: Storage, tier: str, write: Write, src: Storage) -> int:
    """The one-process step ``write`` from ``src`` (a memory tier's folder) to ``storage``, under its
    own generation, so it is the same write there (marks and all): verified first; shard, manifest,
    ``COMMIT`` last, replacing an older write of the step committed there, or a copy of this write
    that a restore cannot open (see the module). Its
    bytes. No writer of ``storage`` deletes meanwhile: ``close()`` and a save short of the budget
    copy once every tier writer is idle, and ``persist-memory`` runs once the job ended.

    Raises:
        NebulaError: the folder holds a newer write's marker or a newer generation's files.
    """
    g, s, w = write
    if (why := folder_problem(storage, write, older_ok=True)) is not None:
        raise NebulaError(why)
    at = f"{src.display_url} step {s}"
    open_checkpoint(src, s, "full", at)
    _, _, man, parts, tensors, nbytes = committed_whole(src, s, at)
    fence = Fence.past(storage, g).for_tier(storage)
    old = read_commit(storage, s, tier) if COMMIT in storage.list(step_dir(s)) else None
    damage = None if old is None or old.write != write else restore_problem(storage, s, f"{tier} step {s}")
    if old is not None and old.write == write and damage is None:
        return nbytes  # there already (another copy made it)
    if old is not None and old.write > write:  # committed since the check above
        raise NebulaError(folder_problem(storage, write, older_ok=True) or f"step {s} changed on {tier}")

    def manifest(shard: str, info: dict[str, Any]) -> bytes:
        return encode_manifest(whole_manifest(man.to_json(), shard={"file": shard, "bytes": nbytes, "storage": info},
                                              tensors=tensors, generation=g))
    try:
        if old is not None:
            _replace(storage, fence, tier, write, old, manifest, parts, damage)
        else:
            shard = shard_name(g, 0)
            info = write_whole(storage, f"{step_dir(s)}/{shard}", parts)
            commit_manifest(storage, fence, s, manifest(shard, info), CommitProgress(), tier, w)
    except FileExistsError:  # another marker appeared: raised unless it is this very write
        if read_commit(storage, s, tier).write != write:
            raise
    return nbytes


def _replace(storage: Storage, fence: WriterFence, tier: str, write: Write, old: Commit,
             manifest: Callable[[str, dict[str, Any]], bytes], parts: list[memoryview],
             damage: Optional[str] = None) -> None:
    """Commit ``write`` (its shard ``parts``; ``manifest(shard name, storage info)``: its manifest's
    bytes) in place of ``old``, the marker of an older write of its step or, ``damage`` saying why,
    of this very write where a restore cannot open it, as a save of the step does: nothing of the
    old write changes until the new marker is in, and a copy that certainly did not commit leaves
    the step as it was (its own files removed, the steps unlisted listed again).

    Raises:
        FileExistsError: another writer replaced the marker meanwhile (nothing of this write is listed).
    """
    g, s, w = write
    where = f"tier {tier}"
    variant = new_variant()
    shard = shard_name(g, 0, variant)
    progress = CommitProgress()
    if damage is not None:
        log.warning("nebula_ckpt: %s: step %d holds this write, but a restore cannot open it (%s); the memory "
                    "tier's copy replaces it", where, s, damage)
    else:
        log.info("nebula_ckpt: %s: step %d holds the write of generation %d, save %d; the copy of save %d replaces "
                 "it", where, s, old.generation, old.write[2], w)
    try:
        info = write_whole(storage, f"{step_dir(s)}/{shard}", parts)
        no_lock = contextlib.nullcontext()  # no writer of the tier deletes meanwhile (copy_as_written)
        with sweep.referrers_unlisted(storage, fence, s, True, progress, no_lock, where) as unlisted:
            commit_manifest(storage, fence, s, manifest(shard, info), progress, tier, w, old, variant)
    except BaseException:
        if not progress.may_commit:  # the committed step stays as it was
            sweep.discard_variant(storage, s, variant, where)
        raise
    sweep.replaced(storage, fence, s, where, unlisted)
