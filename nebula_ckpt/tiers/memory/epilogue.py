"""Nothing left only in RAM: put the newest step the memory tiers hold on the persistent root.

A job that ends for good (its epilogue, or a node agent before the node is given back), or whose
nodes were lost and whose scheduler moves it to fresh nodes without a memory tier, may hold its
newest checkpoint only in the memory tiers (``/dev/shm``), which do not survive a reboot: the
persistent tiers are written less often. :func:`persist_memory` (``nebula-ckpt persist-memory
ROOT``) puts the newest step this host's memory tiers hold of the root's run on the root:

* it looks at every memory-tier folder of the root's run on this host (each rank's own steps,
  and the replicas it holds of other ranks' steps), each locked for the whole run: a folder a
  live process writes is never read (the job, or its restart, runs here: nothing is done);
* it writes the step **under the writer generation that made it** and takes none: it fences
  nobody, and it writes only a step newer, in the order a restore prefers (newest generation,
  then step, then the later write of a step saved twice), than every step on the root: a job
  that took the root over since (a newer generation that committed a step) supersedes the
  memory step, and nothing is written (:func:`~nebula_ckpt.save.drain.not_newer`);
* it deletes nothing: no retention of its own, the root's checkpoints all stay;
* every checksum is verified before a byte is written (a damaged copy is never written).

One process: the step is copied as is, under the root's commit protocol (shard, manifest,
``COMMIT`` last). A multi-rank job: each node's run writes the parts of the ranks it holds, and
the step is committed once every rank's part is on the root, by whichever node's run sees that
(:mod:`nebula_ckpt.save.drain`): run it on every node that holds a part (their runs may overlap).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable, Iterator, Optional

from nebula_ckpt.errors import NebulaError, ValidationError
from nebula_ckpt.format.commit import (
    CommitProgress,
    Write,
    commit_manifest,
    committed_writes,
    read_commit,
    read_committed_manifest,
    shard_path,
)
from nebula_ckpt.format.manifest import Manifest, encode_manifest, whole_manifest
from nebula_ckpt.format.names import shard_name, step_dir
from nebula_ckpt.ranks.fencing import Fence, read_run_id
from nebula_ckpt.restore.open import open_checkpoint, read_manifest
from nebula_ckpt.save.drain import Copy, Drain, folder_problem, not_newer, write_whole
from nebula_ckpt.save.incremental import whole_image
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.storage.local import LocalStorage
from nebula_ckpt.storage.urls import canonical_root
from nebula_ckpt.tiers.memory.replica_store import ReplicaStore, writes
from nebula_ckpt.tiers.memory.shm import scan, try_lock
from nebula_ckpt.tiers.roots import tier_for_root

log = logging.getLogger(__name__)

#: a progress callback: ``(rank, bytes)`` after each part written
OnPart = Optional[Callable[[int, int], None]]


def persist_memory(root: str, storage_options: Optional[dict[str, Any]] = None,
                   on_part: OnPart = None) -> dict[str, Any]:
    """Put the newest step this host's memory tiers hold of ``root``'s run on the root (see the
    module docstring).

    Args:
        root: the checkpoint root (a path or URL).
        storage_options: for a blob root.
        on_part: told ``(rank, bytes)`` after each rank's part this host writes.

    Returns:
        ``{"step", "generation", "copied", "why"}``: ``copied`` when the step is committed on the
        root now (by this run, or by another node's that completed it); ``why`` says what was
        done or why nothing was (nothing only in RAM here, the root holds it or something newer, a
        multi-rank step still waiting for other nodes' parts: ``"missing"`` lists those ranks).

    Raises:
        ValidationError: a memory tier of the root's run here is written by a live process.
        CorruptCheckpointError: a one-process step's copy fails its checksums (nothing written; a
            multi-rank part that does is left to another node's healthy copy, and named).
        FencedError: a newer generation committed a step on the root while this ran (nothing of
            this run is visible).
        NebulaError: the step's folder on the root holds another write's ``COMMIT`` (nothing is
            ever replaced) or a newer generation's files; the root's own errors (``OSError``).
    """
    root_tier = tier_for_root(root, storage_options)
    storage = root_tier.make_storage()
    try:
        rid = read_run_id(storage)
        if rid is None:
            return _result(None, False, f"{canonical_root(root)} was never written")
        with _copies(root, rid) as copies:
            if not copies:
                return _result(None, False, "no memory tier of this root's run on this host")
            return _persist(storage, root_tier.name, rid, copies, on_part)
    finally:
        storage.close()


def _result(write: Optional[Write], copied: bool, why: str, **extra: Any) -> dict[str, Any]:
    return {"step": None if write is None else write[1], "generation": None if write is None else write[0],
            "copied": copied, "why": why, **extra}


def _persist(storage: Storage, tier: str, run_id: str, copies: list[Copy], on_part: OnPart) -> dict[str, Any]:
    """The newest write worth writing (newest first), committed; or why nothing was."""
    groups: dict[tuple[Write, int], list[Copy]] = {}
    for c in copies:
        groups.setdefault((c.write, c.world), []).append(c)
    have = set(committed_writes(storage))
    targets = sorted((k for k in groups if not_newer(k[0], have, tier) is None), reverse=True)
    if not targets:
        newest = max(groups)[0]
        return _result(newest, False, not_newer(newest, have, tier) or "")
    waiting: dict[Write, tuple[list[int], dict[int, str]]] = {}
    for write, world in targets:
        if world == 1:
            _copy_one(storage, tier, write, groups[(write, world)][0], on_part)
            return _result(write, True, f"step {write[1]} was only in memory; it is committed on {tier}")
        drain = Drain(storage, tier, run_id, write, world, on_part)
        done, missing = drain.run(groups[(write, world)])
        if done:
            return _result(write, True, f"step {write[1]} ({world} ranks) was only in memory; it is committed on "
                                        f"{tier}")
        waiting[write] = missing, {r: why for r, why in drain.unusable.items() if r in missing}
    first = targets[0][0]
    missing, damaged = waiting[first]
    why = f"; this host's copies of rank(s) {sorted(damaged)[:16]} are unusable ({next(iter(damaged.values()))})" \
        if damaged else ""
    return _result(first, False, f"step {first[1]} is not committed yet: the part(s) of rank(s) {missing[:16]} are "
                                 f"not on {tier}{why}; this host's other parts are there, and the persist-memory of "
                                 "the node(s) holding healthy copies of those completes it", missing=missing)


def _copy_one(storage: Storage, tier: str, write: Write, copy: Copy, on_part: OnPart) -> None:
    """A one-process step from its memory tier to the root, under its own generation (verified
    first; shard, manifest, ``COMMIT`` last)."""
    g, s, w = write
    why = folder_problem(storage, write)
    if why is not None:
        raise NebulaError(f"persist-memory: {why}")
    src = LocalStorage(copy.folder, private=True, fsync=False)
    try:
        open_checkpoint(src, s, "full", f"{copy.folder} step {s}")
        raw = read_committed_manifest(src, s, f"{copy.folder} step {s}")[1]
        man = Manifest.parse(raw, f"{copy.folder} step {s}", s)
        data = [src.read_buffer(shard_path(man, i), dict(sh.storage or {})) for i, sh in enumerate(man.shards)]
        parts, tensors, nbytes = whole_image(man, data)
        shard = shard_name(g, 0)
        info = write_whole(storage, f"{step_dir(s)}/{shard}", parts)
    finally:
        src.close()
    out = whole_manifest(man.to_json(), shard={"file": shard, "bytes": nbytes, "storage": info}, tensors=tensors,
                         generation=g)
    try:
        commit_manifest(storage, Fence.past(storage, g).for_tier(storage), s, encode_manifest(out), CommitProgress(),
                        tier, w)
    except FileExistsError:
        if read_commit(storage, s, tier).write != write:
            raise
    log.info("nebula_ckpt: persist-memory: step %d copied from %s to %s", s, copy.folder, tier)
    if on_part is not None:
        on_part(0, nbytes)


@contextlib.contextmanager
def _copies(root: str, run_id: str) -> Iterator[list[Copy]]:
    """Every copy of a step that this host's memory tiers of ``root``'s run hold (own steps and
    replicas), each folder locked until the end (a live writer's folder: ValidationError)."""
    held: list[int] = []
    try:
        copies: list[Copy] = []
        for found in scan():
            owner = found.owner
            if found.problem or owner is None or owner.root != canonical_root(root) or owner.run_id != run_id:
                continue
            fd = try_lock(found.folder)
            if fd is None:
                raise ValidationError(f"{found.folder} (a memory tier of {canonical_root(root)}) is written by a live "
                                      "process (the job, or its restart on this host): run persist-memory after the "
                                      "job ended")
            held.append(fd)
            copies += _folder_copies(found.folder, True)
            store = ReplicaStore(found.folder)
            for r in sorted(store.held()):
                copies += _folder_copies(store.source_dir(r), False)
        yield copies
    finally:
        for fd in held:
            os.close(fd)


def _folder_copies(folder: str, own: bool) -> list[Copy]:
    """The committed steps of one memory-tier (or replica) folder, as copies (damaged manifests skipped)."""
    st = LocalStorage(folder, private=True, fsync=False)
    out = []
    try:
        for write in writes(folder):
            try:
                man = read_manifest(st, write[1], f"{folder} step {write[1]}")
            except Exception as e:  # a damaged copy is no part of anything
                log.warning("nebula_ckpt: persist-memory: %s step %d is not used: %s", folder, write[1], e)
                continue
            out += [Copy(write, r, man.world_size, folder, own) for r in man.ranks]
    finally:
        st.close()
    return out
