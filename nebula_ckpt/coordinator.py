"""The rank dimension: what the ranks of one job agree on. A no-op in one process.

Every place where ranks must agree goes through a :class:`Coordinator`, so multi-rank support
is one implementation of this interface (on a gloo group of ``torch.distributed``), not a change
of the pipeline:

* ``shared_generation`` — one writer generation per job: the coordinator rank takes it on the
  root (create-only), every rank uses it (shard names carry it, fencing checks it);
* ``shard_durable`` — before a tier's manifest and commit marker: every rank reports its shard
  durable (and verified) there; the commit goes ahead only if all did. Metadata only, never
  tensor data, never on the training thread;
* ``agree_step`` — on restore: the newest step every rank can restore.

Which rank writes what: shards are named ``shard-g<G>-r<R>``, so ranks never collide;
cleanup and retention never delete a file of the same generation written by another rank.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Optional, Sequence


class Coordinator(ABC):
    """How the ranks of one job agree (see the module docstring for who calls what, when)."""

    #: this process's rank, 0 ... world_size - 1
    rank: int = 0
    #: number of ranks writing one checkpoint
    world_size: int = 1

    @property
    def is_coordinator(self) -> bool:
        """Whether this rank writes the global manifest and commit marker (rank 0)."""
        return self.rank == 0

    @abstractmethod
    def shared_generation(self, take: Callable[[], int]) -> int:
        """The job's writer generation: ``take()`` runs on the coordinator only, all ranks get it."""

    @abstractmethod
    def shard_durable(self, step: int, tier: str, ok: bool) -> bool:
        """Report this rank's shard of ``step`` on ``tier`` (``ok``: durable and verified); True
        when every rank's is, so the commit may go ahead. Called on the tier's writer thread."""

    @abstractmethod
    def agree_step(self, candidates: Sequence[int]) -> Optional[int]:
        """The newest of ``candidates`` (this rank's restorable steps) that every rank has."""

    def close(self) -> None:
        """Release the channel (idempotent)."""


class LocalCoordinator(Coordinator):
    """One process: rank 0 of 1; every agreement is this process's own answer."""

    def shared_generation(self, take: Callable[[], int]) -> int:
        return take()

    def shard_durable(self, step: int, tier: str, ok: bool) -> bool:
        return ok

    def agree_step(self, candidates: Sequence[int]) -> Optional[int]:
        return max(candidates, default=None)
