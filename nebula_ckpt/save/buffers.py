"""Staging buffers: a bounded pool of pre-faulted host buffers, reused across saves.

A save takes one buffer (a *slot*) big enough for its whole shard image and gives it back once
every tier that took the snapshot has written it. Buffers are allocated on first need, rounded up
to 2 MiB, and reused while they are large enough: later saves of the same state allocate nothing.
When no slot is free, a save waits (``on_full="wait"``) or is skipped (``"skip"``); never past the
host-memory budget (:mod:`nebula_ckpt.save.budget`), which counts the memory tier's files too.

With a memory tier, CPU saves stage into *slot files*: files in the memory tier's ``.slots/``
folder (tmpfs), mapped shared and pre-faulted. The memory tier then "writes" a snapshot by
hard-linking the slot file as its shard, so the bytes are copied once (tensors -> slot) instead of
twice, and the disk / remote tiers read the same mapping. A slot file some committed memory-tier
checkpoint still links to is *live*: it is that tier's storage, not staging, and is never reused
until retention unlinks the checkpoint, nor while another process still reads it (a restore of
that checkpoint holds a reader lock on the file: see :mod:`nebula_ckpt.storage.local`).

Creating a slot file costs a page fault per 4 KiB page of tmpfs (about 0.4-1 GB/s here): seconds
for a state of several GB. States of at least ``slot_ahead_bytes`` therefore never create one on
the training thread: a save that finds no slot file ready stages in an anonymous buffer, which
the memory tier copies, while the next slot file is made by a background thread; once two slot
files of its size exist, that anonymous buffer is freed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Optional

from nebula_ckpt import knobs
from nebula_ckpt.errors import ValidationError
from nebula_ckpt.latch import Latch
from nebula_ckpt.native import get_ops
from nebula_ckpt.save.budget import HostMemoryBudget, folder_ram_bytes, held_by
from nebula_ckpt.save.slot_claim import SlotClaim
from nebula_ckpt.save.slots import (
    POOLS,
    Slot,
    adopt_slot_file,
    create_slot_file,
    fresh_anonymous,
    idle_elsewhere,
    retire_anonymous,
    shm_room,
    unlink_spares,
)
from nebula_ckpt.storage.prefault import FaultAhead, threads_for
from nebula_ckpt.tiers.memory.runtime import mapped_by_garbage, own_spare_slot_files

#: states at least this large never create a memory-tier slot file on the training thread: a save
#: with no slot file ready stages in an anonymous buffer while the next slot file is made in the
#: background
SLOT_AHEAD_BYTES = 32 << 20
#: longest a staging buffer made in the background waits for the copy of the save that asked for it
#: to finish (so that it does not take that copy's cores and memory bandwidth) before it is made anyway
SLOT_AHEAD_WAIT_S = 60.0

__all__ = ["Slot", "StagingPool"]

log = logging.getLogger(__name__)

_ROUND = 2 << 20


class StagingPool:
    """A bounded set of reusable host buffers.

    Args:
        budget: the host-memory budget: staging buffers plus the memory tier's folder (its
            checkpoints, slot files, replicas) stay under it (:meth:`used`).
        max_slots: most staging buffers at once (1 = no overlap between consecutive saves' persists).
        on_full: ``"wait"`` or ``"skip"`` when every slot is busy.
        slot_dir: folder for slot files (the memory tier's ``.slots``); ``None``: anonymous only.
    """

    def __init__(self, budget: Optional[HostMemoryBudget], max_slots: int, on_full: str,
                 slot_dir: Optional[str] = None) -> None:
        if on_full not in ("wait", "skip"):
            raise ValidationError(f"on_full must be 'wait' or 'skip', got {on_full!r}")
        self.budget = budget or HostMemoryBudget(None)
        self.max_slots = max_slots
        self.on_full = on_full
        self.slot_dir = slot_dir
        self._slots: list[Slot] = []
        self._mutex = threading.RLock()  # taken directly: a C call a Ctrl-C cannot cut (Condition.__enter__ can)
        self._cond = threading.Condition(self._mutex)
        self.allocations = 0
        self._closed = False
        self._warned_shm = False
        #: background thread making a slot file ahead of need (see :meth:`_prepare_ahead`)
        self._preparer: Optional[threading.Thread] = None
        self._preparing_bytes = 0
        self._ahead_failed: Optional[int] = None  # size whose slot file could not be made
        #: size of the slot files prepare() is making (two: the steady state's), else None
        self._preparing_two: Optional[int] = None
        #: set while no save's copy is running (a Latch: the training thread sets / clears it): a slot made
        #: ahead waits for it, so that it does not take the cores and memory bandwidth of the snapshot that asked for it
        self._copies_idle = Latch()
        self._copies_idle.set()
        #: states' worth of the budget one save needs at least (:meth:`serve_writers`)
        self._states = 1
        #: the last state size check_fits() passed (a later save of the same size is not checked again)
        self._checked: Optional[tuple[int, int]] = None
        #: why the budget refused the last try: (bytes asked, bytes held by kind, limit), else None
        self._short: Optional[tuple[int, dict[str, int], int]] = None
        #: threads faulting in fresh anonymous buffers ahead of their first copy (see prefault.py)
        self._faulters: list[FaultAhead] = []
        POOLS.add(self)

    def serve_writers(self, slot_dir: Optional[str], max_slots: int, states: int = 1) -> None:
        """Fit the pool to the tiers this process writes, once they are known (before the first
        save): their slot folder (a tier that links staged files, the memory tier: CPU saves then
        stage in its slot files, so the bytes are copied once), the staging buffers they need
        at once (``max_slots``) and how many states' worth of the budget a save needs at least
        (``states``: 2 where the memory tier is written and no persistent tier, which would let
        it give its step up: the new step must fit beside the one it replaces)."""
        with self._mutex:
            self.slot_dir = slot_dir
            self.max_slots = max_slots
            self._states = states

    @property
    def allocated_bytes(self) -> int:
        """Staging bytes held by the pool now (slot files that hold a memory-tier checkpoint excluded)."""
        with self._mutex:
            return sum(s.capacity for s in self._slots if not s.live())

    @property
    def memory_tier_bytes(self) -> int:
        """Bytes of slot files that hold a committed memory-tier checkpoint (that tier's storage)."""
        with self._mutex:
            return sum(s.capacity for s in self._slots if s.live())

    def used(self) -> dict[str, int]:
        """Host memory checkpointing holds now, as the budget counts it: ``staging`` (anonymous and
        pinned buffers, and one being made ahead) and ``memory_tier`` (the RAM of the memory tier's
        folder: its checkpoints and their bases, slot files, replicas held for partners)."""
        with self._mutex:
            return self._used()

    def _used(self) -> dict[str, int]:
        anon = sum(s.capacity for s in self._slots if s.path is None) + self._preparing_bytes
        folder = None if self.slot_dir is None else os.path.dirname(self.slot_dir)
        return {"staging": anon, "memory_tier": folder_ram_bytes(folder)}

    def _shortage(self, nbytes: int) -> Optional[tuple[int, dict[str, int], int]]:
        """``(nbytes, held by kind, limit)`` when ``nbytes`` more exceed the budget (lock held), else None."""
        held = self._used()
        used = sum(held.values())
        limit = self.budget.limit(used)
        return None if used + nbytes <= limit else (nbytes, held, limit)

    def _fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more stay within the budget (lock held); else remembers the shortage."""
        short = self._shortage(nbytes)
        if short is not None:
            self._short = short
        return short is None

    def room_for(self, nbytes: int) -> Optional[str]:
        """Why ``nbytes`` more host memory (a partner's replica received into the memory tier) do
        not fit in the budget now, in words; None when they do."""
        with self._mutex:
            short = self._shortage(nbytes)
        return None if short is None else \
            f"{self.budget.say_short(*short)}; pass a larger host_memory_budget on that rank"

    def check_fits(self, nbytes: int) -> None:
        """Raise a clear error if one save of ``nbytes`` can never fit in the budget (before
        anything is written): with only the memory tier written, the new step beside the newest."""
        if (nbytes, self._states) == self._checked:
            return  # the same size as the last save: checked then (acquire() still holds the budget)
        with self._mutex:
            held = sum(self._used().values())
        need = nbytes * self._states
        self.budget.check_fits(need, held, nbytes if self._states > 1 else None)
        self._checked = (nbytes, self._states)

    def why_full(self) -> str:
        """Why the last :meth:`acquire` found no slot, in words (the budget, or busy buffers)."""
        short = self._short
        if short is None:
            return "every staging buffer is still being persisted"
        return self.budget.say_short(*short)

    def acquire(self, nbytes: int, pinned: bool, reclaim: Optional[Callable[[bool], bool]] = None,
                what: str = "a save", claim: Optional[SlotClaim] = None) -> Optional[Slot]:
        """A free slot of at least ``nbytes``; ``None`` when skipped by policy. ``claim`` holds the
        slot from the moment it is marked in use (see :class:`SlotClaim`).

        ``reclaim(budget)`` is called (without the pool's lock) when no slot can be had: it drops
        snapshots that slow tiers hold but have not started writing, which may free a slot, and
        (``budget``: the budget is what is short) gives up what loses nothing, the memory tier's
        steps that a persistent tier holds too. A save that waits for the budget says so once
        in the log (``what``: which save), naming the budget.
        """
        self.check_fits(nbytes)
        reclaimed = told = False
        freed, stuck = reclaim is not None, None  # stuck: since when nothing in flight can free memory
        collected: set[str] = set()  # idle slot files a garbage collection was run for (once each)
        while True:
            with self._mutex:
                self._short = None
                slot = self._take(nbytes, pinned, claim or SlotClaim())
                if slot is not None:
                    return slot
                self._copies_idle.set()  # no copy follows
                short = self._short is not None
                if mapped_by_garbage([s.path for s in self._slots if s.path and not s.in_use], collected):
                    continue  # an idle slot file that only a reference cycle still mapped is free again
                if reclaimed or reclaim is None:
                    if self.on_full == "skip":
                        return None
                    idle = short and not freed and self._preparer is None and not any(s.in_use for s in self._slots)
                    if idle and idle_elsewhere(self.slot_dir, self):  # another pool's idle slot files went
                        continue
                    stuck = self.budget.stuck(stuck, held_by(self.slot_dir) if idle else None, what, self.why_full)
                    if short and not told:
                        told = True
                        log.warning("nebula_ckpt: %s waits (on_full='wait'): %s; it goes ahead once a save in flight "
                                    "is durable and frees memory", what, self.why_full())
                    self._cond.wait(0.25)
                    reclaimed = False
                    continue
            reclaimed = True
            freed = bool(reclaim(short))

    def _trim(self) -> list[Slot]:
        """Free idle anonymous buffers slot files replaced (:func:`~nebula_ckpt.save.slots.retire_anonymous`)
        and idle staging slots beyond ``max_slots`` (a slot file stops being live when the memory
        tier's retention drops its checkpoint, which can leave one staging slot too many); return
        the staging slots left."""
        retire_anonymous(self._slots)
        staging = [s for s in self._slots if not s.live()]
        extra = len(staging) - self.max_slots
        if extra > 0:  # the idle ones beyond it go, anonymous buffers first
            for s in sorted((s for s in staging if not s.in_use), key=lambda s: s.path is not None)[:extra]:
                self._slots.remove(s)
                staging.remove(s)
                s.free()
        return staging

    def drop_idle_files(self) -> int:
        """Free this pool's idle slot files no checkpoint links (another pool of the same folder
        needs the room: see :func:`~nebula_ckpt.save.slots.idle_elsewhere`); their bytes."""
        with self._mutex:
            idle = [s for s in self._slots if s.path is not None and not s.in_use and not s.live()]
            for s in idle:
                self._slots.remove(s)
                s.free()
        return sum(s.capacity for s in idle)

    def copy_done(self) -> None:
        """A save's copy into its slot finished (any thread): a slot may be made ahead now."""
        self._copies_idle.set()

    @staticmethod
    def _lend(slot: Slot, claim: SlotClaim) -> None:
        slot.in_use = True  # and the claim, with no call between: nothing can cut in
        claim.slot = slot

    def _take(self, nbytes: int, pinned: bool, claim: SlotClaim) -> Optional[Slot]:
        if self._closed:
            raise RuntimeError("the checkpointer is closed")
        self._copies_idle.clear()  # the caller copies into what it takes (copy_done() after)
        staging = self._trim()
        use_file = self.slot_dir is not None and not pinned
        ahead = use_file and nbytes >= SLOT_AHEAD_BYTES
        free = [s for s in staging if not s.in_use and s.pinned == pinned]
        fit = [s for s in free if s.fits(nbytes)]
        if fit:  # slot files first: the memory tier can link them instead of copying
            slot = min(fit, key=lambda s: (s.path is None, s.capacity))
            self._lend(slot, claim)
            if ahead:
                self._prepare_ahead(nbytes, took_file=slot.path is not None)
            return slot
        if ahead and not self._fits(3 * nbytes):
            # the first save of a large state stages in process memory, the memory tier copies it
            # and a slot file is made meanwhile: three states at once. Short of that budget, the
            # slot file is made here instead (its page faults on this thread, as for small states)
            ahead = False
            self._short = None
        size = max(nbytes, 1)  # the budget's check: a buffer is rounded up below only where the budget holds that

        def room(extra: int = 0) -> bool:
            return len(staging) + (self._preparer is not None) < self.max_slots and self._fits(size + extra)

        made = self._adopt_spare(nbytes) if use_file else None  # a finished process's spare takes no new memory
        if made is None:
            self._make_room(staging, room, lambda: use_file and self.slot_dir is not None and
                            not shm_room(self.slot_dir, size))
            if not room():
                return None
            made = self._new_slot(size, adopt=False) if use_file and not ahead else None  # spares: tried above
        if made is None:
            if use_file and not room(size):
                return None  # the memory tier would copy this buffer: the budget must hold both
            rounded = -(-max(nbytes, 1) // _ROUND) * _ROUND
            if self._fits(rounded + (size if use_file else 0)):  # the rounded buffer (and the tier's copy)
                size = rounded  # else the exact size room() was checked with
            # Filled by this save's copy at once: its threads take the page faults (a pinned
            # buffer is registered, so its pages are faulted anyway).
            made = Slot(get_ops().alloc(size, True, prefault=True), True) if pinned else fresh_anonymous(size)
            if not pinned and threads_for(size):  # idle cores fault its pages ahead of the copy
                self._faulters = [f for f in self._faulters if f.running()]
                self._faulters.append(FaultAhead(made.buffer, threads_for(size)))
        slot = made
        self._slots.append(slot)
        self._lend(slot, claim)
        self.allocations += 1
        log.debug("nebula_ckpt: staging %s of %.1f MiB allocated (%d slots)",
                  "slot file" if slot.path else "buffer", slot.capacity / 2**20, len(self._slots))
        if ahead:
            self._prepare_ahead(nbytes, took_file=slot.path is not None)
        return slot

    def _make_room(self, staging: list[Slot], room: Callable[[], bool], shm_full: Callable[[], bool]) -> None:
        """Drop idle buffers that do not fit (or are of the other kind) until ``room()``; then, on
        a full tmpfs (``shm_full()``), idle slot files of other sizes too (for a new one, or the
        tier's copy). Lock held."""
        for s in [s for s in staging if not s.in_use]:
            if room():
                break
            self._slots.remove(s)
            staging.remove(s)
            s.free()
        for s in [s for s in staging if not s.in_use and s.path] if shm_full() else []:
            self._slots.remove(s)
            staging.remove(s)
            s.free()

    def prepare(self, nbytes: int, pinned: bool) -> None:
        """Make the staging for saves of ``nbytes`` in the background, unless it is there.

        Where saves stage in slot files, the two of the steady state (the memory tier links the
        first save's file as its checkpoint, so the second save needs the other one), made one
        after the other; else one anonymous (pinned, for GPU states) buffer. The first saves then
        find their buffers faulted in, as later saves do, and nothing is made while they run.
        """
        self.check_fits(nbytes)
        with self._mutex:
            as_file = self.slot_dir is not None and not pinned
            self._preparing_two = nbytes if as_file else None
            if self._closed or (not as_file and any(not s.in_use and s.pinned == pinned and s.fits(nbytes)
                                                    for s in self._slots if not s.live())):
                return
            self._prepare_ahead(nbytes, took_file=False, pinned=pinned)

    def wait_prepared(self, timeout: Optional[float] = None) -> None:
        """Wait until no staging buffer is being made in the background (``timeout``: in all)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._mutex:
                preparer = self._preparer
            if preparer is None:
                return
            preparer.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if deadline is not None and time.monotonic() >= deadline:
                return

    def _prepare_ahead(self, nbytes: int, took_file: bool, pinned: bool = False) -> None:
        """Start making a staging buffer of ``nbytes`` in the background if the next save will want one.

        Called with the lock held, after a save of a large state took a slot (or by
        :meth:`prepare`). A save that had to take an anonymous buffer wants a slot file next
        time; one that took the only slot file of its size will see it linked by the memory
        tier, so the save after it wants a second one (two slot files per size is the steady
        state: the memory tier's checkpoint and the next save's staging). Nothing is started when
        a free slot file is ready, one is being made, making one failed before, or it would not
        fit in ``max_slots`` / the budget (idle anonymous buffers count as free: the new one
        replaces one of them).
        """
        as_file = self.slot_dir is not None and not pinned
        size = nbytes if as_file else -(-max(nbytes, 1) // _ROUND) * _ROUND
        if self._preparer is not None or self._ahead_failed == size or self._closed:
            return
        files = [s for s in self._slots if s.path is not None and s.capacity == nbytes]
        # prepare(): both files of the steady state, free; otherwise one free file is enough
        want = 2 if self._preparing_two == nbytes else 1
        if as_file and sum(1 for s in files if not s.in_use and not s.live()) >= want:
            return
        if took_file and len(files) >= 2:
            return
        staging = [s for s in self._slots if not s.live()]
        kept = [s for s in staging if s.in_use or s.path is not None]
        if len(kept) + 1 > self.max_slots:
            return
        idle = sum(s.capacity for s in staging if s.path is None and not s.in_use)  # freed once it is made
        if not self._fits(size - idle):
            self._short = None  # made ahead or not, no save is refused by this
            return
        self._preparing_bytes = size
        self._preparer = threading.Thread(target=self._make_ahead, args=(size, as_file, pinned),
                                          name="nebula-slot-ahead", daemon=True)
        self._preparer.start()

    def _make_ahead(self, size: int, as_file: bool, pinned: bool) -> None:
        """Body of the background thread of :meth:`_prepare_ahead`."""
        slot: Optional[Slot] = None
        self._copies_idle.wait(SLOT_AHEAD_WAIT_S)
        try:
            if as_file:
                slot = self._new_slot(size)
            else:
                slot = Slot(get_ops().alloc(size, pinned), pinned)
        except Exception as e:  # out of memory, no pinned memory: the save allocates as before
            log.warning("nebula_ckpt: staging buffer of %.1f MiB not made ahead: %s", size / 2**20, e)
        finally:
            with self._mutex:
                self._preparer = None
                self._preparing_bytes = 0
                if slot is None:
                    self._ahead_failed = size
                elif self._closed:
                    slot.free()
                else:
                    self._slots.append(slot)
                    self.allocations += 1
                    self._trim()  # an idle anonymous buffer it replaces goes now
                    log.debug("nebula_ckpt: staging %s of %.1f MiB made ahead of need",
                              "slot file" if slot.path else "buffer", size / 2**20)
                    if self._preparing_two == size and slot.path is not None:
                        self._prepare_ahead(size, took_file=False)  # prepare(): the steady state's second
                if self._preparer is None:
                    self._preparing_two = None
                self._cond.notify_all()

    def _adopt_spare(self, size: int) -> Optional[Slot]:
        """A spare slot file of exactly ``size`` that a finished process left (its tmpfs pages
        exist already: mapping it costs no page allocation), or None."""
        if self.slot_dir is None:
            return None
        mine = {sl.path for sl in self._slots if sl.path is not None}
        for path, have in own_spare_slot_files(self.slot_dir, mine):
            if have == size:
                try:
                    return adopt_slot_file(path, size)
                except OSError as e:
                    log.debug("nebula_ckpt: spare slot file %s not adopted: %s", path, e)
        return None

    def _new_slot(self, size: int, adopt: bool = True) -> Optional[Slot]:
        """A slot file (``adopt``: a spare of that size first), or None (logged once) when the tmpfs has no room."""
        assert self.slot_dir is not None
        spare = self._adopt_spare(size) if adopt else None
        if spare is not None:
            return spare
        why = None
        if not shm_room(self.slot_dir, size):
            why = f"less than {knobs.get('shm_min_free_fraction'):.0%} of it would stay free"
        else:
            try:
                return create_slot_file(self.slot_dir, size)
            except OSError as e:
                why = str(e)
        if not self._warned_shm:
            log.warning("nebula_ckpt: no slot file of %.1f MiB in %s (%s): staging in process memory, "
                        "the memory tier copies from it", size / 2**20, self.slot_dir, why)
            self._warned_shm = True
        return None

    def release(self, slot: Slot) -> None:
        """Give ``slot`` back."""
        self._copies_idle.set()  # its copy is over (or never ran: a save that failed to start)
        with self._mutex:
            slot.in_use = False
            if self._closed and slot in self._slots:
                self._slots.remove(slot)
                slot.free()
            elif not self._closed:
                self._trim()
            self._cond.notify_all()

    def close(self) -> None:
        """Free every idle buffer (slot file names too; linked checkpoints keep their bytes); a slot
        file being made ahead of need is waited for, then freed."""
        with self._mutex:
            self._closed = True
            preparer = self._preparer
        self._copies_idle.set()  # a preparer waiting for a copy goes on (and frees what it made)
        if preparer is not None:
            preparer.join()
        for f in self._faulters:
            f.stop()
        with self._mutex:
            for s in self._slots:
                if not s.in_use:
                    s.free()
            self._slots = [s for s in self._slots if s.in_use]
            unlink_spares(self.slot_dir, self._slots)  # taken over from finished processes, never used
            self._cond.notify_all()
