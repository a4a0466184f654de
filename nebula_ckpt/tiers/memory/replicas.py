"""Memory-tier replicas on partner nodes: the thread that runs their rounds, in order on every rank.

``MemoryTier(replicas=k)``: each rank's committed memory-tier step is also held in the memory tier
of ``k`` partner ranks on other nodes (:mod:`nebula_ckpt.ranks.partners`), so losing any ``k``
nodes leaves a copy of every rank's newest memory-tier step.

One :class:`Replicator` per :class:`~nebula_ckpt.Checkpointer`, with a channel of its own (a gloo
group: :mod:`~nebula_ckpt.tiers.memory.replica_channel`) and one thread that runs its rounds in
the same order on every rank:

* a **save round** per save index, once this rank's memory tier is done with that save and
  the training thread is not inside ``save_async`` of a later one
  (:mod:`~nebula_ckpt.tiers.memory.replica_save`): each rank sends its step to its partners, which
  verify and keep it (:mod:`~nebula_ckpt.tiers.memory.replica_store`); the save's handle gets its
  ``replicas`` part done (or failed, naming the partner and why). The training thread never
  waits for any of it; ``handle.result()`` does. From the first save round on, the thread and its
  channel's threads run niced (:data:`~nebula_ckpt.tiers.memory.replica_channel.REPLICA_NICE`): they
  take what training leaves.
* a **recover round** at restore (the training thread hands it over and waits:
  :mod:`~nebula_ckpt.tiers.memory.replica_recover`): the ranks agree on the newest step every rank
  can get (:mod:`~nebula_ckpt.tiers.memory.recovery`) and each rank whose own copy of it is gone or
  damaged pulls it from a holder into memory, verified before the restore reads it; then, once the
  training thread has the step, a *keep round* (niced) pulls those copies again into the ranks'
  memory tiers, verified before they become visible. A node was lost, so the step now lives in
  fewer places, and only in RAM when the shared tiers lack it: once it is kept, each rank puts its
  own part of it on the shared tier, on a thread of its own (``after_loss``, the drain of
  :mod:`nebula_ckpt.save.drain`), and the step is committed there once every rank's part is in.

A rank that dies makes the channel's collectives fail or time out (knob ``replica_timeout_s``):
the round's replicas fail on the other ranks, and every later round fails at once (the job
restarts, as it would anyway).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch.distributed as dist

from nebula_ckpt import knobs
from nebula_ckpt.errors import PersistError, ValidationError
from nebula_ckpt.format.commit import Write
from nebula_ckpt.latch import Latch
from nebula_ckpt.ranks.distributed import meeting
from nebula_ckpt.ranks.partners import choose_partners, node_id, pack_node_id, sources_of, unpack_node_id
from nebula_ckpt.save import budget
from nebula_ckpt.tiers.memory import recovery
from nebula_ckpt.tiers.memory.replica_channel import Channel, Replication
from nebula_ckpt.tiers.memory.replica_recover import Skip, keep_pulled, recover
from nebula_ckpt.tiers.memory.replica_save import replicate
from nebula_ckpt.tiers.memory.replica_store import ReplicaStore

#: after a restore that pulled memory-tier copies from partners, how long the replicas' thread
#: waits (unless a save or close() comes first) before pulling them again into the memory tiers, so
#: that the copies do not compete with the first training steps for the cores
KEEP_AFTER_S = 1.0

log = logging.getLogger(__name__)

#: the name of a save's replicas on its handle (``tiers_written``, ``durable_s``, failures)
PART = "replicas"

#: ``(write, rank, world, folder)``: what a rank runs once its memory tier kept a step restored
#: after a node loss (the drain of its own part to the shared tier)
AfterLoss = Callable[[tuple[int, int, int], int, int, str], None]


@dataclass
class SaveRound:
    """What this rank's replicas thread knows of one save: its handle (None: it does not go to
    the memory tier), whether ``save_async`` returned, whether the memory tier is done with it."""

    handle: Any = None
    submitted: bool = False
    memory_done: bool = False

    def ready(self) -> bool:
        """Whether nothing more can change what this rank sends in the save's round."""
        return self.submitted and (self.handle is None or self.memory_done)


def round_may_start(save: SaveRound, later: Sequence[SaveRound]) -> bool:
    """Whether the round of ``save`` may start now: this rank's memory tier is done with it, and
    the training thread is not inside ``save_async`` of a ``later`` save (its staging copy and
    its Python then have the cores and the GIL to themselves: the round waits the few
    milliseconds until that call returns, and cannot wait longer, as ``save_async`` never waits
    for a round)."""
    return save.ready() and all(s.submitted for s in later)


class Replicator:
    """The replicas of one Checkpointer's memory tier (see the module docstring).

    Constructed on every rank, in the same order (a collective: it creates a gloo group and
    gathers the node ids).

    Args:
        folder: this rank's memory-tier folder (None: no usable memory tier; the rank still takes
            part in every round, holding and sending nothing).
        k: copies of each rank's step on other nodes.
        keep: replicas kept per source rank (the memory tier's ``keep_last``).
        group: the checkpoint's control group (its ranks are the job's).
        after_loss: ``(write, rank, world, folder)``: puts this rank's part of a step restored after
            a node loss, kept in its memory tier ``folder``, on the shared tier (None: nothing).
        budget_room: why ``n`` more bytes of host memory do not fit in this rank's host-memory
            budget now, or None (a partner's copy beyond it is refused; None: no budget).
        holds: whether a shared persistent tier holds a write ``(generation, step, save)``
            committed (None: there is none such). A replica of such a write protects nothing against a node
            loss: it is given up where the budget is short (:meth:`give_up`).
        keep_also: the replicas kept beside ``keep``
            (:attr:`~nebula_ckpt.tiers.memory.replica_channel.Replication.keep_also`).

    Raises:
        ValidationError: the job runs on fewer than ``k + 1`` nodes (on every rank alike).
    """

    def __init__(self, folder: Optional[str], k: int, keep: int, group: Any,
                 after_loss: Optional[AfterLoss] = None,
                 budget_room: Optional[Callable[[int], Optional[str]]] = None,
                 holds: Optional[Callable[[Write], bool]] = None,
                 keep_also: Optional[Callable[[Any, list[int]], set[int]]] = None) -> None:
        channel = Channel(dist.get_process_group_ranks(group), dist.get_rank(group),
                          float(knobs.get("replica_timeout_s")))
        self.rank, self.world = channel.rank, channel.world
        self.node = node_id()
        self.nodes = [unpack_node_id(b) for b in channel.gather_bytes(pack_node_id(self.node))]
        partners_all = choose_partners(self.nodes, k)
        store = ReplicaStore(folder) if folder else None
        if store is not None:
            store.sweep()
        self._budget_room, self._holds = budget_room, holds
        self._rp = Replication(channel, folder, store, k, max(1, keep), partners_all[self.rank],
                               sources_of(partners_all, self.rank),
                               budget_room=None if budget_room is None else self._room, keep_also=keep_also)
        #: held by the replicas' thread while a round (or remove()) uses the replicas held: the
        #: budget gives none up meanwhile (:meth:`give_up`)
        self._store_lock = threading.RLock()
        self.partners, self.sources = self._rp.partners, self._rp.sources
        self._saves: dict[int, SaveRound] = collections.defaultdict(SaveRound)
        self._tasks: collections.deque[tuple[str, Any]] = collections.deque()
        self._cond = threading.Condition()
        self._broken: Optional[BaseException] = None
        #: the keep round waiting after a recover that pulled copies into memory, and when it is due
        self._keep: Optional[tuple[Any, float]] = None
        self._after_loss = after_loss
        self._drainer: Optional[threading.Thread] = None
        self._thread = threading.Thread(target=self._run, name="nebula-replicas", daemon=True)
        self._thread.start()
        if folder and holds is not None:  # a save short of the host-memory budget gives replicas up too
            budget.add_giver(folder, self.give_up)
        log.info("nebula_ckpt: rank %d on node %s: memory-tier replicas on rank(s) %s; holding rank(s) %s",
                 self.rank, self.node, self.partners, self.sources)

    # -- the training thread's side -----------------------------------------------------------
    def submit(self, index: int) -> None:
        """Save ``index`` was numbered: its round comes next in this rank's order."""
        with self._cond:
            self._tasks.append(("save", index))
            self._cond.notify_all()

    def attach(self, index: int, handle: Any) -> None:
        """Save ``index`` goes to the memory tier: its round waits for that, ``handle`` hears of it."""
        with self._cond:
            self._saves[index].handle = handle

    def submitted(self, index: int) -> None:
        """``save_async`` of ``index`` returned or raised: nothing more will be attached."""
        with self._cond:
            self._saves[index].submitted = True
            self._cond.notify_all()

    def settled(self, index: int) -> None:
        """The memory tier is done with save ``index`` (committed, dropped or failed)."""
        with self._cond:
            self._saves[index].memory_done = True
            self._cond.notify_all()

    def recover(self, shared: Sequence[tuple[int, int, int]], step: Optional[int] = None,
                among: Optional[Sequence[int]] = None, skip: Optional[Skip] = None) -> dict[str, Any]:
        """Make the newest step every rank can get present in every rank's memory tier or a shared
        tier, pulling lost copies from their holders (a collective; every rank calls it). Returns
        :func:`~nebula_ckpt.tiers.memory.replica_recover.recover`'s answer. ``skip(generation,
        step, save)``: the writes the restore leaves out on this rank (``load_latest``: rank 0
        leaves suspect steps out); every rank passes one, or none, alike.

        Raises:
            PersistError: a rank died or stalled during the round (gloo's error of the replicas'
                channel, as a restore's other collectives say it, naming this rank, its node and
                its partners).
        """
        box: dict[str, Any] = {}
        done = Latch()  # the training thread waits: a Ctrl-C there leaves no lock the thread needs held
        with self._cond:
            self._tasks.append(("recover", (list(shared), step, among, skip, box, done)))
            self._cond.notify_all()
        done.wait()
        if "error" in box:
            e = box["error"]
            if isinstance(e, RuntimeError):  # gloo: a closed connection, a timeout
                with meeting(self.rank, during=f"the memory-tier replicas' recover round, whose channel waits "
                             f"NEBULA_REPLICA_TIMEOUT_S: {self._where()}"):
                    raise e
            raise e
        return dict(box["result"])

    def forget(self, steps: Sequence[int]) -> None:
        """Drop the copies of ``steps`` this rank holds for its sources (``remove()``, which every
        rank calls: each drops what it holds), on the replicas' thread after the rounds queued
        before (a keep round waiting too, which could bring a step back); waits for it."""
        if self._rp.store is None:
            return
        done = Latch()
        with self._cond:
            alive = self._thread.is_alive()
            if alive:
                self._tasks.append(("forget", (list(steps), done)))
                self._cond.notify_all()
        if not alive:
            with self._store_lock:
                self._forget_task(list(steps), done)
        done.wait()

    def give_up(self) -> bool:
        """Drop the replicas this rank holds whose write a shared persistent tier holds committed
        (the ``holds`` of the class), and the spare files of those it pruned: they protect
        nothing against a node loss, and a save short of the host-memory budget needs the room
        (:func:`~nebula_ckpt.save.budget.give_up_memory_steps`, on the training thread). Never
        during a round, nor while a keep round waits (it sends from the replicas held): the save
        asks again. True if anything went."""
        store = self._rp.store
        if store is None or self._holds is None or not self._store_lock.acquire(blocking=False):
            return False
        try:
            with self._cond:
                if self._keep is not None:
                    return False
            return bool(store.give_up(self._holds))
        finally:
            self._store_lock.release()

    def _room(self, nbytes: int) -> Optional[str]:
        """Why a partner's copy of ``nbytes`` does not fit in this rank's budget (None: it does),
        after giving up the replicas a shared tier holds as the same write when it does not
        (in a save round, on the replicas' thread)."""
        assert self._budget_room is not None
        short = self._budget_room(nbytes)
        if short is not None and self._holds is not None and self._rp.store is not None and \
                self._rp.store.give_up(self._holds):
            short = self._budget_room(nbytes)
        return short

    def _forget_task(self, steps: list[int], done: Latch) -> None:
        try:
            assert self._rp.store is not None
            gone = self._rp.store.forget(set(steps))
            if gone:
                log.info("nebula_ckpt: rank %d: removed the copies (rank, step) %s it held (remove())", self.rank,
                         gone)
        except OSError as e:
            log.warning("nebula_ckpt: rank %d: cannot remove the copies of step(s) %s it holds: %s", self.rank, steps,
                        e)
        finally:
            done.set()

    def close(self, timeout: Optional[float] = None) -> None:
        """Finish the rounds of every save submitted, then stop the thread."""
        if self._rp.folder:
            budget.drop_giver(self._rp.folder, self.give_up)
        with self._cond:
            self._tasks.append(("end", None))
            self._cond.notify_all()
        self._thread.join(timeout if timeout is not None else 2 * float(knobs.get("replica_timeout_s")))
        if self._drainer is not None:  # the shared tier's copy of a step restored after a node loss
            self._drainer.join(timeout)

    def release(self) -> None:
        """Free the channel (after every rank is done with it: call after the ranks' closing barrier)."""
        self._rp.channel.release()

    def stats(self) -> dict[str, Any]:
        """What replication holds and moved: partners, bytes held (the memory it costs here),
        bytes sent / received, rounds, failures, the memory bound."""
        rp = self._rp
        held = rp.store.held_bytes() if rp.store is not None else 0
        return {"k": rp.k, "node": self.node, "partners": list(self.partners), "holding_for": list(self.sources),
                "held_bytes": held, "held_steps": rp.store.held() if rp.store is not None else {},
                "keep": rp.keep, "bound": f"(keep + 1) x the step size of each of {len(self.sources)} rank(s)",
                **rp.counters.snapshot()}

    # -- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            keep: Optional[tuple[Any, float]] = None
            with self._cond:
                self._cond.wait_for(lambda: (bool(self._tasks) and self._task_ready(self._tasks[0]))
                                    or self._keep_due(), timeout=self._keep_wait())
                if self._keep_due():
                    keep, self._keep = self._keep, None
                elif not (self._tasks and self._task_ready(self._tasks[0])):
                    continue  # woken for a keep round not due yet
                else:
                    kind, arg = self._tasks.popleft()
            if keep is None and kind == "end":
                return
            with self._store_lock:  # the budget gives up no replica a round uses (give_up)
                if keep is not None:
                    self._keep_task(keep[0])
                elif kind == "save":
                    with self._cond:
                        save = self._saves.pop(arg)
                    self._save_round(save)
                elif kind == "forget":
                    self._forget_task(*arg)
                else:
                    self._recover_task(*arg)

    def _recover_task(self, shared: list[tuple[int, int, int]], step: Optional[int], among: Optional[Sequence[int]],
                      skip: Optional[Skip], box: dict[str, Any], done: Latch) -> None:
        keep = None
        try:
            result = self._guarded(lambda: recover(self._rp, shared, step, self._among_all(among), skip))
            keep = result.pop("keep", None)
            box["result"] = result
        except BaseException as e:
            box["error"] = e
        if keep is not None:  # the same on every rank: the keep round is a collective, due later
            with self._cond:
                self._keep = (keep, time.monotonic() + float(KEEP_AFTER_S))
        done.set()

    def _keep_due(self) -> bool:
        """Whether the keep round waiting (if any) runs now: its time came, or a task is queued
        (a save's round, a restore, close(): the keep round goes first, in every rank's order)."""
        return self._keep is not None and (bool(self._tasks) or time.monotonic() >= self._keep[1])

    def _keep_wait(self) -> Optional[float]:
        """How long the thread may sleep before the keep round waiting is due (None: no keep round)."""
        return None if self._keep is None else max(0.0, self._keep[1] - time.monotonic())

    def _keep_task(self, keep: Any) -> None:
        """The keep round after a recover that pulled copies into memory (niced, like every round
        after the restore; see :func:`~nebula_ckpt.tiers.memory.replica_recover.keep_pulled`)."""
        self._rp.channel.yield_to_training()
        t0 = time.monotonic()
        try:
            self._guarded(lambda: keep_pulled(self._rp, keep, self._saved_since(), self._may_publish))
            self._rp.counters.set("last_keep_s", time.monotonic() - t0)
        except BaseException as e:
            self._rp.counters.add("keep_failed", 1)
            log.error("nebula_ckpt: rank %d: keeping the copies pulled at restore in the memory tiers failed: %s",
                      self.rank, self._why(e))
            return
        views, _, target = keep
        if self._after_loss is not None and self._rp.folder and not self._saved_since() and \
                target not in recovery.shared_orders(views):
            self._drainer = threading.Thread(target=self._drain, args=(target,), name="nebula-drain", daemon=True)
            self._drainer.start()

    def _drain(self, target: Any) -> None:
        """This rank's part of ``target`` to the shared tier (:attr:`_after_loss`); never raises."""
        assert self._after_loss is not None and self._rp.folder is not None
        try:
            self._after_loss(target, self.rank, self.world, self._rp.folder)
        except Exception as e:  # the step stays where it is (RAM); persist-memory or the next save persists it
            log.warning("nebula_ckpt: rank %d: step %d restored after a node loss is not drained to the shared "
                        "tier: %s: %s", self.rank, target[1], type(e).__name__, e)

    def _saved_since(self) -> bool:
        """Whether a save was handed to this rank's memory tier since the restore (its round
        makes new copies: a copy pulled at the restore is not kept then)."""
        with self._cond:
            return any(s.handle is not None for s in self._saves.values())

    def _may_publish(self, step: int, publish: Callable[[], None]) -> bool:
        """Run ``publish`` (a pulled copy of ``step`` becomes the memory tier's) unless a save was
        handed to this rank's memory tier since the restore: that save's step is newer in the
        training's order (or the same step saved again, whose write owns the tier's folder of it),
        its write may build on what the tier holds now, and its replicas make new copies. Under
        the lock :meth:`attach` takes, so no such save can start meanwhile."""
        with self._cond:
            if any(s.handle is not None for s in self._saves.values()):
                return False
            publish()
            return True

    def _among_all(self, among: Optional[Sequence[int]]) -> Optional[list[int]]:
        """The steps any rank sees with the tag asked for (a collective when there is a tag; every
        rank asks alike): a rank that lost its memory tier sees fewer of them, and every rank must
        plan from the same steps, else the ranks choose different steps and wait on each other."""
        if among is None:
            return None
        return sorted({int(s) for seen in self._rp.channel.gather(list(among)) for s in seen})

    def _task_ready(self, task: tuple[str, Any]) -> bool:
        if task[0] != "save":
            return True
        later = [self._saves[i] for kind, i in self._tasks if kind == "save" and i != task[1]]
        return round_may_start(self._saves[task[1]], later)

    def _guarded(self, fn: Callable[[], Any]) -> Any:
        if self._broken is not None:
            raise PersistError(f"rank {self.rank}: memory-tier replication failed earlier ({self._broken}); "
                               "restart the job") from self._broken
        try:
            return fn()
        except BaseException as e:
            if isinstance(e, (RuntimeError, OSError)) and not isinstance(e, PersistError):
                self._broken = e  # a collective failed: the group is out of step for good
            raise

    def _save_round(self, save: SaveRound) -> None:
        self._rp.channel.yield_to_training()
        t0 = time.monotonic()
        handle = save.handle
        try:
            errors = self._guarded(lambda: replicate(self._rp, None if self._superseded() else handle))
        except BaseException as e:
            log.error("nebula_ckpt: rank %d: memory-tier replicas failed: %s: %s", self.rank, type(e).__name__, e)
            errors = [self._why(e)]
        counters = self._rp.counters
        counters.add("rounds", 1)
        counters.set("last_round_s", time.monotonic() - t0)
        counters.add("failed", bool(errors))
        if handle is None:
            return
        if errors is None:
            handle.progress.part_done(PART, dropped=True)
        elif errors:
            handle.progress.part_done(PART, PersistError(f"step {handle.step}: memory-tier replicas failed: "
                                                + "; ".join(errors)))
        else:
            handle.progress.part_done(PART)

    def _why(self, e: BaseException) -> str:
        """What a round that raised ``e`` tells the save's handle: a failed collective (a rank of
        the job died or stalled) names this rank, its node and its partners."""
        if isinstance(e, PersistError) or not isinstance(e, (RuntimeError, OSError)):  # says what it is already
            return f"{type(e).__name__}: {e}"
        return (f"rank {self.rank} on node {_short(self.node)}: the replicas' channel failed (a rank of the job "
                f"died or stalled; this rank's partners: {self._partners()}): {type(e).__name__}: {e}")

    def _partners(self) -> str:
        return ", ".join(f"rank {p} on node {_short(self.nodes[p])}" for p in self.partners)

    def _where(self) -> str:
        """This rank, its node, its partners and the ranks it holds copies for, in words."""
        sources = ", ".join(f"rank {s} on node {_short(self.nodes[s])}" for s in self.sources)
        return (f"rank {self.rank} on node {_short(self.node)}; its copies are held by {self._partners()}; it holds "
                f"those of {sources or 'no rank'}")

    def _superseded(self) -> bool:
        """Whether a newer save is already in this rank's memory tier (this one is then not sent:
        like a slow tier, replication never queues saves)."""
        with self._cond:
            return any(s.memory_done and s.handle is not None for s in self._saves.values())


def _short(node: str) -> str:
    """``node`` as a message shows it (quoted, a long id cut)."""
    return repr(node if len(node) <= 64 else node[:61] + "...")


def start_replicator(tiers: Sequence[Any], runtimes: Sequence[Any], coordinator: Any,
                     read_only: bool, after_loss: Optional[AfterLoss] = None,
                     budget_room: Optional[Callable[[int], Optional[str]]] = None) -> Optional[Replicator]:
    """The :class:`Replicator` of a Checkpointer whose memory tier asks for ``replicas`` (None
    otherwise, and for a reader). A collective in a multi-rank job: every rank calls it alike.
    ``after_loss``, ``budget_room``: see :class:`Replicator`.

    Raises:
        ValidationError: replicas asked for in a one-process job, or with too few nodes.
    """
    mem = next((t for t in tiers if t.capabilities.has_replicas), None)
    k = mem.capabilities.replicas if mem is not None else 0
    if mem is None or not k or read_only:
        return None
    if coordinator.world_size < 2 or coordinator.group is None:
        raise ValidationError(f"MemoryTier(replicas={k}) needs a job of several ranks on {k + 1} or more nodes "
                              "(torch.distributed initialised); this is one process, which has no partner "
                              "node: use replicas=0")
    rt = next((r for r in runtimes if r.tier is mem), None)
    folder = getattr(rt, "folder", None) if rt is not None else None
    shared = [r.storage for r in runtimes if r.persistent and r.tier.shared]
    holds = (lambda write: any(budget.holds_write(st, write) for st in shared)) if shared else None
    return Replicator(folder if folder and os.path.isdir(folder) else None, k, mem.keep_last or 1, coordinator.group,
                      after_loss, budget_room, holds, None if rt is None else rt.keep_also_in)
