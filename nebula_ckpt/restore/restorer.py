"""The restore side of a Checkpointer: listing, finding and opening a step, loading it into ``into``.

Only this module knows the order of the restore stages: select a candidate
(:mod:`~nebula_ckpt.restore.select`; in a multi-rank job the ranks agree on it), open and verify
it (:mod:`~nebula_ckpt.restore.open`) while staging the restore into ``into``
(:mod:`~nebula_ckpt.restore.apply`, handing over the memory tier's pages where it may:
:mod:`~nebula_ckpt.tiers.memory.adopt`), then apply it, or reshard it when it was saved in another
layout (:mod:`~nebula_ckpt.restore.reshard`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from nebula_ckpt.arguments import check_restore_arguments
from nebula_ckpt.errors import CorruptCheckpointError, NotFoundError, OtherRanksError, ValidationError
from nebula_ckpt.format.commit import Write, committed_steps, step_dirs
from nebula_ckpt.format.manifest import Manifest
from nebula_ckpt.format.names import COMMIT, step_dir
from nebula_ckpt.health.book import HealthBook
from nebula_ckpt.ranks.coordinator import Coordinator
from nebula_ckpt.restore.apply import apply, materialize, stage_restore
from nebula_ckpt.restore.candidates import (
    RELIST_ROUNDS,
    Candidate,
    changed_meanwhile,
    check_listed,
    list_again,
    list_candidates,
    removed_error,
)
from nebula_ckpt.restore.intact import files_problem
from nebula_ckpt.restore.open import OpenCheckpoint, read_main_manifest
from nebula_ckpt.restore.select import (
    HealthChoice,
    Stage,
    find_and_open,
    newest_first,
    open_agreed,
    open_tagged,
    say,
    stop_together,
)
from nebula_ckpt.restore.unreadable import outage
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.storage.buffers import BufferStorage
from nebula_ckpt.tiers.base import Tier
from nebula_ckpt.tiers.memory.adopt import adoption_for
from nebula_ckpt.tiers.runtime import TierRuntime

log = logging.getLogger("nebula_ckpt")


class Restorer:
    """Lists and restores the checkpoints of one root over its tiers.

    Args:
        runtimes: the tiers opened for this run, fastest first.
        coordinator: how the ranks of the job agree on the step to restore.
        root: the run's root, as shown in messages.
        allow_pickle: load values stored with pickle.
        may_adopt: whether the memory tier's pages may be handed over instead of copied now
            (not once this process saved, nor for a reader, which deletes nothing).
        on_restored: called with ``(step, tier name, its manifest)`` after each restore.
        health: the root's health records: a restore of the newest step skips the checkpoints
            marked suspect (:class:`~nebula_ckpt.restore.select.HealthChoice`).
    """

    def __init__(self, runtimes: list[TierRuntime], coordinator: Coordinator, root: str, allow_pickle: bool,
                 may_adopt: Callable[[], bool],
                 on_restored: Optional[Callable[[int, str, Manifest], None]] = None,
                 health: Optional[HealthBook] = None) -> None:
        self._runtimes = runtimes
        self.coordinator = coordinator
        self.root = root
        self.allow_pickle = allow_pickle
        self._may_adopt = may_adopt
        #: told ``(step, tier, manifest)`` after each restore (the tier's next save may build on it)
        self._on_restored = on_restored
        #: ``{"step", "tier", "adopted_bytes", "copy_on_write_bytes"}`` of the last restore (``None``
        #: before any); with memory-tier replicas also ``sources`` (where each rank's copy was) and
        #: ``source`` (this rank's)
        self.last_restore: Optional[dict[str, Any]] = None
        #: memory-tier replicas on partner nodes (:mod:`nebula_ckpt.tiers.memory.replicas`), or None
        self.replicator: Any = None
        #: the root's health records (a restore of the newest step skips the suspect ones), or None
        self.health = health
        #: told ``(generation, step, health mark)`` after each restore
        #: (:class:`~nebula_ckpt.health.monitor.HealthMonitor`)
        self.monitor: Any = None

    def tier_pairs(self) -> list[tuple[Tier, Storage]]:
        """``(tier, storage)`` of every tier read, fastest first."""
        return [(rt.tier, rt.storage) for rt in self._runtimes]

    def warn_kept(self, steps: list[int], written: set[str]) -> None:
        """Log the ``steps`` that stay committed on a tier this process does not write (``written``:
        the tiers it does): a ``remove()`` deletes nothing there."""
        for t, st in self.tier_pairs():
            left = [s for s in steps if t.name not in written and st.exists(f"{step_dir(s)}/{COMMIT}")]
            if left:
                log.warning("nebula_ckpt: remove(): tier %s is not written by this process; step(s) %s stay there",
                            t.name, left)

    # -- listing ------------------------------------------------------------------------------------
    def committed(self) -> dict[str, list[int]]:
        """Tier name -> its committed steps, ascending."""
        return {t.name: committed_steps(st) for t, st in self.tier_pairs()}

    def step_tags(self, check_shards: bool) -> dict[int, Optional[str]]:
        """Step -> tag (None: untagged) of every committed step with a valid manifest on some tier
        (commit marker, manifest checksum, every field); ``check_shards``: and every shard file
        it names present with its recorded size (the check of ``nebula-ckpt ls --quick``). A tier
        that cannot be listed or read raises its error: what it holds is not known."""
        out: dict[int, Optional[str]] = {}
        for t, st in self.tier_pairs():
            for s in step_dirs(st):  # a folder without a marker has no manifest that checks out: not listed
                if s not in out:
                    man = _sound(t, st, s, check_shards)
                    if man is not None:
                        out[s] = man.tag
        return out

    def latest(self) -> Optional[tuple[int, Optional[str]]]:
        """``(step, tag)`` of the checkpoint :meth:`load` of the newest step tries first (see
        :meth:`Checkpointer.latest`), or None."""
        choice = HealthChoice(self.health.view() if self.health is not None else None, skip_suspect=True)
        removed: list[Candidate] = []
        before: Optional[list[tuple[str, int]]] = None
        for rnd in range(RELIST_ROUNDS):  # listed again when steps went while read (a job's retention beside)
            unlisted: list[BaseException] = []
            unmarked: list[Candidate] = []
            gone = len(removed)
            for c in newest_first(self.tier_pairs(), unlisted=unlisted, unmarked=unmarked):  # markers as needed
                if list_again(rnd, unmarked, before, len(removed) > gone):
                    break  # newer steps may have come since this listing (as find_and_open)
                if c.problem is None and not choice.skips(*c.order):
                    check_listed(unlisted, c)  # a tier not listed may hold a newer step
                    man = _sound(c.tier, c.storage, c.step, True)
                    now = changed_meanwhile(c) if man is None else None
                    if now is c:  # removed while read: listed again, but in the last listing
                        removed.append(c)
                        continue
                    if now is not None:  # saved again while read: its new write
                        man = _sound(c.tier, c.storage, c.step, True)
                    if man is not None:
                        return c.step, man.tag
            check_listed(unlisted)
            folders = [(c.tier.name, c.step) for c in unmarked]
            if len(removed) == gone and (not folders or folders == before):
                break
            before = folders
        if removed:
            raise removed_error(removed, [])
        return None

    def tags(self) -> dict[str, int]:
        """Tag -> the newest step holding it (see :meth:`Checkpointer.tags`)."""
        out: dict[str, int] = {}
        for step, tag in sorted(self.step_tags(check_shards=True).items()):
            if tag is not None:
                out[tag] = step  # ascending steps: the newest one holding a tag wins
        return out

    def steps_tagged(self, tag: str) -> list[int]:
        """Committed steps whose manifest carries ``tag``, newest first."""
        return sorted((s for s, t in self.step_tags(check_shards=False).items() if t == tag), reverse=True)

    def not_found(self, step: Optional[int], tag: Optional[str]) -> NotFoundError:
        """The error for nothing healthy of ``step`` / with ``tag`` (or at all)."""
        if tag is not None:
            return NotFoundError(f"no healthy checkpoint tagged {tag!r} under {self.root} "
                                 f"(tags: {sorted(self.tags())[:20]})")
        steps = sorted({s for steps in self.committed().values() for s in steps})
        return NotFoundError(f"no healthy checkpoint{'' if step is None else f' of step {step}'} under "
                             f"{self.root} (committed steps: {steps})")

    # -- opening and loading -------------------------------------------------------------------------
    def open(self, step: Optional[int] = None, on_damaged: str = "raise", tag: Optional[str] = None,
             stage: Optional[Stage] = None) -> Optional[OpenCheckpoint]:
        """Open ``step`` (None: the newest not marked suspect), or the newest healthy step tagged ``tag``.

        ``stage`` (:meth:`stage`): prepares the restore of each candidate; one it finds damaged is
        skipped like one that does not open.
        """
        if on_damaged not in ("raise", "warn"):
            raise ValidationError(f"on_damaged must be 'raise' or 'warn', got {on_damaged!r}")
        co = self.coordinator
        reads = self.health is not None and (co.world_size == 1 or co.is_coordinator)  # rank 0 decides
        choice = HealthChoice(self.health.view() if reads and self.health is not None else None,
                              skip_suspect=step is None and tag is None)
        if co.world_size > 1:
            ck, rec = self._open_ranks(step, tag, on_damaged, stage, choice)
            outcome = co.exchange(choice.outcome(_key(ck)) if co.is_coordinator else None)[0]
        else:
            ck, rec = self._open_one(step, tag, on_damaged, stage, choice), None
            outcome = choice.outcome(_key(ck))
        say(outcome, None if ck is None else ck.step, self.root)
        if ck is None and outcome["skipped"]:
            if on_damaged == "raise":
                raise all_suspect_error(outcome, self.root)
            log.warning("nebula_ckpt: %s", all_suspect_error(outcome, self.root))
        self.last_restore = None if ck is None else {"step": ck.step, "tier": ck.tier_name, "adopted_bytes": 0,
                                                     "copy_on_write_bytes": 0, **outcome}
        if ck is not None and self.last_restore is not None and rec is not None and rec["step"] == ck.step:
            # where each rank's copy was before the restore: its own memory tier, a partner's
            # replica (pulled into its memory tier), a shared tier; ``tier``: where this rank read it
            self.last_restore.update(sources=rec["sources"], source=rec["sources"][co.rank])
        return ck

    def _open_one(self, step: Optional[int], tag: Optional[str], on_damaged: str, stage: Optional[Stage],
                  choice: HealthChoice) -> Optional[OpenCheckpoint]:
        """One process: open ``step`` / the newest tagged ``tag`` / the newest not left out by ``choice``."""
        pairs = self.tier_pairs()
        if tag is not None:
            return open_tagged(pairs, self.steps_tagged(tag), tag, self.root, stage)
        try:
            return find_and_open(pairs, step=step, on_all_damaged=on_damaged, stage=stage, skip=choice.skips)
        except CorruptCheckpointError as e:
            if not choice.skipped:
                raise
            raise CorruptCheckpointError(f"{all_suspect_error(choice.outcome(None), self.root)}\n"
                                         f"The steps not marked suspect are damaged: {e}") from None

    def _open_ranks(self, step: Optional[int], tag: Optional[str], on_damaged: str, stage: Optional[Stage],
                    choice: HealthChoice) -> tuple[Optional[OpenCheckpoint], Optional[dict[str, Any]]]:
        """Several ranks: every rank opens the same step (the replicas' recover round first, when
        there are replicas); the checkpoint and that round's outcome."""
        pairs = self.tier_pairs()
        rec = None
        among = None if tag is None else self._tagged_together(tag)
        if self.replicator is not None:  # lost memory-tier copies come back from partners first
            shared = [c.order for c in list_candidates([(t, s) for t, s in pairs if t.shared])]
            # rank 0 alone reads the marks; a suspect newest write is never what the round pulls
            rec = self.replicator.recover(shared, step, among, choice.skips if choice.skip_suspect else None)
            pairs = _with_pulled(pairs, rec, self.coordinator.rank)
        agreed = None if rec is None or rec["step"] is None else \
            (int(rec["generation"]), int(rec["step"]), int(rec["save"]))
        skip = choice.skips if choice.view is not None else None
        ck = open_agreed(pairs, self.coordinator, self.root, step, on_damaged, among, stage, self._checked(rec),
                         agreed, skip)
        return ck, rec

    def _tagged_together(self, tag: str) -> list[int]:
        """:meth:`steps_tagged` on every rank: a rank that cannot list a tier raises, and so does every rank."""
        lost: Optional[BaseException] = None
        try:
            steps = self.steps_tagged(tag)
        except Exception as e:
            if not outage(e):
                raise
            lost, steps = e, []
        stop_together(self.coordinator, self.coordinator.exchange(None if lost is None else str(lost)), lost)
        return steps

    def _checked(self, rec: Optional[dict[str, Any]]) -> Optional[tuple[str, int, int, int]]:
        """The memory-tier copy the replicas' recover round checked in full on this rank (its own
        copy, or the one it pulled), which the restore then need not check again; None if none."""
        mem = next((t for t, _ in self.tier_pairs() if t.capabilities.has_replicas), None)
        if rec is None or mem is None or not rec.get("checked") or rec["step"] is None:
            return None
        return (mem.name, int(rec["generation"]), int(rec["step"]), int(rec["save"]))

    def stage(self, into: Any, map_location: Any, strict: bool) -> Optional[Stage]:
        """What prepares a restore into ``into`` while the candidates are opened (None: no ``into``)."""
        if into is None:
            return None
        no_adoption = not self._may_adopt()
        return stage_restore(into, map_location=map_location, strict=strict, allow_pickle=self.allow_pickle,
                             adopt=lambda ck: adoption_for(self._runtimes, ck, no_adoption,
                                                           self.coordinator.world_size))

    def apply(self, ck: OpenCheckpoint, into: Any, map_location: Any, strict: bool) -> None:
        """Restore ``ck`` into ``into``: as staged, directly, or resharded when the layout differs."""
        if ck.pending is not None:  # staged while opening: read, matched and verified already
            ck.pending()
            if ck.adoption is not None and self.last_restore is not None:
                self.last_restore.update(adopted_bytes=ck.adoption.handed_bytes,
                                         copy_on_write_bytes=ck.adoption.cow_bytes)
            return
        if ck.same_layout:
            apply(ck, into, map_location=map_location, strict=strict, allow_pickle=self.allow_pickle)
            return
        log.info("nebula_ckpt: step %d was saved by %d ranks; resharding it for rank %d of %d", ck.step,
                 ck.manifest.world_size, self.coordinator.rank, self.coordinator.world_size)
        assert ck.storage is not None  # set by find_and_open
        # imported here: resharding brings in torch.distributed.checkpoint, which plain restores never need
        from nebula_ckpt.restore.reshard import load_resharded

        load_resharded(ck.storage, ck.step, ck.manifest, into, process_group=self.coordinator.group,
                       strict=strict, allow_pickle=self.allow_pickle)

    def load(self, step: Optional[int], tag: Optional[str], into: Any, map_location: Any, strict: bool,
             on_damaged: str = "raise") -> Optional[int]:
        """Open ``step`` / the newest tagged ``tag`` / the newest, restore it into ``into`` (when
        given); the step, or None when nothing is committed (of ``step`` / with ``tag``)."""
        check_restore_arguments(map_location, strict)  # the caller's mistakes, before any tier is read
        ck = self.open(step, on_damaged=on_damaged, tag=tag, stage=self.stage(into, map_location, strict))
        if ck is None:
            return None
        if into is not None:
            self.apply(ck, into, map_location, strict)
        if self._on_restored is not None and ck.tier_name is not None and not isinstance(ck.storage, BufferStorage):
            # a copy pulled from a partner is not (yet) the tier's: the tier's next save is full
            self._on_restored(ck.step, ck.tier_name, ck.manifest)
        self._tell_monitor(ck)
        return ck.step

    def _tell_monitor(self, ck: OpenCheckpoint) -> None:
        """The reports from now on judge the step restored (:class:`~nebula_ckpt.health.monitor.HealthMonitor`)."""
        if self.monitor is not None:
            self.monitor.restored(ck.manifest.generation, ck.step, (self.last_restore or {}).get("health", "unknown"),
                                  None if ck.save < 0 else ck.save)

    def read(self, step: Optional[int], tag: Optional[str], map_location: Any) -> tuple[int, Any]:
        """``(step, state)`` as a fresh tree (see :meth:`Checkpointer.read`)."""
        check_restore_arguments(map_location, True)
        ck = self.open(step, tag=tag)
        if ck is None:
            raise self.not_found(step, tag)
        if not ck.same_layout:
            raise OtherRanksError(f"step {ck.step} was saved by {ck.manifest.world_size} ranks: read() gives one "
                                  "rank's state; restore it with load_latest(into) (resharded), or gather it "
                                  "whole with `nebula-ckpt export`")
        state = materialize(ck, map_location=map_location, allow_pickle=self.allow_pickle)
        self._tell_monitor(ck)  # a framework resumes from read() (Hugging Face's Trainer does)
        return ck.step, state


def _key(ck: Optional[OpenCheckpoint]) -> Optional[Write]:
    """``(writer generation, step, save)`` of an open checkpoint: the write its health marks name."""
    return None if ck is None else (ck.manifest.generation, ck.step, ck.save)


def _with_pulled(pairs: list[tuple[Tier, Storage]], rec: dict[str, Any], rank: int) -> list[tuple[Tier, Storage]]:
    """``pairs`` with the memory tier read through the copy this rank pulled into memory at the
    recover round, when it did (its files served from memory, the tier's others from the tier:
    :class:`~nebula_ckpt.storage.buffers.BufferStorage`)."""
    pulled = rec.get("pulled")
    if not pulled:
        return pairs
    return [(t, BufferStorage(pulled, st, f"step {rec['step']} pulled from {rec['sources'][rank]}"))
            if t.capabilities.has_replicas else (t, st) for t, st in pairs]


def _sound(tier: Tier, st: Storage, step: int, check_shards: bool) -> Optional[Manifest]:
    """The manifest of committed ``step`` on ``st`` when it checks out (marker, manifest checksum,
    every field; ``check_shards``: what a restore checks without reading a shard byte, as
    :func:`~nebula_ckpt.restore.intact.files_problem` tells it: every file at its recorded size,
    every step it refers to committed and listing the shard it refers to), else None."""
    try:
        where = f"tier {tier.name} step {step}"
        man = read_main_manifest(st, step, where)
        problem = files_problem(st, man, where) if check_shards else None
        if problem is not None:
            raise CorruptCheckpointError(problem)
    except Exception as e:  # damaged or gone meanwhile: not a healthy checkpoint here
        if outage(e):
            raise  # a store that did not answer: not known
        log.debug("nebula_ckpt: skipping tier %s step %d: %s", tier.name, step, e)
        return None
    return man


def all_suspect_error(outcome: dict[str, Any], root: str) -> CorruptCheckpointError:
    """The error for a root whose every restorable step is marked suspect."""
    steps = [x["step"] for x in outcome.get("skipped") or []]
    return CorruptCheckpointError(
        f"no checkpoint of {root} is left to restore: every committed step that opens is marked suspect "
        f"(steps {steps[:20]}; the log says why). Restoring one again would repeat the failure: fix its cause, "
        "then clear a mark with `nebula-ckpt mark --healthy STEP ROOT`, or pass on_damaged='warn' to start afresh")
