"""The replicas' own channel between ranks: a gloo group, its gathers, and files moved zero-copy.

One :class:`Channel` per :class:`~nebula_ckpt.tiers.memory.replicas.Replicator` (never the
training group, never the checkpoint protocol's groups). Files are sent straight from a
read-only mapping of the sender's memory-tier file (no snapshot, no copy in this process) and
received straight into a mapping of the receiver's new file under ``.incoming-*`` (see
:mod:`~nebula_ckpt.tiers.memory.replica_store`), made from a spare file when there is one, its
pages allocated by one ``fallocate`` (a tmpfs without room refuses the copy there) and mapped in by
one call while the first bytes arrive. The threads that move and check the bytes
yield to training once saves begin (:meth:`Channel.yield_to_training`). :class:`Replication` bundles what the save
rounds (:mod:`~nebula_ckpt.tiers.memory.replica_save`) and the recover round
(:mod:`~nebula_ckpt.tiers.memory.replica_recover`) share.
"""

from __future__ import annotations

import datetime
import logging
import mmap
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from nebula_ckpt.format.names import step_dir
from nebula_ckpt.priority import lower_priority
from nebula_ckpt.storage.holds import MappedHold
from nebula_ckpt.storage.prefault import populate_mapping
from nebula_ckpt.tiers.memory.replica_store import ReplicaStore, safe_name

#: the threads that move and check memory-tier replicas during training run this much nicer than
#: the process (Linux, 0-19; 0: same priority), so that on a machine without idle cores replication
#: yields to training
REPLICA_NICE = 10

log = logging.getLogger(__name__)

#: ``(work, tensor)`` of a transfer in flight (the tensor lives until the work is done)
Works = list[tuple[Any, torch.Tensor]]


class Counters:
    """What replication moved (bytes, rounds, failures), safe to read from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, Any] = {"rounds": 0, "sent_bytes": 0, "received_bytes": 0, "failed": 0,
                                        "pulled_bytes": 0, "keep_failed": 0, "last_keep_s": None, "last_round_s": None,
                                        "peak_incoming_bytes": 0}

    def add(self, name: str, n: int) -> None:
        """Add ``n`` to counter ``name``."""
        with self._lock:
            self._values[name] += n

    def set(self, name: str, value: Any) -> None:
        """Set ``name`` to ``value``."""
        with self._lock:
            self._values[name] = value

    def peak(self, name: str, value: int) -> None:
        """Raise ``name`` to ``value`` when it is higher."""
        with self._lock:
            self._values[name] = max(self._values[name], value)

    def snapshot(self) -> dict[str, Any]:
        """Every counter, now."""
        with self._lock:
            return dict(self._values)


class Channel:
    """A gloo group of the job's ranks for the replicas alone (a collective to create).

    Args:
        ranks: the global ranks of the checkpoint's control group, by group rank.
        rank: this process's rank in that group.
        timeout_s: how long a gather or transfer waits for the other ranks.
    """

    def __init__(self, ranks: list[int], rank: int, timeout_s: float) -> None:
        self.ranks = ranks
        self.rank = rank
        self.world = len(ranks)
        before = _thread_ids()
        self._group = dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        #: the threads gloo started for this group (its TCP loop receives the bytes, its workers
        #: run the gathers): theirs is the CPU a transfer costs beside the calling thread's
        self._threads = sorted(_thread_ids() - before)
        self._yielded = False

    def yield_to_training(self) -> None:
        """Lower the scheduling priority of the calling thread and of this group's threads by the
        :data:`REPLICA_NICE` (once; Linux: a thread's nice value is its own, and threads the
        calling thread starts later inherit it), so that where no core is idle the replicas take
        what training leaves. Called by the replicas' thread before its first save round: a
        recover round before it (at restore, while training waits) runs at full priority."""
        if self._yielded:
            return
        self._yielded = True
        lower_priority(int(REPLICA_NICE), [threading.get_native_id(), *self._threads])

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, by rank (a collective)."""
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value, group=self._group)
        return out

    def gather_flags(self, flags: tuple[bool, ...]) -> list[tuple[bool, ...]]:
        """Every rank's ``flags`` (the same number on every rank), by rank: one collective of a
        few bytes, where :meth:`gather` pickles and takes two."""
        return [tuple(bool(x) for x in raw) for raw in self.gather_bytes(bytes(bool(f) for f in flags))]

    def gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` (the same length on every rank), by rank: one collective of
        ``len(data)`` bytes a rank, where :meth:`gather` pickles and takes two."""
        mine = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(out, mine, group=self._group)
        return [t.numpy().tobytes() for t in out]

    def send(self, paths: list[str], files: list[tuple[str, int]], dst: int, works: Works) -> None:
        """Start sending ``files`` (``(name, size)``, each as :meth:`mapped_for_send` gives it) to
        rank ``dst``, one message a file."""
        for i, ((_, size), path) in enumerate(zip(files, paths, strict=True)):
            if not size:
                continue
            t = self.mapped_for_send(path, size, dst)
            works.append((dist.isend(t, dst=self.ranks[dst], group=self._group, tag=i), t))

    def mapped_for_send(self, path: str, size: int, dst: int) -> torch.Tensor:
        """The ``size`` bytes of the file at ``path``, mapped read-only (no copy), to send to rank
        ``dst``; while the tensor lives no save of this process stages into the file (a
        memory-tier step that retention dropped meanwhile keeps its bytes). A file that cannot be
        mapped (gone meanwhile) gives zeros of its size, so the ranks stay in step; the
        receiver's checksums then reject the copy."""
        hold = MappedHold(path)
        try:
            t = torch.from_file(path, shared=False, size=size, dtype=torch.uint8)
        except (OSError, RuntimeError) as e:
            hold.release()
            log.warning("nebula_ckpt: rank %d cannot read %s to send it to rank %d: %s", self.rank, path, dst, e)
            return torch.zeros(size, dtype=torch.uint8)
        hold.tie(t)
        return t

    def receive(self, store: ReplicaStore, info: dict[str, Any], src: int, works: Works,
                refs: Sequence[tuple[int, str, int]] = (),
                landed: Optional[dict[str, torch.Tensor]] = None) -> str:
        """Start receiving ``info``'s files from rank ``src`` into a new incoming folder of
        ``store``, then ``refs`` (``(step, name, size)``: shards of earlier steps the step refers
        to, sent after its own files, each into that step's folder beside it); return its path, or
        why not (the bytes then go to scratch memory: the ranks stay in step). ``landed`` (when
        given) gets the mapping each of the step's own files is received into, by name: their
        checksums are taken there once the bytes are in, without mapping the files again."""
        step = int(info["step"])
        maps: list[Optional[mmap.mmap]] = []
        made: Optional[str] = None
        whole = info.get("base") is None  # an incremental step's own shard is small: no spare for it
        files = [(step, name, size) for name, size in info["files"]] + list(refs)
        try:
            inc = made = store.incoming(step)
            for s, name, size in files:
                spare = store.spare(src, name) if whole and s == step else None
                maps.append(_target(inc, s, name, size, src, spare))
            targets = [torch.frombuffer(m, dtype=torch.uint8) if m is not None else torch.empty(0, dtype=torch.uint8)
                       for m in maps]
            if landed is not None:
                landed.update((name, t) for (s, name, _), t in zip(files, targets, strict=True)
                              if s == step and t.numel())
        except OSError as e:
            log.warning("nebula_ckpt: rank %d cannot receive rank %d's step: %s", self.rank, src, e)
            inc = f"{type(e).__name__}: {e}"
            maps = []
            if made is not None:  # what was made of it (a spare moved in included) goes now
                store.discard(made)
            targets = [torch.empty(size, dtype=torch.uint8) for _, _, size in files]
        for i, t in enumerate(targets):
            if t.numel():
                works.append((dist.irecv(t, src=self.ranks[src], group=self._group, tag=i), t))
        for m in maps:  # while the first bytes arrive: the pages the rest lands in, in one call
            _populate(m)
        return inc

    def post_send(self, t: torch.Tensor, dst: int, tag: int) -> Any:
        """Start sending ``t`` (contiguous) to rank ``dst`` with ``tag``; its work."""
        return dist.isend(t, dst=self.ranks[dst], group=self._group, tag=tag)

    def post_receive(self, t: torch.Tensor, src: int, tag: int) -> Any:
        """Start receiving into ``t`` (contiguous) from rank ``src`` with ``tag``; its work."""
        return dist.irecv(t, src=self.ranks[src], group=self._group, tag=tag)

    @staticmethod
    def wait(works: Works) -> None:
        """Wait for every transfer of ``works`` (raises when one failed), then forget them."""
        for w, _ in works:
            w.wait()
        works.clear()

    def release(self) -> None:
        """Free the group (after every rank is done with it)."""
        group, self._group = self._group, None  # freed now, not by a later garbage collection
        if group is None:
            return
        try:
            dist.destroy_process_group(group)
        except Exception as e:  # best effort, as the protocol's groups
            log.debug("nebula_ckpt: cannot free the replica group: %s", e)


def _thread_ids() -> set[int]:
    """Native ids of this process's threads now (empty where ``/proc`` does not list them)."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except (OSError, ValueError):
        return set()


def _target(inc: str, step: int, name: str, size: int, src: int, spare: Optional[str]) -> Optional[mmap.mmap]:
    """The file ``name`` of the incoming copy, made (from ``spare``, a file of an older copy whose
    pages exist already, when given) and mapped to receive into; None when empty."""
    if not safe_name(name):  # the sender lists only these names
        raise OSError(f"rank {src} sent a file named {name!r}; refusing it")
    os.makedirs(os.path.join(inc, step_dir(step)), mode=0o700, exist_ok=True)
    path = os.path.join(inc, step_dir(step), name)
    exclusive = os.O_EXCL
    if spare is not None:
        try:
            os.rename(spare, path)  # every byte of it is received anew (the checksums tell)
            exclusive = 0
        except OSError as e:
            log.debug("nebula_ckpt: cannot reuse %s: %s", spare, e)
    fd = os.open(path, os.O_CREAT | exclusive | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, size)
        if size and os.fstat(fd).st_blocks * 512 < size:  # a spare's pages exist already: no hole left
            # the pages, allocated in one call (cheaper than populating a hole page by page), and
            # a full tmpfs found now (OSError: the copy is refused) rather than by the bytes
            # received into a hole it has no room for (SIGBUS)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise no_room_for_copy(e, src, name, size, inc) from e
        return mmap.mmap(fd, size) if size else None
    finally:
        os.close(fd)


def no_room_for_copy(e: OSError, src: int, name: str, size: int, inc: str) -> OSError:
    """The error of a copy of rank ``src``'s file ``name`` (``size`` bytes) that the tmpfs of
    ``inc`` refused (``e``, from ``posix_fallocate``): what it needs and the room left."""
    sv = os.statvfs(inc)
    return OSError(e.errno, f"{e.strerror}: rank {src}'s {name} needs {size} bytes in {inc}, "
                   f"its tmpfs has {sv.f_bavail * sv.f_frsize} free (NEBULA_SHM_DIR)")


def _populate(m: Optional[mmap.mmap]) -> None:
    """Fault in every page of ``m`` for writing in one call (Linux 5.14+; else each page faults
    on its first byte received): far cheaper than a fault per page."""
    if m is not None and not populate_mapping(m):  # without the GIL: the training thread runs on
        log.debug("nebula_ckpt: cannot populate a receive mapping of %d bytes", len(m))


@dataclass
class Replication:
    """What one rank's replication works with: the channel, its memory tier and replicas, its
    partners (who hold its copies) and sources (whose copies it holds)."""

    channel: Channel
    folder: Optional[str]
    store: Optional[ReplicaStore]
    k: int
    keep: int
    partners: list[int]
    sources: list[int]
    counters: Counters = field(default_factory=Counters)
    #: whether the replicas of ranks that are not :attr:`sources` (an earlier job's) were removed
    dropped_others: bool = False
    #: the host-memory budget of this rank's Checkpointer: why N more bytes do not fit (None: they do)
    budget_room: Optional[Callable[[int], Optional[str]]] = None
    #: of a source rank's replicas (a storage on their folder, their steps oldest first), those kept
    #: beside :attr:`keep` as this rank's memory tier keeps its own steps (its ``keep_also_in``)
    keep_also: Optional[Callable[[Any, list[int]], set[int]]] = None

    @property
    def rank(self) -> int:
        """This rank (in the checkpoint's group)."""
        return self.channel.rank

    @property
    def world(self) -> int:
        """The job's number of ranks."""
        return self.channel.world
