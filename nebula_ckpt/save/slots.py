"""Staging buffers and slot files: what :class:`~nebula_ckpt.save.buffers.StagingPool` holds.

A :class:`Slot` is one staging buffer: anonymous (fresh pages the save's copy faults in), pinned
(CUDA), or a *slot file* of the memory tier's ``.slots/`` folder (tmpfs), mapped shared and
pre-faulted, which the memory tier links as its shard (see :mod:`nebula_ckpt.save.buffers`).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from nebula_ckpt import knobs
from nebula_ckpt.format.names import slot_file_name
from nebula_ckpt.storage.holds import read_elsewhere
from nebula_ckpt.tiers.memory.runtime import own_spare_slot_files

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Slot:
    """One staging buffer."""

    buffer: torch.Tensor       # 1-D uint8, capacity bytes
    pinned: bool
    in_use: bool = field(default=False)
    #: slot file (exactly ``capacity`` bytes) the memory tier may link as its shard; None: anonymous
    path: Optional[str] = None
    _mm: Any = field(default=None, repr=False)
    _view: Optional[memoryview] = field(default=None, repr=False)

    def view(self) -> memoryview:
        """The whole buffer as a memoryview, made once (``Tensor.numpy()`` costs tens of µs a call,
        paid on the training thread by every save otherwise)."""
        if self._view is None:
            self._view = self.buffer.numpy().data
        return self._view

    def __post_init__(self) -> None:
        self._capacity = int(self.buffer.numel())  # read at every save's slot choice: not a torch call each time

    @property
    def capacity(self) -> int:
        """Bytes available."""
        return self._capacity

    def live(self) -> bool:
        """Whether a committed memory-tier checkpoint still links to this slot file, or another
        process still reads it (a restore of a checkpoint that linked it: see
        :func:`~nebula_ckpt.storage.holds.read_elsewhere`); either way it is not staged in."""
        if self.path is None:
            return False
        try:
            return os.stat(self.path).st_nlink > 1 or read_elsewhere(self.path)
        except FileNotFoundError:
            return False

    def fits(self, nbytes: int) -> bool:
        """Whether a shard image of ``nbytes`` can be staged here (slot files: exactly that size)."""
        return self.capacity == nbytes if self.path is not None else self.capacity >= nbytes

    def free(self) -> None:
        """Drop the buffer (a slot file's name goes too; a checkpoint linking it keeps its bytes)."""
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        self._view = None
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self._capacity = 0
        self._mm = None


def create_slot_file(slot_dir: str, nbytes: int) -> Slot:
    """A new slot file of exactly ``nbytes`` in ``slot_dir``, allocated and mapped pre-faulted.

    Raises:
        OSError: no room on the tmpfs (``ENOSPC``) or no such folder.
    """
    os.makedirs(slot_dir, mode=0o700, exist_ok=True)
    path = os.path.join(slot_dir, slot_file_name())
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)  # pages exist now: ENOSPC here, never SIGBUS later
        return map_slot(fd, path, nbytes)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def adopt_slot_file(path: str, nbytes: int) -> Slot:
    """Map the existing slot file ``path`` (a spare of exactly ``nbytes``, its pages allocated).

    Raises:
        OSError: it is gone, is a link, or is not ``nbytes`` long.
    """
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        if os.fstat(fd).st_size != nbytes:
            raise OSError(f"slot file {path} is not {nbytes} bytes")
        os.posix_fallocate(fd, 0, nbytes)  # a no-op for a whole file: no hole can SIGBUS later
        return map_slot(fd, path, nbytes)
    finally:
        os.close(fd)


def map_slot(fd: int, path: str, nbytes: int) -> Slot:
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    mm = mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return Slot(torch.frombuffer(mm, dtype=torch.uint8), False, path=path, _mm=mm)


def fresh_anonymous(nbytes: int) -> Slot:
    """A staging buffer of fresh anonymous pages, none of them touched: the save's copy (and the
    fault-ahead threads) fault them in as they fill it. A mapping of its own, whatever its size:
    a block of the heap would have to be zeroed first, on the training thread."""
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if knobs.get("huge_pages") and hasattr(mmap, "MADV_HUGEPAGE"):
        mm.madvise(mmap.MADV_HUGEPAGE)
    return Slot(torch.frombuffer(mm, dtype=torch.uint8), False, _mm=mm)


def shm_room(slot_dir: str, nbytes: int) -> bool:
    """Whether a slot file of ``nbytes`` leaves the tmpfs at least ``shm_min_free_fraction`` free."""
    try:
        st = os.statvfs(os.path.dirname(slot_dir))
    except OSError:
        return False
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    return free - nbytes >= knobs.get("shm_min_free_fraction") * total


def retire_anonymous(slots: list[Slot]) -> None:
    """Free (and drop from ``slots``) each idle unpinned anonymous buffer that two slot files of a
    size it would serve have replaced (the steady state: the memory tier's checkpoint and the next
    save's staging; saves stage in slot files first). Kept, such a buffer (the first save's, made
    while no slot file was ready) would hold a state's worth of memory for the rest of the job.
    The pool's lock held."""
    sizes = [s.capacity for s in slots if s.path is not None]
    if len(sizes) < 2:
        return  # no size has two slot files
    for s in [s for s in slots if s.path is None and not s.in_use and not s.pinned]:
        if any(sizes.count(n) >= 2 and s.fits(n) for n in set(sizes)):
            log.debug("nebula_ckpt: anonymous staging buffer of %.1f MiB freed (slot files replace it)",
                      s.capacity / 2**20)
            slots.remove(s)
            s.free()


#: every staging pool of this process (``save.buffers.StagingPool``), for :func:`idle_elsewhere`
POOLS: "weakref.WeakSet[Any]" = weakref.WeakSet()


def idle_elsewhere(slot_dir: Optional[str], me: Any) -> int:
    """Bytes freed from the idle slot files of the other staging pools of this process that stage in
    ``slot_dir`` (a Checkpointer still open beside a newer one on the same root: its idle slot files
    would count in the newer one's budget for as long as it stays open)."""
    if slot_dir is None:
        return 0
    return sum(p.drop_idle_files() for p in list(POOLS) if p is not me and p.slot_dir == slot_dir)


def unlink_spares(slot_dir: Optional[str], slots: list[Slot]) -> None:
    """Remove the spare slot files in ``slot_dir`` that finished processes left and none of ``slots`` took."""
    if slot_dir is not None:
        for path, _ in own_spare_slot_files(slot_dir, {s.path for s in slots if s.path}):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
