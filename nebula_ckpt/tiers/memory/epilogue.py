"""Nothing left only in RAM: put the newest step the memory tiers hold on the persistent root.

A job that ends for good (its epilogue, or a node agent before the node is given back), or whose
nodes were lost and whose scheduler moves it to fresh nodes without a memory tier, may hold its
newest checkpoint only in the memory tiers (``/dev/shm``), which do not survive a reboot: the
persistent tiers are written less often. :func:`persist_memory` (``nebula-ckpt persist-memory
ROOT``) puts the newest step this host's memory tiers hold of the root's run on the root:

* it looks at every memory-tier folder of the root's run on this host (each rank's own steps,
  and the replicas it holds of other ranks' steps), each locked for the whole run: a folder a
  live process writes is never read (the job, or its restart, runs here: nothing is done); a
  run that overlaps another one on this host waits for it to end, then finds the step there;
* it writes the step **under the writer generation that made it** and takes none: it fences
  nobody, and it writes only a step newer, in the order a restore prefers (newest generation,
  then step, then the later write of a step saved twice), than every step on the root: a job
  that took the root over since (a newer generation that committed a step) supersedes the
  memory step, and nothing is written (:func:`~nebula_ckpt.save.drain.not_newer`);
* a step the root holds as the same write counts as there only when a restore can open it (its
  shards, and those it refers to, at their recorded sizes:
  :func:`~nebula_ckpt.restore.intact.restore_problem`): a one-process step's memory copy
  replaces a damaged one as a save of the step replaces a write
  (:func:`~nebula_ckpt.save.resave.copy_as_written`); a multi-rank step's parts cannot replace a
  committed step: it says so (NebulaError) and leaves the memory copies, which ``gc`` keeps too;
* the step a restart restores comes first: when the root's health records mark the newest
  step suspect, a restore skips it and takes the newest one not marked suspect, which may be
  only in memory although newer (suspect) steps are on the root: it is written all the same
  (the newest step then follows, as above);
* it deletes nothing but what a replaced write leaves (its files, and the steps that refer to its
  bytes): no retention of its own, the root's other checkpoints all stay;
* every checksum is verified before a byte is written (a damaged copy is never written).

One process: the step is copied as is, under the root's commit protocol (shard, manifest,
``COMMIT`` last). A multi-rank job: each node's run writes the parts of the ranks it holds, and
the step is committed once every rank's part is on the root, by whichever node's run sees that
(:mod:`nebula_ckpt.save.drain`): run it on every node that holds a part (their runs may overlap).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from typing import Any, Callable, Iterator, Optional

from nebula_ckpt.errors import NebulaError, ValidationError
from nebula_ckpt.format.commit import (
    Write,
    committed_writes,
)
from nebula_ckpt.format.health import SUSPECT
from nebula_ckpt.health.book import HealthView
from nebula_ckpt.ranks.fencing import read_run_id
from nebula_ckpt.restore.intact import restore_problem
from nebula_ckpt.restore.open import read_manifest
from nebula_ckpt.save.drain import Copy, Drain, copy_as_written, not_newer
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
        NebulaError: the step's folder on the root holds another write's ``COMMIT`` (only an older
            write of a one-process step, or its own damaged copy, is replaced) or a newer
            generation's files; the root holds a multi-rank step damaged (nothing written); the
            root's own errors (``OSError``).
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


Groups = dict[tuple[Write, int], list[Copy]]


def _persist(storage: Storage, tier: str, run_id: str, copies: list[Copy], on_part: OnPart) -> dict[str, Any]:
    """The step a restart restores, when only memory holds it, then the newest write worth writing,
    committed; or why nothing was."""
    groups: Groups = {}
    for c in copies:
        groups.setdefault((c.write, c.world), []).append(c)
    held = {w for w, _ in groups}
    have, broken = _whole_on_root(storage, held)
    pick = _restored_write(held | have | broken.keys(), HealthView(storage))
    # without suspect marks that is the newest write, newer than the root's or on it: as below
    if pick is None or pick not in held or pick in have or (pick == max(held) and not_newer(pick, have, tier) is None):
        return _persist_newest(storage, tier, run_id, groups, have, broken, on_part)
    first = _persist_restored(storage, tier, run_id, groups, have, broken, pick, on_part)
    if not first["copied"]:  # a newer (suspect) step committed first would keep it off the root for good
        return first
    rest = _persist_newest(storage, tier, run_id, groups, *_whole_on_root(storage, held), on_part)
    if rest["copied"] or "missing" in rest:
        first["why"] += f"; then {rest['why']}"
    return first


def _whole_on_root(storage: Storage, held: set[Write]) -> tuple[set[Write], dict[Write, str]]:
    """The writes committed on the root, but those that this host's memory tiers hold (``held``)
    and that a restore cannot open there (:func:`~nebula_ckpt.restore.intact.restore_problem`: a
    shard missing or cut short, by sizes, no shard byte read); and those, with why. A marker alone
    does not put a step on the root: its memory copy is still worth writing."""
    have = set(committed_writes(storage))
    broken = {w: why for w in sorted(have & held) if (why := restore_problem(storage, w[1])) is not None}
    for w, why in broken.items():
        log.warning("nebula_ckpt: persist-memory: the root holds step %d (writer generation %d) but a restore "
                    "cannot open it: %s", w[1], w[0], why)
    return have - broken.keys(), broken


def _only_here(write: Write, tier: str, broken: dict[Write, str], world: int) -> str:
    """Where ``write`` was whole before this run, in the result's words: only in memory (the root
    lacks it, or holds it damaged: ``broken``, and the memory copy replaces that one). Raises
    where the damaged copy is a multi-rank step's (its parts cannot replace a committed step:
    nothing is written, this host's memory copies stay, and ``gc`` keeps them too)."""
    g, s, _ = write
    if write not in broken:
        return "was only in memory"
    if world > 1:
        raise NebulaError(f"persist-memory: step {s} (writer generation {g}, {world} ranks) is committed on {tier} "
                          f"but cannot be restored there ({broken[write]}); this host's memory copies are kept (gc "
                          "keeps them too): restart the job to resume from them, or copy the step's files back")
    return f"was whole only in memory (the copy on {tier} cannot be restored: {broken[write]}; it is replaced)"


def _restored_write(writes: set[Write], view: HealthView) -> Optional[Write]:
    """The write a restart restores among ``writes`` (the memory tiers' and the root's): the newest,
    in a restore's order (:func:`~nebula_ckpt.restore.select.list_candidates`: writer generation,
    step, save), that the root's health records do not mark suspect; None when all are."""
    return next((w for w in sorted(writes, reverse=True)
                 if view.mark(w[0], w[1], None if w[2] < 0 else w[2]).state != SUSPECT), None)


def _persist_restored(storage: Storage, tier: str, run_id: str, groups: Groups, have: set[Write],
                      broken: dict[Write, str], pick: Write, on_part: OnPart) -> dict[str, Any]:
    """``pick``, the write a restart restores (the newest not marked suspect), committed on the root
    that lacks it (or holds it damaged: ``broken``) although newer steps of the run may be there
    (marked suspect: a restore skips them), a multi-rank one too
    (:class:`~nebula_ckpt.save.drain.Drain`'s ``skip``)."""
    g, s, _ = pick
    why = f"step {s} is the step a restart restores (the newest not marked suspect)"
    if any(w[0] > g for w in have):
        return _result(pick, False, f"{why}, but {not_newer(pick, have, tier)}")
    world, group = next((k[1], v) for k, v in groups.items() if k[0] == pick)
    if world == 1:
        only = _only_here(pick, tier, broken, world)
        _copy_one(storage, tier, pick, group[0], on_part)
        return _result(pick, True, f"{why} and {only}; it is committed on {tier}")
    _only_here(pick, tier, broken, world)
    # the newer steps on the root are marked suspect (else pick would be one of them): a restore
    # passes over them, so they keep the step it restores off the root no more than a restart
    newer = frozenset(w for w in have | broken.keys() if w > pick)
    drain = Drain(storage, tier, run_id, pick, world, on_part, skip=newer)
    done, missing = drain.run(group)
    if done:
        return _result(pick, True, f"{why} ({world} ranks) and was only in memory; it is committed on {tier}")
    return _result(pick, False, f"{why}; it is not committed yet: the part(s) of rank(s) {missing[:16]} are not on "
                                f"{tier}, and the persist-memory of the node(s) holding them completes it",
                   missing=missing)


def _persist_newest(storage: Storage, tier: str, run_id: str, groups: Groups, have: set[Write],
                    broken: dict[Write, str], on_part: OnPart) -> dict[str, Any]:
    """The newest write worth writing (newest first; one the root holds damaged, ``broken``, is
    written again), committed; or why nothing was."""
    targets = sorted((k for k in groups if not_newer(k[0], have, tier) is None), reverse=True)
    if not targets:
        newest = max(groups)[0]
        return _result(newest, False, not_newer(newest, have, tier) or "")
    waiting: dict[Write, tuple[list[int], dict[int, str]]] = {}
    for write, world in targets:
        only = _only_here(write, tier, broken, world)
        if world == 1:
            _copy_one(storage, tier, write, groups[(write, world)][0], on_part)
            return _result(write, True, f"step {write[1]} {only}; it is committed on {tier}")
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
    """A one-process step from its memory tier to the root, under its own generation
    (:func:`~nebula_ckpt.save.drain.copy_as_written`)."""
    src = LocalStorage(copy.folder, private=True, fsync=False)
    try:
        nbytes = copy_as_written(storage, tier, write, src)
    except NebulaError as e:
        if type(e) is not NebulaError:  # damage and the like, as they are
            raise
        raise NebulaError(f"persist-memory: {e}") from None
    finally:
        src.close()
    log.info("nebula_ckpt: persist-memory: step %d copied from %s to %s", write[1], copy.folder, tier)
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
            try:
                held.append(_run_lock(found.folder))
            except FileNotFoundError:  # removed since the scan (gc): nothing of it to write
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
        for fd in reversed(held):  # a LOCK before its run lock: a run let in next finds the LOCK free
            os.close(fd)


def _run_lock(folder: str) -> int:
    """The lock of a persist-memory run on the memory-tier folder ``folder`` (an exclusive ``flock``
    on the folder itself; its fd), taken before the folder's ``LOCK`` and dropped after it, once
    another run that holds it has ended. So the ``LOCK`` of a folder whose run lock this run holds
    is held by no other run of persist-memory: only by a live job (or ``gc`` removing the folder).
    Runs on one host (the job's epilogue, a node agent) may overlap: the later one then finds the
    step on the root and has nothing to do."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("nebula_ckpt: persist-memory: waiting for another persist-memory run on %s to end", folder)
            fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd


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
