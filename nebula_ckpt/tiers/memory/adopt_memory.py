"""Restore from a copy held in this process's memory without copying it again.

A memory-tier copy pulled from a partner at restore lands in this process's anonymous memory
(:mod:`~nebula_ckpt.tiers.memory.replica_pull`), read through a
:class:`~nebula_ckpt.storage.buffers.BufferStorage`. Those pages are this process's alone: no file
names them, no other process maps them, nothing writes them. So the tensors a restore *creates*
(the optimizer state, new tensors; not the model's parameters, which exist and are copied into)
are views of them, as :mod:`~nebula_ckpt.tiers.memory.adopt` does with a memory tier's pages after a
crash, with no claim to win: the copy the restore would make (a new buffer's page faults and a
memcpy) is not made. Their checksums were checked as the bytes landed (``verify_rest`` checks any
left). Once the restore is applied, the pages no created tensor covers (the model's bytes, the
header) are given back.
"""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING

import torch

from nebula_ckpt.format.records import TensorRecord
from nebula_ckpt.storage.prefault import free_pages

if TYPE_CHECKING:
    from nebula_ckpt.restore.open import OpenCheckpoint


class MemoryAdoption:
    """The pages of a checkpoint held in this process's memory, handed to its restore (see the
    module docstring); the interface of :class:`~nebula_ckpt.tiers.memory.adopt.Adoption`."""

    #: never refused: nothing can keep these pages from being handed out
    refused = False

    def __init__(self, ck: "OpenCheckpoint") -> None:
        self._ck_ref = weakref.ref(ck)  # weak: the checkpoint holds its adoption
        self._used: dict[int, list[tuple[int, int]]] = {}  # shard -> byte ranges handed out
        self.given_up = False

    @property
    def adopted(self) -> dict[int, TensorRecord]:
        """Views to copy when the claim is not won: none (it always is)."""
        return {}

    @property
    def handed_bytes(self) -> int:
        """Bytes of tensors handed out without a copy."""
        return sum(hi - lo for used in self._used.values() for lo, hi in used) if self.given_up else 0

    @property
    def cow_bytes(self) -> int:
        """Copy-on-write bytes: none here."""
        return 0

    def tensors(self, recs: list[TensorRecord]) -> list[torch.Tensor]:
        """Views of ``recs`` over the checkpoint's buffers."""
        ck = self._ck_ref()
        assert ck is not None, "the checkpoint of this adoption is gone"
        out = []
        for r in recs:
            if math.prod(r.shape) == 0:
                out.append(torch.empty(r.shape, dtype=r.torch_dtype))
                continue
            out.append(ck.buffer(r.shard)[r.start:r.end].view(r.torch_dtype).reshape(r.shape))
            self._used.setdefault(r.shard, []).append((r.start, r.end))
        return out

    def give_up(self) -> bool:
        """The claim: always won (the pages are this process's alone)."""
        self.given_up = True
        return True

    def finish(self) -> None:
        """After the restore was applied: give back the pages no handed-out tensor covers."""
        ck = self._ck_ref()
        if ck is None or not self.given_up:
            return
        for si, used in self._used.items():
            buf, at = ck.buffer(si), 0
            for lo, hi in sorted(used) + [(buf.numel(), buf.numel())]:
                if lo > at:
                    free_pages(buf, at, lo)
                at = max(at, hi)
