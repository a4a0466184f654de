"""Checkpointer: the orchestration of plan -> snapshot -> persist, and of restore.

Only this module knows the order of the stages. Threads:

* the training thread runs :meth:`Checkpointer.save_async` up to enqueuing the copy;
* one stager thread waits for copies, checksums and hands snapshots to the tiers;
* one writer thread per tier persists them.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any, Optional, Sequence

import torch

from .buffers import SLOT_DIR, StagingPool, sweep_slot_files
from .errors import NebulaError, NotFoundError, ValidationError
from .fencing import Fence
from .handle import SaveHandle
from .native import describe as native_describe
from .native import get_ops, monotonic
from .persist import TierWriter, committed_steps
from .plan import make_plan
from .restore import apply, find_and_open, materialize
from .snapshot import Snapshot, Stager
from .storage.base import Storage
from .tiers import (MemoryTier, Tier, canonical_root, default_tiers, now, shm_available,
                    tier_for_root)

log = logging.getLogger("nebula_ckpt")

_ROOT_FILE = "ROOT"


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

    Example::

        ckpt = nc.Checkpointer("/ckpt/run-42")
        for step in range(n):
            train_step()
            if step % 100 == 0:
                ckpt.save_async(step, {"model": model, "optim": opt, "step": step})
        ckpt.close()

    Consistency rule: a checkpoint is the state at the moment ``save_async`` was called. The copy
    runs after the call returns, so the next ``optimizer.step()`` of every optimizer in the state
    (and the next forward of a module with buffers) waits for it automatically; before any other
    in-place change to a saved tensor call ``handle.wait_snapshot()``. A change that slips through
    anyway is detected and that save fails with :class:`ConsistencyError` — never a torn file.
    """

    def __init__(self, root: str, *, storage_options: Optional[dict[str, Any]] = None,
                 tiers: Optional[Sequence[Tier]] = None, keep_last: int = 3,
                 max_host_bytes: Optional[int] = None, memory_tier: bool = True, on_full: str = "wait",
                 allow_pickle: bool = False, on_persist_error: str = "raise") -> None:
        if not isinstance(root, str) or not root:
            raise ValidationError(f"root must be a non-empty path or URL string, got {root!r}")
        if not isinstance(keep_last, int) or keep_last < 1:
            raise ValidationError(f"keep_last must be an int >= 1 (the newest checkpoint is always kept), "
                                  f"got {keep_last!r}")
        if max_host_bytes is not None and (not isinstance(max_host_bytes, int) or max_host_bytes <= 0):
            raise ValidationError(f"max_host_bytes must be a positive int or None, got {max_host_bytes!r}")
        if on_persist_error not in ("raise", "log"):
            raise ValidationError(f"on_persist_error must be 'raise' or 'log', got {on_persist_error!r}")
        self.root = root
        self._keep_last = keep_last
        self.allow_pickle = allow_pickle
        self.on_persist_error = on_persist_error
        root_tier = tier_for_root(root, storage_options)
        if tiers is None:
            chosen: list[Tier] = default_tiers(root, storage_options, memory_tier)
            root_tier = chosen[-1]
        else:
            chosen = list(tiers)
            if not chosen:
                raise ValidationError("tiers must name at least one tier")
        for t in chosen:
            if not isinstance(t, Tier):
                raise ValidationError(f"tiers must be Tier objects (MemoryTier, LocalTier, RemoteTier), got {t!r}")
            if isinstance(t, MemoryTier):
                t.bind(root)
            t.validate()
        self._tiers: list[Tier] = []
        for t in chosen:
            if isinstance(t, MemoryTier):
                why = shm_available(t.display_url)
                if why:
                    log.info("nebula_ckpt: memory tier skipped: %s", why)
                    continue
            self._tiers.append(t)
        self._storages: list[Storage] = [t.make_storage() for t in self._tiers]
        for st in self._storages:  # fail fast, before leaving anything behind
            check = getattr(st, "check_access", None)
            if callable(check):
                check()
        for t, st in zip(self._tiers, self._storages):
            if isinstance(t, MemoryTier):
                self._claim_memory_tier(st)
        self._root_storage = root_tier.make_storage() if root_tier.name not in [t.name for t in self._tiers] \
            else self._storages[[t.name for t in self._tiers].index(root_tier.name)]
        self._fence = Fence(self._root_storage)
        self._pool = self._make_pool(max_host_bytes, on_full)
        self._writers: Optional[list[TierWriter]] = None
        self._stager: Optional[Stager] = None
        self._lock = threading.Lock()
        self._handles: list[SaveHandle] = []
        self._inflight: list[Snapshot] = []
        self._hooked: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._hook_handles: list[Any] = []
        self._save_index = 0
        self._closed = False
        #: ``{"step", "tier"}`` of the last restore (``None`` before any).
        self.last_restore: Optional[dict[str, Any]] = None
        log.info("nebula_ckpt: checkpointer on %s, tiers %s, %s path", canonical_root(root),
                 [t.name for t in self._tiers], native_describe()["path"])

    # -- properties -----------------------------------------------------------------------------
    @property
    def tiers(self) -> list[Tier]:
        """The active tiers, fastest first."""
        return list(self._tiers)

    def _make_pool(self, max_host_bytes: Optional[int], on_full: str) -> StagingPool:
        # With a memory tier, CPU saves stage into slot files it links (one copy of the bytes). A
        # second staging slot lets the next save start while a slower tier still reads one.
        mem = [t for t in self._tiers if isinstance(t, MemoryTier)]
        slot_dir = None
        if mem:
            assert mem[0].path is not None
            slot_dir = os.path.join(mem[0].path, SLOT_DIR)
            sweep_slot_files(slot_dir)
        return StagingPool(max_host_bytes, 1 if len(self._tiers) == 1 else 2, on_full, slot_dir)

    def _claim_memory_tier(self, st: Storage) -> None:
        ident = canonical_root(self.root).encode()
        try:
            have = st.read_small(_ROOT_FILE)
        except FileNotFoundError:
            st.write_small(_ROOT_FILE, ident)
            return
        if have != ident:
            raise NebulaError(f"memory tier folder {st.display_url} belongs to root {have.decode(errors='replace')!r}, "
                              f"not {ident.decode()!r} (hash collision); pass MemoryTier(path=...) explicitly")

    def _start(self) -> list[TierWriter]:
        if self._writers is None:
            self._writers = [TierWriter(t, st, self._fence.for_tier(st), self._keep_last_for(t))
                             for t, st in zip(self._tiers, self._storages)]
            self._stager = Stager(canonical_root(self.root)[-24:])
        return self._writers

    def _keep_last_for(self, t: Tier) -> int:
        return t.keep_last or self._keep_last

    # -- saving -----------------------------------------------------------------------------------
    def save_async(self, step: int, state: Any) -> SaveHandle:
        """Snapshot ``state`` and persist it in the background.

        Returns as soon as the copy into host memory is enqueued. See the class docstring for the
        consistency rule.

        Args:
            step: non-negative int; names the checkpoint (``step-<N>/``).
            state: tree of dicts / lists / tuples with tensors, plain values, and objects with
                ``state_dict()`` (modules, optimizers, schedulers, GradScaler) as leaves.

        Returns:
            A :class:`SaveHandle`.

        Raises:
            ValidationError: bad input, naming the key; nothing was written.
            PersistError: an earlier save failed and was not yet seen (``on_persist_error="raise"``).
        """
        if self._closed:
            raise NebulaError("save_async() on a closed Checkpointer")
        self._confirm_inflight()
        self._raise_unseen()
        t0 = monotonic()
        plan = make_plan(step, state, allow_pickle=self.allow_pickle)
        self._pool.check_fits(plan.layout.total_bytes)
        writers = self._start()
        t_now = now()
        with self._lock:
            idx = self._save_index
            self._save_index += 1
        targets = [w for w in writers if w.tier.wants(idx, t_now)]
        handle = SaveHandle(plan.step, [w.name for w in targets])
        if not targets:
            handle._skip("no tier's cadence wanted this save")
            return handle
        pinned = any(t.is_cuda for t in plan.sources)
        slot = self._pool.acquire(plan.layout.total_bytes, pinned, self._reclaim)
        if slot is None:
            log.warning("nebula_ckpt: step %d skipped: every staging buffer is still being persisted "
                        "(on_full='skip')", plan.step)
            handle._skip("no free staging buffer (on_full='skip')")
            return handle
        ops = get_ops()
        header = plan.layout.header
        slot.buffer.numpy().data[: len(header)] = header  # plain memcpy (ATen copy_ costs ms here)
        job = ops.enqueue_copy(plan.sources, slot.buffer, [e.offset for e in plan.layout.entries])
        snap = Snapshot(plan, slot, job, handle, self._pool, targets, t0)
        handle._confirm = snap.confirm
        with self._lock:
            self._inflight = [s for s in self._inflight if not s.confirmed] + [snap]
            self._handles = [h for h in self._handles if not (h.done() and (h.seen or h.error() is None))]
            self._handles.append(handle)
        self._install_hooks(plan.optimizers, plan.modules_with_buffers)
        assert self._stager is not None
        self._stager.submit(snap)
        return handle

    def _reclaim(self) -> bool:
        """Free staging buffers held only by snapshots slow tiers have not started on."""
        return any([w.drop_pending() for w in self._writers or []])

    def save(self, step: int, state: Any) -> SaveHandle:
        """Synchronous save: :meth:`save_async` then wait until durable (raises on failure)."""
        h = self.save_async(step, state)
        h.result()
        return h

    def _confirm_inflight(self, *_: Any, **__: Any) -> None:
        """Hook body (training thread): wait for pending snapshot copies and confirm them."""
        if not self._inflight:
            return
        with self._lock:
            pending, self._inflight = self._inflight, []
        for s in pending:
            s.confirm()

    def _install_hooks(self, optimizers: list[Any], modules: list[torch.nn.Module]) -> None:
        for opt in optimizers:
            if opt not in self._hooked:
                self._hook_handles.append(opt.register_step_pre_hook(self._confirm_inflight))
                self._hooked.add(opt)
        for m in modules:
            if m not in self._hooked:
                self._hook_handles.append(m.register_forward_pre_hook(self._confirm_inflight))
                self._hooked.add(m)

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
            if not h._durable.wait(timeout):
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
        try:
            self.wait(timeout)
        finally:
            for hh in self._hook_handles:
                hh.remove()
            self._hook_handles.clear()
            if self._stager is not None:
                self._stager.close()
            for w in self._writers or []:
                w.wait_idle()
            self._drop_memory_tier()
            for w in self._writers or []:
                w.close()
            self._pool.close()

    def _drop_memory_tier(self) -> None:
        pairs = self._tier_pairs()
        persistent = [(t, st) for t, st in pairs if not isinstance(t, MemoryTier)]
        for t, st in pairs:
            if not isinstance(t, MemoryTier) or not persistent:
                continue
            try:
                mem_steps = committed_steps(st)
                safe = set()
                for _, pst in persistent:
                    safe.update(committed_steps(pst))
            except Exception as e:
                log.warning("nebula_ckpt: memory tier %s kept: cannot check the slower tiers (%s)",
                            t.display_url, e)
                continue
            if mem_steps and max(mem_steps) not in safe:
                log.warning("nebula_ckpt: memory tier %s kept: its newest step %d is committed on no "
                            "slower tier", t.display_url, max(mem_steps))
                continue
            # A clean close: the state is safe on a slower tier; free the RAM.
            st.remove_dir("")
            log.debug("nebula_ckpt: memory tier %s removed", t.display_url)

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
        return list(zip(self._tiers, self._storages))

    def list(self, detailed: bool = False) -> Any:
        """Committed steps, ascending (the union over tiers).

        Args:
            detailed: return ``{tier name: [steps]}`` instead.
        """
        per = {t.name: committed_steps(st) for t, st in self._tier_pairs()}
        if detailed:
            return per
        return sorted({s for steps in per.values() for s in steps})

    def _open(self, step: Optional[int] = None) -> Any:
        ck = find_and_open(self._tier_pairs(), step=step)
        self.last_restore = None if ck is None else {"step": ck.step, "tier": ck.tier_name}
        return ck

    def load_latest(self, into: Any = None, *, map_location: Any = None, strict: bool = True) -> Optional[int]:
        """Restore the newest healthy checkpoint into ``into`` in place; return its step.

        Every tier is searched, newest step first, fastest tier first; a candidate that fails
        verification is skipped (logged) and the next is tried.

        Args:
            into: the same tree shape as saved: objects get ``load_state_dict``, tensors are copied
                into, dict entries are replaced. ``None``: only find and verify.
            map_location: device for tensors that are created (not copied into).
            strict: require ``into`` and the checkpoint to have the same keys.

        Returns:
            The step restored, or ``None`` when no healthy checkpoint exists.
        """
        ck = self._open()
        if ck is None:
            return None
        if into is not None:
            apply(ck, into, map_location=map_location, strict=strict, allow_pickle=self.allow_pickle)
        return ck.step

    def load(self, step: int, into: Any = None, *, map_location: Any = None, strict: bool = True) -> int:
        """Restore ``step`` (its healthiest copy on the fastest tier) into ``into``.

        Raises:
            NotFoundError: no healthy copy of ``step`` on any tier.
        """
        ck = self._open(step)
        if ck is None:
            raise NotFoundError(f"no healthy checkpoint of step {step} under {canonical_root(self.root)} "
                                f"(committed steps: {self.list()})")
        if into is not None:
            apply(ck, into, map_location=map_location, strict=strict, allow_pickle=self.allow_pickle)
        return ck.step

    def read(self, step: Optional[int] = None, *, map_location: Any = None) -> tuple[int, Any]:
        """Return ``(step, state)`` as a fresh tree (tensors owned, stateful objects as their state dicts).

        Raises:
            NotFoundError: nothing healthy (of ``step``, if given).
        """
        ck = self._open(step)
        if ck is None:
            raise NotFoundError(f"no healthy checkpoint{'' if step is None else f' of step {step}'} under "
                                f"{canonical_root(self.root)}")
        return ck.step, materialize(ck, map_location=map_location, allow_pickle=self.allow_pickle)

    def stats(self) -> dict[str, Any]:
        """Counters for monitoring and benchmarks."""
        return {"staging_bytes": self._pool.allocated_bytes, "memory_tier_slot_bytes": self._pool.memory_tier_bytes,
                "staging_allocations": self._pool.allocations,
                "saves": self._save_index, "path": native_describe()["path"],
                "tiers": [t.name for t in self._tiers]}

