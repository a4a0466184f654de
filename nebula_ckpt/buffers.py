"""Staging buffers: a bounded pool of pre-faulted host buffers, reused across saves.

A save takes one buffer (a *slot*) big enough for its whole shard image and gives it back once
every tier that took the snapshot has written it. Buffers are allocated on first need, rounded up
to 2 MiB, and reused while they are large enough: later saves of the same state allocate nothing.
When no slot is free, a save waits (``on_full="wait"``, the default) or is skipped
(``on_full="skip"``); memory never grows past ``max_host_bytes``.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .errors import ValidationError
from .native import get_ops

log = logging.getLogger(__name__)

_ROUND = 2 << 20


@dataclass(eq=False)
class Slot:
    """One staging buffer."""

    buffer: torch.Tensor       # 1-D uint8, capacity bytes
    pinned: bool
    in_use: bool = field(default=False)

    @property
    def capacity(self) -> int:
        """Bytes available."""
        return int(self.buffer.numel())


class StagingPool:
    """A bounded set of reusable host buffers.

    Args:
        max_bytes: cap on the sum of all buffers (``None``: only ``max_slots`` bounds it).
        max_slots: most buffers at once (1 = no overlap between consecutive saves' persists).
        on_full: ``"wait"`` or ``"skip"`` when every slot is busy.
    """

    def __init__(self, max_bytes: Optional[int], max_slots: int, on_full: str) -> None:
        if on_full not in ("wait", "skip"):
            raise ValidationError(f"on_full must be 'wait' or 'skip', got {on_full!r}")
        self.max_bytes = max_bytes
        self.max_slots = max_slots
        self.on_full = on_full
        self._slots: list[Slot] = []
        self._cond = threading.Condition()
        self.allocations = 0
        self._closed = False

    @property
    def allocated_bytes(self) -> int:
        """Bytes held by the pool now."""
        with self._cond:
            return sum(s.capacity for s in self._slots)

    def check_fits(self, nbytes: int) -> None:
        """Raise a clear error if one save of ``nbytes`` can never fit."""
        if self.max_bytes is not None and nbytes > self.max_bytes:
            raise ValidationError(
                f"this state needs {nbytes / 2**20:.1f} MiB of host staging memory but "
                f"max_host_bytes is {self.max_bytes / 2**20:.1f} MiB; raise max_host_bytes")

    def acquire(self, nbytes: int, pinned: bool,
                reclaim: Optional[Callable[[], bool]] = None) -> Optional[Slot]:
        """A free slot of at least ``nbytes``; ``None`` when skipped by policy.

        ``reclaim()`` is called (without the pool's lock) when every slot is busy: it drops
        snapshots that slow tiers hold but have not started writing, which may free a slot.
        """
        self.check_fits(nbytes)
        reclaimed = False
        while True:
            with self._cond:
                slot = self._take(nbytes, pinned)
                if slot is not None:
                    return slot
                if reclaimed or reclaim is None:
                    if self.on_full == "skip":
                        return None
                    self._cond.wait(0.25)
                    reclaimed = False
                    continue
            reclaimed = True
            reclaim()

    def _take(self, nbytes: int, pinned: bool) -> Optional[Slot]:
        if self._closed:
            raise RuntimeError("the checkpointer is closed")
        free = [s for s in self._slots if not s.in_use and s.pinned == pinned]
        fit = [s for s in free if s.capacity >= nbytes]
        if fit:
            slot = min(fit, key=lambda s: s.capacity)
            slot.in_use = True
            return slot
        total = sum(s.capacity for s in self._slots)
        size = -(-max(nbytes, 1) // _ROUND) * _ROUND

        def room() -> bool:
            return len(self._slots) < self.max_slots and (self.max_bytes is None or total + size <= self.max_bytes)

        # Drop free buffers that are too small (or of the other kind) to make room.
        for s in [s for s in self._slots if not s.in_use]:
            if room():
                break
            self._slots.remove(s)
            total -= s.capacity
        if not room():
            return None
        slot = Slot(get_ops().alloc(size, pinned), pinned, in_use=True)
        self.allocations += 1
        self._slots.append(slot)
        log.debug("nebula_ckpt: staging buffer of %.1f MiB allocated (%d slots)", size / 2**20, len(self._slots))
        return slot

    def release(self, slot: Slot) -> None:
        """Give ``slot`` back."""
        with self._cond:
            slot.in_use = False
            self._cond.notify_all()

    def close(self) -> None:
        """Free every idle buffer; wake waiters."""
        with self._cond:
            self._closed = True
            self._slots = [s for s in self._slots if s.in_use]
            self._cond.notify_all()
