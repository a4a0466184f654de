"""Checkpointer: the orchestration of plan -> snapshot -> fan-out -> persist, and of restore.

Only this module knows the order of the stages. Threads:

* the training thread runs :meth:`Checkpointer.save_async` up to enqueuing the copy (and, with
  ``snapshot="sync"``, waiting for it and settling the verdict);
* one stager thread waits for copies, records the tensor index and fans snapshots out to tiers;
* one writer thread per tier persists them.
"""

from __future__ import annotations

import atexit
import builtins
import logging
import threading
import weakref
from typing import Any, Callable, Optional, Sequence

import torch

from nebula_ckpt import knobs
from nebula_ckpt.errors import CorruptCheckpointError, NebulaError, NotFoundError, ValidationError
from nebula_ckpt.format.commit import committed_steps
from nebula_ckpt.format.names import COMMIT, check_tag, step_dir
from nebula_ckpt.handle import SaveHandle
from nebula_ckpt.native import describe as native_describe
from nebula_ckpt.native import get_ops, monotonic
from nebula_ckpt.ranks.coordinator import Coordinator, LocalCoordinator
from nebula_ckpt.ranks.distributed import default_coordinator
from nebula_ckpt.ranks.fencing import Fence, read_run_id, run_id
from nebula_ckpt.restore.adopt import adoption_for
from nebula_ckpt.restore.core import apply, find_and_open, list_candidates, materialize, read_manifest, stage_restore
from nebula_ckpt.save.buffers import StagingPool
from nebula_ckpt.save.fanout import fan_out
from nebula_ckpt.save.persist import TierWriter
from nebula_ckpt.save.plan import check_step, make_plan
from nebula_ckpt.save.snapshot import Snapshot, Stager
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.storage.urls import canonical_root, refuse_url_credentials
from nebula_ckpt.tiers.base import Tier, now
from nebula_ckpt.tiers.factory import runtime_for
from nebula_ckpt.tiers.memory.shm import Owner
from nebula_ckpt.tiers.roots import default_tiers, tier_for_root
from nebula_ckpt.tiers.runtime import TierRuntime

log = logging.getLogger("nebula_ckpt")

#: prepares the restore of one opened candidate (see :func:`~nebula_ckpt.restore.core.stage_restore`)
Stage = Callable[[Any], None]

#: Unguarded tensors (see the consistency rule) on the CPU up to this many bytes in all are copied
#: on the training thread, so that an asynchronous save of, e.g., a model, its optimizer and an RNG
#: state still overlaps its copy; more, or any on a GPU, make the save synchronous.
SMALL_UNGUARDED_BYTES = 1 << 20

#: every Checkpointer not yet closed (strong references: a forgotten one must still be flushed at
#: interpreter exit, see :func:`_close_at_exit`; close() removes it)
_open_checkpointers: "set[Checkpointer]" = set()


def _check_arguments(root: Any, keep_last: Any, max_host_bytes: Any, on_full: Any, on_persist_error: Any,
                     snapshot: Any) -> None:
    """The constructor's validation, all before anything is touched."""
    if not isinstance(root, str) or not root:
        raise ValidationError(f"root must be a non-empty path or URL string, got {root!r}")
    refuse_url_credentials(root)  # before the root is parsed, logged or written anywhere
    if not isinstance(keep_last, int) or keep_last < 1:
        raise ValidationError(f"keep_last must be an int >= 1 (the newest checkpoint is always kept), "
                              f"got {keep_last!r}")
    if max_host_bytes is not None and (not isinstance(max_host_bytes, int) or max_host_bytes <= 0):
        raise ValidationError(f"max_host_bytes must be a positive int or None, got {max_host_bytes!r}")
    if on_full not in ("wait", "skip"):
        raise ValidationError(f"on_full must be 'wait' or 'skip', got {on_full!r}")
    if on_persist_error not in ("raise", "log"):
        raise ValidationError(f"on_persist_error must be 'raise' or 'log', got {on_persist_error!r}")
    if snapshot not in ("auto", "sync", "async"):
        raise ValidationError(f"snapshot must be 'auto', 'sync' or 'async', got {snapshot!r}")


def _close_at_exit() -> None:
    """Close every checkpointer the program forgot to close, so no accepted save is lost.

    Runs from ``atexit``: before Python stops the writer threads, each pending save is written
    (its snapshot was taken when ``save_async`` returned, so it is the state the user asked for).
    """
    for ck in list(_open_checkpointers):
        if ck._closed:
            continue
        pending = ck._save_index
        log.warning("nebula_ckpt: Checkpointer(%s) was not closed; closing it at exit so its pending "
                    "saves are written (call close() or use it as a context manager)", canonical_root(ck.root))
        try:
            ck.close(timeout=knobs.get("exit_timeout_s"))
        except BaseException as e:  # at exit nobody can catch it: log it loudly instead
            log.error("nebula_ckpt: closing Checkpointer(%s) at exit failed after %d save(s): %s: %s",
                      canonical_root(ck.root), pending, type(e).__name__, e)


atexit.register(_close_at_exit)


class Checkpointer:
    """Asynchronous, tiered checkpoints of a training job.

    Args:
        root: local path or any fsspec URL (``az://c/p``, ``s3://b/p``, ``file:///p``). It is the
            run's identity and, unless ``tiers`` is given, its persistent tier.
        storage_options: fsspec options for a remote ``root`` (credentials; never logged).
        tiers: explicit tiers, fastest first (default: ``[MemoryTier(), <root tier>]``).
        keep_last: committed checkpoints kept per tier unless the tier says otherwise.
        max_host_bytes: cap on host staging memory (default: two buffers' worth with a remote
            tier, one otherwise).
        memory_tier: add the default memory tier (ignored when ``tiers`` is given).
        on_full: ``"wait"`` (default) or ``"skip"``: what a save does when every staging buffer
            is still being persisted.
        allow_pickle: allow saving (and loading) values typed JSON cannot hold, via pickle.
        on_persist_error: ``"raise"`` (default): a background failure is raised from the next
            ``save_async`` / ``wait`` / ``close`` unless already seen through its handle;
            ``"log"``: only on the handle and in the log (training goes on).
        snapshot: when ``save_async`` returns. ``"sync"``: after the copy into host memory is
            done and checked (one parallel memcpy of the state; nothing done afterwards can reach
            the checkpoint). ``"async"``: as soon as the copy is enqueued; the copy overlaps the
            next forward/backward, guarded by step/forward hooks and version counters (see the
            consistency rule). ``"auto"`` (default): ``"sync"`` for states on the CPU (the copy
            competes with training for the same cores and memory anyway, and changes through
            ``.data`` or numpy, which no version counter sees, cannot tear it), ``"async"`` when
            the state has CUDA tensors (the device-to-host copy then overlaps compute). A state
            holding live tensors no hook guards (a plain dict of ``state_dict()`` results) is
            always taken synchronously (see the consistency rule).
        coordinator: how the ranks of a job agree (writer generation, commit, restore step).
            Default: with an initialised ``torch.distributed`` process group of several ranks, a
            :class:`~nebula_ckpt.ranks.distributed.DistCoordinator` over all of them (construct the
            Checkpointer on every rank, in the same order: the constructor is a collective);
            otherwise :class:`~nebula_ckpt.ranks.coordinator.LocalCoordinator` (one process).
        read_only: open the root for reading only (``list``, ``tags``, ``steps``, ``read``,
            ``load``, ``load_latest``): nothing is created, claimed or written on any tier, not
            even the root's folder or its ``_nebula/run.json`` (a root that does not exist reads
            as empty); the memory tier is read when it holds this root's current run. ``save_async``,
            ``prepare`` and ``remove`` raise. What reads a root named by a file (a framework's
            pointer file) opens it so.

    Example::

        ckpt = nc.Checkpointer("/ckpt/run-42")
        for step in range(n):
            train_step()
            if step % 100 == 0:
                ckpt.save_async(step, {"model": model, "optim": opt, "step": step})
        ckpt.close()

    Consistency rule: a checkpoint is the state at the moment ``save_async`` was called. With
    ``snapshot="sync"`` (the default for CPU states) the copy is finished when the call returns.
    With ``"async"`` (the default for CUDA states) the copy runs after the call returns, so the
    next ``optimizer.step()`` of every optimizer in the state (and the next forward of a module
    with buffers) waits for it automatically; before any other in-place change to a saved tensor
    call ``handle.wait_snapshot()``. A change seen by PyTorch's version counters, or one racing
    the copy of a tensor, is detected and that save fails with :class:`ConsistencyError`; a
    change through ``.data`` or numpy made before the copy reached that tensor is invisible to
    any check, which is why CPU states default to ``"sync"``. A committed checkpoint's bytes
    always match its checksums.

    Only tensors reached through a module or an optimizer passed *as an object* have such a
    mutation point to hook. A save whose state holds other live tensors (a plain dict such as
    ``{"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()]}``, what
    frameworks hand over) is therefore taken synchronously whatever ``snapshot`` says: it returns
    once the copy is done, so changing those tensors afterwards never reaches the checkpoint.
    (Up to :data:`SMALL_UNGUARDED_BYTES` of such tensors on the CPU, e.g. an RNG state saved
    beside a model and optimizer, are copied on the spot instead, and the rest still overlaps.)
    Optimizer wrappers (accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``,
    DeepSpeed's) are saved through their own ``state_dict()`` and hooked on the
    ``torch.optim.Optimizer`` they wrap; module wrappers (DDP, ``torch.compile``'s
    ``OptimizedModule``) are modules and hooked as they are (call the object you saved).
    """

    def __init__(self, root: str, *, storage_options: Optional[dict[str, Any]] = None,
                 tiers: Optional[Sequence[Tier]] = None, keep_last: int = 3,
                 max_host_bytes: Optional[int] = None, memory_tier: bool = True, on_full: str = "wait",
                 allow_pickle: bool = False, on_persist_error: str = "raise", snapshot: str = "auto",
                 coordinator: Optional[Coordinator] = None, read_only: bool = False) -> None:
        _check_arguments(root, keep_last, max_host_bytes, on_full, on_persist_error, snapshot)
        #: opened for reading only (see ``read_only``)
        self.read_only = bool(read_only)
        self.snapshot = snapshot
        #: how the ranks of the job agree (one process: :class:`LocalCoordinator`, a no-op)
        self.coordinator = coordinator or default_coordinator() or LocalCoordinator()
        self.root = root
        self._keep_last = keep_last
        self.allow_pickle = allow_pickle
        self.on_persist_error = on_persist_error
        self._open_tiers(*self._choose_tiers(storage_options, tiers, memory_tier))
        self._fence = Fence(self._root_storage, self.coordinator)
        runtimes = list(self._runtimes)

        def give_back() -> None:  # fenced on one tier, fenced on all: the memory tier's lock goes
            for rt in runtimes:
                rt.fenced()
        self._fence.on_fenced(give_back)
        if self.coordinator.world_size > 1 and not self.read_only:
            # Collectives belong here, where every rank is (the constructor): one root for all
            # ranks, the job's writer generation, and the rounds of each shared tier.
            self._check_shared_root()
            _ = self._fence.generation
            for rt in self._runtimes:
                if rt.tier.shared:
                    self.coordinator.open_tier(rt.name, rt.tier.every)
        # A second staging slot lets the next save start while a slower tier still reads one.
        self._pool = StagingPool(max_host_bytes, 1 if len(self._runtimes) == 1 else 2, on_full)
        self._writers: Optional[list[TierWriter]] = None
        self._stager: Optional[Stager] = None
        self._lock = threading.Lock()
        self._handles: list[SaveHandle] = []
        self._inflight: list[Snapshot] = []
        self._hooked: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._hook_handles: list[Any] = []
        self._save_index = 0
        self._metrics: dict[str, Any] = {"saves_finished": 0, "bytes_saved": 0, "blocked_s_total": 0.0,
                                         "blocked_s_max": 0.0, "durable_s_last": {}, "last_save": None}
        self._closed = False
        self._told_unguarded = False
        #: ``{"step", "tier", "adopted_bytes"}`` of the last restore (``None`` before any);
        #: ``adopted_bytes``: bytes the memory tier handed over without a copy (:mod:`.adopt`).
        self.last_restore: Optional[dict[str, Any]] = None
        _open_checkpointers.add(self)
        log.info("nebula_ckpt: checkpointer on %s, tiers %s, %s path", canonical_root(root),
                 [rt.name for rt in self._runtimes], native_describe()["path"])

    def _choose_tiers(self, storage_options: Optional[dict[str, Any]], tiers: Optional[Sequence[Tier]],
                      memory_tier: bool) -> tuple[list[Tier], Tier]:
        """The tiers to use (validated, bound to root and rank) and the persistent root's tier."""
        rank = self.coordinator.rank
        root_tier = tier_for_root(self.root, storage_options)
        if tiers is None:
            chosen: list[Tier] = default_tiers(self.root, storage_options, memory_tier, rank)
            root_tier = chosen[-1]
        else:
            chosen = list(tiers)
            if not chosen:
                raise ValidationError("tiers must name at least one tier")
        for t in chosen:
            if not isinstance(t, Tier):
                raise ValidationError(f"tiers must be Tier objects (MemoryTier, LocalTier, RemoteTier), got {t!r}")
            t.bind(self.root, rank)
            t.validate()
        return chosen, root_tier

    def _open_tiers(self, chosen: list[Tier], root_tier: Tier) -> None:
        """Reach every tier (fail fast), take the root's run id, let each tier open for this run.

        Read only: the run id is only read (None: no run ever opened the root) and a tier is
        used when :meth:`~nebula_ckpt.tiers.runtime.TierRuntime.unreadable` allows it, which
        creates, claims and writes nothing."""
        runtimes = [runtime_for(t, t.make_storage()) for t in chosen]
        for rt in runtimes:  # fail fast, before leaving anything behind (a listing: nothing written)
            rt.storage.check_access()
        by_name = {rt.name: rt.storage for rt in runtimes}
        self._root_storage = by_name.get(root_tier.name) or root_tier.make_storage()
        self._own_root_storage = root_tier.name not in by_name
        if self._own_root_storage:
            self._root_storage.check_access()
        #: id of this incarnation of the root (``_nebula/run.json``); fast tiers are tied to it
        self.run_id: Optional[str] = read_run_id(self._root_storage) if self.read_only else run_id(self._root_storage)
        owner = Owner(canonical_root(self.root), self.run_id)
        self._runtimes: list[TierRuntime] = []
        for rt in runtimes:
            why = (rt.unreadable(owner) or None) if self.read_only else (None if rt.open(owner) else "refused")
            if why is None:
                self._runtimes.append(rt)
            else:
                if self.read_only:
                    log.debug("nebula_ckpt: tier %s not read: %s", rt.name, why)
                rt.release()

    def _check_shared_root(self) -> None:
        """Every rank must see the same root: on a root that is not shared (a node-local path in a
        multi-node job) each node would hold a part of every checkpoint and none would restore."""
        ids = self.coordinator.exchange(self.run_id)
        if len(set(ids)) > 1:
            groups: dict[str, list[int]] = {}
            for r, i in enumerate(ids):
                groups.setdefault(i, []).append(r)
            for rt in self._runtimes:
                rt.release()
            if self._own_root_storage:
                self._root_storage.close()
            raise ValidationError(
                f"root {canonical_root(self.root)} is not the same place for every rank: ranks see "
                f"{len(groups)} different roots (by run id: {[g[:4] for g in groups.values()]}); use a path "
                "on a file system every node mounts, or a blob URL (az://, s3://), for a multi-rank job")

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            raise NebulaError(f"{what}() on a read-only Checkpointer of {canonical_root(self.root)} (opened with "
                              "read_only=True, which never writes): open it without read_only to write")

    # -- properties -----------------------------------------------------------------------------
    @property
    def tiers(self) -> list[Tier]:
        """The active tiers, fastest first."""
        return [rt.tier for rt in self._runtimes]

    def _start(self) -> list[TierWriter]:
        """At the first save: the tiers this process writes, their writer threads, the stager."""
        if self._writers is None:
            writing = [rt for rt in self._runtimes if rt.open_for_writing()]
            if not writing:
                raise NebulaError(f"no tier of {canonical_root(self.root)} can be written by this process")
            # With a tier that links staged files (the memory tier), CPU saves stage in its slot
            # files: the bytes are copied once. Reading tiers that are not written stays possible.
            self._pool.slot_dir = next((d for d in (rt.staging_dir() for rt in writing) if d), None)
            self._pool.max_slots = 1 if len(writing) == 1 else 2
            self._writers = [TierWriter(rt, self._fence.for_tier(rt.storage), rt.tier.keep_last or self._keep_last,
                                        self.coordinator) for rt in writing]
            self._stager = Stager(canonical_root(self.root)[-24:], fan_out)
        return self._writers

    # -- saving -----------------------------------------------------------------------------------
    def prepare(self, state: Any, *, wait: bool = False) -> None:
        """Make the staging memory for saves of ``state`` now, in the background (optional).

        The first save of a state otherwise finds no staging buffer and pays for fresh memory
        (page faults, and on a virtual machine the host backing it) on the training thread. Call
        this once the state has its final size: after ``load_latest`` restored it, or after the
        first optimizer step created the optimizer's state. Returns at once (``wait=True``: once
        the buffer is ready); a save that comes before the buffer is ready allocates as it would
        have. Checks ``state`` like :meth:`save_async` (``ValidationError``, nothing written).
        """
        if self._closed:
            raise NebulaError("prepare() on a closed Checkpointer")
        self._check_writable("prepare")
        plan = make_plan(0, state, allow_pickle=self.allow_pickle)
        self._start()
        self._pool.prepare(plan.layout.total_bytes, any(t.is_cuda for t in plan.sources))
        if wait:
            self._pool.wait_prepared()

    def save_async(self, step: int, state: Any, *, tag: Optional[str] = None) -> SaveHandle:
        """Snapshot ``state`` and persist it in the background.

        Returns once the copy into host memory is done (``snapshot="sync"``, and always for a
        state holding live tensors no hook guards, such as a plain dict of ``state_dict()``
        results) or enqueued (``"async"``: the next ``optimizer.step()`` / forward waits for it).
        See the class docstring for the consistency rule.

        A checkpoint of several named parts (DeepSpeed's successive ``save(state_dict, path)``
        calls between ``create(tag)`` and ``commit(tag)``, Azure ML Nebula's
        ``Checkpoint.save(name, obj)``) is one state ``{name: obj, ...}`` saved once, at commit,
        with the framework's tag as ``tag``: nothing else is needed.

        Args:
            step: non-negative int; names the checkpoint (``step-<N>/``).
            state: tree of dicts / lists / tuples with tensors, NumPy arrays and scalars (stored
                without pickle: RNG states round-trip), plain values, and objects with
                ``state_dict()`` (modules, optimizers and their wrappers, schedulers, GradScaler)
                as leaves.
            tag: a name for the checkpoint, as frameworks address them (Lightning's path,
                DeepSpeed's tag): 1-256 characters of ``A-Z a-z 0-9 _ . ~ : @ = + , / -``. It is
                recorded in the manifest; :meth:`tags`, ``load(tag=...)``, ``read(tag=...)`` and
                ``remove(tag=...)`` find the checkpoint by it. Several steps may carry one tag
                (the newest is the one it names); retention treats tagged checkpoints like any other.

        Returns:
            A :class:`SaveHandle`.

        Raises:
            ValidationError: bad input (state, step or tag), naming the key or field; nothing was
                written.
            PersistError: an earlier save failed and was not yet seen (``on_persist_error="raise"``).
        """
        if self._closed:
            raise NebulaError("save_async() on a closed Checkpointer")
        self._check_writable("save_async")
        self._confirm_inflight()
        self._raise_unseen()
        t0 = monotonic()
        plan = make_plan(step, state, allow_pickle=self.allow_pickle, tag=tag)
        self._pool.check_fits(plan.layout.total_bytes)
        writers = self._start()
        t_now = now()
        with self._lock:
            idx = self._save_index
            self._save_index += 1
        try:
            return self._save_indexed(idx, plan, writers, t_now, t0)
        except BaseException:
            for w in writers:  # the ranks' rounds of this save go on without this rank
                self.coordinator.abandon(w.name, idx)
            raise

    def _save_indexed(self, idx: int, plan: Any, writers: list[TierWriter], t_now: float, t0: float) -> SaveHandle:
        """The rest of :meth:`save_async` for save number ``idx`` of this job."""
        targets = [w for w in writers if w.wants(idx, t_now)]
        for w in writers:
            if w not in targets:
                self.coordinator.abandon(w.name, idx)
        handle = SaveHandle(plan.step, [w.name for w in targets], plan.tag)
        handle._begin(t0, plan.layout.total_bytes, self._save_finished)
        handle._bind_settled(lambda tier: self.coordinator.abandon(tier, idx))
        if not targets:
            handle._skip("no tier's cadence wanted this save")
            handle._returned()
            return handle
        pinned = any(t.is_cuda for t in plan.sources)
        overlap = self._may_overlap(plan, pinned)
        slot = self._pool.acquire(plan.layout.total_bytes, pinned, self._reclaim)
        if slot is None:
            log.warning("nebula_ckpt: step %d skipped: every staging buffer is still being persisted "
                        "(on_full='skip')", plan.step)
            handle._skip("no free staging buffer (on_full='skip')")
            handle._returned()
            return handle
        for w in targets:  # the save goes ahead: only now does it count for every_seconds
            w.took(t_now)
        try:
            header = plan.layout.header
            slot.buffer.numpy().data[: len(header)] = header  # plain memcpy (ATen copy_ costs ms here)
            # A save the training thread waits for copies at memcpy speed: the stager takes the
            # checksums of the staged bytes afterwards, off the training thread (nothing can
            # change them). An overlapped copy checksums while copying and checks each block
            # against a hash taken before its copy (writes through .data / numpy during it).
            job = get_ops().enqueue_copy(plan.sources, slot.buffer, [e.offset for e in plan.layout.entries],
                                         checksum=overlap)
        except BaseException:
            self._pool.release(slot)  # nothing is in flight: the slot goes back
            raise
        snap = Snapshot(plan, slot, job, handle, self._pool, targets, t0)
        try:
            snap.index = idx
            handle._bind_confirm(snap.confirm)
            if overlap:
                overlap = self._install_hooks(plan.optimizers, plan.modules_with_buffers)
            if not overlap:
                snap.confirm()  # the copy is done and checked before we return: nothing can tear it
            with self._lock:
                if overlap:
                    self._inflight = [s for s in self._inflight if not s.confirmed] + [snap]
                self._handles = [h for h in self._handles if not (h.done() and (h.seen or h.error() is None))]
                self._handles.append(handle)
            assert self._stager is not None
            self._stager.submit(snap)  # last: from here on the stager owns the snapshot
        except BaseException as e:
            self._take_back(snap, handle, e)
            raise
        handle._returned()
        return handle

    def _may_overlap(self, plan: Any, pinned: bool) -> bool:
        """Whether this save may return before its copy is done: the snapshot mode asks for it and
        every tensor has a mutation point the hooks guard. The few small CPU tensors that have
        none (an RNG state beside a model) are copied here instead (:data:`SMALL_UNGUARDED_BYTES`)."""
        if self.snapshot == "sync" or (self.snapshot == "auto" and not pinned):
            return False
        if not plan.unguarded:
            return True
        srcs = [plan.sources[i] for i in plan.unguarded]
        if not any(t.is_cuda for t in srcs) and \
                sum(t.numel() * t.element_size() for t in srcs) <= SMALL_UNGUARDED_BYTES:
            try:
                copies = [t.clone() for t in srcs]
            except Exception:  # a dtype without clone(): copy it with the rest, synchronously
                copies = []
            if copies:
                for i, c in zip(plan.unguarded, copies, strict=True):
                    plan.sources[i], plan.versions[i] = c, c._version
                return True
        if not self._told_unguarded:
            self._told_unguarded = True
            keys = [plan.layout.entries[i].key for i in plan.unguarded]
            log.info("nebula_ckpt: snapshot=%r, but tensor(s) %s%s of the state are not inside a module or optimizer "
                     "passed as an object, so no hook can make their next change wait for the copy: such saves "
                     "return once the copy is done (pass the model and optimizer themselves to overlap it)",
                     self.snapshot, keys[:3], f" and {len(keys) - 3} more" if len(keys) > 3 else "")
        return False

    def _take_back(self, snap: Snapshot, handle: SaveHandle, error: BaseException) -> None:
        """``save_async`` failed after enqueuing its copy: wait for the copy (it writes into the
        slot), give the slot back and end the handle with ``error``, so that nothing of this save
        stays in flight (``wait()`` / ``close()`` do not wait for it, the next save gets a slot)."""
        try:
            snap.finish_copy()
        finally:
            with self._lock:
                self._inflight = [s for s in self._inflight if s is not snap]
                self._handles = [h for h in self._handles if h is not handle]
            handle._abort(error)
            snap.release()

    def _reclaim(self) -> bool:
        """Free staging buffers held only by snapshots slow tiers have not started on."""
        return any([w.drop_pending() for w in self._writers or []])

    def save(self, step: int, state: Any, *, tag: Optional[str] = None) -> SaveHandle:
        """Synchronous save: :meth:`save_async` (same arguments) then wait until durable (raises on failure)."""
        h = self.save_async(step, state, tag=tag)
        h.result()
        return h

    def _confirm_inflight(self, *_: Any, **__: Any) -> None:
        """Hook body (training thread): wait for pending snapshot copies and confirm them."""
        if not self._inflight:
            return
        with self._lock:
            pending, self._inflight = self._inflight, []
        for s in pending:
            t = monotonic()
            s.confirm()
            s.handle._add_stall(monotonic() - t)

    def _install_hooks(self, optimizers: list[Any], modules: list[torch.nn.Module]) -> bool:
        """Make the next step / forward wait for the copy; False if an object cannot be hooked
        (a wrapped optimizer without PyTorch's hook machinery): the save then waits itself."""
        try:
            for opt in optimizers:
                if opt not in self._hooked:
                    self._hook_handles.append(opt.register_step_pre_hook(self._confirm_inflight))
                    self._hooked.add(opt)
            for m in modules:
                if m not in self._hooked:
                    self._hook_handles.append(m.register_forward_pre_hook(self._confirm_inflight))
                    self._hooked.add(m)
        except Exception as e:
            log.debug("nebula_ckpt: cannot hook %s (%s): this save waits for its copy", type(e).__name__, e)
            return False
        return True

    def _raise_unseen(self) -> None:
        if self.on_persist_error != "raise":
            return
        with self._lock:
            for h in self._handles:
                if h.done() and not h.seen and h.error() is not None:
                    h.seen = True
                    raise h.error()  # type: ignore[misc]

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until every save so far is durable on every tier that took it.

        Raises:
            PersistError / ConsistencyError: the first failure not yet seen through a handle.
        """
        self._confirm_inflight()
        with self._lock:
            handles = list(self._handles)
        for h in handles:
            if not h.wait(timeout):
                raise TimeoutError(f"save of step {h.step} not durable after {timeout} s")
        for w in self._writers or []:
            w.wait_idle(timeout)
        self._raise_unseen()

    def close(self, timeout: Optional[float] = None) -> None:
        """Wait for every pending persist, stop the threads, remove the memory tier.

        The memory tier is removed only when its newest checkpoint is also committed on a slower
        tier; otherwise it is kept (and logged), so that a restart can still restore from it.

        Raises:
            PersistError: a failure not yet seen through a handle.
        """
        if self._closed:
            return
        self._closed = True
        timed_out = False
        try:
            self.wait(timeout)
        except TimeoutError:
            timed_out = True
            raise
        finally:
            self._shutdown(join=not timed_out)

    def _shutdown(self, join: bool) -> None:
        """Stop hooks and threads, free staging, let each tier close (the memory tier frees its RAM
        when its newest step is safe elsewhere), release the tiers.

        ``join=False`` (a timed-out close): nothing is waited for or removed; the daemon threads
        end with the process and a restart finds whatever had committed.
        """
        for hh in self._hook_handles:
            hh.remove()
        self._hook_handles.clear()
        _open_checkpointers.discard(self)
        if join:
            if self._stager is not None:
                self._stager.close()
            for w in self._writers or []:
                w.wait_idle()
            self._flush_newest()
            written = [w.runtime for w in self._writers or []]
            for rt in written:
                rt.close(written)   # e.g. the memory tier frees its RAM when that is safe
            for w in self._writers or []:
                w.close()
            self.coordinator.close(self._save_index)
            self._pool.close()
        for rt in self._runtimes:
            rt.release()
        if self._own_root_storage:
            self._root_storage.close()

    def _flush_newest(self) -> None:
        """Put the newest committed step on every persistent tier that lacks it (cadence, drops).

        A disk or remote tier with ``every=N`` (or one that dropped saves while busy) would
        otherwise end the job older than the memory tier, which does not survive a reboot.
        """
        if self._writers is None:
            return  # nothing was saved by this checkpointer
        if self.coordinator.world_size > 1:
            return  # a multi-rank copy would need every rank again: not done at close (see README)
        have = {w.name: set(committed_steps(w.storage)) for w in self._writers}
        newest = max((max(s) for s in have.values() if s), default=None)
        if newest is None:
            return
        src = next((w.storage for w in self._writers if newest in have[w.name] and w.storage.is_local), None)
        for w in self._writers:
            if not w.tier.persistent or newest in have[w.name]:
                continue
            try:
                if src is None:
                    raise NebulaError("no tier with a local copy of it")
                w.copy_from(src, newest)
                log.info("nebula_ckpt: close() put the newest step %d on %s", newest, w.name)
            except Exception as e:
                log.error("nebula_ckpt: close() could not put the newest step %d on %s (it ends at step "
                          "%s): %s: %s", newest, w.name, max(have[w.name], default=None), type(e).__name__, e)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:
            try:
                self.close()
            except NebulaError as e:  # don't hide the exception that is already propagating
                log.error("nebula_ckpt: close() after an exception also failed: %s", e)

    # -- listing and restoring ---------------------------------------------------------------------
    def _tier_pairs(self) -> list[tuple[Tier, Storage]]:
        return [(rt.tier, rt.storage) for rt in self._runtimes]

    def list(self, detailed: bool = False) -> Any:
        """Committed steps, ascending (the union over tiers).

        Args:
            detailed: return ``{tier name: [steps]}`` instead.

        See :meth:`tags` for the steps' tags.
        """
        per = {t.name: committed_steps(st) for t, st in self._tier_pairs()}
        if detailed:
            return per
        return sorted({s for steps in per.values() for s in steps})

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def steps(self, *, check_shards: bool = True) -> dict[int, Optional[str]]:
        """Step -> tag (None: untagged) of every committed step whose manifest checks out on some
        tier (marker, manifest checksum, every field; ``check_shards``: and every shard file there
        with its recorded size). Reads each manifest; what :meth:`tags` is built on."""
        return self._step_tags(check_shards)

    def _step_tags(self, check_shards: bool) -> dict[int, Optional[str]]:
        """Step -> tag (None: untagged) of every committed step with a valid manifest on some tier
        (commit marker, manifest checksum, every field); ``check_shards``: and every shard file
        it names present with its recorded size (the check of ``nebula-ckpt ls --quick``)."""
        out: dict[int, Optional[str]] = {}
        for t, st in self._tier_pairs():
            try:
                steps = committed_steps(st)
            except Exception as e:
                log.warning("nebula_ckpt: cannot list tier %s: %s", t.name, e)
                continue
            for s in steps:
                if s in out:
                    continue
                try:
                    man = read_manifest(st, s, f"tier {t.name} step {s}")
                    if check_shards:
                        for sh in man.shards:
                            if st.size(f"{step_dir(s)}/{sh.file}") != sh.stored_bytes:
                                raise CorruptCheckpointError(f"tier {t.name} step {s}: shard {sh.file} has the "
                                                             "wrong size")
                except Exception as e:  # damaged or gone meanwhile: not a healthy checkpoint here
                    log.debug("nebula_ckpt: tags: skipping tier %s step %d: %s", t.name, s, e)
                    continue
                out[s] = man.tag
        return out

    def tags(self) -> dict[str, int]:
        """Tag -> the newest step holding it, over the healthy committed checkpoints of every tier.

        Healthy here: the commit marker, the manifest and the shard sizes check out (full
        checksums are verified when a checkpoint is loaded). Untagged checkpoints are not listed.
        Each call reads the manifest of every committed step (no cache). In a multi-rank job each
        rank answers from the tiers it sees (its memory tier and the shared ones).

        Example::

            ckpt.save(1200, state, tag="epoch=3-step=1200.ckpt")
            ckpt.tags()    # {"epoch=3-step=1200.ckpt": 1200}
        """
        out: dict[str, int] = {}
        for step, tag in sorted(self._step_tags(check_shards=True).items()):
            if tag is not None:
                out[tag] = step  # ascending steps: the newest one holding a tag wins
        return out

    def _steps_tagged(self, tag: str) -> builtins.list[int]:
        """Committed steps whose manifest carries ``tag``, newest first."""
        return sorted((s for s, t in self._step_tags(check_shards=False).items() if t == tag), reverse=True)

    @staticmethod
    def _one_of(what: str, step: Optional[int], tag: Optional[str]) -> None:
        """Validate the ``step`` / ``tag`` pair of ``load`` / ``remove``: exactly one of them."""
        if (step is None) == (tag is None):
            raise ValidationError(f"{what}(): give either step or tag (exactly one of them), got step={step!r}, "
                                  f"tag={tag!r}")
        if step is not None:
            check_step(step)
        else:
            check_tag(tag)

    def _open(self, step: Optional[int] = None, on_damaged: str = "raise", tag: Optional[str] = None,
              stage: Optional[Stage] = None) -> Any:
        """Open ``step`` (None: the newest), or the newest healthy step tagged ``tag``.

        ``stage`` (:func:`~nebula_ckpt.restore.core.stage_restore`): prepares the restore of each
        candidate; one it finds damaged is skipped like one that does not open.
        """
        if on_damaged not in ("raise", "warn"):
            raise ValidationError(f"on_damaged must be 'raise' or 'warn', got {on_damaged!r}")
        if self.coordinator.world_size > 1:
            ck = self._open_agreed(step, on_damaged, None if tag is None else self._steps_tagged(tag), stage)
        elif tag is not None:
            ck = self._open_tagged(tag, stage)
        else:
            ck = find_and_open(self._tier_pairs(), step=step, on_all_damaged=on_damaged, stage=stage)
        self.last_restore = None if ck is None else {"step": ck.step, "tier": ck.tier_name, "adopted_bytes": 0}
        return ck

    def _open_tagged(self, tag: str, stage: Optional[Stage] = None) -> Any:
        """One process: the newest step tagged ``tag`` that opens healthy (older ones with the
        same tag are the fallback, as for ``load_latest``); None when no step holds the tag."""
        steps = self._steps_tagged(tag)
        for s in steps:
            ck = find_and_open(self._tier_pairs(), step=s, on_all_damaged="warn", stage=stage)
            if ck is not None:
                return ck
        if steps:
            raise CorruptCheckpointError(f"every checkpoint tagged {tag!r} under {canonical_root(self.root)} (steps "
                                         f"{steps}) is damaged (the log names each copy); `nebula-ckpt verify ROOT` "
                                         "lists damage")
        return None

    def _open_agreed(self, step: Optional[int], on_damaged: str, among: Optional[builtins.list[int]] = None,
                     stage: Optional[Stage] = None) -> Any:
        """Every rank opens the same step: the newest that every rank can open from some tier
        (of ``among``, when given: the steps this rank sees with the tag asked for).

        Each round, the ranks intersect the steps committed on their tiers (minus those that
        failed on some rank) and take the newest; each rank opens it (its own memory tier, or its
        part of the shared tier); if any rank cannot, the step is dropped on all and the next
        round tries an older one. Runs on the training thread; collectives on the control group.
        """
        co = self.coordinator
        pairs = self._tier_pairs()
        failed: list[tuple[int, int]] = []
        while True:
            # (writer generation, step): a stale writer's steps never win over a newer writer's
            have = {c.order for c in list_candidates(pairs)
                    if (step is None or c.step == step) and (among is None or c.step in among)}
            newest = co.agree_step(sorted(have - set(failed)))
            if newest is None:
                if failed and on_damaged == "raise":
                    raise CorruptCheckpointError(
                        f"rank {co.rank}: no step is restorable on every rank of {canonical_root(self.root)}: "
                        f"step(s) {sorted({s for _, s in failed})} failed to open on some rank (see the ranks' "
                        "logs for why); "
                        "`nebula-ckpt verify ROOT` lists damage")
                return None
            generation, agreed = newest
            mismatch: Optional[ValidationError] = None
            try:
                ck = find_and_open(pairs, step=agreed, on_all_damaged="warn", rank=co.rank, world=co.world_size,
                                   stage=stage, generation=generation)
            except ValidationError as e:  # this rank's `into`: raised on every rank, after the round
                ck, mismatch = None, e
            except Exception as e:
                log.warning("nebula_ckpt: rank %d cannot open step %d: %s", co.rank, agreed, e)
                ck = None
            if not co.all_true(mismatch is None):
                raise mismatch or ValidationError(
                    f"rank {co.rank}: restoring step {agreed} failed on another rank because its `into` does not "
                    "match the checkpoint (that rank's error says how); nothing was restored")
            if co.all_true(ck is not None):
                return ck
            log.warning("nebula_ckpt: step %d is not restorable on every rank; trying an older one", agreed)
            failed.append(newest)

    def _not_found(self, step: Optional[int], tag: Optional[str]) -> NotFoundError:
        if tag is not None:
            return NotFoundError(f"no healthy checkpoint tagged {tag!r} under {canonical_root(self.root)} "
                                 f"(tags: {sorted(self.tags())[:20]})")
        return NotFoundError(f"no healthy checkpoint{'' if step is None else f' of step {step}'} under "
                             f"{canonical_root(self.root)} (committed steps: {self.list()})")

    def _apply(self, ck: Any, into: Any, map_location: Any, strict: bool) -> None:
        """Restore ``ck`` into ``into``: directly, or resharded when the layout differs."""
        if ck.pending is not None:  # staged while opening: read, matched and verified already
            ck.pending()
            if ck.adoption is not None and self.last_restore is not None:
                self.last_restore["adopted_bytes"] = ck.adoption.handed_bytes
            return
        if ck.same_layout:
            apply(ck, into, map_location=map_location, strict=strict, allow_pickle=self.allow_pickle)
            return
        from nebula_ckpt.restore.reshard import load_resharded

        log.info("nebula_ckpt: step %d was saved by %d ranks; resharding it for rank %d of %d", ck.step,
                 ck.manifest.world_size, self.coordinator.rank, self.coordinator.world_size)
        load_resharded(ck.storage, ck.step, ck.manifest, into, process_group=self.coordinator.group,
                       strict=strict, allow_pickle=self.allow_pickle)

    def load_latest(self, into: Any = None, *, map_location: Any = None, strict: bool = True,
                    on_damaged: str = "raise") -> Optional[int]:
        """Restore the newest healthy checkpoint into ``into`` in place; return its step.

        Every tier is searched, newest step first, fastest tier first; a candidate that fails
        verification is skipped (logged) and the next is tried.

        Args:
            into: the same tree shape as saved: objects get ``load_state_dict``, tensors are copied
                into, dict entries are replaced. ``None``: only find and verify.
            map_location: device for tensors that are created (not copied into).
            strict: require ``into`` and the checkpoint to have the same keys, both ways: a key
                the checkpoint holds that ``into`` lacks (a forgotten scheduler), a key of ``into``
                the checkpoint lacks, or an object / tensor in ``into`` where something else was
                saved raises :class:`ValidationError` naming every such key, with ``into``
                untouched. ``strict=False`` restores the keys both have and puts a key only the
                checkpoint has into its dict as the saved value.
            on_damaged: when committed checkpoints exist but none of them is restorable:
                ``"raise"`` (default) :class:`CorruptCheckpointError` naming every damaged copy,
                so a damaged root never silently restarts training from step 0; ``"warn"``: log
                it loudly and return ``None``.

        Returns:
            The step restored, or ``None`` when the root holds no committed checkpoint.

        Raises:
            CorruptCheckpointError: committed checkpoints exist but all are damaged (see above).
        """
        ck = self._open(on_damaged=on_damaged, stage=self._stage(into, map_location, strict))
        if ck is None:
            return None
        if into is not None:
            self._apply(ck, into, map_location, strict)
        return ck.step

    def _stage(self, into: Any, map_location: Any, strict: bool) -> Optional[Stage]:
        """What prepares a restore into ``into`` while the candidates are opened (None: no ``into``)."""
        if into is None:
            return None
        no_adoption = self._writers is not None or self.read_only  # a reader deletes nothing, even in memory
        return stage_restore(into, map_location=map_location, strict=strict, allow_pickle=self.allow_pickle,
                             adopt=lambda ck: adoption_for(self._runtimes, ck, no_adoption,
                                                           self.coordinator.world_size))

    def load(self, step: Optional[int] = None, into: Any = None, *, map_location: Any = None, strict: bool = True,
             tag: Optional[str] = None) -> int:
        """Restore ``step``, or the newest step tagged ``tag`` (exactly one of them), into ``into``;
        return the step restored.

        The healthiest copy on the fastest tier is used; for a tag whose newest step is damaged
        on every tier, the next older step with the same tag (logged).

        Example::

            ckpt.load(tag="epoch=3-step=1200.ckpt", into={"model": model, "optim": opt})

        Raises:
            ValidationError: neither or both of ``step`` and ``tag``, or a malformed one.
            NotFoundError: nothing committed is that step / carries that tag.
            CorruptCheckpointError: it is, but every copy is damaged (the message names each).
        """
        self._one_of("load", step, tag)
        ck = self._open(step, tag=tag, stage=self._stage(into, map_location, strict))
        if ck is None:
            raise self._not_found(step, tag)
        if into is not None:
            self._apply(ck, into, map_location, strict)
        return ck.step

    def read(self, step: Optional[int] = None, *, map_location: Any = None,
             tag: Optional[str] = None) -> tuple[int, Any]:
        """Return ``(step, state)`` as a fresh tree (tensors owned, stateful objects as their state
        dicts, NumPy values as NumPy values): of ``step``, of the newest step tagged ``tag``, or
        (neither given) of the newest healthy step.

        Raises:
            ValidationError: both ``step`` and ``tag`` given, or a malformed one.
            NotFoundError: nothing healthy (of ``step`` / with ``tag``, if given).
        """
        if step is not None or tag is not None:
            self._one_of("read", step, tag)
        ck = self._open(step, tag=tag)
        if ck is None:
            raise self._not_found(step, tag)
        if not ck.same_layout:
            raise ValidationError(f"step {ck.step} was saved by {ck.manifest.world_size} ranks: read() gives one "
                                  "rank's state; restore it with load_latest(into) (resharded), or gather it "
                                  "whole with `nebula-ckpt export`")
        return ck.step, materialize(ck, map_location=map_location, allow_pickle=self.allow_pickle)

    def remove(self, step: Optional[int] = None, *, tag: Optional[str] = None) -> builtins.list[int]:
        """Delete committed checkpoints from every tier: ``step``, or every step tagged ``tag``
        (exactly one of them); return the steps deleted.

        Deletion is retention's (commit marker first, so a reader never sees half a checkpoint;
        the writer generation checked first, so a stale process never deletes a newer run's
        checkpoints), serialised with retention. A save of that step / with that tag still in
        flight in this process is waited for first, so a checkpoint being written is never
        touched. This is what a framework's "remove checkpoint" maps to (Lightning's
        ``remove_checkpoint(path)`` with the path as tag).

        Multi-rank jobs: a shared tier's checkpoint is removed by the coordinator (rank 0) only,
        each rank's own tier (memory) by that rank: call it on every rank. Called on rank 0
        alone, the other ranks' memory tiers keep their part until retention drops it, and it is
        never restored (rank 0 lacks it, and restore agrees on a step every rank has).

        Raises:
            ValidationError: neither or both of ``step`` and ``tag``, or a malformed one.
            NotFoundError: nothing committed is that step / carries that tag (one process).
            FencedError: a newer writer owns the root; nothing was deleted on that tier.
        """
        if self._closed:
            raise NebulaError("remove() on a closed Checkpointer")
        self._check_writable("remove")
        self._one_of("remove", step, tag)
        self._confirm_inflight()
        with self._lock:
            pending = [h for h in self._handles if not h.done() and (h.step == step if tag is None else h.tag == tag)]
        for h in pending:
            h.wait(None)
        steps = [step] if step is not None else self._steps_tagged(tag or "")
        writers = self._start()
        co = self.coordinator
        removed: set[int] = set()
        for w in writers:
            if co.world_size > 1 and w.tier.shared and not co.is_coordinator:
                continue  # the shared tier's checkpoint is the coordinator's to delete
            for s in steps:
                if w.remove(s):
                    removed.add(s)
        written = {w.name for w in writers}
        for t, st in self._tier_pairs():
            left = [s for s in steps if t.name not in written and st.exists(f"{step_dir(s)}/{COMMIT}")]
            if left:
                log.warning("nebula_ckpt: remove(): tier %s is not written by this process; step(s) %s stay there",
                            t.name, left)
        if not removed and co.world_size == 1:
            raise self._not_found(step, tag)
        return sorted(removed)

    def stats(self) -> dict[str, Any]:
        """Counters for monitoring and benchmarks.

        ``saves``: ``save_async`` calls; ``saves_finished``: saves over on every tier;
        ``bytes_saved``: their snapshot bytes; ``blocked_s_total`` / ``blocked_s_max``: what
        they cost the training thread; ``last_save``: the newest finished save's
        :meth:`SaveMetrics.to_dict`; ``durable_s_last``: per tier, seconds until durable for the
        newest save it wrote; staging and memory-tier bytes as allocated now.
        """
        with self._lock:
            m = dict(self._metrics)
            m["durable_s_last"] = dict(self._metrics["durable_s_last"])
        return {"staging_bytes": self._pool.allocated_bytes, "memory_tier_slot_bytes": self._pool.memory_tier_bytes,
                "staging_allocations": self._pool.allocations,
                "saves": self._save_index, "path": native_describe()["path"],
                "tiers": [rt.name for rt in self._runtimes], **m}

    def _save_finished(self, handle: SaveHandle) -> None:
        """A save is over on every tier (a writer thread calls this): fold its metrics in."""
        m = handle.metrics
        with self._lock:
            c = self._metrics
            c["saves_finished"] += 1
            c["bytes_saved"] += m.bytes
            if m.blocked_s is not None:
                c["blocked_s_total"] += m.blocked_s
                c["blocked_s_max"] = max(c["blocked_s_max"], m.blocked_s)
            c["durable_s_last"].update(m.durable_s)
            c["last_save"] = m.to_dict()

