"""The tier writers: one thread per tier, writing snapshots as committed checkpoints.

For each snapshot a tier writes, in this order (the commit protocol)::

    step-N/shard-g<G>-r<R>.safetensors (durable: fsync / completed upload; R = this rank)
    -- the snapshot is confirmed consistent, every rank's shard is durable (coordinator) --
    step-N/manifest.json               (the coordinator's; tmp + fsync + rename, or a new object)
    step-N/COMMIT                      (the coordinator's; create-only, last)

The last two are :func:`nebula_ckpt.format.commit.commit_manifest`, which the DCP writer shares.
A save of a step committed already writes ``-v<V>`` names beside the committed files, unlists the
later steps that refer to the old write's bytes (the timeline the run left), and replaces
``COMMIT`` in one atomic write; only then does the old write go (:func:`nebula_ckpt.save.sweep.replaced`;
on a shared tier, and a tier with replicas, the old one goes first).
Then retention: markers go before data, a step before its bases, the newest checkpoint never goes, and leftovers
without a marker go only when no live writer owns them (:mod:`nebula_ckpt.save.sweep`). A failed step's own files (and
its folder, once empty) are removed at once, but only while its ``COMMIT`` certainly does not exist: once the marker may
have been written (on a rank other than the coordinator: once its shard record may have reached the coordinator) a
failure deletes nothing of that step (:class:`~nebula_ckpt.save.rounds.CommitUncertain`) until a later prune of its
writer (or its close) finds that the write can no longer land (a file system's at once; an object store's, whose lost
response may still land, once older than its deadline ``NEBULA_REMOTE_TIMEOUT_S``): the step is then a committed
checkpoint, or a leftover that goes. :meth:`TierWriter.remove` (``Checkpointer.remove``) deletes a committed checkpoint
the same way (fence checked, marker first), serialised with retention. A save fenced after a tier committed its step
takes it back (:meth:`TierWriter.retract`).

In a multi-rank job a *shared* tier commits one checkpoint for all ranks in three rounds
(:mod:`nebula_ckpt.save.rounds`); a rank's own tier (the memory tier) commits its rank's state alone; restore agrees on
a step every rank has.

A tier never queues: it holds at most one pending snapshot; a newer one replaces it *for this tier* (reported as
``tiers_dropped``), so a slow tier never blocks a fast one, nor training.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Optional

from nebula_ckpt.errors import FencedError, PersistError
from nebula_ckpt.format.commit import (
    Commit,
    CommitProgress,
    clear_step,
    commit_manifest,
    committed_steps,
    delete_checkpoint,
    read_kept,
    referrers,
    retract_step,
    scan_steps,
)
from nebula_ckpt.format.manifest import Manifest, encode_manifest, finish_manifest, stored_json, tagged
from nebula_ckpt.format.multi_rank import rank_manifest
from nebula_ckpt.format.names import COMMIT, new_variant, shard_name, shard_owner, step_dir
from nebula_ckpt.latch import Latch, Wakeup
from nebula_ckpt.ranks import shards as ranks
from nebula_ckpt.ranks.coordinator import Coordinator, LocalCoordinator
from nebula_ckpt.ranks.fencing import TierFence
from nebula_ckpt.save import seeding, sweep
from nebula_ckpt.save.incremental import Incremental, committed_whole, may_build_on_base
from nebula_ckpt.save.kept import KeptSteps
from nebula_ckpt.save.rounds import CommitUncertain, PeerSkipped, SharedCommit
from nebula_ckpt.save.snapshot import Delivery, Snapshot, build_tier_manifest
from nebula_ckpt.save.tier_image import Staged, TierImage, TierStep, tier_image, write_image
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.tiers.base import Cadence
from nebula_ckpt.tiers.runtime import TierRuntime

log = logging.getLogger(__name__)


class TierWriter:
    """Writes snapshots to one tier on its own thread.

    Args:
        runtime: the tier's runtime (its settings, storage and special behaviour).
        fence: the writer generation, checked on this tier's storage.
        keep_last: default retention when the tier has none.
        coordinator: the ranks' agreement (a no-op in one process): the commit of a step goes
            ahead only when every rank's shard of it is durable on this tier.
        incremental: write only the tensors that changed since this tier's last save
            (:mod:`nebula_ckpt.save.incremental`; :func:`~nebula_ckpt.save.incremental.may_build_on_base`).
    """

    def __init__(self, runtime: TierRuntime, fence: TierFence, keep_last: int,
                 coordinator: Optional[Coordinator] = None, incremental: bool = True) -> None:
        self.runtime = runtime
        self.coordinator = coordinator or LocalCoordinator()
        self.tier = runtime.tier
        self.storage = runtime.storage
        self.fence = fence
        self.keep_last = self.tier.keep_last or keep_last
        self.name = runtime.name
        #: which saves this tier takes (the training thread asks and records)
        self.cadence = Cadence(self.tier, self._shared)
        self._pending: Optional[Delivery] = None
        self._writing: Optional[int] = None  # the step being written (None: not busy)
        self._closing = False
        self._seed: Optional[tuple[Manifest, bool]] = None  # seed()'s request, for the next write
        #: the training thread takes it directly (a C call a Ctrl-C cannot cut, unlike Condition.__enter__)
        self._mutex = threading.RLock()
        self._wake = Wakeup()  # offer() and close() ring it; the writer thread sleeps on it while idle
        self._idle = Latch(True)  # set while nothing is pending or being written (under _mutex)
        #: held while checkpoints are deleted (retention on the writer thread, remove() on the caller's)
        self._delete_lock = threading.RLock()  # also taken by the fence's take-back (retract)
        #: steps whose commit may land (CommitUncertain), with when: kept, not written again, until :meth:`_settle`
        self._uncertain: dict[int, float] = {}
        #: this tier's base and cadence of full saves (a tier that keeps its base in RAM, the memory
        #: tier, compares bytes instead of hashing)
        on_base = incremental and may_build_on_base(self.tier, self.coordinator.world_size, self.storage)
        self.incremental = Incremental(on_base, compare=runtime.capabilities.keeps_base_in_ram)
        #: remove()'s requests for steps later ones refer to, recorded on the tier: they go once none does
        self._removals = sweep.Removals(runtime.storage, self.name)
        self._strays_swept = False  # the strays of committed folders are looked for once (sweep.stray_files)
        self._kept = KeptSteps(runtime.storage)  # each committed step's write and references, read once
        fence.retract_with(self)  # a save ending fenced takes back what it committed here
        self._thread = threading.Thread(target=self._run, name=f"nebula-{self.tier.kind}-writer", daemon=True)
        self._thread.start()

    def seed(self, man: Manifest, here: bool = True) -> None:
        """A restarted job restored the committed step of ``man`` from this tier (``here``) or from another one, every
        tensor verified: the next save here may build on it, or on another committed step of this tier, instead of
        being full (no save made yet; see :func:`~nebula_ckpt.save.seeding.restart_base`). Taken up by the thread that
        writes the next save: it reads the tier, which must never hold the training thread (a store down)."""
        if self.incremental.enabled:
            with self._mutex:
                self._seed = (man, here)

    def _take_seed(self) -> None:
        """Apply :meth:`seed`'s request, if any, before a write (:func:`~nebula_ckpt.save.seeding.seed_tier`)."""
        with self._mutex:
            req, self._seed = self._seed, None
        if req is not None:
            seeding.seed_tier(self, *req, shared=self._shared)

    # -- called from other threads ---------------------------------------------------------------
    def offer(self, delivery: Delivery) -> None:
        """Take a snapshot to write (the tier now owns ``delivery``); a pending older one is dropped."""
        with self._mutex:
            dropped, self._pending = self._pending, delivery
            self._idle.clear()
        self._wake.ring()
        if dropped is not None:
            dropped.drop(self.name, f"still busy; step {delivery.snap.step} is newer")

    def drop_pending(self) -> bool:
        """Drop the snapshot waiting for this tier while it writes an older one; True if any (an idle tier is about to
        start on its pending snapshot: that one is kept)."""
        with self._mutex:  # the training thread (a save that needs a staging buffer)
            if self._writing is None:
                return False
            dropped, self._pending = self._pending, None
        if dropped is None:
            return False
        dropped.drop(self.name, "to free its staging buffer for a newer save")
        return True

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """Block until idle (woken as the writer goes idle); False on timeout. Ctrl-C safe (a Latch)."""
        return self._idle.wait(timeout)

    def in_flight(self) -> set[int]:
        """The steps this tier is writing or holds pending (see :meth:`retract`)."""
        with self._mutex:
            pending = self._pending.snap.step if self._pending is not None else None
            return {s for s in (self._writing, pending) if s is not None}

    def retract(self, steps: set[int]) -> None:
        """The writer was fenced while saving ``steps``: take back its commits of them here, newest
        first (:func:`~nebula_ckpt.format.commit.retract_step`; only where this rank commits)."""
        if self._owner.commits_here:
            with self._delete_lock:
                for s in sorted(steps, reverse=True):
                    retract_step(self.storage, s, self.fence.generation, self.name)

    def close(self) -> None:
        """Write what is pending, stop the thread, then settle the uncertain commits that can be (a prune)."""
        with self._mutex:
            self._closing = True
        self._wake.ring()  # a Ctrl-C before it leaves an idle writer asleep, until the next close() rings
        self._thread.join()
        if self._uncertain and self._owner.commits_here:
            try:
                self.prune()
            except Exception as e:  # best effort, as retention is
                log.warning("nebula_ckpt: tier %s: cannot settle the uncertain commits at close: %s", self.name, e)

    # -- the writer thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._mutex:
                delivery, self._pending = self._pending, None
                self._writing = delivery.snap.step if delivery is not None else None
                if delivery is None:
                    self._idle.set()  # wakes wait_idle()
                    if self._closing:
                        return
            if delivery is None:
                self._wake.sleep()  # no timeout: an idle writer does not wake until offer() or close()
                continue
            self._write_one(delivery)

    def _write_one(self, delivery: Delivery) -> None:
        snap = delivery.snap
        try:
            written = self.write(snap, delivery.source,
                                 lambda rel: delivery.shard_written(self.storage.local_path(rel)))
        except PeerSkipped as e:
            log.info("nebula_ckpt: tier %s: %s", self.name, e)
            snap.handle.progress.tier_done(self.name, dropped=True)
        except BaseException as e:
            log.error("nebula_ckpt: tier %s failed to write step %d: %s: %s", self.name, snap.step,
                      type(e).__name__, e)
            snap.handle.progress.tier_done(self.name, e)
        else:
            snap.handle.progress.tier_done(self.name, written=written)
        finally:
            delivery.finish()

    def write(self, snap: Snapshot, source: Any, on_shard: Optional[Callable[[str], None]] = None) -> int:
        """Write one snapshot (bytes from ``source``) as a committed checkpoint, then apply retention; return the bytes
        of the shard written (less than the snapshot's for an incremental save). ``on_shard(rel)`` is called once the
        shard file is durable, before manifest and commit."""
        self._take_seed()

        def confirmed() -> None:
            snap.wait_confirmed()
            failure = snap.handle.progress.snapshot_failure()
            if failure is not None:
                raise failure

        co = self.coordinator
        if co.world_size == 1:
            draft = build_tier_manifest(snap, 0, {})  # its generation, shards and tensors are the commit's
            return self._commit_step(self._own_step(snap, source, confirmed, draft), on_shard)
        meta: dict[str, Any] = {"tensors": snap.tensor_index, "aliases": snap.plan.aliases, "tree": snap.plan.tree,
                                "stats": snap.stats()}
        if not self._shared:  # this rank's own tier (memory): incremental on its own previous step
            draft = tagged(rank_manifest(step=snap.step, generation=0, rank=co.rank, world=co.world_size,
                                               shard={}, **meta), snap.plan.tag)
            return self._commit_step(self._own_step(snap, source, confirmed, draft, self.key_prefix), on_shard)
        return self._commit_step(TierStep(snap.step, source, confirmed, index=snap.index, meta=meta,
                                          tag=snap.plan.tag, hashes=snap.hashes, origin=snap.write_id), on_shard)

    def _own_step(self, snap: Snapshot, source: Any, confirmed: Callable[[], None], draft: dict[str, Any],
                  prefix: str = "") -> TierStep:
        """The step of a one-process job, or of a rank's own tier (``draft``: its manifest, its keys
        under ``prefix``): whole, or incremental on this tier's base (:mod:`nebula_ckpt.save.tier_image`)."""
        staged = Staged(snap.step, self.fence.generation, ranks.prefixed(snap.tensor_index, prefix),
                        ranks.prefixed(snap.hashes, prefix), source.view(), snap.compared)
        image = tier_image(staged, self.incremental.claim(), self.storage, self.name,
                           compare=self.incremental.compare, nbytes=snap.nbytes)
        if image.lost_base:
            self.incremental.forget()
        whole = None
        if not image.full:
            log.debug("nebula_ckpt: tier %s: step %d builds on step %d (%d of %d tensors written)", self.name,
                      snap.step, image.base, len(image.write), len(staged.index))
            whole = TierImage(snap.step, None, snap.nbytes, staged.index, tuple(staged.index))
        return TierStep(snap.step, source, confirmed, image, whole, draft, origin=snap.write_id, save=snap.index)

    def copy_from(self, src: Storage, step: int) -> None:
        """Write the committed checkpoint ``step`` of another (local) tier's storage to this tier: ``close()`` puts the
        newest step on tiers whose cadence skipped it. The source's manifest is taken as is but for this tier's
        generation and shard record (its marker names the same save number); an incremental one is written whole."""
        if self.coordinator.world_size > 1:
            raise ValueError(f"step {step}: only one-process checkpoints are copied between tiers")
        commit, raw, parsed, parts, tensors, nbytes = committed_whole(src, step, f"{src.display_url} step {step}")
        if parsed.multi_rank:
            raise ValueError(f"step {step} is a multi-rank checkpoint; only one-process checkpoints are copied")
        man = stored_json(raw)
        image = TierImage(step, tuple(parts), nbytes, tensors, tuple(tensors))
        self._commit_step(TierStep(step, None, lambda: None, image, manifest=man, restamp=False, save=commit.save),
                          None)

    @property
    def key_prefix(self) -> str:
        """The prefix of the keys in this tier's manifests: ``r<R>/`` on a rank's own tier, else none."""
        own = self.coordinator.world_size > 1 and self.tier.capabilities.per_rank
        return f"r{self.coordinator.rank}/" if own else ""

    @property
    def _shared(self) -> bool:
        """Whether this tier commits one checkpoint for all ranks (multi-rank, shared tier)."""
        return self.coordinator.world_size > 1 and self.tier.shared

    @property
    def _owner(self) -> sweep.Ownership:
        """Which leftovers this rank may remove on this tier (:mod:`nebula_ckpt.save.sweep`)."""
        return sweep.Ownership(self.fence.generation, self.coordinator.rank,
                               self.coordinator.is_coordinator or not self._shared)

    def _commit_step(self, item: "TierStep", on_shard: Optional[Callable[[str], None]]) -> int:
        """The commit protocol for one step on this tier, then retention; the shard's bytes."""
        gen = self.fence.generation
        d = step_dir(item.step)
        self.fence.check(f"write step {item.step}")
        self._check_uncertain(item.step)
        # the committed write of the step this save replaces, once it commits (None: none)
        old = self._clear_step(item.step) if self._owner.commits_here else None  # others: after round 1
        variant = new_variant() if old is not None else None
        shard = shard_name(gen, self.coordinator.rank, variant)
        progress = CommitProgress()
        committed: Optional[Manifest] = None
        share: Optional[dict[str, Any]] = None
        try:
            if self._shared:
                share = SharedCommit(self.runtime, self.fence, self.coordinator, self.incremental).run(
                    item, lambda: self._clear_step(item.step), d, shard, on_shard, progress)
                written, full, unlisted = share["shard"]["bytes"], not share.get("refs"), list[int]()
            else:
                committed, image, unlisted = self._write_files(item, d, shard, gen, on_shard, progress, old, variant)
                written, full = image.nbytes, image.full
        except BaseException as e:
            self.incremental.forget()
            if not progress.may_commit:
                if variant is None:
                    sweep.discard_save(self.storage, item.step, self._owner, self.coordinator.rank, f"tier {self.name}")
                else:  # the committed step stays as it was
                    sweep.discard_variant(self.storage, item.step, variant, f"tier {self.name}")
                raise
            self._uncertain[item.step] = time.monotonic()  # committed or not, nothing of the step may go now
            if isinstance(e, CommitUncertain):
                raise
            raise CommitUncertain(f"step {item.step} may have committed on tier {self.name}: the write of its COMMIT "
                                  f"reported an error ({type(e).__name__}: {e}); its files are kept meanwhile") from e
        log.info("nebula_ckpt: step %d committed on %s (%.1f MiB%s)", item.step, self.name, written / 2**20,
                 "" if full else ", incremental")
        if old is not None:  # what referred to the old write, then its files (best effort)
            with self._delete_lock:
                sweep.replaced(self.storage, self.fence, item.step, f"tier {self.name}", unlisted)
        if self.incremental.enabled:
            self._new_base(item, gen, full, committed, share)
        if self._shared and not self.coordinator.is_coordinator:
            return written  # retention of a shared tier is the coordinator's
        try:
            self.prune(keep_step=item.step)
        except FencedError:
            raise
        except Exception as e:  # retention is best effort: the checkpoint itself is committed
            log.warning("nebula_ckpt: tier %s: retention failed: %s", self.name, e)
        return written

    def _new_base(self, item: "TierStep", gen: int, full: bool, manifest: Optional[Manifest],
                  share: Optional[dict[str, Any]]) -> None:
        """The step just committed is what this tier's next save builds on."""
        if manifest is not None:
            self.incremental.committed(manifest, full, item.origin)
        elif share is not None:
            self.incremental.committed_share(item.step, gen, share, item.origin)

    def _clear_step(self, step: int) -> Optional[Commit]:
        """Before writing ``step``: make its folder ready (what is removed is never a live writer's);
        the marker of the committed write the save replaces once it commits, if any."""
        st = self.storage
        d = step_dir(step)
        owner = self._owner
        existing = st.list(d)
        if self._shared and not self.coordinator.is_coordinator:
            # Called after the first round (rounds.py): the coordinator has replaced an old checkpoint
            # of this step by then. Only this rank's own leftovers of an uncommitted step go.
            if COMMIT not in existing:
                clear_step(st, step, lambda n: shard_owner(n) is not None and owner.stale(n))
        elif COMMIT in existing:
            # Saving a step that exists: the new run owns the root (it resumed from an older step or
            # saves the same step again). The old one stays whole until the new save replaces it
            # (commit_manifest), but where a step's files travel under fixed names (a shared tier's
            # ranks, replicas on partner nodes) or its marker is unreadable: there it goes first.
            old = None if self._shared or self.runtime.capabilities.has_replicas else \
                sweep.marker_of(st, step, f"tier {self.name}")
            if old is not None:
                log.info("nebula_ckpt: tier %s: step %d is saved again; the committed one stays until the new save "
                         "commits", self.name, step)
                keep = sweep.committed_files(st, step)  # None: not known, nothing goes
                clear_step(st, step, lambda n: keep is not None and n not in keep and owner.stale(n))  # strays
                return old
            log.warning("nebula_ckpt: tier %s: replacing existing checkpoint of step %d", self.name, step)
            with self._delete_lock:
                sweep.drop_referrers(st, step, f"tier {self.name}")
            self.incremental.forget()
            delete_checkpoint(st, step)
        elif self._is_link(d):
            st.remove_dir(d)  # a planted link in place of the folder: unlinked, never followed
        else:  # leftovers of crashed writers of this step, never a live peer's
            clear_step(st, step, owner.stale)
        return None

    def _write_files(self, item: "TierStep", d: str, shard: str, gen: int,
                     on_shard: Optional[Callable[[str], None]], progress: CommitProgress, old: Optional[Commit] = None,
                     variant: Optional[str] = None) -> tuple[Optional[Manifest], TierImage, list[int]]:
        """Shard; then, once the snapshot is confirmed, the manifest (parsed before its marker is written:
        :meth:`Incremental.checked`) and the commit marker; the parsed manifest, the image as written (an
        incremental one whole where the tier found no room for it) and the steps unlisted because they
        referred to the replaced write ``old``."""
        log.debug("nebula_ckpt: phase=shard tier=%s step=%d", self.name, item.step)
        info, image = write_image(self.runtime, f"{d}/{shard}", item)
        if on_shard is not None and image.parts is None:  # a slower tier is fed only a whole image
            on_shard(f"{d}/{shard}")
        item.before_commit()
        assert item.manifest is not None
        manifest = finish_manifest(item.manifest, generation=gen, tensors=image.records, stats=image.stats(),
                                   shards=image.shards({"file": shard, "bytes": image.nbytes, "storage": info}),
                                   restamp=item.restamp)
        checked = self.incremental.checked(manifest, f"tier {self.name} step {item.step}: the manifest to commit")
        with sweep.referrers_unlisted(self.storage, self.fence, item.step, old is not None, progress, self._delete_lock,
                                      f"tier {self.name}") as unlisted:  # no listed step refers to a replaced write
            commit = commit_manifest(self.storage, self.fence, item.step, encode_manifest(manifest), progress,
                                     self.name, item.save, old, variant)
        self._kept.committed(commit, {sh["step"] for sh in manifest["shards"] if sh.get("step") is not None})
        return checked, image, unlisted

    def _check_uncertain(self, step: int) -> None:
        """Refuse to write ``step`` again while an earlier save of it may still commit here."""
        if step in self._uncertain:
            self._settle()  # one whose put can no longer land is settled: it may be written again
        if step in self._uncertain:
            raise PersistError(f"step {step} is not written again on tier {self.name}: an earlier save of it may "
                               "still commit there (its outcome was never confirmed; see the earlier error). Save "
                               "another step, or restart the job")

    def _settle(self) -> set[int]:
        """Settle the uncertain commits that can be (:func:`.sweep.settle`); the leftovers among them."""
        due, left = sweep.settle(self.storage, self._uncertain, time.monotonic())
        self._uncertain = {s: t for s, t in self._uncertain.items() if s not in due}
        self._strays_swept &= not (due - left)  # a replacing write that did not land left its files there
        return left

    def _is_link(self, rel: str) -> bool:
        """Whether ``rel`` is a symlink on a local file system (a tier never follows one)."""
        root = self.storage.local_path("")
        return root is not None and os.path.islink(os.path.join(root, rel))

    def remove(self, step: int) -> bool:
        """Delete the committed checkpoint ``step`` from this tier as retention does (fence checked, commit marker
        first, then its data), or, while later steps refer to it, once none does (the request is recorded on the tier:
        any process's next deletion there honours it); False when the tier holds no committed ``step``. No save of
        ``step`` is in flight (the caller's); retention waits. Raises ``FencedError`` (a newer writer owns the root:
        nothing is deleted)."""
        with self._delete_lock:
            if not self.storage.exists(f"{step_dir(step)}/{COMMIT}"):
                return False
            self.fence.check(f"remove step {step}")
            committed = committed_steps(self.storage)
            self._removals.load(committed)
            users = referrers(self.storage, committed, step)
            if users or not self.incremental.let_go(step):
                log.info("nebula_ckpt: tier %s: step %d is kept while step(s) %s refer to its bytes (incremental "
                         "checkpoints); it goes once none does", self.name, step, users[:8] or "being saved")
                self._removals.request(step)  # on the tier, durably: whoever deletes next honours it
                return True
            log.info("nebula_ckpt: tier %s: removing step %d (remove())", self.name, step)
            delete_checkpoint(self.storage, step)
            self._removals.drop_unreferenced(self.incremental.let_go)
            return True

    def prune(self, keep_step: Optional[int] = None) -> bool:
        """Apply ``keep_last`` / ``keep_every`` and remove leftovers no live writer owns; whether any went."""
        with self._delete_lock:
            return self._prune(keep_step)

    def _prune(self, keep_step: Optional[int]) -> bool:
        st = self.storage
        failed = self._settle() if self._uncertain else set()
        kept = self._kept  # the markers and references of the steps it knows are not read again
        committed, uncommitted = scan_steps(st, kept.current())
        kept.listed(committed, uncommitted)
        due = self._removals.due(committed)  # remove() asked for them: they go once nothing refers to them
        doomed: list[int] = []
        if len(committed) > self.keep_last or due:  # else every step stays (KEEP_ALL): nothing to rank
            for s, mark in kept.unknown(committed).items():
                kept.learn(s, mark, *read_kept(st, s))
            ranked = kept.ranked(committed)  # a restore's order; an unreadable marker: as newest
            # + the newest healthy step; a kept step's references and what a save in flight builds on stay
            doomed = kept.doomed(ranked, self.keep_last, self.tier.keep_every, self.runtime.keep_also(ranked), due,
                                 self.incremental.pinned() | ({keep_step} if keep_step is not None else set()))
        with self._mutex:
            busy_step = self._pending.snap.step if self._pending is not None else None
        candidates = [s for s in uncommitted if s != busy_step and s not in self._uncertain]
        leftovers = sweep.leftover_steps(st, candidates, self._owner, failed)
        abandoned = sweep.abandoned_uploads(st, self.fence.generation)  # ours are never in flight while we prune
        strays = [] if self._strays_swept else \
            sweep.stray_files(st, [s for s in committed if s not in doomed and s not in self._uncertain], self._owner)
        self._strays_swept = True
        if not doomed and not leftovers and not abandoned and not strays:
            return False
        self.fence.check("delete old checkpoints")
        log.debug("nebula_ckpt: phase=prune tier=%s step=%s", self.name, keep_step)
        for s in doomed:
            log.debug("nebula_ckpt: tier %s: retention deletes step %d", self.name, s)
            delete_checkpoint(st, s)
        sweep.remove_leftovers(st, leftovers, abandoned, f"tier {self.name}", strays)
        return True
