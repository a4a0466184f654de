"""The save pipeline: plan -> snapshot -> fan-out -> persist, in order, with its threads.

Only this module knows the order of the save stages. Threads:

* the training thread runs :meth:`SavePipeline.save_async` up to enqueuing the copy (and, for a
  save that does not overlap, waiting for it and settling the verdict);
* one stager thread waits for copies, records the tensor index and fans snapshots out to tiers;
* one writer thread per tier persists them.

The overlap policy lives here too: a save returns before its copy is done only when every tensor
has a mutation point (an optimizer's step, a module's forward) whose hook makes the next change
wait for the copy; see :class:`~nebula_ckpt.checkpointer.Checkpointer`'s consistency rule.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from typing import Any, Callable, Iterable, Optional

import torch

from nebula_ckpt import knobs
from nebula_ckpt.errors import NebulaError
from nebula_ckpt.format.manifest import Manifest
from nebula_ckpt.handle import SaveCounters, SaveHandle, unguarded
from nebula_ckpt.native import get_ops, monotonic
from nebula_ckpt.ranks.coordinator import Coordinator
from nebula_ckpt.ranks.fencing import Fence
from nebula_ckpt.save.budget import Budget, HostMemoryBudget
from nebula_ckpt.save.buffers import StagingPool
from nebula_ckpt.save.drain import flush_newest, make_room
from nebula_ckpt.save.plan import Plan
from nebula_ckpt.save.plan_cache import PlanCache
from nebula_ckpt.save.snapshot import Snapshot, Stager, Taken
from nebula_ckpt.save.uncut import run_uncut
from nebula_ckpt.save.writer import TierWriter
from nebula_ckpt.tiers.base import now
from nebula_ckpt.tiers.memory.replicas import PART as REPLICAS
from nebula_ckpt.tiers.runtime import TierRuntime

#: unguarded CPU tensors (no module or optimizer hook can make their next change wait for the copy)
#: up to this many bytes in all are copied on the training thread, so the rest of an asynchronous
#: save still overlaps; more, or any on a GPU, make the save synchronous
SMALL_UNGUARDED_BYTES = 1 << 20

log = logging.getLogger("nebula_ckpt")

#: set by the Checkpointer's exit hook: a save accepted after it ran (from an ``atexit`` hook the
#: program registered before ``import nebula_ckpt``) has no hook left to write it, so it is waited for
exit_hook_ran = threading.Event()


class SavePipeline:
    """The saves of one :class:`~nebula_ckpt.checkpointer.Checkpointer`: staging memory, the
    stager and tier writer threads (started at the first save), the handles in flight, the hooks
    that guard overlapped copies, and the counters.

    Args:
        runtimes: the tiers opened for this run, fastest first (those this process writes are
            chosen at the first save).
        fence: the root's writer fence (each tier writer checks it before committing).
        coordinator: how the ranks of the job agree (save numbers, commit rounds).
        root: the run's root (names the stager thread and errors).
        keep_last: committed checkpoints kept per tier unless the tier says otherwise.
        host_memory_budget, on_full: the host-memory budget and what a save does beyond it (see
            the Checkpointer).
        snapshot: ``"auto"``, ``"sync"`` or ``"async"`` (see the Checkpointer).
        allow_pickle: allow values typed JSON cannot hold, via pickle.
        on_persist_error: ``"raise"`` or ``"log"`` (see the Checkpointer).
        incremental: whether persistent tiers write only what changed (see the Checkpointer).
        create_root: makes the root and its run record (once), called when a first save was checked.
        guard: ``guard(name, fn)`` runs ``fn`` as the Checkpointer's method ``name`` (its ``Calls.call``):
            the hooks and the handles' checks run through it, so a ``close()`` from a signal handler
            landing in them is deferred until they return (it would wait for locks they hold).
    """

    def __init__(self, runtimes: list[TierRuntime], fence: Fence, coordinator: Coordinator, root: str, *,
                 keep_last: int, host_memory_budget: Budget, on_full: str, snapshot: str, allow_pickle: bool,
                 on_persist_error: str, incremental: bool = True,
                 create_root: Callable[[], Any] = lambda: None, guard: Callable[..., Any] = unguarded) -> None:
        self._runtimes = runtimes
        self._guard = guard
        self._create_root = create_root  # the root and its run record, made once a first save is checked
        self._fence = fence
        self.coordinator = coordinator
        self.root = root
        self._keep_last = keep_last
        self.snapshot = snapshot
        self.allow_pickle = allow_pickle
        #: the previous save's plan, reused while the state keeps its structure
        self.plans = PlanCache(allow_pickle)
        self.on_persist_error = on_persist_error
        self.incremental = incremental
        # A second staging slot lets the next save start while a slower tier still reads one.
        #: the staging buffers (fitted to the written tiers at the first save)
        self.pool = StagingPool(HostMemoryBudget(host_memory_budget), 1 if len(runtimes) == 1 else 2, on_full)
        #: the tier writers (None until the first save)
        self.writers: Optional[list[TierWriter]] = None
        #: (tier, manifest) of the last restore, for the tier's first save (:meth:`restored`)
        self._restored: Optional[tuple[str, Manifest]] = None
        self._stager: Optional[Stager] = None
        self._start_lock = threading.Lock()  # taken by the thread that makes the writers (start())
        #: the number of the save last given to the stager (set just before the C call that queues it)
        self._handing = -1
        self._lock = threading.Lock()
        #: set by :meth:`shutdown` (under both locks): no writers are made and no save handed over after it
        self.closed = False
        #: the handles of saves not yet over, or (on_persist_error="raise") over with a failure not yet seen
        self.handles: list[SaveHandle] = []
        #: snapshots whose overlapped copy the training thread has not confirmed yet
        self.inflight: list[Snapshot] = []
        self._hooked: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._hook_handles: list[Any] = []
        #: ``save_async`` calls so far (every rank numbers its saves alike)
        self.count = 0
        self._counters = SaveCounters()  # of the finished saves
        self._told_unguarded = False
        #: copies of the memory tier on partner nodes (:mod:`nebula_ckpt.tiers.memory.replicas`), or None
        self.replicator: Any = None
        #: the Checkpointer's health monitor (None: read only): close() never copies a step it marked suspect
        self.monitor: Any = None
        if torch.cuda.is_initialized():  # a CUDA process (never initialises CUDA itself)
            self.warm_up([torch.cuda.current_device()])

    def warm_up(self, devices: Iterable[int]) -> None:
        """Set up the device-to-host copy path of these CUDA devices now, so that the first save
        of the process does not wait for the work queued on the GPU to drain (first-use setup of
        the side stream, events, host functions; :meth:`~nebula_ckpt.native.NativeOps.warm_up_cuda`)."""
        try:
            get_ops().warm_up_cuda(sorted(set(devices)))
        except Exception as e:  # then the first save does it, as it would have
            log.warning("nebula_ckpt: could not set up the CUDA copy path ahead of the first save: %s: %s",
                        type(e).__name__, e)

    def start(self) -> list[TierWriter]:
        """At the first save: the tiers this process writes, their writer threads, the stager.

        Made on a thread of their own (:func:`~nebula_ckpt.save.uncut.run_uncut`): a Ctrl-C (or a signal handler's
        exception) in the first ``save_async`` cannot leave them half made or the memory tier claimed twice; the next
        save finds them made, or waits for them."""
        writers = self.writers
        if writers is None:
            writers = run_uncut(self._start_once, f"nebula-start-{self.root[-24:]}")
        return writers

    def _start_once(self) -> list[TierWriter]:
        """Body of :meth:`start` (its own thread; one at a time, once)."""
        with self._start_lock:
            if self.closed:
                raise NebulaError(f"the first save (or prepare) on {self.root} was refused: another thread closed "
                                  "the Checkpointer meanwhile (nothing was written); open a new one to save")
            if self.writers is not None:
                return self.writers
            self._fence.take_root()  # an older Checkpointer of this process on the root hands its tiers over
            writing = [rt for rt in self._runtimes if rt.open_for_writing()]
            if not writing:
                raise NebulaError(f"no tier of {self.root} can be written by this process")
            # With a tier that links staged files (the memory tier), CPU saves stage in its slot
            # files: the bytes are copied once. Reading tiers that are not written stays possible.
            # the memory tier alone keeps its newest step until the new one is in: two states
            alone = not any(rt.tier.persistent for rt in writing) and any(rt.staging_dir() for rt in writing)
            self.pool.serve_writers(next((d for d in (rt.staging_dir() for rt in writing) if d), None),
                                    1 if len(writing) == 1 else 2, states=2 if alone else 1)
            writers = [TierWriter(rt, self._fence.for_tier(rt.storage), rt.tier.keep_last or self._keep_last,
                                  self.coordinator, self.incremental) for rt in writing]
            self._stager = Stager(self.root[-24:])
            if self.monitor is not None:  # what any tier holds keeps its health records
                self.monitor.tiers = [rt.storage for rt in self._runtimes]
            self.writers = writers  # last: a save that finds them finds the stager too
            if self._restored is not None:
                self._seed(*self._restored)
            return writers

    def restored(self, step: int, tier: str, manifest: Manifest) -> None:
        """Committed ``step`` (its validated ``manifest``) was restored and verified from ``tier``: that tier's next
        save may build on it (:meth:`TierWriter.seed`); remembered until the writers start."""
        self._restored = (tier, manifest)
        self._seed(tier, manifest)

    def _seed(self, tier: str, manifest: Manifest) -> None:
        for w in self.writers or []:
            w.seed(manifest, here=w.name == tier)

    def prepare(self, state: Any, wait: bool) -> None:
        """Make the staging memory for saves of ``state`` (see :meth:`Checkpointer.prepare`)."""
        plan = self.plans.plan(0, state)  # the saves that follow reuse it
        self.warm_up(int(d.split(":")[1]) for d in plan.devices.values())
        self._create_root()
        self.start()
        self.pool.prepare(plan.layout.total_bytes, plan.sources.any_cuda())
        if wait:
            self.pool.wait_prepared()

    def save_async(self, step: int, state: Any, tag: Optional[str]) -> SaveHandle:
        """Plan, snapshot and hand ``state`` to the tiers (see :meth:`Checkpointer.save_async`)."""
        h = self._save_async(step, state, tag)
        if exit_hook_ran.is_set():
            h.wait(knobs.get("exit_timeout_s"))
        return h

    def _save_async(self, step: int, state: Any, tag: Optional[str]) -> SaveHandle:
        t0 = monotonic()
        try:
            self.confirm_inflight()
            self.raise_unseen()
            plan = self.plans.plan(step, state, tag)
            self.pool.check_fits(plan.layout.total_bytes)
            self._create_root()  # nothing before this line writes: a refused save leaves a new root unmade
            writers = self.start()
        except BaseException:  # refused on this rank (its state, a failure not yet seen): the job's
            if self.coordinator.world_size > 1:  # save number goes by all the same, as on the others
                self._numbered(None, [rt.name for rt in self._runtimes])
            raise
        t_now = now()
        handle = self._numbered(lambda i: self._save_indexed(i, plan, writers, t_now, t0), [w.name for w in writers])
        assert handle is not None
        return handle

    def _numbered(self, save: Optional[Callable[[int], SaveHandle]], tiers: list[str]) -> Optional[SaveHandle]:
        """Take the next save number and run ``save`` under it (None: this rank does not save it). Each
        rank's save ``idx`` is one save of the job: when this rank does not write it, or ``save``
        raises, the ranks' rounds of ``idx`` on ``tiers`` go on without this rank."""
        repl = self.replicator
        with self._lock:
            idx = self.count
            self.count += 1
            if repl is not None:
                repl.submit(idx)  # its round comes next, in the same order on every rank
        saved = False
        try:
            handle = save(idx) if save is not None else None
            saved = handle is not None
            return handle
        finally:
            for name in [] if saved else tiers:
                self.coordinator.abandon(name, idx)
            if repl is not None:
                repl.submitted(idx)

    def _save_indexed(self, idx: int, plan: Plan, writers: list[TierWriter], t_now: float, t0: float) -> SaveHandle:
        """The rest of :meth:`save_async` for save number ``idx`` of this job."""
        nbytes = plan.layout.total_bytes
        targets = [w for w in writers if w.cadence.wants(idx, t_now) and w.runtime.admits(nbytes, plan.step)]
        for w in writers:
            if w not in targets:
                self.coordinator.abandon(w.name, idx)
        handle = self._new_handle(idx, plan, targets, t0)
        progress = handle.progress
        if not targets:
            progress.skip("no tier's cadence wanted this save")
            progress.returned()
            return handle
        pinned = plan.sources.any_cuda()
        overlap = self._may_overlap(plan, pinned)
        took = Taken()
        try:
            self._stage(plan, handle, targets, t_now, t0, idx, overlap, pinned, took)
        except BaseException as e:  # cut anywhere (a signal handler's exception too): give back what it took
            if took.snap is not None:
                self._take_back(took.snap, e)
            else:
                took.give_back_slot(self.pool)
            raise
        progress.returned()
        return handle

    def _stage(self, plan: Plan, handle: SaveHandle, targets: list[TierWriter], t_now: float, t0: float, idx: int,
               overlap: bool, pinned: bool, took: Taken) -> None:
        """Take a staging slot, enqueue the copy into it and hand the snapshot to the stager,
        recording in ``took`` what is taken as it is taken (:class:`~nebula_ckpt.save.snapshot.Taken`)."""
        slot = self.pool.acquire(plan.layout.total_bytes, pinned, self._reclaim, what=f"step {plan.step}",
                                 claim=took.claim)
        if slot is None:
            log.warning("nebula_ckpt: step %d skipped (on_full='skip'): %s", plan.step, self.pool.why_full())
            handle.progress.skip(f"no free staging buffer (on_full='skip'): {self.pool.why_full()}")
            return
        for w in targets:  # the save goes ahead: only now does it count for every_seconds
            w.cadence.took(t_now)
        header = plan.layout.header
        slot.view()[: len(header)] = header  # plain memcpy (ATen copy_ costs ms here)
        # A save the training thread waits for copies at memcpy speed (the stager checksums the staged
        # bytes afterwards); an overlapped copy checksums while copying, each block checked against
        # a hash taken before its copy (writes through .data / numpy during it).
        took.job = get_ops().enqueue_sources(plan.sources, slot.buffer, checksum=overlap)
        took.snap = Snapshot(plan, slot, took.job, handle, self.pool, targets, t0, index=idx)
        self._hand_over(took.snap, overlap)

    def _new_handle(self, idx: int, plan: Plan, targets: list[TierWriter], t0: float) -> SaveHandle:
        """The handle of save ``idx``: its tiers, and the memory tier's replicas when it goes there."""
        repl, mem = self.replicator, next((w.name for w in targets if w.tier.capabilities.has_replicas), None)
        handle = SaveHandle(plan.step, [w.name for w in targets] + ([REPLICAS] if repl and mem else []), plan.tag)
        handle.progress.begin(t0, plan.layout.total_bytes, self._counters.add)
        handle.progress.save = idx
        if repl is not None and mem is not None:
            repl.attach(idx, handle)

        def settled(tier: str) -> None:  # the ranks' protocol, and the replicas' round, hear of it
            self.coordinator.abandon(tier, idx)
            if repl is not None and tier == mem:
                repl.settled(idx)
        handle.progress.bind_settled(settled)
        return handle

    def _hand_over(self, snap: Snapshot, overlap: bool) -> None:
        """Confirm ``snap`` now (no overlap) or guard it with hooks, track its handle, and give
        it to the stager; on any failure the caller takes it back (see :meth:`_take_back`)."""
        handle = snap.handle
        handle.progress.bind_confirm(snap.confirm, self._guard)
        if overlap:
            overlap = self._install_hooks(snap.plan.optimizers, snap.plan.modules_with_buffers)
        if not overlap:
            snap.confirm()  # the copy is done and checked before we return: nothing can tear it
        with self._lock:  # shutdown() sets closed under it, then stops the stager: accepted means written
            if self.closed:
                raise NebulaError(f"save_async() of step {snap.step} on {self.root} was refused: another thread "
                                  "closed the Checkpointer while this call made the save (it was not written); "
                                  "close it only after the last save_async() returned")
            if overlap:
                self.inflight = [s for s in self.inflight if not s.confirmed] + [snap]
            raising = self.on_persist_error == "raise"  # "log": a failure was said at ERROR, never raised
            self.handles = [h for h in self.handles if not h.done() or (raising and not h.seen and h.error())]
            self.handles.append(handle)
            assert self._stager is not None
            # last: from here on the stager owns the snapshot. Nothing can interrupt between the two lines
            # (no call), nor inside the queueing (one C call): _take_back tells by _handing whether the stager got it.
            self._handing = snap.index
            self._stager.submit(snap)

    def _may_overlap(self, plan: Plan, pinned: bool) -> bool:
        """Whether this save may return before its copy is done: the snapshot mode asks for it and
        every tensor has a mutation point the hooks guard. The few small CPU tensors that have
        none (an RNG state beside a model) are copied here instead (:data:`SMALL_UNGUARDED_BYTES`)."""
        if self.snapshot == "sync" or (self.snapshot == "auto" and not pinned):
            return False
        if plan.copy_unguarded(SMALL_UNGUARDED_BYTES):
            return True
        if not self._told_unguarded:
            self._told_unguarded = True
            keys = [plan.layout.entries[i].key for i in plan.unguarded]
            log.info("nebula_ckpt: snapshot=%r, but tensor(s) %s%s of the state are not inside a module or optimizer "
                     "passed as an object, so no hook can make their next change wait for the copy: such saves "
                     "return once the copy is done (pass the model and optimizer themselves to overlap it)",
                     self.snapshot, keys[:3], f" and {len(keys) - 3} more" if len(keys) > 3 else "")
        return False

    def _take_back(self, snap: Snapshot, error: BaseException) -> None:
        """``save_async`` failed after making ``snap``: wait for its copy, give the slot back and end
        the handle with ``error``: nothing of this save stays in flight (the next save gets a slot).

        If the stager has the snapshot already (a signal handler's exception right after it was
        queued), the save goes on like an accepted one; its caller got ``error`` and never the
        handle, so nothing raises its outcome later (a failure is logged by the tier)."""
        if self._handing == snap.index:
            snap.handle.seen = True
            return
        try:
            snap.finish_copy()
        finally:
            with self._lock:
                self.inflight = [s for s in self.inflight if s is not snap]
                self.handles = [h for h in self.handles if h is not snap.handle]
            snap.handle.progress.abort(error)
            snap.release()

    def _reclaim(self, budget: bool = False) -> bool:
        """Free staging buffers held only by snapshots slow tiers have not started on; ``budget`` (the host-memory
        budget is short): also what :func:`~nebula_ckpt.save.drain.make_room` frees."""
        dropped = any([w.drop_pending() for w in self.writers or []])
        return make_room(self.writers or [], self.handles, self.monitor) or dropped if budget else dropped

    def confirm_inflight(self) -> None:
        """Wait for pending snapshot copies and confirm them (training thread); a snapshot stays in :attr:`inflight`
        until confirmed: one an interrupt cut short is confirmed by the next call."""
        if not self.inflight:
            return
        with self._lock:
            pending = list(self.inflight)
        for s in pending:
            t = monotonic()
            s.confirm()
            s.handle.progress.add_stall(monotonic() - t)
        with self._lock:
            self.inflight = [s for s in self.inflight if not s.confirmed]

    def _hook(self, name: str, *_: Any, **__: Any) -> None:
        """The step / forward pre-hook ``name``: :meth:`confirm_inflight` through ``guard``."""
        if self.inflight:
            self._guard(name, self.confirm_inflight)

    def _install_hooks(self, optimizers: list[Any], modules: list[torch.nn.Module]) -> bool:
        """Make the next step / forward wait for the copy; False if an object cannot be hooked (a wrapped optimizer
        without PyTorch's hook machinery): the save then waits itself."""
        step, forward = functools.partial(self._hook, "optimizer.step"), functools.partial(self._hook, "forward")
        try:
            for opt in optimizers:
                if opt not in self._hooked:
                    self._hook_handles.append(opt.register_step_pre_hook(step))
                    self._hooked.add(opt)
            for m in modules:
                if m not in self._hooked:
                    self._hook_handles.append(m.register_forward_pre_hook(forward))
                    self._hooked.add(m)
        except Exception as e:
            log.debug("nebula_ckpt: cannot hook %s (%s): this save waits for its copy", type(e).__name__, e)
            return False
        return True

    def raise_unseen(self) -> None:
        """Raise the first failure no handle has shown yet (``on_persist_error="raise"``)."""
        if self.on_persist_error != "raise":
            return
        with self._lock:
            for h in self.handles:
                err = h.error() if h.done() and not h.seen else None
                if err is not None:
                    h.seen = True  # then raised at once: no call between them that a Ctrl-C could cut
                    raise err

    def pending(self, match: Callable[[SaveHandle], bool]) -> list[SaveHandle]:
        """The handles of saves still in flight that ``match`` selects."""
        with self._lock:
            return [h for h in self.handles if not h.done() and match(h)]

    def remove(self, match: Callable[[SaveHandle], bool], which: Callable[[], list[int]]) -> tuple[list[int], set[int]]:
        """After the saves in flight that ``match`` selects, delete the steps ``which()`` names then
        from every tier this process writes, as retention does (see :meth:`Checkpointer.remove`);
        ``(those steps, the steps deleted somewhere)``. A shared tier's copy is the coordinator's."""
        self.confirm_inflight()
        for h in self.pending(match):
            h.wait(None)
        steps = which()
        if self.replicator is not None:  # the partners' copies first: a keep round waiting cannot bring one back
            self.replicator.forget(steps)
        co = self.coordinator
        removed: set[int] = set()
        for w in self.start():
            if co.world_size > 1 and w.tier.shared and not co.is_coordinator:
                continue
            removed.update(s for s in steps if w.remove(s))
        return steps, removed

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until every save so far is durable (see :meth:`Checkpointer.wait`)."""
        self.confirm_inflight()
        with self._lock:
            handles = list(self.handles)
        for h in handles:
            if not h.wait(timeout):
                raise TimeoutError(f"save of step {h.step} not durable after {timeout} s")
        for w in self.writers or []:
            w.wait_idle(timeout)
        self.raise_unseen()

    def shutdown(self, join: bool) -> None:
        """Stop hooks and threads, free staging, let each written tier close (the memory tier frees its RAM when its
        newest step is safe elsewhere).

        ``join=False`` (a timed-out close): nothing is waited for or removed; the daemon threads
        end with the process and a restart finds whatever had committed.
        """
        if join:  # a first save starting its writers finishes first; a save not handed over yet is refused
            with self._start_lock, self._lock:
                self.closed = True
        for hh in self._hook_handles:
            hh.remove()
        self._hook_handles.clear()
        self.plans.clear()
        if not join:
            return
        if self._stager is not None:
            self._stager.close()
        for w in self.writers or []:
            w.wait_idle()
        if self.writers is not None and self.coordinator.world_size == 1:  # a multi-rank copy would need every
            flush_newest(self.writers, self.monitor)  # rank again: not done at close (see README)
        if self.replicator is not None:
            self.replicator.close()  # its last rounds, before the memory tier may go
        written = [w.runtime for w in self.writers or []]
        for rt in written:
            rt.close(written)   # e.g. the memory tier frees its RAM when that is safe
        for w in self.writers or []:
            w.close()
        self.coordinator.close(self.count)
        if self.replicator is not None:
            self.replicator.release()
        self.pool.close()

    def stats(self) -> dict[str, Any]:
        """The save counters of :meth:`Checkpointer.stats`."""
        m = self._counters.get()
        held = sum(self.pool.used().values())
        return {"staging_bytes": self.pool.allocated_bytes, "memory_tier_slot_bytes": self.pool.memory_tier_bytes,
                "host_memory_bytes": held, "host_memory_limit_bytes": self.pool.budget.limit(held),
                "memory_tier_dropped_cow_bytes": sum(rt.dropped_cow_bytes() for rt in self._runtimes),
                "memory_tier_whole_fallbacks": sum(rt.whole_fallbacks() for rt in self._runtimes),
                "staging_allocations": self.pool.allocations, "saves": self.count, "plans": self.plans.stats(), **m,
                **({"replicas": self.replicator.stats()} if self.replicator is not None else {})}
