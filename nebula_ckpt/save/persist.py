"""Persist: one writer thread per tier, writing snapshots as committed checkpoints.

For each snapshot a tier writes, in this order (the commit protocol)::

    step-N/shard-g<G>-r<R>.safetensors (durable: fsync / completed upload; R = this rank)
    -- the snapshot is confirmed consistent, every rank's shard is durable (coordinator) --
    step-N/manifest.json               (the coordinator's; tmp + fsync + rename, or a new object)
    step-N/COMMIT                      (the coordinator's; create-only, last)

then applies retention: markers are deleted before data, the newest checkpoint is never
deleted, and leftovers without a marker are removed only when no live writer owns them (an
older generation, or this rank's own files). A failed step's own files (and its folder, once
empty) are removed at once, but only while its ``COMMIT`` certainly does not exist: once the
marker may have been written (its write began and did not certainly fail; on a rank other than
the coordinator: once its shard record may have reached the coordinator) a failure deletes
nothing of that step (:class:`CommitUncertain`); if it never committed, its files are leftovers
that the sweep of a newer generation (a restarted job's first save) removes.
:meth:`TierWriter.remove` (``Checkpointer.remove``) deletes a committed checkpoint the same way
(fence checked, marker first), serialised with retention.

In a multi-rank job a *shared* tier (every rank sees it) commits one checkpoint for all ranks,
in three rounds among the ranks (:mod:`nebula_ckpt.ranks.coordinator`, metadata only):

1. digest, then index: every rank sends a hash of its replicable tensors' index (and of its
   tree); only when the hashes differ do the ranks send the index itself. Replicated tensors
   get one owner each (:func:`nebula_ckpt.ranks.shards.assign`). The coordinator has already removed
   an old checkpoint of the same step, so nobody writes into a folder being deleted;
2. durable: every rank writes its share (``shard-g<G>-r<R>``), checks its snapshot, and sends
   its shard record, index and tree (or its error);
3. verdict: the coordinator writes manifest and ``COMMIT`` only if every rank's shard is
   durable and verified, and tells every rank whether it did. Otherwise each rank removes its
   shard and the previous checkpoint stays the newest. A rank that hears no verdict (the
   coordinator died or timed out after it sent its record) cannot know whether the step
   committed: it looks for the ``COMMIT`` once (there: the save succeeded) and otherwise
   keeps its shard and reports :class:`CommitUncertain`.

A rank's own tier (the memory tier) commits its rank's state alone; restore agrees on a step
every rank has (:meth:`nebula_ckpt.checkpointer.Checkpointer.load_latest`).

A tier never queues: it holds at most one pending snapshot. When a newer one arrives while the
tier is still busy, the pending one is dropped *for this tier* (reported on its handle as
``tiers_dropped``), so a slow tier never blocks a fast one, nor the training loop.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

from nebula_ckpt import knobs
from nebula_ckpt.errors import FencedError, PersistError
from nebula_ckpt.format.commit import Commit, read_commit
from nebula_ckpt.format.names import (
    COMMIT,
    MANIFEST,
    parse_step_dir,
    shard_generation,
    shard_name,
    shard_owner,
    step_dir,
)
from nebula_ckpt.format.records import ShardRecord
from nebula_ckpt.native import get_ops
from nebula_ckpt.ranks import shards as ranks
from nebula_ckpt.ranks.coordinator import (
    PHASE_DIGEST,
    PHASE_DURABLE,
    PHASE_INDEX,
    PHASE_VERDICT,
    SKIP,
    Coordinator,
    LocalCoordinator,
)
from nebula_ckpt.ranks.fencing import TierFence
from nebula_ckpt.save.fanout import Delivery
from nebula_ckpt.save.snapshot import Snapshot, build_tier_manifest
from nebula_ckpt.storage.base import Storage, never_created
from nebula_ckpt.tiers.runtime import TierRuntime

log = logging.getLogger(__name__)


def _tagged(manifest: dict[str, Any], tag: Optional[str]) -> dict[str, Any]:
    """``manifest`` with the optional ``tag`` field (only when there is a tag)."""
    if tag is not None:
        manifest["tag"] = tag
    return manifest


def delete_checkpoint(storage: Storage, step: int) -> None:
    """Delete a checkpoint: marker first (it stops being visible), then its data."""
    d = step_dir(step)
    storage.remove(f"{d}/{COMMIT}")
    storage.remove_dir(d)


class CommitUncertain(PersistError):
    """A save whose ``COMMIT`` may exist although this rank could not confirm it (the
    coordinator died or timed out after every shard was durable, or the marker's own write
    reported an error). Nothing of the step is deleted: if it committed, it is whole; if not,
    its files are uncommitted leftovers that a later sweep removes."""


@dataclass
class _Progress:
    """How far the commit of one step on one tier got (decides what its failure path removes)."""

    #: the step's COMMIT may exist (or still appear): a failure deletes nothing of the step
    may_commit: bool = False


class PeerSkipped(PersistError):
    """Another rank did not write this save on a shared tier (its cadence skipped it, or a newer
    save replaced it there): the save is dropped on that tier, not failed."""


@dataclass(frozen=True)
class _Item:
    """One step to commit on a tier: its bytes and how to build its manifest."""

    step: int
    nbytes: int
    source: Any                                               # has .view() -> memoryview
    make_manifest: Callable[[int, dict[str, Any]], dict[str, Any]]  # (generation, shard record)
    before_commit: Callable[[], None]                         # raises if it must not commit
    index: int = 0                                            # the save's number in the job
    meta: Optional[dict[str, Any]] = None                     # multi-rank: tensors, aliases, tree, stats
    tag: Optional[str] = None                                 # multi-rank: the checkpoint's tag


class TierWriter:
    """Writes snapshots to one tier on its own thread.

    The writer also holds the tier's cadence state: :meth:`wants` asks, :meth:`took` records,
    and only a save that really goes ahead (it got a staging buffer) is recorded.

    Args:
        runtime: the tier's runtime (its settings, storage and special behaviour).
        fence: the writer generation, checked on this tier's storage.
        keep_last: default retention when the tier has none.
        coordinator: the ranks' agreement (a no-op in one process): the commit of a step goes
            ahead only when every rank's shard of it is durable on this tier.
    """

    def __init__(self, runtime: TierRuntime, fence: TierFence, keep_last: int,
                 coordinator: Optional[Coordinator] = None) -> None:
        self.runtime = runtime
        self.coordinator = coordinator or LocalCoordinator()
        self.tier = runtime.tier
        self.storage = runtime.storage
        self.fence = fence
        self.keep_last = self.tier.keep_last or keep_last
        self.name = runtime.name
        self._last_time: Optional[float] = None
        self._pending: Optional[Delivery] = None
        self._busy = False
        self._closing = False
        self._cond = threading.Condition()
        #: held while checkpoints are deleted (retention on the writer thread, remove() on the caller's)
        self._delete_lock = threading.Lock()
        #: steps whose commit this writer could not confirm (CommitUncertain): never deleted as
        #: leftovers nor written again by this process; a restart (a newer generation) sweeps them
        self._uncertain: set[int] = set()
        self._thread = threading.Thread(target=self._run, name=f"nebula-{self.tier.kind}-writer", daemon=True)
        self._thread.start()

    # -- cadence (training thread) ----------------------------------------------------------------
    def wants(self, save_index: int, now: float) -> bool:
        """Whether this tier takes the ``save_index``-th save (0-based) by its cadence (no state change)."""
        if save_index % self.tier.every:
            return False
        every_s = self.tier.every_seconds
        return every_s is None or self._last_time is None or now - self._last_time >= every_s

    def took(self, now: float) -> None:
        """Record that a save went ahead on this tier at ``now`` (starts its ``every_seconds`` window)."""
        self._last_time = now

    # -- called from other threads ---------------------------------------------------------------
    def offer(self, delivery: Delivery) -> None:
        """Take a snapshot to write (the tier now owns ``delivery``); a pending older one is dropped."""
        with self._cond:
            dropped, self._pending = self._pending, delivery
            self._cond.notify_all()
        if dropped is not None:
            dropped.drop(self.name, f"still busy; step {delivery.snap.step} is newer")

    def drop_pending(self) -> bool:
        """Drop the snapshot waiting for this tier while it writes an older one; True if any.

        An idle tier is about to start on its pending snapshot, so that one is kept.
        """
        with self._cond:
            if not self._busy:
                return False
            dropped, self._pending = self._pending, None
            self._cond.notify_all()
        if dropped is None:
            return False
        dropped.drop(self.name, "to free its staging buffer for a newer save")
        return True

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """Block until idle; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending is None and not self._busy, timeout)

    def close(self) -> None:
        """Write what is pending, then stop the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()

    # -- the writer thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closing)
                if self._pending is None:
                    return
                delivery, self._pending = self._pending, None
                self._busy = True
            self._write_one(delivery)
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _write_one(self, delivery: Delivery) -> None:
        snap = delivery.snap
        try:
            self.write(snap, delivery.source,
                       lambda rel: delivery.shard_written(self.storage.local_path(rel)))
        except PeerSkipped as e:
            log.info("nebula_ckpt: tier %s: %s", self.name, e)
            snap.handle.progress.tier_done(self.name, dropped=True)
        except BaseException as e:
            log.error("nebula_ckpt: tier %s failed to write step %d: %s: %s", self.name, snap.step,
                      type(e).__name__, e)
            snap.handle.progress.tier_done(self.name, e)
        else:
            snap.handle.progress.tier_done(self.name)
        finally:
            delivery.finish()

    def write(self, snap: Snapshot, source: Any, on_shard: Optional[Callable[[str], None]] = None) -> None:
        """Write one snapshot (bytes from ``source``) as a committed checkpoint, then apply retention.

        ``on_shard(rel)`` is called once the shard file is durable, before manifest and commit.
        """
        def confirmed() -> None:
            snap.wait_confirmed(knobs.get("confirm_timeout_s"))
            failure = snap.handle.progress.snapshot_failure()
            if failure is not None:
                raise failure

        co = self.coordinator
        if co.world_size == 1:
            self._commit_step(_Item(snap.step, snap.nbytes, source,
                                    lambda gen, shard: build_tier_manifest(snap, gen, shard), confirmed), on_shard)
            return
        meta: dict[str, Any] = {"tensors": snap.tensor_index, "aliases": snap.plan.aliases, "tree": snap.plan.tree,
                "stats": {"tensor_bytes": snap.plan.tensor_bytes, "copy_seconds": snap.copy_seconds}}

        def rank_manifest(gen: int, shard: dict[str, Any]) -> dict[str, Any]:
            return _tagged(ranks.rank_manifest(step=snap.step, generation=gen, rank=co.rank, world=co.world_size,
                                               shard=shard, **meta), snap.plan.tag)

        self._commit_step(_Item(snap.step, snap.nbytes, source, rank_manifest, confirmed, snap.index, meta,
                                snap.plan.tag), on_shard)

    def copy_from(self, src: Storage, step: int) -> None:
        """Write the committed checkpoint ``step`` of another (local) tier's storage to this tier.

        Used by ``Checkpointer.close()`` to put the newest step on tiers whose cadence skipped it.
        The source's manifest is taken as is but for this tier's generation and shard record.
        """
        d = step_dir(step)
        man = json.loads(src.read_small(f"{d}/{MANIFEST}"))
        if len(man["shards"]) != 1 or self.coordinator.world_size > 1:
            raise ValueError(f"step {step} has {len(man['shards'])} shards; only one-shard checkpoints are copied")
        rec = man["shards"][0]
        data = src.read_buffer(f"{d}/{ShardRecord.parse(rec, d).file}", rec.get("storage"))

        class _View:
            def view(self) -> memoryview:
                return data

        def manifest(gen: int, shard: dict[str, Any]) -> dict[str, Any]:
            return dict(man, generation=gen, shards=[shard])

        self._commit_step(_Item(step, len(data), _View(), manifest, lambda: None), None)

    @property
    def _shared(self) -> bool:
        """Whether this tier commits one checkpoint for all ranks (multi-rank, shared tier)."""
        return self.coordinator.world_size > 1 and self.tier.shared

    def _commit_step(self, item: "_Item", on_shard: Optional[Callable[[str], None]]) -> None:
        """The commit protocol for one step on this tier, then retention."""
        st = self.storage
        gen = self.fence.generation
        d = step_dir(item.step)
        self.fence.check(f"write step {item.step}")
        self._check_uncertain(item.step)
        existing = st.list(d)
        if self._shared and not self.coordinator.is_coordinator:
            # The coordinator replaces an old checkpoint of this step before the first round
            # (marker first); this rank writes only after that round, and removes only its own
            # leftovers of an uncommitted step: never a shard of a checkpoint still committed.
            if COMMIT not in existing:
                for name in existing:
                    if shard_owner(name) is not None and self._stale(name, gen):
                        st.remove(f"{d}/{name}")
        elif COMMIT in existing:
            # Saving a step that exists: the new run owns the root (it resumed from an older step
            # or saves the same step again); the old one goes, marker first.
            log.warning("nebula_ckpt: tier %s: replacing existing checkpoint of step %d", self.name, item.step)
            delete_checkpoint(st, item.step)
        elif self._is_link(d):
            st.remove_dir(d)  # a planted link in place of the folder: unlinked, never followed
        else:
            for name in existing:  # leftovers of crashed writers of this step, never a live peer's
                if self._stale(name, gen):
                    st.remove(f"{d}/{name}")
        shard = shard_name(gen, self.coordinator.rank)
        progress = _Progress()
        try:
            if self._shared:
                self._write_shared(item, d, shard, gen, on_shard, progress)
            else:
                self._write_files(item, d, shard, gen, on_shard, progress)
        except BaseException as e:
            if not progress.may_commit:
                self._discard(d, shard)
                raise
            self._uncertain.add(item.step)  # committed or not, nothing of the step may go now
            if isinstance(e, CommitUncertain):
                raise
            raise CommitUncertain(f"step {item.step} may have committed on tier {self.name}: the write of its "
                                  f"COMMIT reported an error ({type(e).__name__}: {e}); its files are kept (a "
                                  "restart removes them if it never committed)") from e
        log.info("nebula_ckpt: step %d committed on %s (%.1f MiB)", item.step, self.name, item.nbytes / 2**20)
        if self._shared and not self.coordinator.is_coordinator:
            return  # retention of a shared tier is the coordinator's
        try:
            self.prune(keep_step=item.step)
        except FencedError:
            raise
        except Exception as e:  # retention is best effort: the checkpoint itself is committed
            log.warning("nebula_ckpt: tier %s: retention failed: %s", self.name, e)

    def _write_files(self, item: "_Item", d: str, shard: str, gen: int,
                     on_shard: Optional[Callable[[str], None]], progress: _Progress) -> None:
        """Shard; then, once the snapshot is confirmed, the manifest and the commit marker."""
        log.debug("nebula_ckpt: phase=shard tier=%s step=%d", self.name, item.step)
        info = self.runtime.write_shard(f"{d}/{shard}", item.source)
        if on_shard is not None:
            on_shard(f"{d}/{shard}")
        item.before_commit()
        self._commit_manifest(item.step, gen, item.make_manifest(gen, {"file": shard, "bytes": item.nbytes,
                                                                       "storage": info}), progress)

    def _commit_manifest(self, step: int, gen: int, manifest: dict[str, Any], progress: _Progress) -> None:
        """Manifest (atomic), fence check, then the create-only commit marker naming its checksum.

        From the start of the marker's write on, ``progress.may_commit``: a write that reports an
        error may still have created it (a lost response, a failed directory fsync).
        """
        st = self.storage
        d = step_dir(step)
        mbytes = json.dumps(manifest, separators=(",", ":"), allow_nan=False).encode()
        log.debug("nebula_ckpt: phase=manifest tier=%s step=%d", self.name, step)
        st.write_small(f"{d}/{MANIFEST}", mbytes)
        self.fence.check(f"commit step {step}")
        log.debug("nebula_ckpt: phase=commit tier=%s step=%d", self.name, step)
        commit = Commit(step, gen, len(mbytes), get_ops().crc32c_bytes(mbytes))
        progress.may_commit = True
        try:
            st.write_small(f"{d}/{COMMIT}", commit.to_bytes(), create_only=True)
        except BaseException:
            progress.may_commit = not never_created(st, f"{d}/{COMMIT}")
            raise

    def _write_shared(self, item: "_Item", d: str, shard: str, gen: int,
                      on_shard: Optional[Callable[[str], None]], progress: _Progress) -> None:
        """A multi-rank save on a shared tier: the three rounds of the module docstring."""
        co, name, idx = self.coordinator, self.name, item.index
        assert item.meta is not None
        tensors = item.meta["tensors"]
        rep, sharded = ranks.summary(tensors)
        mine_digest = ranks.digest(rep)
        tree_digest = ranks.digest(item.meta["tree"])
        peers = co.round(name, idx, PHASE_DIGEST, {"step": item.step, "digest": mine_digest, "tree": tree_digest,
                                                  "sharded": sharded})
        problem = ranks.peer_problem(peers, item.step, name)
        if problem is not None:
            co.abandon(name, idx)
            raise (PeerSkipped if problem[0] else PersistError)(problem[1])
        if all(p["digest"] == mine_digest for p in peers):  # the usual DDP case: a hash was enough
            co.round(name, idx, PHASE_INDEX, SKIP)  # every rank saw the same digests: no collective
            summaries = [rep] * len(peers)
        else:  # every rank sees the same digests, so every rank takes this branch
            got = co.round(name, idx, PHASE_INDEX, {"keys": rep})
            if any(g is None for g in got):
                raise PersistError(f"step {item.step}: a rank left the index round on tier {name}")
            summaries = [g["keys"] for g in got]
        owners = ranks.assign(summaries, [p["sharded"] for p in peers])
        keep = [k for k in tensors if owners.get(k, co.rank) == co.rank]
        failure: Optional[BaseException] = None
        try:
            log.debug("nebula_ckpt: phase=shard tier=%s step=%d (%d of %d tensors)", name, item.step, len(keep),
                      len(tensors))
            parts, index, nbytes = ranks.subset_image(tensors, keep, item.source.view())
            info = self.runtime.write_parts(f"{d}/{shard}", parts)
            if on_shard is not None:
                on_shard(f"{d}/{shard}")
            item.before_commit()
            same_tree = tree_digest == peers[0]["tree"] and not co.is_coordinator
            mine: dict[str, Any] = {"step": item.step, "shard": {"file": shard, "bytes": nbytes, "storage": info},
                                    "tensors": index, "aliases": item.meta["aliases"],
                                    "tree": None if same_tree else item.meta["tree"], "stats": item.meta["stats"]}
        except BaseException as e:
            failure, mine = e, {"error": f"{type(e).__name__}: {e}"}
        if co.is_coordinator:
            verdict = self._coordinate(item.step, gen, co.round(name, idx, PHASE_DURABLE, mine), owners, failure,
                                       progress, item.tag)
            try:
                co.round(name, idx, PHASE_VERDICT, verdict)
            except PersistError as e:
                if not verdict.get("ok"):
                    raise
                log.warning("nebula_ckpt: tier %s: step %d is committed, but the other ranks could not be told: %s",
                            name, item.step, e)
        else:
            # Once this rank's record may have reached the coordinator, the step may commit at
            # any moment: only a verdict (or the COMMIT itself) tells this rank whether it did.
            progress.may_commit = failure is None
            try:
                co.round(name, idx, PHASE_DURABLE, mine)
                verdict = co.round(name, idx, PHASE_VERDICT, {})[0] or {}
            except PersistError as e:
                if failure is not None:
                    raise failure from e
                if self._committed(item.step, gen):
                    log.warning("nebula_ckpt: tier %s: no verdict from rank 0 on step %d (%s), but its COMMIT is "
                                "there: the step is committed", name, item.step, e)
                    return
                raise CommitUncertain(f"step {item.step} may have committed on tier {name}: rank 0 died, left or "
                                      f"timed out after this rank's shard was durable ({e}), and no COMMIT was there "
                                      "yet; this rank keeps its files of it (a restart removes them if it never "
                                      "committed)") from e
            progress.may_commit = bool(verdict.get("ok") or verdict.get("uncertain"))
        if failure is not None:
            raise failure
        if not verdict.get("ok"):
            why = verdict.get("why", f"rank 0 did not take part in committing step {item.step}")
            raise (CommitUncertain if verdict.get("uncertain") else PeerSkipped if verdict.get("skipped")
                   else PersistError)(why)

    def _coordinate(self, step: int, gen: int, parts: list[Any], owners: dict[str, int],
                    failure: Optional[BaseException], progress: _Progress,
                    tag: Optional[str] = None) -> dict[str, Any]:
        """The coordinator's commit of a shared tier: manifest + COMMIT if every rank's share is in.

        The verdict: ``ok``, or not with ``why`` (and ``skipped`` when a rank only did not write
        it), or ``uncertain`` when the marker's write failed (it may exist: nobody deletes).
        """
        if failure is not None:
            return {"ok": False, "why": f"step {step} failed on rank 0 (tier {self.name}): {failure}"}
        problem = ranks.peer_problem(parts, step, self.name)
        if problem is not None:
            return {"ok": False, "skipped": problem[0], "why": problem[1]}
        try:
            self._commit_manifest(step, gen, _tagged(ranks.global_manifest(step=step, generation=gen, parts=parts,
                                                                           owners=owners), tag), progress)
        except BaseException as e:
            log.error("nebula_ckpt: tier %s: committing step %d failed: %s", self.name, step, e)
            if progress.may_commit:
                return {"ok": False, "uncertain": True,
                        "why": f"step {step} may have committed on tier {self.name}: rank 0's write of its COMMIT "
                               f"reported an error ({type(e).__name__}: {e}); every rank keeps its files of it"}
            return {"ok": False, "why": f"rank 0 could not commit step {step} on tier {self.name}: {e}"}
        return {"ok": True}

    def _committed(self, step: int, gen: int) -> bool:
        """Whether this generation's ``COMMIT`` of ``step`` is on the tier (read back; False when unsure)."""
        d = step_dir(step)
        try:
            c = read_commit(self.storage, step, f"{self.storage.display_url}/{d}")
        except Exception as e:  # missing, unreadable: not known to be committed
            log.debug("nebula_ckpt: tier %s: no readable COMMIT of step %d: %s", self.name, step, e)
            return False
        return c.step == step and c.generation == gen

    def _check_uncertain(self, step: int) -> None:
        """Refuse to write ``step`` again while an earlier save of it may still commit here."""
        if step not in self._uncertain:
            return
        if self.storage.exists(f"{step_dir(step)}/{COMMIT}"):
            self._uncertain.discard(step)  # it did commit: an ordinary checkpoint from now on
            return
        raise PersistError(f"step {step} is not written again on tier {self.name}: an earlier save of it may still "
                           "commit there (its outcome was never confirmed; see the earlier error). Save another step, "
                           "or restart the job")

    def _stale(self, name: str, gen: int) -> bool:
        """Whether file ``name`` of an uncommitted step belongs to no writer that may still run:
        an older generation, or this very rank of this generation. A same-generation peer rank's
        shard is in flight; a manifest is the committing rank's to replace (the coordinator's on
        a shared tier, this rank's on its own tier)."""
        owner = shard_owner(name)
        if owner is None:  # the manifest (or a temp file) of whoever commits on this tier
            return self.coordinator.is_coordinator or not self._shared
        return owner[0] < gen or owner == (gen, self.coordinator.rank)

    def _is_link(self, rel: str) -> bool:
        """Whether ``rel`` is a symlink on a local file system (a tier never follows one)."""
        root = self.storage.local_path("")
        return root is not None and os.path.islink(os.path.join(root, rel))

    def _discard(self, d: str, shard: str) -> None:
        """After a save that certainly did not commit: remove what it wrote of the step (this
        rank's shard; the manifest when this rank commits here and no newer writer is in the
        folder), then the folder if that left it empty. Never a committed step's files, nor a
        peer's: each rank removes its own, and the last one to finish removes the folder
        (``remove_empty_dir`` is atomic), so no empty folder is left behind."""
        st = self.storage
        gen = self.fence.generation
        try:
            names = st.list(d)
            if COMMIT in names:  # not this save's marker (it never wrote one), but a checkpoint all the same
                log.warning("nebula_ckpt: tier %s: %s holds a COMMIT; nothing of it is removed", self.name, d)
                return
            newer = any((o := shard_owner(n)) is not None and o[0] > gen for n in names)
            mine_manifest = not newer and (self.coordinator.is_coordinator or not self._shared)
            for n in names:
                if n == shard or (n == MANIFEST and mine_manifest):
                    st.remove(f"{d}/{n}")
            st.remove_empty_dir(d)
        except Exception as e:
            log.warning("nebula_ckpt: tier %s: cannot remove the files of failed step folder %s: %s",
                        self.name, d, e)

    def remove(self, step: int) -> bool:
        """Delete the committed checkpoint ``step`` from this tier as retention does (fence checked,
        commit marker first, then its data); False when the tier holds no committed ``step``.

        The caller makes sure no save of ``step`` is in flight (``Checkpointer.remove`` waits for
        them); retention on the writer thread is held off meanwhile.

        Raises:
            FencedError: a newer writer owns the root: nothing is deleted.
        """
        with self._delete_lock:
            if not self.storage.exists(f"{step_dir(step)}/{COMMIT}"):
                return False
            self.fence.check(f"remove step {step}")
            log.info("nebula_ckpt: tier %s: removing step %d (remove())", self.name, step)
            delete_checkpoint(self.storage, step)
            return True

    def prune(self, keep_step: Optional[int] = None) -> None:
        """Apply ``keep_last`` / ``keep_every`` and remove leftovers no live writer owns."""
        with self._delete_lock:
            self._prune(keep_step)

    def _prune(self, keep_step: Optional[int]) -> None:
        st = self.storage
        gen = self.fence.generation
        names = st.list("")
        committed: list[int] = []
        uncommitted: list[int] = []
        for name in names:
            s = parse_step_dir(name)
            if s is None:
                continue
            (committed if st.exists(f"{name}/{COMMIT}") else uncommitted).append(s)
        committed.sort()
        keep = set(committed[-self.keep_last:])
        if keep_step is not None:
            keep.add(keep_step)
        if self.tier.keep_every:
            keep.update(s for s in committed if s % self.tier.keep_every == 0)
        doomed = [s for s in committed if s not in keep]
        with self._cond:
            busy_step = self._pending.snap.step if self._pending is not None else None
        leftovers = []
        for s in uncommitted:
            if s == busy_step or s in self._uncertain:
                continue
            if all(self._stale(n, gen) for n in st.list(step_dir(s))):
                leftovers.append(s)
        abandoned = []
        for rel, upload_id in st.incomplete_uploads():
            g = shard_generation(rel.rsplit("/", 1)[-1])
            if g is not None and g <= gen:  # ours are never in flight while we prune
                abandoned.append((rel, upload_id))
        if not doomed and not leftovers and not abandoned:
            return
        self.fence.check("delete old checkpoints")
        log.debug("nebula_ckpt: phase=prune tier=%s step=%s", self.name, keep_step)
        for s in doomed:
            log.debug("nebula_ckpt: tier %s: retention deletes step %d", self.name, s)
            delete_checkpoint(st, s)
        for s in leftovers:
            log.info("nebula_ckpt: tier %s: removing uncommitted leftovers of step %d", self.name, s)
            st.remove_dir(step_dir(s))
        for rel, upload_id in abandoned:
            log.info("nebula_ckpt: tier %s: aborting the abandoned upload of %s", self.name, rel)
            st.abort_upload(rel, upload_id)
