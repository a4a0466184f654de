"""Multi-rank coordination on ``torch.distributed``: :class:`DistCoordinator`.

The checkpoint protocol runs on gloo groups of its own, created once per :class:`Checkpointer`
(the same call on every rank): one *control* group (writer generation, restore agreement: called
on the training thread, never while shards are being written) and one group per shared tier,
driven by one thread per tier. Only metadata crosses them (``all_gather_object`` of small
dicts: tensor index entries, shard records, verdicts); tensor data never does. With an NCCL
default group the protocol still runs on gloo (CPU, no GPU stream involved).

Why a thread per tier: a tier's rounds must run in the same order on every rank, but each rank's
tier writer reaches a save at its own pace, may drop or skip saves, and tiers run at different
speeds. The tier's thread runs the rounds strictly in (save index, phase) order; a writer posts
its payload and waits for the result, and a save a rank does not write on the tier is abandoned
(its rounds get ``None`` from this rank). So tiers never wait for each other and every rank runs
the identical sequence of collectives on each group.

A rank that dies makes the collectives of the others fail (gloo: connection closed) or time out
(``knobs.commit_timeout_s``): that save is not committed anywhere, the error reaches the handles
(naming the step, and the rank lost with its host where gloo's closed connection says which: each
gathered round carries every rank's host), and the later rounds on that group fail at once (the
job has to restart, as it would anyway).
"""

from __future__ import annotations

import datetime
import logging
import re
import socket
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence

import torch.distributed as dist

from nebula_ckpt import knobs
from nebula_ckpt.errors import PersistError
from nebula_ckpt.ranks.coordinator import PHASE_DURABLE, PHASE_VERDICT, PHASES, SKIP, Coordinator, OrderT

log = logging.getLogger(__name__)


def default_coordinator() -> Optional["DistCoordinator"]:
    """A :class:`DistCoordinator` when a process group of more than one rank is initialised."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return DistCoordinator()
    return None


def group_destroyed() -> bool:
    """Whether this process's default process group is gone (``destroy_process_group()``), which
    takes the checkpoint protocol's own groups with it."""
    return dist.is_available() and not dist.is_initialized()


class RanksDisagree(PersistError):
    """The ranks called the Checkpointer differently (a different number of saves before close)."""


class GroupDestroyed(PersistError):
    """A save cut short because this process destroyed its process group while it was committed."""


#: where gloo names the other end of a connection that closed (``Connection closed by peer [10.0.0.7]:4711``)
_PEER = re.compile(r"peer \[([^\]]+)\]")


def _this_host() -> tuple[str, Optional[str]]:
    """This host's name and the address its name resolves to (what gloo listens on by default)."""
    name = socket.gethostname()
    try:
        return name, socket.gethostbyname(name)
    except OSError:  # a name no resolver knows: the name alone
        return name, None


def _destroyed_error(tier: str, what: str, cause: Optional[BaseException]) -> GroupDestroyed:
    err = GroupDestroyed(f"tier {tier}: {what} was cut short: this process destroyed its process group "
                         "(torch.distributed.destroy_process_group()) while the Checkpointer was still committing "
                         "it. Close the Checkpointer first (ckpt.close(), or leave its `with` block: it waits until "
                         "every save is committed), then destroy the group")
    err.__cause__ = cause
    return err


class _TierChannel:
    """Ordered rounds of one shared tier on its own gloo group, run by one thread."""

    def __init__(self, name: str, group: Any, world: int, every: int, rank: int) -> None:
        self.name = name
        self.group = group
        self._world = world
        self._rank = rank
        self._me = _this_host()
        #: every rank's host (name, address), learnt in each gathered round: who a lost peer was
        self._hosts: list[Any] = []
        self._steps: dict[int, int] = {}  # save index -> its step (from the digest round's payload)
        self._broken_at = "round"  # which round failed, in words
        self._lost = "a rank died, left or timed out"
        self._every = max(1, every)
        self._posts: dict[tuple[int, int], Any] = {}
        self._abandoned: set[int] = set()
        self._results: dict[tuple[int, int], list[Any]] = {}
        self._next = (0, 0)
        self._end: Optional[int] = None
        self._broken: Optional[BaseException] = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"nebula-rounds-{name}", daemon=True)
        self._thread.start()

    def has_rounds(self, index: int) -> bool:
        """Saves the tier's ``every=N`` cadence skips on every rank have no rounds at all."""
        return index % self._every == 0

    def round(self, index: int, phase: int, payload: Any) -> list[Any]:
        with self._cond:
            if isinstance(payload, dict) and isinstance(payload.get("step"), int):
                self._steps[index] = payload["step"]
            if self._broken is not None:
                raise self._failure(index, earlier=True)
            if (index, phase) < self._next:
                raise PersistError(f"tier {self.name}: save {index} phase {phase} posted after its round ran")
            self._posts[(index, phase)] = payload
            self._cond.notify_all()
            self._cond.wait_for(lambda: (index, phase) in self._results or self._broken is not None)
            if (index, phase) in self._results:
                return self._results.pop((index, phase))
            raise self._failure(index, earlier=False)

    def _save_name(self, index: int) -> str:
        """``step N`` of save ``index`` where this rank posted its digest round, else the index."""
        step = self._steps.get(index)
        return f"step {step}" if step is not None else f"save {index} of this Checkpointer (counted from 0)"

    def _failure(self, index: int, earlier: bool) -> PersistError:
        """The error of a round that cannot run: the group is gone, the ranks' calls differ, or a
        rank died, left or timed out (its cause chained)."""
        broken, what, at = self._broken, self._save_name(index), self._broken_at
        if isinstance(broken, GroupDestroyed):
            err: PersistError = _destroyed_error(self.name, "the save in flight", broken.__cause__)
        elif isinstance(broken, RanksDisagree):
            err = PersistError(f"{broken}; nothing of {what} was committed there")
        elif earlier:
            err = PersistError(f"tier {self.name}: {what} was not written there: the ranks' checkpoint protocol "
                               f"failed earlier, in the {at}: {self._lost} ({broken}); restart the job")
        else:
            err = PersistError(f"tier {self.name}: {what} was not committed there: {self._lost} in the ranks' {at} "
                               f"({broken})")
        err.__cause__ = broken
        return err

    def _who_was_lost(self, error: BaseException) -> str:
        """Which rank a failed round lost, as far as gloo says: a closed connection names the
        peer's address (the ranks whose host has it, this one left out, are named), a timeout
        names nobody."""
        peer = _PEER.search(str(error))
        if peer is None:
            return "a rank died, left or timed out (gloo does not say which one)"
        addr = peer.group(1)
        there = [r for r, h in enumerate(self._hosts) if r != self._rank and h is not None and h[1] == addr]
        hosts = sorted({self._hosts[r][0] for r in there})
        if len(there) == 1:
            return f"rank {there[0]} (host {hosts[0]}, {addr}) died or left"
        if there:
            return f"one of ranks {', '.join(map(str, there))} (host {', '.join(hosts)}, {addr}) died or left"
        return f"a rank at {addr} died or left"

    def abandon(self, index: int) -> None:
        with self._cond:
            if index >= self._next[0]:  # an abandon after the save's rounds ran changes nothing
                self._abandoned.add(index)
                self._cond.notify_all()

    def close(self, end: int, timeout: Optional[float]) -> None:
        with self._cond:
            self._end = end
            self._cond.notify_all()
        self._thread.join(timeout)

    def running(self) -> bool:
        """Whether the channel's thread still runs (a round that outlived ``close``'s wait)."""
        return self._thread.is_alive()

    def _ready(self) -> bool:
        index, phase = self._next
        if self._end is not None and index >= self._end and phase == 0:
            return True
        return (index, phase) in self._posts or index in self._abandoned or not self.has_rounds(index)

    def _advance(self) -> None:
        index, phase = self._next
        self._next = (index, phase + 1) if phase + 1 < PHASES else (index + 1, 0)
        if self._next[1] == 0:
            self._abandoned.discard(index)
            self._steps.pop(index, None)

    def _collective(self, phase: int, out: list[Any], payload: Any) -> None:
        """Digest and index rounds: every rank gets every payload; durable round: the coordinator
        gets them; verdict round: every rank gets the coordinator's (``out[0]``)."""
        if phase < PHASE_DURABLE:  # each rank's host rides along: who a later failure lost
            got: list[Any] = [None] * self._world
            dist.all_gather_object(got, (self._me, payload), group=self.group)
            self._hosts = [g[0] for g in got]
            out[:] = [g[1] for g in got]
        elif phase == PHASE_DURABLE:
            dst = dist.get_global_rank(self.group, 0)
            dist.gather_object(payload, out if dist.get_rank(self.group) == 0 else None, dst=dst, group=self.group)
        else:
            assert phase == PHASE_VERDICT
            box = [payload]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
            out[0] = box[0]

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(self._ready)
                index, phase = self._next
                ending = self._end is not None and index >= self._end
                if not ending and not self.has_rounds(index):
                    self._advance()
                    continue
                # The last round tells the others how many saves this rank made; it meets
                # their last round, or the first round of a save this rank never made.
                payload = {"end": self._end} if ending else self._posts.pop((index, phase), None)
            out: list[Any] = [None] * self._world
            if payload is SKIP:  # every rank skips this round by the same decision
                with self._cond:
                    self._results[(index, phase)] = []
                    self._advance()
                    self._cond.notify_all()
                continue
            try:
                self._collective(0 if ending else phase, out, payload)
                ended = [(r, e["end"]) for r, e in enumerate(out) if isinstance(e, dict) and "end" in e]
                if ended and not ending:
                    raise RanksDisagree(f"tier {self.name}: rank(s) {[r for r, _ in ended][:8]} closed their "
                                        f"Checkpointer after {ended[0][1]} save(s), while this rank makes save "
                                        f"{index + 1}: every rank must call save_async the same number of times, "
                                        "then close()")
                if ended and len(ended) < self._world and ending:
                    raise RanksDisagree(f"tier {self.name}: this rank closed after {self._end} save(s) while "
                                        f"rank(s) {[r for r, e in enumerate(out) if r not in dict(ended)][:8]} "
                                        "make more")
            except BaseException as e:  # a dead rank, a timeout: every later round fails too
                self._break(e, index, phase, ending)
                return
            with self._cond:
                if ending:
                    return
                if payload is not None:
                    self._results[(index, phase)] = out
                self._advance()
                self._cond.notify_all()

    def _break(self, e: BaseException, index: int, phase: int, ending: bool) -> None:
        """The round ``(index, phase)`` failed with ``e``: every round waiting, and every later
        one, fails with what it says."""
        broken = _destroyed_error(self.name, "its close" if ending else "the save in flight", e) \
            if group_destroyed() else e
        with self._cond:
            self._lost = self._who_was_lost(e)
            self._broken_at = "closing round" if ending else f"round {phase} of {self._save_name(index)}"
        if isinstance(broken, (GroupDestroyed, RanksDisagree)):
            log.error("nebula_ckpt: %s", broken)
        else:
            log.error("nebula_ckpt: tier %s: the ranks' %s failed: %s: %s: %s", self.name, self._broken_at,
                      self._lost, type(e).__name__, e)
        with self._cond:
            self._broken = broken
            self._cond.notify_all()


@contextmanager
def meeting(rank: int, within: str = "in time", during: str = "") -> Iterator[None]:
    """A collective of the checkpoint protocol on this ``rank``: gloo's timeout or closed
    connection (a ``RuntimeError``) becomes a :class:`PersistError` that says which calls every
    rank must make, or that one of them died or stalled (``within``: the time allowed, in words;
    ``during``: what the collective was for, when not the constructor's or a restore's agreement)."""
    try:
        yield
    except RuntimeError as e:  # gloo: a timeout, a closed connection
        what = f" ({during})" if during else ""
        raise PersistError(
            f"rank {rank}: the ranks did not all meet in a collective call of the checkpoint protocol{what} "
            f"{within} (NEBULA_COMMIT_TIMEOUT_S): in a multi-rank job, "
            "the Checkpointer's constructor, load_latest() and load() run on every rank together (each "
            "restores its own share): call them on every rank in the same order, not on rank 0 alone "
            f"(if every rank did, one of them died or stalled: {type(e).__name__}: {e})") from e


class DistCoordinator(Coordinator):
    """The ranks of a ``torch.distributed`` job (rank 0 commits).

    Args:
        group: the ranks taking part (default: the default group, i.e. every rank). Created on
            every rank of it, in the same order (the constructor is a collective).
        timeout_s: how long a round waits for the slowest rank (default ``commit_timeout_s``).
    """

    def __init__(self, group: Any = None, timeout_s: Optional[float] = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise PersistError("DistCoordinator needs an initialised torch.distributed process group "
                               "(torch.distributed.init_process_group)")
        self._parent = group
        ranks = None if group is None else dist.get_process_group_ranks(group)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._timeout = datetime.timedelta(seconds=timeout_s or knobs.get("commit_timeout_s"))
        self._control = dist.new_group(ranks=ranks, backend="gloo", timeout=self._timeout)
        self.group = self._control
        self._ranks = ranks
        self._channels: dict[str, _TierChannel] = {}
        self._closed = False

    def __repr__(self) -> str:
        return f"DistCoordinator(rank={self.rank}, world_size={self.world_size})"

    def shared_generation(self, take: Callable[[], int]) -> int:
        box: list[Any] = [None]
        if self.is_coordinator:
            try:
                box[0] = take()
            except BaseException as e:  # the others must learn it too, not hang
                box[0] = f"{type(e).__name__}: {e}"
        group = self._live_control()
        with self._meeting():
            dist.broadcast_object_list(box, src=self._global(0), group=group)
        if not isinstance(box[0], int):
            raise PersistError(f"rank 0 could not take the writer generation: {box[0]}")
        return box[0]

    def _global(self, rank: int) -> int:
        return rank if self._ranks is None else self._ranks[rank]

    def open_tier(self, tier: str, every: int = 1) -> None:
        if tier not in self._channels:
            self._live_control()
            group = dist.new_group(ranks=self._ranks, backend="gloo", timeout=self._timeout)
            self._channels[tier] = _TierChannel(tier, group, self.world_size, every, self.rank)

    def round(self, tier: str, index: int, phase: int, payload: Any) -> list[Any]:
        return self._channels[tier].round(index, phase, payload)

    def abandon(self, tier: str, index: int) -> None:
        ch = self._channels.get(tier)
        if ch is not None:
            ch.abandon(index)

    def exchange(self, value: Any) -> list[Any]:
        return self._gather(value)

    def _live_control(self) -> Any:
        """The control group; a closed coordinator has none (never fall back to the default group)."""
        if self._control is None:
            raise PersistError("the checkpoint protocol of this Checkpointer is closed: open a new Checkpointer")
        return self._control

    @contextmanager
    def _meeting(self) -> Iterator[None]:
        """A collective of the control group: gloo's timeout or closed connection becomes a
        :class:`PersistError` that says which calls every rank must make."""
        with meeting(self.rank, f"within {self._timeout.total_seconds():g} s"):
            yield

    def _gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        group = self._live_control()
        with self._meeting():
            dist.all_gather_object(out, value, group=group)
        return out

    def agree_step(self, candidates: Sequence[OrderT]) -> Optional[OrderT]:
        sets = [{tuple(x) for x in c} for c in self._gather(sorted(set(candidates)))]
        common = set.intersection(*sets) if sets else set()
        newest = max(common, default=None)
        return None if newest is None else next(c for c in candidates if tuple(c) == newest)

    def all_true(self, ok: bool) -> bool:
        return all(self._gather(bool(ok)))

    def close(self, saves: int = 0) -> None:
        """Finish the rounds of the ``saves`` saves, then free the groups (after a barrier, so no
        rank frees a group a peer still uses). Every rank calls it (``Checkpointer.close``)."""
        if self._closed:
            return
        self._closed = True
        for ch in self._channels.values():
            ch.close(saves, self._timeout.total_seconds() * 2)
        try:
            dist.barrier(group=self._control)
        except Exception as e:  # a rank died: its groups die with the job
            log.warning("nebula_ckpt: rank %d: closing the checkpoint protocol without every rank: %s", self.rank, e)
            return
        if any(ch.running() for ch in self._channels.values()):
            return  # a round still runs (it timed out above): its group must outlive it
        # Drop every reference to the groups here (this method's list goes when it returns), so
        # that their gloo threads are joined now, on this thread, and not when a garbage collection
        # (or the interpreter's finalisation) gets to them: a gloo worker that frees a tensor during
        # finalisation aborts the process.
        groups = [ch.group for ch in self._channels.values()] + [self._control]
        for ch in self._channels.values():
            ch.group = None
        self._channels.clear()
        self._control = self.group = None
        for g in groups:
            try:
                dist.destroy_process_group(g)
            except Exception as e:  # best effort: the default group may already be gone
                log.debug("nebula_ckpt: cannot free a protocol group: %s", e)
