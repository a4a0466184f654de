"""Memory-tier replicas on partner nodes: the background transfer and the pull at restore.

``MemoryTier(replicas=k)``: each rank's committed memory-tier step is also held in the memory tier
of ``k`` partner ranks on other nodes (:mod:`nebula_ckpt.ranks.partners`), so losing any ``k``
nodes leaves a copy of every rank's newest memory-tier step.

One :class:`Replicator` per :class:`~nebula_ckpt.Checkpointer`, with a gloo group of its own
(never the training group, never the checkpoint protocol's groups) and one thread that runs its
rounds in the same order on every rank:

* a **save round** per save index, once this rank's memory tier is done with that save: the ranks
  exchange what they committed (file names and sizes; ``None`` for a rank whose memory tier did
  not commit it), each receiver says which copies it has room for (``knobs.shm_min_free``), each
  rank sends its files to its partners straight from the memory tier (a read-only mapping of the
  staged shard: no second snapshot), each receiver writes them into an ``.incoming-*`` folder,
  verifies every checksum and only then renames the copy into place (see
  :mod:`~nebula_ckpt.tiers.memory.replica_store`), prunes older replicas of that rank, and the
  ranks exchange the outcome: the save's handle gets its ``replicas`` part done (or failed, naming
  the partner and why). The training thread never waits for any of it; ``handle.result()`` does.
* a **recover round** at restore (the training thread hands it over and waits): the ranks exchange
  what they hold, agree on the newest step every rank can get (:mod:`.recovery`), and each rank
  whose own copy of it is gone or damaged (its checksums are checked first) pulls it from a holder
  over the same group into its own memory tier (verified before it becomes visible, so nothing of
  ``into`` changes for a bad copy; the next holder, then the shared tier, are the fallbacks). The
  normal restore then finds the step there.

A rank that dies makes the group's collectives fail or time out (``knobs.replica_timeout_s``):
the round's replicas fail on the other ranks, and every later round fails at once (the job
restarts, as it would anyway).
"""

from __future__ import annotations

import collections
import datetime
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from nebula_ckpt import knobs
from nebula_ckpt.errors import PersistError, ValidationError
from nebula_ckpt.format.names import step_dir
from nebula_ckpt.ranks.partners import choose_partners, node_id, sources_of
from nebula_ckpt.tiers.memory import recovery
from nebula_ckpt.tiers.memory.replica_store import (
    ReplicaStore,
    committed,
    of_world,
    safe_name,
    step_files,
    verify_step,
)
from nebula_ckpt.tiers.memory.tier import MemoryTier

log = logging.getLogger(__name__)

#: the name of a save's replicas on its handle (``tiers_written``, ``durable_s``, failures)
PART = "replicas"


@dataclass
class _Save:
    handle: Any = None
    submitted: bool = False
    memory_done: bool = False

    def ready(self) -> bool:
        return self.submitted and (self.handle is None or self.memory_done)


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

    Raises:
        ValidationError: the job runs on fewer than ``k + 1`` nodes (on every rank alike).
    """

    def __init__(self, folder: Optional[str], k: int, keep: int, group: Any) -> None:
        self._ranks = dist.get_process_group_ranks(group)
        self.rank = dist.get_rank(group)
        self.world = len(self._ranks)
        timeout = datetime.timedelta(seconds=float(knobs.get("replica_timeout_s")))
        self._group = dist.new_group(ranks=self._ranks, backend="gloo", timeout=timeout)
        self.node = node_id()
        self.nodes = self._gather(self.node)
        self.k, self.keep = k, max(1, keep)
        self.partners_all = choose_partners(self.nodes, k)
        self.partners = self.partners_all[self.rank]
        self.sources = sources_of(self.partners_all, self.rank)
        self.folder = folder
        self.store = ReplicaStore(folder) if folder else None
        if self.store is not None:
            self.store.sweep()
        self._saves: dict[int, _Save] = collections.defaultdict(_Save)
        self._tasks: collections.deque[tuple[str, Any]] = collections.deque()
        self._cond = threading.Condition()
        self._broken: Optional[BaseException] = None
        self._counters: dict[str, Any] = {"rounds": 0, "sent_bytes": 0, "received_bytes": 0, "failed": 0,
                                          "pulled_bytes": 0, "last_round_s": None, "peak_incoming_bytes": 0}
        self._thread = threading.Thread(target=self._run, name="nebula-replicas", daemon=True)
        self._thread.start()
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

    def recover(self, shared: Sequence[tuple[int, int]], step: Optional[int] = None,
                among: Optional[Sequence[int]] = None) -> dict[str, Any]:
        """Make the newest step every rank can get present in every rank's memory tier or a shared
        tier, pulling lost copies from their holders (a collective; every rank calls it).

        Returns:
            ``{"step", "generation", "sources"}``: ``sources[r]`` says where rank ``r``'s copy is
            (``"memory"``, ``"replica from rank H"``, ``"shared tier"``); ``step`` None when no
            step is available to every rank.
        """
        box: dict[str, Any] = {}
        done = threading.Event()
        with self._cond:
            self._tasks.append(("recover", (list(shared), step, among, box, done)))
            self._cond.notify_all()
        done.wait()
        if "error" in box:
            raise box["error"]
        return dict(box["result"])

    def close(self, timeout: Optional[float] = None) -> None:
        """Finish the rounds of every save submitted, then stop the thread."""
        with self._cond:
            self._tasks.append(("end", None))
            self._cond.notify_all()
        self._thread.join(timeout if timeout is not None else 2 * float(knobs.get("replica_timeout_s")))

    def release(self) -> None:
        """Free the group (after every rank is done with it: call after the ranks' closing barrier)."""
        try:
            dist.destroy_process_group(self._group)
        except Exception as e:  # best effort, as the protocol's groups
            log.debug("nebula_ckpt: cannot free the replica group: %s", e)

    def stats(self) -> dict[str, Any]:
        """What replication holds and moved: partners, bytes held (the memory it costs here),
        bytes sent / received, rounds, failures, the memory bound."""
        with self._cond:
            c = dict(self._counters)
        held = self.store.held_bytes() if self.store is not None else 0
        return {"k": self.k, "node": self.node, "partners": list(self.partners), "holding_for": list(self.sources),
                "held_bytes": held, "held_steps": self.store.held() if self.store is not None else {},
                "keep": self.keep, "bound": f"(keep + 1) x the step size of each of {len(self.sources)} rank(s)",
                **c}

    # -- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._tasks) and self._task_ready(self._tasks[0]))
                kind, arg = self._tasks.popleft()
            if kind == "end":
                return
            if kind == "save":
                with self._cond:
                    save = self._saves.pop(arg)
                self._save_round(save)
            else:
                self._recover_task(*arg)

    def _recover_task(self, shared: list[tuple[int, int]], step: Optional[int], among: Optional[Sequence[int]],
                      box: dict[str, Any], done: threading.Event) -> None:
        try:
            box["result"] = self._guarded(lambda: self._recover(shared, step, among))
        except BaseException as e:
            box["error"] = e
        done.set()

    def _task_ready(self, task: tuple[str, Any]) -> bool:
        return task[0] != "save" or self._saves[task[1]].ready()

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

    def _gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value, group=self._group)
        return out

    def _save_round(self, save: _Save) -> None:
        t0 = time.monotonic()
        handle = save.handle
        try:
            errors = self._guarded(lambda: self._replicate(handle))
        except BaseException as e:
            log.error("nebula_ckpt: rank %d: memory-tier replicas failed: %s: %s", self.rank, type(e).__name__, e)
            errors = [f"{type(e).__name__}: {e}"]
        with self._cond:
            self._counters["rounds"] += 1
            self._counters["last_round_s"] = time.monotonic() - t0
            self._counters["failed"] += bool(errors)
        if handle is None:
            return
        if errors is None:
            handle.progress.part_done(PART, dropped=True)
        elif errors:
            handle.progress.part_done(PART, PersistError(f"step {handle.step}: memory-tier replicas failed: "
                                                + "; ".join(errors)))
        else:
            handle.progress.part_done(PART)

    def _mine(self, handle: Any) -> tuple[Optional[dict[str, Any]], list[int]]:
        """What this rank sends for the save of ``handle`` (its committed memory-tier step) and
        its files, opened now: retention may unlink them while they are sent, never unmap them."""
        if handle is None or self.folder is None or not any(t.startswith("memory") for t in handle.tiers_written):
            return None, []
        fds: list[int] = []
        try:
            gen = next(g for g, s in committed(self.folder) if s == handle.step)
            d = os.path.join(self.folder, step_dir(handle.step))
            files = step_files(self.folder, handle.step)
            for name, _ in files:
                fds.append(os.open(os.path.join(d, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC))
        except (StopIteration, OSError):  # retention took it already: a newer step is on its way
            for fd in fds:
                os.close(fd)
            return None, []
        return {"step": handle.step, "gen": gen, "files": files, "bytes": sum(n for _, n in files)}, fds

    def _superseded(self) -> bool:
        """Whether a newer save is already in this rank's memory tier (this one is then not sent:
        like a slow tier, replication never queues saves)."""
        with self._cond:
            return any(s.memory_done and s.handle is not None for s in self._saves.values())

    def _replicate(self, handle: Any) -> Optional[list[str]]:
        """One save round; the errors of this rank's replicas (None: this rank sent nothing)."""
        mine, fds = self._mine(None if self._superseded() else handle)
        try:
            infos = self._gather(mine)
            accept = {s: self._room_for(infos[s]) for s in self.sources if infos[s] is not None}
            accepts = self._gather(accept)
            works: list[Any] = []
            if mine is not None:
                paths = [f"/proc/self/fd/{fd}" for fd in fds]
                for p in self.partners:
                    if accepts[p].get(self.rank) is True:
                        works += self._send(paths, mine["files"], p)
            incoming = {s: self._receive(infos[s], s, works) for s in accept if accept[s] is True}
            for w, _ in works:
                w.wait()
            works.clear()
        finally:
            for fd in fds:
                os.close(fd)
        outcome = {s: self._commit_replica(s, infos[s], inc) for s, inc in incoming.items()}
        outcome.update({s: why for s, why in accept.items() if why is not True})
        outcomes = self._gather(outcome)
        if mine is None:
            return None
        with self._cond:
            sent = sum(accepts[p].get(self.rank) is True for p in self.partners)
            self._counters["sent_bytes"] += mine["bytes"] * sent
        return [f"partner rank {p}: {outcomes[p].get(self.rank)}" for p in self.partners
                if outcomes[p].get(self.rank) is not None]

    def _room_for(self, info: dict[str, Any]) -> Any:
        """True, or why this rank cannot hold that copy."""
        if self.store is None:
            return "it has no usable memory tier"
        left = self.store.free_after(int(info["bytes"]))
        floor = float(knobs.get("shm_min_free_fraction"))
        if left is not None and left < floor:
            return (f"its memory tier would keep less than {floor:.0%} free with {info['bytes']} more bytes "
                    "(NEBULA_SHM_MIN_FREE)")
        return True

    def _send(self, paths: list[str], files: list[tuple[str, int]], dst: int) -> list[Any]:
        """Start sending ``files`` (mapped read-only from ``paths``: no copy) to rank ``dst``."""
        works = []
        for i, ((_, size), path) in enumerate(zip(files, paths, strict=True)):
            if size:
                t = torch.from_file(path, shared=False, size=size, dtype=torch.uint8)
                works.append((dist.isend(t, dst=self._ranks[dst], group=self._group, tag=i), t))
        return works

    def _receive(self, info: dict[str, Any], src: int, works: list[Any]) -> Any:
        """Start receiving ``info``'s files from rank ``src`` into a new incoming folder; return
        it, or why not (the bytes are then received into scratch memory: the ranks stay in step)."""
        assert self.store is not None
        with self._cond:
            self._counters["peak_incoming_bytes"] = max(self._counters["peak_incoming_bytes"], int(info["bytes"]))
        try:
            inc: Any = self.store.incoming(int(info["step"]))
            targets = [self._target(inc, int(info["step"]), name, size, src) for name, size in info["files"]]
        except OSError as e:
            log.warning("nebula_ckpt: rank %d cannot receive rank %d's step: %s", self.rank, src, e)
            inc = f"{type(e).__name__}: {e}"
            targets = [torch.empty(size, dtype=torch.uint8) for _, size in info["files"]]
        for i, t in enumerate(targets):
            if t.numel():
                works.append((dist.irecv(t, src=self._ranks[src], group=self._group, tag=i), t))
        return inc

    def _target(self, inc: str, step: int, name: str, size: int, src: int) -> torch.Tensor:
        """The file ``name`` of the incoming copy, made and mapped to receive into."""
        if not safe_name(name):  # the sender lists only these names
            raise OSError(f"rank {src} sent a file named {name!r}; refusing it")
        path = os.path.join(inc, step_dir(step), name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        return torch.from_file(path, shared=True, size=size, dtype=torch.uint8) if size else torch.empty(0)

    def _commit_replica(self, src: int, info: dict[str, Any], inc: str) -> Optional[str]:
        """Verify the copy of ``src``'s step in ``inc`` and make it visible; None, or why not."""
        assert self.store is not None
        step = int(info["step"])
        if not os.path.isabs(inc):  # it could not be received into the memory tier: why
            return inc
        try:
            self._check_copy(inc, step, src, int(info["gen"]))
            self.store.publish(inc, step, self.store.source_dir(src))
            self.store.prune(src, self.keep)
        except Exception as e:
            self.store.discard(inc)
            log.warning("nebula_ckpt: rank %d: the replica of rank %d's step %d is not kept: %s",
                        self.rank, src, step, e)
            return f"{type(e).__name__}: {e}"
        with self._cond:
            self._counters["received_bytes"] += int(info["bytes"])
        return None

    def _check_copy(self, inc: str, step: int, rank: int, gen: int) -> None:
        verify_step(inc, step, rank, self.world, "full")
        if (gen, step) not in committed(inc):
            raise PersistError(f"the copy of step {step} does not carry writer generation {gen}")

    # -- restore ------------------------------------------------------------------------------
    def _view(self, shared: list[tuple[int, int]]) -> dict[str, Any]:
        """What this rank can offer: own steps and replicas of this world size, the shared tiers'."""
        own = [o for o in of_world(self.folder, committed(self.folder), self.world) if self._own_ok(o)] \
            if self.folder else []
        store = self.store
        held = {} if store is None else \
            {r: of_world(store.source_dir(r), o, self.world) for r, o in store.held().items()}
        return {"own": own, "shared": shared, "held": held, "can_pull": self.store is not None}

    def _own_ok(self, target: tuple[int, int], verify: str = "size") -> bool:
        """Whether this rank's own memory-tier copy of ``target`` passes ``verify`` (``"size"``:
        markers and file sizes, for every step offered; ``"full"``: every checksum too, for the
        step agreed on, so a copy with flipped bytes is pulled like a lost one)."""
        if self.folder is None:
            return False
        try:
            verify_step(self.folder, target[1], self.rank, self.world, verify)
            return True
        except Exception as e:
            log.warning("nebula_ckpt: rank %d: own memory-tier copy of step %d is damaged: %s", self.rank, target[1], e)
            return False

    def _recover(self, shared: list[tuple[int, int]], step: Optional[int],
                 among: Optional[Sequence[int]]) -> dict[str, Any]:
        views = self._gather(self._view(shared))
        excluded: set[tuple[int, int]] = set()
        while True:
            target = recovery.choose_target(views, step, among, excluded)
            if target is None:
                return {"step": None, "generation": None, "sources": [None] * self.world}
            got: dict[int, str] = {r: "memory" for r, v in enumerate(views) if target in {tuple(o) for o in v["own"]}}
            # an own copy whose bytes fail their checksums is pulled like a lost one (every rank
            # learns which, so all compute the same pulls); nothing of ``into`` has changed yet
            damaged = self._gather(self.rank in got and not self._own_ok(target, "full"))
            got = {r: src for r, src in got.items() if not damaged[r]}
            pending = [r for r in range(self.world) if r not in got]
            attempt = 0
            while pending:
                assign = recovery.assignments(views, target, pending, attempt)
                if not assign:
                    break
                ok = self._pull_round(assign, target)
                got.update({r: f"replica from rank {h}" for r, h in assign.items() if ok[r]})
                pending = [r for r in pending if r not in got]
                attempt += 1
            if target in recovery.shared_orders(views):
                got.update({r: "shared tier" for r in pending})
            if len(got) == self.world:
                log.info("nebula_ckpt: rank %d: step %d is on every rank (%s)", self.rank, target[1],
                         ", ".join(f"rank {r}: {got[r]}" for r in sorted(got)))
                return {"step": target[1], "generation": target[0], "sources": [got[r] for r in range(self.world)]}
            log.warning("nebula_ckpt: step %d cannot be had by rank(s) %s (every holder lost or damaged); "
                        "trying an older step", target[1], [r for r in range(self.world) if r not in got])
            excluded.add(target)

    def _pull_round(self, assign: dict[int, int], target: tuple[int, int]) -> list[bool]:
        """Each requester ``r`` receives its ``target`` from holder ``assign[r]``; who succeeded."""
        offers: dict[int, Any] = {}
        for r, h in assign.items():
            if h == self.rank:
                try:
                    offers[r] = step_files(self.store.source_dir(r), target[1]) if self.store else None
                except OSError:
                    offers[r] = None
        offered = self._gather(offers)
        works: list[Any] = []
        for r, files in offers.items():
            if files is not None:
                assert self.store is not None
                d = os.path.join(self.store.source_dir(r), step_dir(target[1]))
                works += self._send([os.path.join(d, n) for n, _ in files], files, r)
        inc = None
        files = offered[assign[self.rank]].get(self.rank) if self.rank in assign else None
        if files is not None:
            info = {"step": target[1], "gen": target[0], "files": files, "bytes": sum(n for _, n in files)}
            inc = self._receive(info, assign[self.rank], works)
        for w, _ in works:
            w.wait()
        works.clear()
        ok = False
        if inc is not None and not os.path.isabs(inc):
            log.warning("nebula_ckpt: rank %d cannot receive its step: %s", self.rank, inc)
        elif inc is not None:
            assert self.store is not None and self.folder is not None
            try:
                self._check_copy(inc, target[1], self.rank, target[0])
                self.store.publish(inc, target[1], self.folder)
                ok = True
                with self._cond:
                    self._counters["pulled_bytes"] += sum(n for _, n in files or [])
            except Exception as e:
                self.store.discard(inc)
                log.warning("nebula_ckpt: rank %d: the copy of step %d from rank %d is damaged (%s); trying "
                            "the next source", self.rank, target[1], assign[self.rank], e)
        return [bool(x) for x in self._gather(ok)]


def start_replicator(tiers: Sequence[Any], runtimes: Sequence[Any], coordinator: Any,
                     read_only: bool) -> Optional[Replicator]:
    """The :class:`Replicator` of a Checkpointer whose memory tier asks for ``replicas`` (None
    otherwise, and for a reader). A collective in a multi-rank job: every rank calls it alike.

    Raises:
        ValidationError: replicas asked for in a one-process job, or with too few nodes.
    """
    mem = next((t for t in tiers if isinstance(t, MemoryTier)), None)
    k = mem.replicas if mem is not None else 0
    if mem is None or not k or read_only:
        return None
    if coordinator.world_size < 2 or coordinator.group is None:
        raise ValidationError(f"MemoryTier(replicas={k}) needs a job of several ranks on {k + 1} or more nodes "
                              "(torch.distributed initialised); this is one process, which has no partner "
                              "node: use replicas=0")
    rt = next((r for r in runtimes if r.tier is mem), None)
    folder = getattr(rt, "folder", None) if rt is not None else None
    return Replicator(folder if folder and os.path.isdir(folder) else None, k, mem.keep_last or 1, coordinator.group)
