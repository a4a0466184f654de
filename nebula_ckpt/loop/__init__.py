"""Resuming a training loop exactly: every random stream and the position in the data (:class:`LoopState`)."""

from nebula_ckpt.loop.state import LoopState

__all__ = ["LoopState"]
