"""Snapshot: copy the planned tensors into a staging buffer and settle the verdict.

The training thread enqueues the copy (one native call for all tensors); with
``snapshot="sync"`` it also waits for it. The copy threads checksum each block of the staged
bytes while copying and flag a source that changed under them. The stager thread waits for the
copy, records the tensor index (dtypes, offsets, checksums), takes the SHA-256 that incremental
tiers need (:mod:`nebula_ckpt.save.incremental`; those the memory tier's compare already knows are
not hashed: :func:`nebula_ckpt.save.tier_image.staged_hashes`) and hands the snapshot to the tiers
through :func:`fan_out`. The training thread confirms the verdict (version counters) before any
tier commits.

Fan-out, at the end of this module: how one staged snapshot reaches each tier that takes it.
Two routes:

* **side by side** (the default): every tier reads the staging buffer (a :class:`SlotSource`,
  one reference to the staging slot each);
* **chained**: when the fastest tier links or writes a local file of the shard
  (``runtime.feeds_slower``, the memory tier) and the snapshot is not already staged in such a
  file, that tier goes first and, as soon as its shard is complete, hands the slower tiers its
  file (:class:`FileSource`) and gives the staging buffer back, so the next save can start while
  disk and remote tiers still drain. If it fails before its shard is complete, the slower tiers
  read the staging buffer instead.

A :class:`Delivery` is one snapshot on its way to one tier. Tier writers call ``shard_written``,
``finish`` and ``drop`` on it; they never route anything themselves.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import secrets
import threading
from typing import Any, Callable, Optional, Protocol

from nebula_ckpt.errors import ConsistencyError
from nebula_ckpt.format import manifest as mf
from nebula_ckpt.handle import SaveHandle
from nebula_ckpt.latch import Latch
from nebula_ckpt.native import CopyJob, get_ops, monotonic
from nebula_ckpt.save.buffers import Slot, SlotClaim, StagingPool
from nebula_ckpt.save.plan import Plan
from nebula_ckpt.save.tier_image import Compared, staged_hashes

log = logging.getLogger(__name__)

#: seconds a tier writer waits for the training thread to confirm a snapshot (its next
#: ``optimizer.step``, ``save_async`` or ``wait``) before it runs the check itself
CONFIRM_TIMEOUT_S = 5.0


class _WriteIds:
    """Names of writes: 12 random bytes of this process (drawn again in a forked child) and a
    count, so two writes never share one and no save pays for a draw from ``os.urandom``."""

    def __init__(self) -> None:
        self.reset()
        os.register_at_fork(after_in_child=self.reset)

    def reset(self) -> None:
        self._prefix, self._count = secrets.token_hex(12), itertools.count()

    def next(self) -> str:
        return f"{self._prefix}{next(self._count):08x}"


_write_ids = _WriteIds()


class Taken:
    """What one ``save_async`` took on its way to the stager, recorded as each is taken: the pool's
    :class:`~nebula_ckpt.save.buffers.SlotClaim` (its slot), the copy job, the snapshot. A save cut
    anywhere (a signal handler's exception too) gives back exactly that: the snapshot whole
    (``SavePipeline._take_back``), else the slot after its copy (:meth:`give_back_slot`)."""

    __slots__ = ("claim", "job", "snap")

    def __init__(self) -> None:
        self.claim = SlotClaim()
        self.job: Optional[CopyJob] = None
        self.snap: Optional[Snapshot] = None

    def give_back_slot(self, pool: StagingPool) -> None:
        """No snapshot was made: wait for a copy in flight into the slot (a job the cut lost on
        the way was waited for by its own release), then give the slot back, if one was taken."""
        if self.claim.slot is None:
            return
        try:
            if self.job is not None:
                with contextlib.suppress(Exception):
                    self.job.wait()
        finally:
            pool.release(self.claim.slot)


class Snapshot:
    """One save in flight: its plan, its staging slot and the copy job.

    The slot is reference-counted: the stager holds it until it has offered the snapshot to the
    tiers, each tier that takes it holds it until written; the last release returns it to the pool.
    """

    def __init__(self, plan: Plan, slot: Slot, job: CopyJob, handle: SaveHandle, pool: StagingPool,
                 targets: list[Any], t_start: float, index: int = 0) -> None:
        self.plan = plan
        self.slot = slot
        self.job = job
        self.handle = handle
        self.targets = targets
        self.t_start = t_start
        #: the save's number in the job (every rank numbers its saves alike)
        self.index = index
        self.checksums: list[int] = []  # per layout entry; empty until the copy computed them
        self.tensor_index: dict[str, dict[str, Any]] = {}
        #: key -> SHA-256 of the staged bytes, for the tensors incremental tiers need (stager thread)
        self.hashes: dict[str, str] = {}
        #: the memory tier's compare of the staged bytes with its base, when the stager made it
        #: (:func:`nebula_ckpt.save.tier_image.staged_hashes`)
        self.compared: Optional[Compared] = None
        #: a random name of this write, recorded in its manifests' ``stats`` (``write_id``): two
        #: saves of one step in one writer generation are told apart without trusting a checksum,
        #: and a tier's base records the snapshot it was committed from
        self.write_id = _write_ids.next()
        self.copy_seconds = 0.0
        self._pool = pool
        self._refs = 1
        self._lock = threading.Lock()
        self._copy_lock = threading.Lock()
        self._copied = False
        self._confirmed = Latch()  # set on the training thread: a Ctrl-C there leaves no lock held

    @property
    def step(self) -> int:
        """Step of this snapshot."""
        return self.plan.step

    def stats(self) -> dict[str, Any]:
        """The ``stats`` its manifests record: tensor bytes, copy time and :attr:`write_id`."""
        return {"tensor_bytes": self.plan.tensor_bytes, "copy_seconds": self.copy_seconds, "write_id": self.write_id}

    @property
    def nbytes(self) -> int:
        """Size of the shard image."""
        return self.plan.layout.total_bytes

    def view(self) -> memoryview:
        """The shard image (a zero-copy memoryview of the staging buffer)."""
        return self.slot.view()[: self.nbytes]

    def finish_copy(self) -> None:
        """Wait for the copy (idempotent, any thread) and settle the snapshot verdict."""
        job = self.job
        if job is not None:
            # The wait takes no lock: a signal handler that runs here (a SIGTERM handler's close(),
            # which waits for this save) must not find the lock held that the stager needs too.
            # A failure of the copy is raised again below, where it is settled.
            with contextlib.suppress(Exception):
                job.wait()
        with self._copy_lock:
            if self._copied:
                return
            err: Optional[BaseException] = None
            try:
                self.job.wait()  # done: returns at once, or raises the copy's failure
                self.checksums = self.job.checksums()
                changed = self.job.modified()
                if changed:
                    err = self._consistency_error(changed)
            except Exception as e:  # the copy failed; a signal handler's exception (Ctrl-C, sys.exit)
                err = e             # is the caller's, not the copy's: it propagates, nothing settled
            self._pool.copy_done()
            self.copy_seconds = monotonic() - self.t_start
            self._copied = True
            self.job = None  # type: ignore[assignment]  # drop the source tensor references
            self.handle.progress.set_snapshot(err)

    def confirm(self) -> None:
        """Settle the consistency verdict: no saved tensor changed since ``save_async``.

        In-place kernels bump a tensor's version counter only when they finish, so a check on the
        copy threads can miss a write still in flight. Called on the training thread (hooks,
        ``save_async``, ``wait``, handle methods), every kernel it launched before has finished,
        which makes the check exact. Tier writers wait for this verdict before committing and run
        it themselves after :data:`CONFIRM_TIMEOUT_S` (best effort) if the training thread is silent.
        """
        self.finish_copy()
        with self._copy_lock:
            if self._confirmed.is_set():
                return
            if self.handle.progress.snapshot_failure() is None:
                changed = self.plan.sources.changed()
                if changed:
                    self.handle.progress.fail_snapshot(self._consistency_error(changed))
            self.plan.release_sources()
            self._confirmed.set()

    def wait_confirmed(self) -> None:
        """Wait for :meth:`confirm` from the training thread; do it here after :data:`CONFIRM_TIMEOUT_S`."""
        if not self._confirmed.wait(CONFIRM_TIMEOUT_S):
            self.confirm()

    @property
    def confirmed(self) -> bool:
        """Whether the consistency verdict is settled."""
        return self._confirmed.is_set()

    def _consistency_error(self, changed: list[int]) -> ConsistencyError:
        keys = [self.plan.layout.entries[i].key for i in changed[:5]]
        more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
        return ConsistencyError(
            f"step {self.step}: tensor(s) {keys}{more} changed in place while the snapshot was being "
            "copied, so this checkpoint would not be the state at save_async(); it was not written. "
            "Call handle.wait_snapshot() before changing tensors in place outside optimizer.step() "
            "(which waits by itself).")

    def acquire(self, n: int = 1) -> None:
        """Take ``n`` more references to the staging slot."""
        with self._lock:
            self._refs += n

    def release(self) -> None:
        """Drop one reference; the last one returns the slot to the pool."""
        with self._lock:
            self._refs -= 1
            last = self._refs == 0
        if last:
            self._pool.release(self.slot)


class SlotSource:
    """A tier's view of a snapshot: the staging buffer itself (holds one slot reference)."""

    def __init__(self, snap: Snapshot) -> None:
        self._snap: Optional[Snapshot] = snap

    def view(self) -> memoryview:
        """The shard image."""
        assert self._snap is not None
        return self._snap.view()

    @property
    def path(self) -> Optional[str]:
        """The slot file holding exactly the shard image (memory tier links it), or None."""
        return self._snap.slot.path if self._snap is not None else None

    def release(self) -> None:
        """Drop the slot reference (idempotent)."""
        if self._snap is not None:
            self._snap.release()
            self._snap = None


class FileSource:
    """A tier's view of a snapshot: the shard file a faster tier (memory) already wrote.

    Mapped at hand-off, so the faster tier's retention may unlink the file meanwhile: the mapping
    keeps the bytes alive until released. This is what lets the staging buffer go back to the
    pool as soon as the memory tier has its copy, while disk and remote tiers drain on their own.
    """

    def __init__(self, path: str, nbytes: int) -> None:
        import mmap

        with open(path, "rb") as f:
            self._mm: Optional[mmap.mmap] = mmap.mmap(f.fileno(), nbytes, flags=mmap.MAP_PRIVATE,
                                                      prot=mmap.PROT_READ | mmap.PROT_WRITE) if nbytes else None
        self._nbytes = nbytes

    def view(self) -> memoryview:
        """The shard image."""
        return memoryview(self._mm) if self._mm is not None else memoryview(bytearray())

    def release(self) -> None:
        """Unmap (when no view is left; otherwise when the last view goes)."""
        self._mm = None


class Stager:
    """The thread between the training thread and the tier writers."""

    def __init__(self, name: str) -> None:
        # a SimpleQueue: put() is one C call, so a Ctrl-C in save_async cannot leave a queue lock held
        self._q: "queue.SimpleQueue[Optional[Snapshot]]" = queue.SimpleQueue()
        #: hand over a snapshot whose copy is enqueued: the queue's own ``put``, one C call (a
        #: signal handler's exception lands before the snapshot is queued or after, never inside)
        self.submit: Callable[[Snapshot], None] = self._q.put
        self._thread = threading.Thread(target=self._run, name=f"nebula-stager-{name}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Finish the queued snapshots and stop."""
        self._q.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            snap = self._q.get()
            if snap is None:
                return
            try:
                self._stage(snap)
            except BaseException as e:  # never let the thread die; report on the handle
                log.exception("nebula_ckpt: staging step %d failed", snap.step)
                if not snap.handle.progress.snapshot_settled():
                    snap.handle.progress.set_snapshot(e)
                else:
                    for t in snap.targets:
                        snap.handle.progress.tier_done(t.name, e)
                snap.release()

    def _stage(self, snap: Snapshot) -> None:
        log.debug("nebula_ckpt: phase=snapshot step=%d", snap.step)
        snap.finish_copy()
        if snap.handle.progress.snapshot_failure() is not None:
            snap.release()
            return
        entries = snap.plan.layout.entries
        sums = snap.checksums  # taken by the copy threads while copying (native CPU path)
        if len(sums) != len(entries):
            sums = get_ops().crc32c(snap.slot.buffer, [e.offset for e in entries], [e.nbytes for e in entries])
        devices = snap.plan.devices
        snap.tensor_index = {
            e.key: {"dtype": e.dtype, "shape": list(e.shape), "offsets": [e.offset, e.offset + e.nbytes],
                    "crc32c": c, "device": devices.get(e.key, "cpu")}
            for e, c in zip(entries, sums, strict=False)}
        for k, info in snap.plan.dtensors.items():
            if k in snap.tensor_index:  # a tied key is an alias of the stored one
                snap.tensor_index[k]["dtensor"] = info.to_json()
        snap.hashes, snap.compared = staged_hashes(snap.targets, snap.view(), snap.tensor_index)
        log.debug("nebula_ckpt: step %d staged (%d tensors, %.1f MiB, copy %.1f ms)", snap.step,
                  len(entries), snap.nbytes / 2**20, snap.copy_seconds * 1e3)
        fan_out(snap, snap.targets)  # takes over the stager's reference


def build_tier_manifest(snap: Snapshot, generation: int, shard: dict[str, Any]) -> dict[str, Any]:
    """The manifest of ``snap`` as written on one tier."""
    return mf.build_manifest(step=snap.step, generation=generation, shards=[shard],
                             tensors=snap.tensor_index, aliases=snap.plan.aliases, tree=snap.plan.tree,
                             stats=snap.stats(), tag=snap.plan.tag, hashes=snap.hashes)


# -- fan-out: one staged snapshot on its way to each tier -----------------------------------------


class Target(Protocol):
    """What the fan-out uses of a tier writer (:class:`nebula_ckpt.save.writer.TierWriter`)."""

    name: str
    runtime: Any

    def offer(self, delivery: "Delivery") -> Any:
        """Queue ``delivery`` for this tier."""


class Delivery:
    """One snapshot on its way to one tier: the source it reads and the tiers it feeds.

    Args:
        snap: the snapshot.
        source: what the tier reads (owned: released exactly once).
        downstream: slower tiers this tier hands its shard file to once written.
    """

    def __init__(self, snap: Snapshot, source: Any, downstream: Optional[list["Target"]] = None) -> None:
        self.snap = snap
        self.source = source
        self.downstream = list(downstream or [])
        self._handed = False

    def shard_written(self, path: Optional[str]) -> None:
        """The tier's shard file at ``path`` is complete: feed the slower tiers from it."""
        if not self.downstream or self._handed:
            return
        assert path is not None, "a tier that feeds slower tiers writes a local file"
        for w in self.downstream:
            w.offer(Delivery(self.snap, FileSource(path, self.snap.nbytes)))
        self._handed = True
        self.source.release()  # the staging buffer goes back now

    def finish(self) -> None:
        """The tier is done (committed or failed): route what is left, release the source."""
        if self.downstream and not self._handed:
            # Failed before our shard was complete: the slower tiers read the staging buffer.
            self.snap.acquire(len(self.downstream))
            for w in self.downstream:
                w.offer(Delivery(self.snap, SlotSource(self.snap)))
            self._handed = True
        self.source.release()

    def drop(self, writer_name: str, why: str) -> None:
        """The tier skips this snapshot (a newer one came while it was busy): so do its feeds."""
        log.info("nebula_ckpt: tier %s dropped step %d (%s)", writer_name, self.snap.step, why)
        for name in [writer_name, *(w.name for w in self.downstream)]:
            self.snap.handle.progress.tier_done(name, dropped=True)
        self.source.release()


def fan_out(snap: Snapshot, targets: list["Target"]) -> None:
    """Offer ``snap`` (holding one staging reference, which this takes over) to its tiers."""
    first, rest = targets[0], targets[1:]
    if rest and first.runtime.feeds_slower and snap.slot.path is None:
        first.offer(Delivery(snap, SlotSource(snap), rest))
        return
    snap.acquire(len(targets) - 1)
    for t in targets:
        t.offer(Delivery(snap, SlotSource(snap)))
