"""What one save took from the staging pool (:class:`~nebula_ckpt.save.buffers.StagingPool`)."""

from __future__ import annotations

from typing import Optional

from nebula_ckpt.save.slots import Slot


class SlotClaim:
    """What one save took from the pool and has not handed on yet: its slot, set by the pool in the
    same step that marks the slot in use (no point between them where a signal handler's exception
    can land), so a save cut anywhere after that still knows which slot to give back."""

    __slots__ = ("slot",)

    def __init__(self) -> None:
        self.slot: Optional[Slot] = None
