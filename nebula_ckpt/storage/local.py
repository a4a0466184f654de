"""POSIX file-system storage: local disks, NFS, and ``/dev/shm`` for the memory tier.

Durability: shard data is written with parallel ``pwrite`` (``O_DIRECT`` where allowed) and
fsync'd by the native writer; small files are written by :func:`~nebula_ckpt.storage.atomic.write_file_atomic`
(a temp file in the same directory, fsync, rename or ``link`` for create-only, directory fsync),
so a crash leaves either the old state or the new one, never a zero-filled file.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import shutil
import stat
import struct
import threading
import weakref
from typing import Any, Optional

import torch

from nebula_ckpt.errors import CorruptCheckpointError, ValidationError
from nebula_ckpt.native import get_ops
from nebula_ckpt.storage.atomic import fsync_dir, write_file_atomic
from nebula_ckpt.storage.base import Buffer, Storage

log = logging.getLogger(__name__)


def _open_nofollow(path: str) -> Any:
    """``open(path, "rb")`` that refuses a symlink as the last component (``ELOOP``)."""
    return os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb")


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
# process maps to read them (:meth:`LocalStorage.read_buffer`) are therefore also counted in
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
    process maps it to read it (:meth:`LocalStorage.read_buffer` of the memory tier); False when
    it is gone. Either way its bytes must not change: nothing may stage into it in place."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
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


class LocalStorage(Storage):
    """Storage in a local directory.

    Args:
        root: directory (created if missing).
        private: create directories 0700 and files 0600 (memory tier: owner only).
        fsync: fsync files and directories (off for tmpfs, where it is a no-op anyway).
        hold_reads: every mapping :meth:`read_buffer` makes holds a reader lock on its file
            (:func:`hold_read`): the memory tier, whose files a restart may take over. A file
            already taken over reads as missing.
    """

    is_local = True
    failed_create_is_final = True

    def __init__(self, root: str, *, private: bool = False, fsync: bool = True, hold_reads: bool = False) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))
        self.display_url = self.root
        self.private = private
        self.fsync = fsync
        self.hold_reads = hold_reads
        self._dir_mode = 0o700 if private else 0o755
        self._file_mode = 0o600 if private else 0o644

    def check_access(self) -> None:
        """Fail fast when the root cannot be a folder: it, or a folder above it, is a file.

        Raises:
            ValidationError: naming the path and what is there instead.
        """
        path = self.root
        while True:
            if os.path.exists(path):
                if not os.path.isdir(path):
                    what = "the root" if path == self.root else f"'{path}', a folder above the root,"
                    raise ValidationError(f"{self.display_url}: {what} is a file, not a folder: a checkpoint root "
                                          "must be a folder path (existing or not); pick another path")
                return
            parent = os.path.dirname(path)
            if parent == path:
                return
            path = parent

    def _p(self, rel: str) -> str:
        """Absolute path of ``rel``, refusing anything that leaves the root or passes a symlink.

        ``rel`` must be a plain relative path (no ``..``, no absolute path); no folder or file on
        the way below the root may be a symlink (a planted link would otherwise redirect reads,
        writes and deletions anywhere). The root itself may be a symlink: the user chose it.

        Raises:
            ValueError: ``rel`` is not a plain relative path.
            OSError: ``ELOOP`` when a component below the root is a symlink.
        """
        if not rel:
            return self.root
        parts = rel.split("/")
        if rel.startswith("/") or any(p in ("", ".", "..") or "\0" in p for p in parts):
            raise ValueError(f"{self.display_url}: refusing path {rel!r}: not a plain relative path")
        path = self.root
        for p in parts:
            path = os.path.join(path, p)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                break  # nothing below a missing component can be a link
            except NotADirectoryError:
                break
            if stat.S_ISLNK(st.st_mode):
                raise OSError(errno.ELOOP, f"{self.display_url}: '{rel}' passes the symlink "
                              f"'{os.path.relpath(path, self.root)}'; links inside a tier are never followed "
                              "(remove it)", path)
        return os.path.join(self.root, rel)

    def _makedirs(self, path: str) -> None:
        os.makedirs(path, mode=self._dir_mode, exist_ok=True)

    def write_buffer(self, rel: str, data: Buffer) -> dict[str, Any]:
        path = self._p(rel)
        self._makedirs(os.path.dirname(path))
        n = len(data)
        buf = torch.frombuffer(data, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        try:
            get_ops().write_file(path, buf, 0, n, self.fsync)
        except (RuntimeError, OSError) as e:
            raise OSError(getattr(e, "errno", None) or errno.EIO,
                          f"writing {n} bytes to '{path}' failed: {e}") from e
        if self.private:
            os.chmod(path, self._file_mode)
        if self.fsync:
            fsync_dir(os.path.dirname(path))
        return {"stored_bytes": n}

    def write_parts(self, rel: str, parts: list[memoryview]) -> dict[str, Any]:
        """Write ``parts`` back to back without joining them (one ``write`` loop per part), durable."""
        path = self._p(rel)
        self._makedirs(os.path.dirname(path))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, self._file_mode)
        n = 0
        try:
            for part in parts:
                mv = memoryview(part).cast("B")
                while len(mv):
                    k = os.write(fd, mv[: 1 << 30])
                    mv = mv[k:]
                    n += k
            if self.fsync:
                os.fsync(fd)
        except OSError as e:
            raise OSError(e.errno or errno.EIO, f"writing {n} bytes to '{path}' failed: {e}") from e
        finally:
            os.close(fd)
        if self.private:
            os.chmod(path, self._file_mode)
        if self.fsync:
            fsync_dir(os.path.dirname(path))
        return {"stored_bytes": n}

    def link_file(self, src: str, rel: str) -> dict[str, Any]:
        """Hard-link the existing file ``src`` (same file system) as ``rel``; no bytes are copied.

        Raises:
            OSError: ``EXDEV`` (another file system), ``EEXIST``, ``ENOENT``.
        """
        path = self._p(rel)
        self._makedirs(os.path.dirname(path))
        os.link(src, path)
        if self.fsync:
            fsync_dir(os.path.dirname(path))
        return {"stored_bytes": os.stat(path).st_size}

    def read_buffer(self, rel: str, info: Optional[dict[str, Any]] = None, *,
                    expected_bytes: Optional[int] = None) -> Buffer:
        path = self._p(rel)
        with _open_nofollow(path) as f:
            size = os.fstat(f.fileno()).st_size
            if expected_bytes is not None and size != expected_bytes:
                raise CorruptCheckpointError(f"{path} has {size} bytes, the manifest says {expected_bytes}")
            if size == 0:
                return memoryview(bytearray())
            if self.hold_reads and not hold_read(f.fileno()):
                raise FileNotFoundError(errno.ENOENT, f"{path} was taken over by another process (a restart "
                                        "adopted it); it is no checkpoint any more", path)
            # A private (copy-on-write) map gives a writable buffer torch accepts without ever
            # writing to the file; pages are shared with the page cache until touched.
            mm = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
            if self.hold_reads:
                self._mapped_while_linked(f.fileno(), path, mm)
        # The whole shard is read (checksums, then copies): start reading all of it from disk now,
        # in large requests, instead of page fault by page fault with a small readahead window.
        if hasattr(mmap, "MADV_WILLNEED"):
            mm.madvise(mmap.MADV_WILLNEED)
        return memoryview(mm)

    @staticmethod
    def _mapped_while_linked(fd: int, path: str, mm: mmap.mmap) -> None:
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

    def write_small(self, rel: str, data: bytes, *, create_only: bool = False) -> None:
        """Atomic and durable (:func:`~nebula_ckpt.storage.atomic.write_file_atomic`)."""
        write_file_atomic(self._p(rel), data, create_only=create_only, mode=self._file_mode, fsync=self.fsync,
                          dir_mode=self._dir_mode)

    def read_small(self, rel: str) -> bytes:
        with _open_nofollow(self._p(rel)) as f:
            return f.read()

    def list(self, rel_dir: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self._p(rel_dir)))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            log.warning("nebula_ckpt: %s", e.strerror)
            return []  # a linked folder is not ours: nothing to list

    def exists(self, rel: str) -> bool:
        try:
            return os.path.exists(self._p(rel))
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            log.warning("nebula_ckpt: %s", e.strerror)
            return False  # behind a link: not ours, so not there (said, as list() does)

    def size(self, rel: str) -> int:
        return os.stat(self._p(rel)).st_size

    def remove(self, rel: str) -> None:
        head, _, name = rel.rpartition("/")
        parent = self._p(head)
        try:
            os.unlink(os.path.join(parent, name))  # unlink never follows a link: it removes the link
        except FileNotFoundError:
            pass
        else:
            if self.fsync:
                fsync_dir(parent)

    def remove_dir(self, rel: str) -> None:
        if rel:
            parent = self._p(rel.rpartition("/")[0])
            path = os.path.join(parent, rel.rpartition("/")[2])
            if os.path.islink(path):  # a planted link: remove the link, never what it points to
                os.unlink(path)
                return
        shutil.rmtree(self._p(rel), ignore_errors=True)

    def remove_empty_dir(self, rel: str) -> None:
        """``rmdir``: the folder goes only when empty; a missing or non-empty one is left as it is."""
        head, _, name = rel.rpartition("/")
        parent = self._p(head)
        try:
            os.rmdir(os.path.join(parent, name))  # never follows a link: ENOTDIR for one
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise
        else:
            if self.fsync:
                fsync_dir(parent)

    def local_path(self, rel: str) -> str:
        """Absolute path of ``rel`` (checked like every other path: no links, no ``..``)."""
        return self._p(rel)
