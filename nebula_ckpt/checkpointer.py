"""Internal: the Checkpointer, the public facade over the save pipeline and the restore side.

Saving is :class:`~nebula_ckpt.save.pipeline.SavePipeline`'s, listing and restoring
:class:`~nebula_ckpt.restore.restorer.Restorer`'s (the methods: :mod:`nebula_ckpt.restore.reads`);
this module opens a root's tiers, validates, and guards every public call against a ``close()``
re-entered from a signal handler (:class:`Calls`); closing is :class:`~nebula_ckpt.save.closing.Closing`'s."""

from __future__ import annotations

import atexit
import builtins
import functools
import inspect
import logging
import os
import threading
from time import monotonic
from typing import Any, Callable, Collection, Optional, Sequence, TypeVar

from nebula_ckpt import knobs
from nebula_ckpt.arguments import check_arguments, check_step_or_tag, check_timeout
from nebula_ckpt.errors import NebulaError
from nebula_ckpt.handle import SaveHandle
from nebula_ckpt.health.policy import HealthPolicy
from nebula_ckpt.health.reports import HealthReports
from nebula_ckpt.latch import Latch
from nebula_ckpt.native import describe as native_describe
from nebula_ckpt.ranks.coordinator import Coordinator, LocalCoordinator
from nebula_ckpt.ranks.distributed import default_coordinator
from nebula_ckpt.restore.reads import CheckpointReads
from nebula_ckpt.restore.restorer import Restorer
from nebula_ckpt.root import open_root
from nebula_ckpt.save.budget import restorable
from nebula_ckpt.save.closing import Closing, finish_at_exit
from nebula_ckpt.save.pipeline import SavePipeline, exit_hook_ran
from nebula_ckpt.storage.urls import canonical_root
from nebula_ckpt.tiers.base import Tier
from nebula_ckpt.tiers.memory.replicas import start_replicator

log = logging.getLogger("nebula_ckpt")
F = TypeVar("F", bound=Callable[..., Any])


def close_at_exit(checkpointers: Optional[Collection["Checkpointer"]] = None) -> None:
    """At interpreter exit (before Python stops the writer threads): finish the close of
    ``checkpointers`` (the one-liners'), else of every Checkpointer whose close has not finished
    (with a warning): each accepted save is written, ``NEBULA_EXIT_TIMEOUT_S`` bounding each wait."""
    exit_hook_ran.set()
    finish_at_exit(checkpointers, knobs.get("exit_timeout_s"))


atexit.register(close_at_exit)


# -- a close() re-entered from a signal handler ------------------------------------------------------
# A signal handler runs on the main thread between two bytecodes of whatever that thread was doing.
# A SIGTERM handler that calls ``ckpt.close()`` can therefore land inside ``save_async``, ``load``,
# ``remove``, ``wait``, ``stats``, ... of the very same Checkpointer: closing there would wait for a
# lock the interrupted call holds (a deadlock: the locks are not re-entrant) or tear down the
# threads and tiers that call is halfway through. So every public method records that the calling
# thread is inside it (:func:`guard_methods`); a ``close()`` on a thread that is inside one is only
# recorded (:meth:`Calls.defer`) and runs when the outermost call returns or raises (the handler's
# ``sys.exit()`` unwinding through it, typically). A ``close()`` from another thread is not
# deferred: it waits like any close, first for the saves others make; the save hooks and handle checks are calls too.


class Calls:
    """The threads inside a public method of one object (the outermost method's name), and the
    ``close()`` each of them deferred."""

    def __init__(self) -> None:
        self._inside: dict[int, str] = {}
        self._deferred: dict[int, Callable[[], None]] = {}
        #: a latch per close() in :meth:`wait_left`, set by a leaving thread (no lock: a handler lands anywhere)
        self._leaving: list[Latch] = []

    def inside(self) -> Optional[str]:
        """The method the calling thread is inside (its outermost one), or None."""
        return self._inside.get(threading.get_ident())

    def defer(self, close: Callable[[], None]) -> Optional[str]:
        """If the calling thread is inside a method, keep ``close`` to run when it returns and
        return that method's name; else None (the caller closes now)."""
        me = threading.get_ident()
        name = self._inside.get(me)
        if name is not None:
            self._deferred[me] = close
        return name

    def wait_left(self, names: Collection[str], timeout: Optional[float]) -> bool:
        """Block until no other thread is inside one of the methods ``names``; False after ``timeout`` s."""
        me, deadline = threading.get_ident(), None if timeout is None else monotonic() + timeout
        while True:
            left = Latch()
            self._leaving.append(left)
            try:
                if not any(t != me and n in names for t, n in tuple(self._inside.items())):
                    return True
                if not left.wait(None if deadline is None else deadline - monotonic()):
                    return False
            finally:
                self._leaving.remove(left)

    def call(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` as method ``name`` of the object; then a ``close()`` deferred meanwhile.

        When ``fn`` raised (the handler's ``sys.exit()`` or ``KeyboardInterrupt`` unwinding it,
        typically), that exception goes on as it is: a failure of the deferred close is logged."""
        me = threading.get_ident()
        outer = me not in self._inside
        raised: Optional[BaseException] = None
        try:
            if outer:  # inside the try: an interrupt after this line still clears it below
                self._inside[me] = name
            return fn(*args, **kwargs)
        except BaseException as e:
            raised = e
            raise
        finally:
            if outer:
                self._inside.pop(me, None)
                for left in tuple(self._leaving):  # a close() of another thread waits for it
                    left.set()
                close = self._deferred.pop(me, None)
                if close is not None:
                    _close_deferred(close, name, raised)
            raised = None  # no cycle through the traceback


def _close_deferred(close: Callable[[], None], name: str, raised: Optional[BaseException]) -> None:
    """Run a deferred ``close``; if the interrupted call raised, a failure of the close is logged
    instead of taking the place of that exception."""
    if raised is None:
        close()
        return
    try:
        close()
    except Exception as e:
        log.error("nebula_ckpt: close() deferred behind %s(), which raised %s, failed: %s: %s", name,
                  type(raised).__name__, type(e).__name__, e)


def guard_methods(cls: type, calls_of: Callable[[Any], Calls], *, skip: tuple[str, ...] = ("close",)) -> None:
    """Wrap every public method of ``cls`` and of its base classes of this package (but ``skip``)
    so that it runs through ``calls_of(instance)``'s :meth:`Calls.call`."""
    for klass in [k for k in cls.__mro__ if k.__module__.split(".")[0] == __name__.split(".")[0]]:
        for name, fn in list(vars(klass).items()):
            if name.startswith("_") or name in skip or not inspect.isfunction(fn):
                continue
            setattr(klass, name, _guarded(name, fn, calls_of))


def _guarded(name: str, fn: F, calls_of: Callable[[Any], Calls]) -> F:
    @functools.wraps(fn)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return calls_of(self).call(name, fn, self, *args, **kwargs)
    return method  # type: ignore[return-value]


class Checkpointer(Closing, HealthReports, CheckpointReads):
    """Asynchronous, tiered checkpoints of a training job.

    Args:
        root: local path (``str`` or ``pathlib.Path``) or any fsspec URL (``az://c/p``, ``s3://b/p``,
            ``file:///p``). It is the
            run's identity and, unless ``tiers`` is given, its persistent tier.
        storage_options: fsspec options for a remote ``root`` (credentials; never logged).
        tiers: explicit tiers, fastest first (default: ``[MemoryTier(), <root tier>]``).
        keep_last: committed checkpoints kept per tier unless the tier says otherwise.
        host_memory_budget: the most host memory checkpointing holds: staging buffers plus the
            memory tier's files (tmpfs pages are RAM). Bytes (int), a share of the machine's
            memory (float in (0, 1]) or None (default): what is free, keeping 10% of the memory
            (at least 1 GiB) for training. Beyond it a save waits or is skipped (``on_full``);
            a state that never fits raises :class:`ValidationError` (:mod:`nebula_ckpt.save.budget`).
        memory_tier: add the default memory tier (ignored when ``tiers`` is given).
        on_full: ``"wait"`` (default) or ``"skip"``: what a save does when every staging buffer
            is still being persisted, or the host-memory budget has no room for it yet.
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
        incremental: (default True) a save writes to the disk and remote tiers only the tensors
            that changed since that tier's previous save and refers to its bytes for the rest;
            every ``NEBULA_INCREMENTAL_FULL_EVERY``-th save is full. False: every save is full.
        health: how :meth:`report` marks checkpoints (:class:`~nebula_ckpt.health.HealthPolicy`).

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
    (Up to the knob ``small_unguarded_bytes`` (1 MiB) of such tensors on the CPU, e.g. an RNG state saved
    beside a model and optimizer, are copied on the spot instead, and the rest still overlaps.)
    Optimizer wrappers (accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``,
    DeepSpeed's) are saved through their own ``state_dict()`` and hooked on the
    ``torch.optim.Optimizer`` they wrap; module wrappers (DDP, ``torch.compile``'s
    ``OptimizedModule``) are modules and hooked as they are (call the object you saved).
    """

    def __init__(self, root: "str | os.PathLike[str]", *, storage_options: Optional[dict[str, Any]] = None,
                 tiers: Optional[Sequence[Tier]] = None, keep_last: int = 3,
                 host_memory_budget: "int | float | None" = None, memory_tier: bool = True, on_full: str = "wait",
                 allow_pickle: bool = False, on_persist_error: str = "raise", snapshot: str = "auto",
                 coordinator: Optional[Coordinator] = None, read_only: bool = False, incremental: bool = True,
                 health: Optional[HealthPolicy] = None) -> None:
        self._calls = Calls()  # who is inside which method: a close() from a signal handler waits for it
        root = os.fspath(root) if isinstance(root, os.PathLike) else root  # a pathlib.Path: its string
        check_arguments(root, keep_last, host_memory_budget, on_full, on_persist_error, snapshot, incremental,
                        health, allow_pickle=allow_pickle, memory_tier=memory_tier, read_only=read_only)
        #: opened for reading only (see ``read_only``)
        self.read_only = bool(read_only)
        self.snapshot = snapshot
        #: how the ranks of the job agree (one process: :class:`LocalCoordinator`, a no-op)
        self.coordinator = coordinator or default_coordinator() or LocalCoordinator()
        self.root = root
        self.allow_pickle = allow_pickle
        self.on_persist_error = on_persist_error
        self._opened = open_root(root, storage_options, tiers, memory_tier, self.coordinator, self.read_only)
        self._runtimes = runtimes = self._opened.runtimes
        for rt in runtimes:  # the memory tier frees a step at close() only where a copy of it restores
            rt.restorable = restorable
        shown = canonical_root(root)
        self._saves = SavePipeline(runtimes, self._opened.fence, self.coordinator, shown, keep_last=keep_last,
                                   host_memory_budget=host_memory_budget, on_full=on_full, snapshot=snapshot,
                                   allow_pickle=allow_pickle, on_persist_error=on_persist_error,
                                   incremental=incremental, create_root=self._opened.create_once,
                                   guard=self._calls.call)
        self._restores = Restorer(runtimes, self.coordinator, shown, allow_pickle,  # a reader adopts nothing
                                  may_adopt=lambda: self._saves.writers is None and not self.read_only,
                                  on_restored=None if self.read_only else self._saves.restored)
        self._open_health(health)  # report() (HealthReports), its marks read by restores and kept by retention
        try:  # copies of the memory tier on partner nodes (MemoryTier(replicas=k)): a collective
            self._saves.replicator = self._restores.replicator = start_replicator(
                list(tiers or []), runtimes, self.coordinator, self.read_only, self._opened.drainer(),
                self._saves.pool.room_for)
        except BaseException:
            self._opened.release()
            raise
        self._pid = os.getpid()  # a fork's child holds a copy without threads: it never writes, waits or closes it
        self._open_closing()
        log.info("nebula_ckpt: checkpointer on %s, tiers %s, %s path", shown,
                 [rt.name for rt in self._runtimes], native_describe()["path"])

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            raise NebulaError(f"{what}() on a read-only Checkpointer of {canonical_root(self.root)} (opened with "
                              "read_only=True, which never writes): open it without read_only to write")

    def _check_open(self, what: str) -> None:
        forked = self._pid != os.getpid()
        if self._close_started or forked:
            raise NebulaError(f"{what}() on a {'forked (the parent process owns it)' if forked else 'closed'} "
                              f"Checkpointer of {canonical_root(self.root)}: open a new one in this process")

    @property
    def run_id(self) -> Optional[str]:
        """Id of this incarnation of the root (``_nebula/run.json``, recorded by the first save); fast
        tiers are tied to it. None for a read-only Checkpointer of a root no run has written."""
        return self._opened.run_id

    @property
    def tiers(self) -> list[Tier]:
        """The active tiers, fastest first."""
        return [rt.tier for rt in self._runtimes]

    # -- saving -----------------------------------------------------------------------------------
    def prepare(self, state: Any, *, wait: bool = False) -> None:
        """Make the staging memory for saves of ``state`` now, in the background (optional).

        The first save of a state otherwise finds no staging buffer and pays for fresh memory
        (page faults, and on a virtual machine the host backing it) on the training thread. Call
        this once the state has its final size: after ``load_latest`` restored it, or after the
        first optimizer step created the optimizer's state. Returns at once (``wait=True``: once
        the buffer is ready); a save that comes before the buffer is ready allocates as it would
        have. Checks ``state`` like :meth:`save_async` (``ValidationError``, nothing written) and
        plans it (later saves reuse the plan while the state keeps its structure); on a GPU, sets up
        the copy path (side stream, events), as creation does in a process already using CUDA.
        """
        self._check_open("prepare")
        self._check_writable("prepare")
        self._saves.prepare(state, wait)

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
        self._check_open("save_async")
        self._check_writable("save_async")
        return self._saved(step, self._saves.save_async(step, state, tag))

    def save(self, step: int, state: Any, *, tag: Optional[str] = None) -> SaveHandle:
        """Synchronous save: :meth:`save_async` (same arguments) then wait until durable (raises on failure)."""
        h = self.save_async(step, state, tag=tag)
        h.result()
        return h

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until every save so far is durable on every tier that took it.

        Raises:
            PersistError / ConsistencyError: the first failure not yet seen through a handle.
            ValidationError: ``timeout`` is not None or a number of seconds >= 0.
            NebulaError: called in a process forked from the one that made the saves (none of its threads is here).
        """
        check_timeout(timeout)
        if self._pid != os.getpid():
            self._check_open("wait")
        self._saves.wait(timeout)

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

    def remove(self, step: Optional[int] = None, *, tag: Optional[str] = None) -> builtins.list[int]:
        """Delete committed checkpoints from every tier: ``step``, or every step tagged ``tag``
        (exactly one of them); return the steps deleted.

        Deletion is retention's (commit marker first, so a reader never sees half a checkpoint;
        the writer generation checked first, so a stale process never deletes a newer run's
        checkpoints), serialised with retention. A save of that step / with that tag still in
        flight in this process is waited for first, so a checkpoint being written is never
        touched. This is what a framework's "remove checkpoint" maps to (Lightning's
        ``remove_checkpoint(path)`` with the path as tag). A step whose bytes a later incremental
        checkpoint refers to stays (listed) until none does; then the next deletion on that tier
        (retention or ``remove()``, in this process or a later one) deletes it: the request is
        recorded on the tier (``step-N/REMOVED``), so a close or a crash does not lose it.

        Multi-rank jobs: a shared tier's checkpoint is removed by the coordinator (rank 0) only,
        each rank's own tier (memory) and the copies it holds of its partners' (replicas) by that
        rank: call it on every rank. Called on rank 0 alone, the other ranks' memory tiers keep
        their part until retention drops it, never restored.

        Raises:
            ValidationError: neither or both of ``step`` and ``tag``, or a malformed one.
            NotFoundError: nothing committed is that step / carries that tag (one process).
            FencedError: a newer writer owns the root; nothing was deleted on that tier.
        """
        self._check_open("remove")
        self._check_writable("remove")
        check_step_or_tag("remove", step, tag)
        steps, removed = self._saves.remove(
            lambda h: h.step == step if tag is None else h.tag == tag,
            lambda: [step] if step is not None else self._restores.steps_tagged(tag or ""))
        self._restores.warn_kept(steps, {w.name for w in self._saves.start()})
        if not removed and self.coordinator.world_size == 1:
            raise self._restores.not_found(step, tag)
        return sorted(removed)

    def stats(self) -> dict[str, Any]:
        """Counters for monitoring and benchmarks.

        ``saves``: ``save_async`` calls; ``saves_finished``: saves over on every tier;
        ``bytes_saved``: their snapshot bytes; ``blocked_s_total`` / ``blocked_s_max``: what they cost the
        training thread; ``last_save``: the newest finished save's :meth:`SaveMetrics.to_dict`; ``durable_s_last``:
        per tier, seconds until durable for the newest save it wrote; staging and memory-tier bytes as allocated
        now; ``plans``: ``hits`` (saves that reused the last plan), ``misses`` (planned again), ``last_miss`` (why).
        """
        return {**self._saves.stats(), "path": native_describe()["path"], "tiers": [rt.name for rt in self._runtimes]}


guard_methods(Checkpointer, lambda ck: ck._calls)  # a close() from a signal handler inside one of them: deferred
