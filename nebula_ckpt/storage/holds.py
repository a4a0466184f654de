"""Who else reads a file: open-file-description locks on the memory tier's files, and this
process's own mappings of them.

A file one process may take over (a memory tier's shard or slot file) must not change while any
process reads it; these locks say who does. :class:`~nebula_ckpt.storage.local.LocalStorage`
takes a reader lock for every mapping it makes of such a file (``hold_reads``); the memory tier's
adoption (:mod:`nebula_ckpt.tiers.memory.adopt`) takes a file over only when no one else holds
one, and a save stages into a slot file only when :func:`read_elsewhere` says no one reads it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import struct
import threading
import weakref
from typing import Optional

log = logging.getLogger(__name__)

# -- readers of a file, as open-file-description locks ------------------------------------------
#
# A file that one process may take over (the memory tier's shard files: see nebula_ckpt.tiers.memory.adopt)
# is read only under a *reader lock*: a shared lock on the byte at offset <pid> of the file,
# taken on the descriptor that is mapped. Open-file-description locks belong to the opened file,
# not the process, so the mapping keeps the lock (Python's mmap holds a duplicate of the
# descriptor) exactly as long as anything reads through it, and it dies with the process. A
# process takes the file over only with :func:`hold_alone`: an exclusive lock on every byte but
# its own, which is granted only while no other process holds a reader lock, and which, once
# granted, keeps every later reader lock from being granted.
#
# A *private* (copy-on-write) mapping of such a file (:func:`hold_private`: an incremental step's
# base, mapped by a restore) is marked by a reader lock at ``_PRIVATE_AT + <pid>``. Its pages that
# the process has not written yet are the file's: a write into the file in place would show
# through. That byte lies in every range :func:`hold_alone` and :func:`read_elsewhere` look at,
# this process's own included (open-file-description locks conflict between two opens of one
# file in the same process), so no process, the mapping one included, takes the file over or
# stages into it while the mapping lives.

# A reader lock of this process is at its own pid's byte, which :func:`read_elsewhere` does not
# look at (the process's own slot files are always "read" by it). The memory tier's files this
# process maps to read them (:meth:`~nebula_ckpt.storage.local.LocalStorage.read_buffer`) are therefore also counted in
# ``_mapped_here`` while the mapping lives: a save of this very process must not stage into a slot
# file that a restore of it reads (or whose tensors it returned) after retention dropped the step.
_mapped_here: dict[tuple[int, int], int] = {}  # (st_dev, st_ino) -> live mappings in this process
_mapped_lock = threading.Lock()


def _mapped(key: tuple[int, int], delta: int) -> None:
    with _mapped_lock:
        n = _mapped_here.get(key, 0) + delta
        if n > 0:
            _mapped_here[key] = n
        else:
            _mapped_here.pop(key, None)


class MappedHold:
    """This process's count of the file at ``path`` as mapped (:func:`read_elsewhere` then says
    it is read: no save of this process stages into it), taken *before* the caller maps the file:
    a slot file is staged into again only after its step's name went, so the file mapped after
    this is the one counted. :meth:`tie` then hands the count to the mapping's owner (released
    when that object goes); :meth:`release` drops it (the file could not be mapped). A ``path``
    that is gone counts nothing."""

    def __init__(self, path: str) -> None:
        try:
            st = os.stat(path, follow_symlinks=False)
            self._key: Optional[tuple[int, int]] = (st.st_dev, st.st_ino)
            _mapped(self._key, 1)
        except FileNotFoundError:
            self._key = None

    def tie(self, owner: object) -> None:
        """Keep the count for as long as ``owner`` (e.g. a tensor made from the file) lives."""
        if self._key is not None:
            weakref.finalize(owner, _mapped, self._key, -1)
            self._key = None

    def release(self) -> None:
        """Drop the count now."""
        if self._key is not None:
            _mapped(self._key, -1)
            self._key = None


_FLOCK = "@hhqqi4x"  # struct flock: l_type, l_whence, l_start, l_len (0: to the end), l_pid
#: open-file-description locks (Linux >= 3.15); without them no reader can be seen, so no file is
#: ever taken over (adoption copies) and readers register nothing
_OFD: dict[str, Optional[int]] = {"set": getattr(fcntl, "F_OFD_SETLK", None),
                                  "get": getattr(fcntl, "F_OFD_GETLK", None)}


class _NoOfdLocks(Exception):
    pass


def _ofd(fd: int, op: str, kind: int, start: int, length: int) -> bytes:
    cmd = _OFD[op]
    if cmd is None:
        raise _NoOfdLocks()
    try:
        return fcntl.fcntl(fd, cmd, struct.pack(_FLOCK, kind, os.SEEK_SET, start, length, 0))
    except OSError as e:
        if e.errno == errno.EINVAL and _OFD["set"] is not None:
            log.info("nebula_ckpt: no open-file-description locks here (%s): memory-tier pages are copied, "
                     "never handed over", e)
            _OFD["set"] = _OFD["get"] = None
            raise _NoOfdLocks() from None
        raise


def _ofd_lock(fd: int, kind: int, start: int, length: int) -> bool:
    """Set (or clear) an open-file-description lock on ``[start, start + length)`` (0: to the
    end); False when another open file holds a conflicting one.

    Raises:
        _NoOfdLocks: the system has none.
    """
    try:
        _ofd(fd, "set", kind, start, length)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def hold_read(fd: int) -> bool:
    """Register the open file ``fd`` as read by this process (until the last descriptor of it
    closes, a mapping's included); False when another process has taken the file over."""
    try:
        return _ofd_lock(fd, fcntl.F_RDLCK, os.getpid(), 1)
    except _NoOfdLocks:
        return True  # nothing can take a file over here (hold_alone is always False)


#: where the reader locks of private mappings start (beyond any pid, inside every range checked)
_PRIVATE_AT = 1 << 40


def hold_private(fd: int) -> bool:
    """Register the open file ``fd`` as mapped copy-on-write by this process (until the last
    descriptor of it closes, a mapping's included): from then on no process, this one included,
    takes the file over (:func:`hold_alone`) or writes it in place (:func:`read_elsewhere` is
    True for it). False when another process has taken the file over, and always where the
    system has no open-file-description locks (nothing could see the mapping: copy instead)."""
    try:
        return _ofd_lock(fd, fcntl.F_RDLCK, _PRIVATE_AT + os.getpid(), 1)
    except _NoOfdLocks:
        return False


def hold_alone(fd: int) -> bool:
    """Take the file of ``fd`` over: True when no other process holds it open for reading (by
    :func:`hold_read`), and from then on none can; False (nothing taken) otherwise, and always
    where the system has no open-file-description locks."""
    try:
        return _hold_alone(fd)
    except _NoOfdLocks:
        return False


def _hold_alone(fd: int) -> bool:
    pid = os.getpid()
    if not _ofd_lock(fd, fcntl.F_WRLCK, 0, pid):
        return False
    if not _ofd_lock(fd, fcntl.F_WRLCK, pid + 1, 0):
        _ofd_lock(fd, fcntl.F_UNLCK, 0, pid)
        return False
    return True


def read_elsewhere(path: str) -> bool:
    """Whether another process holds a reader lock (:func:`hold_read`) on the file at ``path``,
    any process, this one included, maps it copy-on-write (:func:`hold_private`), or this
    process maps it to read it (:meth:`~nebula_ckpt.storage.local.LocalStorage.read_buffer` of
    the memory tier); False when it is gone. Either way its bytes must not change: nothing may
    stage into it in place."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO never blocks
    except FileNotFoundError:
        return False
    try:
        st = os.fstat(fd)
        with _mapped_lock:
            if (st.st_dev, st.st_ino) in _mapped_here:
                return True
        pid = os.getpid()
        for start, length in ((0, pid), (pid + 1, 0)):
            got = _ofd(fd, "get", fcntl.F_WRLCK, start, length)
            if struct.unpack(_FLOCK, got)[0] != fcntl.F_UNLCK:
                return True
        return False
    except _NoOfdLocks:
        return False
    finally:
        os.close(fd)


def let_go(fd: int) -> None:
    """Undo :func:`hold_alone` (this process still reads the file)."""
    pid = os.getpid()
    try:
        _ofd_lock(fd, fcntl.F_UNLCK, 0, pid)
        _ofd_lock(fd, fcntl.F_UNLCK, pid + 1, 0)
    except _NoOfdLocks:
        pass


def count_mapping(fd: int, path: str, mm: mmap.mmap) -> None:
    """Count the mapping ``mm`` of ``fd`` in ``_mapped_here`` for its life, then make sure
    ``path`` still names that file: a slot file is staged into again only after retention
    unlinked its step's name, so a save that looked before the count either saw the name
    (and left the file alone) or unlinked it before this check (the step is gone: raised)."""
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino)
    _mapped(key, 1)
    weakref.finalize(mm, _mapped, key, -1)
    try:
        now = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        now = None
    if now is None or (now.st_dev, now.st_ino) != key:
        mm.close()
        raise FileNotFoundError(errno.ENOENT, f"{path} was removed while it was opened (retention "
                                "dropped its step)", path)
