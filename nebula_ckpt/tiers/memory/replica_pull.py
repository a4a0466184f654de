"""A pull at restore: one rank's lost memory-tier step moved from a holder in chunks, checked as it lands.

The recover round (:mod:`~nebula_ckpt.tiers.memory.replica_recover`) moves a copy while training
waits, so its latency counts, not its CPU. Both sides cut the step's files into the same
transfers (:func:`pull_order`, computed from the ``(name, size)`` both know and the puller's chunk
size, :data:`PULL_CHUNK_BYTES`): the small files first (manifest, records, commit
marker), then each shard in chunks, one tag each. The holder sends them all at once from
read-only mappings of its replica (no copy). The puller makes the files under an ``.incoming-*``
folder and, chunk by chunk, allocates the chunk's pages (``posix_fallocate``, whose ENOSPC
refuses the copy: no byte is ever received into a tmpfs hole, so a full tmpfs cannot raise
SIGBUS; then one ``madvise(MADV_POPULATE_WRITE)`` maps them in) and posts its receive, so chunk
``i + 1`` is allocated while chunk ``i`` lands.
Then :meth:`Pull.arrivals` waits the chunks in order and the caller checks each tensor's checksum
as soon as its bytes are in, so that the checks overlap the transfer.

A chunk refused for room goes, with every chunk after it, to scratch memory (the ranks stay in
step) and the copy is refused; nothing of it is visible until the caller publishes the whole,
verified copy (:meth:`~nebula_ckpt.tiers.memory.replica_store.ReplicaStore.publish`).

**Into memory** (``into_memory=True``): the copy a restore waits for lands in anonymous memory
instead, one private mapping a file (huge pages where the kernel gives them), each chunk's pages
populated before its receive is posted (measured: 48 MB in 2-4 ms, against ~25 ms of tmpfs pages;
and no second copy: the restore hands these pages out as its tensors,
:class:`~nebula_ckpt.storage.buffers.BufferStorage`). It is refused before anything is
posted when the host's available memory cannot hold it. The memory tier's own copy of it is
pulled again afterwards, into the tier, off the restore's path
(:mod:`~nebula_ckpt.tiers.memory.replica_recover`).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import torch

from nebula_ckpt import knobs
from nebula_ckpt.errors import PersistError
from nebula_ckpt.format.commit import Write, read_commit
from nebula_ckpt.format.names import step_dir
from nebula_ckpt.native import get_ops
from nebula_ckpt.restore.open import OpenCheckpoint, open_checkpoint
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.storage.buffers import BufferStorage
from nebula_ckpt.storage.local import LocalStorage
from nebula_ckpt.storage.prefault import MADV_POPULATE_WRITE, advise
from nebula_ckpt.tiers.memory.replica_channel import Channel, no_room_for_copy
from nebula_ckpt.tiers.memory.replica_store import ReplicaStore, safe_name

#: bytes per transfer of a memory-tier copy pulled from a partner at restore (the puller allocates
#: the next chunk and checks the tensors landed while one arrives)
PULL_CHUNK_BYTES = 8 << 20

log = logging.getLogger(__name__)

def chunk_bytes() -> int:
    """This rank's bytes per transfer of a pull (:data:`PULL_CHUNK_BYTES`, at least one
    page). The puller's value is the one both sides use: it tells it in its view."""
    return max(mmap.PAGESIZE, int(PULL_CHUNK_BYTES) // mmap.PAGESIZE * mmap.PAGESIZE)


def pull_order(files: Sequence[tuple[str, int]], chunk: int) -> list[tuple[int, int, int]]:
    """The transfers of a pull of ``files`` (``(name, size)``), the same on both sides, the tag
    of each being its position: ``(file index, start, end)``; the smallest files first (the
    manifest, records and commit marker, needed to check the shards' tensors as they land),
    each file in chunks of ``chunk`` bytes; empty files move nothing."""
    out = []
    for i in sorted(range(len(files)), key=lambda i: (int(files[i][1]), i)):
        size = int(files[i][1])
        out += [(i, lo, min(lo + chunk, size)) for lo in range(0, size, chunk)]
    return out


def send_pull(ch: Channel, paths: Sequence[str], files: Sequence[tuple[str, int]], dst: int, chunk: int,
              works: list[tuple[Any, torch.Tensor]]) -> None:
    """Start sending ``files`` (mapped read-only from ``paths``: no copy) to rank ``dst`` as the
    transfers of :func:`pull_order` in chunks of ``chunk`` bytes (the puller's). A file that
    cannot be mapped (gone meanwhile) is sent as zeros of its size, so the ranks stay in step;
    the puller's checksums then reject the copy."""
    mapped: dict[int, torch.Tensor] = {}
    for tag, (i, lo, hi) in enumerate(pull_order(files, max(mmap.PAGESIZE, chunk))):
        if i not in mapped:
            mapped[i] = ch.mapped_for_send(paths[i], int(files[i][1]), dst)
        t = mapped[i][lo:hi]
        works.append((ch.post_send(t, dst, tag), t))


@dataclass
class Pull:
    """A pull being received (:func:`receive_pull`).

    Attributes:
        inc: the ``.incoming-*`` folder the copy lands in; not an absolute path when it lands in
            memory, or was refused before anything landed (then why: the bytes went to scratch
            memory).
        files: ``(name, size)`` of the step's files, as the holder listed them.
        landed: the mapping each file is received into, by name (its checksums are taken there).
        refused: why the copy is refused (a chunk without room), or None.
    """

    inc: str
    files: list[tuple[str, int]]
    landed: dict[str, torch.Tensor] = field(default_factory=dict)
    refused: Optional[str] = None
    #: ``(work, tensor, file index, end)`` of each transfer, in order
    chunks: list[tuple[Any, torch.Tensor, int, int]] = field(default_factory=list)
    #: the receive mappings, by file name
    maps: dict[str, mmap.mmap] = field(default_factory=dict)
    #: the transfers (:func:`pull_order`)
    order: list[tuple[int, int, int]] = field(default_factory=list)
    #: whether the copy lands in anonymous memory (see the module docstring), not in a tmpfs
    in_memory: bool = False

    def storage(self, step: int) -> Storage:
        """The landed copy as a storage: the incoming folder, or its buffers in memory."""
        if self.in_memory:
            return BufferStorage(self._in_memory(step), what=f"step {step} received in memory")
        return LocalStorage(self.inc, private=True, fsync=False)

    def hand_over(self, step: int) -> dict[str, torch.Tensor]:
        """The files of a copy landed in memory (``"step-N/name" -> uint8 tensor``; empty files
        as empty tensors), which from now on alone hold its mappings (:meth:`close` leaves them)."""
        out = self._in_memory(step)
        self.maps.clear()
        return out

    def _in_memory(self, step: int) -> dict[str, torch.Tensor]:
        return {f"{step_dir(step)}/{n}": self.landed.get(n, torch.empty(0, dtype=torch.uint8)) for n, _ in self.files}

    def arrivals(self) -> Iterator[tuple[str, int]]:
        """Wait for each transfer in order (raises when one failed: the ranks are out of step);
        after each, ``(file name, bytes of it in)``. Every transfer is waited for, even when the
        caller stops early (closing the iterator waits the rest)."""
        try:
            while self.chunks:
                w, _, i, end = self.chunks[0]
                w.wait()
                self.chunks.pop(0)
                yield self.files[i][0], end
        finally:
            self.wait()

    def wait(self) -> None:
        """Wait for every transfer not waited for yet."""
        while self.chunks:
            self.chunks[0][0].wait()
            self.chunks.pop(0)

    def close(self) -> None:
        """Drop the receive mappings (after every transfer is done)."""
        self.landed.clear()
        for m in self.maps.values():
            try:
                m.close()
            except BufferError:  # a view of it is still alive: the garbage collector unmaps it
                pass
        self.maps.clear()


def receive_pull(ch: Channel, store: ReplicaStore, step: int, files: Sequence[tuple[str, int]],
                 src: int, into_memory: bool = False) -> Pull:
    """Start receiving rank ``src``'s transfers of ``files`` (:func:`pull_order`, in chunks of
    :func:`chunk_bytes`) into a new incoming folder of ``store``, allocating each chunk's pages
    before its receive is posted, or into anonymous memory (``into_memory``; see the module
    docstring)."""
    pull = Pull("", [(str(n), int(s)) for n, s in files], in_memory=into_memory)
    pull.order = pull_order(pull.files, chunk_bytes())
    paths: dict[int, str] = {}
    try:
        if into_memory:
            pull.inc = "memory"
            _fits_in_memory(sum(n for _, n in pull.files), src)
        else:
            pull.inc = store.incoming(step)
        for i, (name, size) in enumerate(pull.files):
            paths[i], m = _target(pull.inc, step, name, size, src, into_memory)
            if m is not None:
                pull.maps[name] = m
                pull.landed[name] = torch.frombuffer(m, dtype=torch.uint8)
    except OSError as e:
        log.warning("nebula_ckpt: rank %d cannot receive its step from rank %d: %s", ch.rank, src, e)
        if os.path.isabs(pull.inc):  # what was made of it goes now
            store.discard(pull.inc)
        pull.inc = pull.refused = f"{type(e).__name__}: {e}"
        pull.close()
    for tag, (i, lo, hi) in enumerate(pull.order):
        name = pull.files[i][0]
        t = None
        if pull.refused is None:
            try:
                if into_memory:  # no room to refuse: MemAvailable was checked
                    advise(pull.maps[name], lo, hi - lo, MADV_POPULATE_WRITE)
                else:
                    _allocate(pull, paths[i], name, lo, hi, src)
                t = pull.landed[name][lo:hi]
            except OSError as e:  # this chunk and the rest to scratch memory: the ranks stay in step
                log.warning("nebula_ckpt: rank %d cannot receive its step from rank %d: %s", ch.rank, src, e)
                pull.refused = f"{type(e).__name__}: {e}"
        if t is None:
            t = torch.empty(hi - lo, dtype=torch.uint8)
        pull.chunks.append((ch.post_receive(t, src, tag), t, i, hi))
    return pull


def _target(inc: str, step: int, name: str, size: int, src: int,
            into_memory: bool = False) -> tuple[str, Optional[mmap.mmap]]:
    """The new file ``name`` of the incoming copy, of ``size`` bytes (a hole: no page allocated
    yet), and a writable mapping of it (None when empty); or, ``into_memory``, a private
    anonymous mapping of ``size`` bytes (no page allocated yet)."""
    if not safe_name(name):  # the holder lists only these names
        raise OSError(f"rank {src} sent a file named {name!r}; refusing it")
    if into_memory:
        return name, (_anonymous(size) if size else None)
    path = os.path.join(inc, step_dir(step), name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, size)
        return path, (mmap.mmap(fd, size) if size else None)
    finally:
        os.close(fd)


def _anonymous(size: int) -> mmap.mmap:
    """A private anonymous mapping of ``size`` bytes, backed by huge pages where the kernel gives
    them (``MADV_HUGEPAGE``, unless the knob ``huge_pages`` is off; measured: 48 MB populated in 2-4 ms,
    against 10-20 ms in 4 KiB pages and ~25 ms for a tmpfs or a shared mapping, which
    ``mmap.mmap(-1, n)`` is; but a kernel short of free huge pages compacts memory first, which
    was seen to take ~80-140 ms)."""
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE") and knobs.get("huge_pages") is not False:
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError as e:  # no transparent huge pages here: 4 KiB pages
            log.debug("nebula_ckpt: no huge pages for a receive buffer: %s", e)
    return m


def _fits_in_memory(nbytes: int, src: int) -> None:
    """Refuse (OSError ``ENOMEM``) a copy of ``nbytes`` that the host's available memory
    (``MemAvailable``, Linux) cannot hold; unknown elsewhere: let through."""
    try:
        with open("/proc/meminfo", "rb") as f:
            avail = next((int(line.split()[1]) * 1024 for line in f if line.startswith(b"MemAvailable:")), None)
    except OSError:
        return
    if avail is not None and nbytes > avail:
        raise OSError(errno.ENOMEM, f"the copy from rank {src} needs {nbytes} bytes of memory, the host has "
                      f"{avail} available")


def _allocate(pull: Pull, path: str, name: str, lo: int, hi: int, src: int) -> None:
    """Allocate the pages of ``name``'s bytes ``[lo, hi)`` before anything is received there: one
    ``posix_fallocate`` (its ENOSPC refuses the copy, naming the tmpfs's free room: OSError),
    then one populate call maps them in (measured: cheaper together than populating the hole
    alone, which allocates page by page)."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        os.posix_fallocate(fd, lo, hi - lo)
    except OSError as e:
        raise no_room_for_copy(e, src, name, next(s for n, s in pull.files if n == name), pull.inc) from e
    finally:
        os.close(fd)
    if not advise(pull.maps[name], lo, hi - lo, MADV_POPULATE_WRITE):  # without the GIL
        log.debug("nebula_ckpt: cannot populate a receive mapping of %d bytes", hi - lo)

def land_and_check(pull: Pull, rank: int, world: int, write: Write) -> Optional[str]:
    """Wait for every byte of ``pull`` and check the copy of ``rank``'s step: it opens as that
    rank's with every checksum verified (each tensor's taken on the receive mapping as soon as its
    bytes are in) and is the write ``write`` (``(generation, step, save)``, its commit marker's:
    the same step saved twice is two writes). None when it does; else why not.

    Raises:
        RuntimeError: a transfer failed (the ranks are out of step; from the channel).
    """
    step = write[1]
    if pull.refused is not None:  # bytes went to scratch memory: nothing here to check
        pull.wait()
        return pull.refused
    st = pull.storage(step)
    last = pull.files[pull.order[-1][0]][0] if pull.order else None  # the biggest file: the last to land
    landed: dict[str, int] = {}
    early: Optional[tuple[OpenCheckpoint, dict[str, list[Any]]]] = None
    tried, why = False, None
    try:
        for name, end in pull.arrivals():
            landed[name] = end
            if why is not None:
                continue  # every transfer is still waited for
            if not tried and name == last:
                tried, early = True, _open_early(st, pull, step, rank, world)
            try:
                if early is not None:
                    for n in list(early[1]):
                        _check_landed(early[0], pull, early[1], n, landed.get(n, 0))
            except Exception as e:
                why = f"{type(e).__name__}: {e}"
        if why is None:
            why = _check_rest(st, pull, rank, world, write, early)
    finally:
        st.close()
    return why


def _open_early(st: Storage, pull: Pull, step: int, rank: int,
                world: int) -> Optional[tuple[OpenCheckpoint, dict[str, list[Any]]]]:
    """The copy opened once every file but the biggest is in (:func:`_open`), to check the
    biggest's tensors as they land; None where it does not open yet: it is opened again, with
    the error that counts, once every byte is in."""
    try:
        return _open(st, pull, step, rank, world)
    except Exception as e:
        log.debug("nebula_ckpt: %s step %d does not open before its last file is in: %s", pull.inc, step, e)
        return None


def _check_rest(st: Storage, pull: Pull, rank: int, world: int, write: Write,
                early: Optional[tuple[OpenCheckpoint, dict[str, list[Any]]]]) -> Optional[str]:
    """Every byte is in: check what was not checked yet; None when the copy passes, else why not."""
    step = write[1]
    try:
        ck, todo = early or _open(st, pull, step, rank, world)
        sizes = dict(pull.files)
        for n in list(todo):
            _check_landed(ck, pull, todo, n, sizes[n])
        ck.verify_rest()  # what was not checked on the receive mappings (none for a whole step)
        have = read_commit(st, step, f"{pull.inc} step {step}").write
        if have != tuple(write):
            raise PersistError(f"the copy of step {step} is the write (generation, step, save) {have}, not the "
                               f"{tuple(write)} agreed on")
        return None
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def _open(st: Storage, pull: Pull, step: int, rank: int,
          world: int) -> tuple[OpenCheckpoint, dict[str, list[Any]]]:
    """The pulled copy opened as ``rank``'s of ``world`` (checksums left to the caller), and the
    records to check on each receive mapping, by file name, in the order their bytes land."""
    ck = open_checkpoint(st, step, "full", f"{pull.inc} step {step}", rank, world, defer_verify=True)
    todo: dict[str, list[Any]] = {}
    for si, recs in ck.unverified.items():
        sh = ck.manifest.shards[si]
        plain = set(sh.storage or {}) <= {"stored_bytes"} and sh.stored_bytes == sh.bytes  # stored as is
        buf = pull.landed.get(sh.file) if sh.step is None and plain else None
        if buf is not None and recs and buf.numel() == sh.bytes:
            todo[sh.file] = sorted(recs, key=lambda r: r.end)
    return ck, todo


def _check_landed(ck: OpenCheckpoint, pull: Pull, todo: dict[str, list[Any]], name: str, end: int) -> None:
    """Check the records of ``todo[name]`` whose bytes are all in (below ``end``) on the receive
    mapping (raises :class:`~nebula_ckpt.errors.CorruptCheckpointError` naming a damaged one)."""
    recs = todo.get(name)
    if not recs:
        return
    n = 0
    while n < len(recs) and recs[n].end <= end:
        n += 1
    if n:
        batch, todo[name] = recs[:n], recs[n:]
        ck.verified_by_copy(batch, get_ops().crc32c(pull.landed[name], [r.start for r in batch],
                                                    [r.nbytes for r in batch]))
