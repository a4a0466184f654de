"""The rank dimension: what the ranks of one job agree on. A no-op in one process.

Every place where ranks must agree goes through a :class:`Coordinator`, so multi-rank support
is one implementation of this interface (:class:`nebula_ckpt.ranks.distributed.DistCoordinator`, on
gloo groups of ``torch.distributed``), not a change of the pipeline:

* ``shared_generation`` — one writer generation per job: the coordinator rank takes it on the
  root (create-only), every rank uses it (shard names carry it, fencing checks it);
* ``round`` — on a shared tier's writer thread: one exchange of metadata (never tensor data)
  among all ranks about save number ``index`` of the job, in a fixed sequence of phases: a
  digest of the replicable tensors (so identical replicas cost a hash, not an index), their
  index only when the digests differ, "my shard is durable" (to the coordinator), and the
  coordinator's verdict (to all).
  Every rank runs the same rounds in the same order: a save a rank does not write on a tier (its
  cadence skipped it, it was dropped or failed) is ``abandon``-ed there and the rank takes part
  with ``None``;
* ``agree_step`` / ``all_true`` — on restore: the newest step every rank can restore, and
  whether every rank opened it.

Which rank writes what: shards are named ``shard-g<G>-r<R>``, so ranks never collide;
cleanup and retention never delete a file of the same generation written by another rank.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Optional, Sequence, TypeVar

#: what the ranks agree on at restore: a tuple of ints compared in order (``(generation, step, save)``)
OrderT = TypeVar("OrderT", bound=tuple[int, ...])

#: the phases of one save on a shared tier, in order (see :mod:`nebula_ckpt.save.rounds`)
PHASE_DIGEST, PHASE_INDEX, PHASE_DURABLE, PHASE_VERDICT = 0, 1, 2, 3
PHASES = 4


class _Skip:
    def __repr__(self) -> str:
        return "SKIP"


#: the payload of a round every rank skips by the same decision (taken from an earlier round's
#: result, which every rank has alike): no collective runs, the round returns ``[]``
SKIP: Any = _Skip()


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

    #: the process group of the ranks (for DCP's collectives when resharding); None in one process
    group: Any = None

    @abstractmethod
    def shared_generation(self, take: Callable[[], int]) -> int:
        """The job's writer generation: ``take()`` runs on the coordinator only, all ranks get it."""

    def open_tier(self, tier: str, every: int = 1) -> None:
        """Prepare the rounds of shared tier ``tier`` (``every``: only every N-th save has rounds)."""

    @abstractmethod
    def round(self, tier: str, index: int, phase: int, payload: Any) -> list[Any]:
        """Exchange ``payload`` with every rank for save ``index``, ``phase`` on ``tier``: every
        rank's payload by rank (``None`` for a rank that abandoned the save). Tier writer thread.

        Raises:
            PersistError: the ranks cannot agree (a rank died, a timeout).
        """

    def abandon(self, tier: str, index: int) -> None:
        """This rank does not write save ``index`` on ``tier`` (its later phases answer ``None``)."""

    @abstractmethod
    def agree_step(self, candidates: Sequence[OrderT]) -> Optional[OrderT]:
        """The newest of ``candidates`` (this rank's restorable ``(writer generation, step, save)``
        writes, compared as tuples: generation first) that every rank has."""

    @abstractmethod
    def all_true(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank (restore: every rank opened the agreed step)."""

    @abstractmethod
    def exchange(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (small metadata), by rank. Training thread, never while saving."""

    def close(self, saves: int = 0) -> None:
        """After ``saves`` save indexes were handed out: finish their rounds, release (idempotent)."""


class LocalCoordinator(Coordinator):
    """One process: rank 0 of 1; every agreement is this process's own answer."""

    def shared_generation(self, take: Callable[[], int]) -> int:
        return take()

    def round(self, tier: str, index: int, phase: int, payload: Any) -> list[Any]:
        return [payload]

    def agree_step(self, candidates: Sequence[OrderT]) -> Optional[OrderT]:
        return max(candidates, default=None)

    def all_true(self, ok: bool) -> bool:
        return ok

    def exchange(self, value: Any) -> list[Any]:
        return [value]
