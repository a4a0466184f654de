"""POSIX file-system storage: local disks, NFS, and ``/dev/shm`` for the memory tier.

Durability: shard data is written with parallel ``pwrite`` (``O_DIRECT`` where allowed) and
fsync'd by the native writer; small files are written by :func:`write_file_atomic` (a temp file
in the same directory, fsync, rename or ``link`` for create-only, directory fsync), so a crash
leaves either the old state or the new one, never a zero-filled file. Who else reads a file (the
memory tier's locks) is :mod:`nebula_ckpt.storage.holds`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import shutil
import stat
import uuid
from typing import Any, Optional

import torch

from nebula_ckpt.errors import CorruptCheckpointError, ValidationError
from nebula_ckpt.native import get_ops
from nebula_ckpt.storage.base import MAX_SMALL_BYTES, Buffer, Storage, too_large
from nebula_ckpt.storage.holds import count_mapping, hold_read

log = logging.getLogger(__name__)


#: what a file that is not a regular one is, by its ``stat`` mode (for messages)
_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _not_regular(path: str, mode: int) -> CorruptCheckpointError:
    kind = next((what for test, what in _KINDS if test(mode)), f"a file of mode {stat.filemode(mode)}")
    return CorruptCheckpointError(f"'{path}' is {kind}, not a regular file: nothing in a checkpoint root but the "
                                  "regular files nebula_ckpt wrote is read (remove it)")


def open_regular_fd(path: str) -> int:
    """A read-only descriptor of the regular file ``path``, refusing a symlink as the last
    component (``ELOOP``); the caller closes it.

    Files in a tier are input: a FIFO (whose ``open`` would wait for a writer forever), a socket,
    a device or a folder where a file belongs is refused before it is opened, and checked again
    on the descriptor (opened non-blocking, so a FIFO swapped in meanwhile cannot block either).

    Raises:
        CorruptCheckpointError: ``path`` is not a regular file (naming it and what it is).
        OSError: as ``open`` (``FileNotFoundError``; ``ELOOP`` for a symlink).
    """
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode) and not stat.S_ISLNK(st.st_mode):  # a link: ELOOP below
        raise _not_regular(path, st.st_mode)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(path, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(path: str) -> Any:
    """``open(path, "rb")`` of a regular file, never blocking and never following a symlink as the
    last component (:func:`open_regular_fd`, whose errors it raises)."""
    fd = open_regular_fd(path)
    try:
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_small_file(path: str, max_bytes: int = MAX_SMALL_BYTES) -> bytes:
    """The content of the regular file ``path`` (a symlink refused), of at most ``max_bytes`` bytes.

    Raises:
        CorruptCheckpointError: ``path`` is not a regular file, or holds more than ``max_bytes``
            bytes (refused before any of it is read: a sparse file of a terabyte costs nothing).
        OSError: as ``open`` (``FileNotFoundError``; ``ELOOP`` for a symlink).
    """
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise too_large(f"'{path}'", size, max_bytes)
        data = f.read(max_bytes + 1)  # never more, should it grow meanwhile
    if len(data) > max_bytes:
        raise too_large(f"'{path}'", len(data), max_bytes)
    return data


# -- the one atomic small-file write -------------------------------------------------------------
#
# A small file (a manifest, a commit marker, a run record, a memory tier's ``ROOT`` file, a
# framework's pointer file) is never written in place: its bytes go to a new temporary file in the
# same folder, which is fsync'd and then renamed over the name (or, for a create-only write, hard
# linked to it: ``link`` fails if the name exists, atomically), and the folder is fsync'd. A crash
# leaves the old file or the new one, never a torn or zero-filled one, and a failed write leaves
# no temporary file behind.

#: the longest file name (bytes) Linux file systems take (NAME_MAX)
NAME_MAX = 255


def fsync_dir(path: "str | os.PathLike[str]") -> None:
    """fsync a folder, so the names created, renamed or removed in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tmp_name(name: str, suffix: str) -> str:
    """``.<name>.<random><suffix>``, within NAME_MAX bytes whatever the length of ``name``."""
    rand = uuid.uuid4().hex[:12]
    room = NAME_MAX - len(rand) - len(suffix.encode()) - 2
    head = name.encode("utf-8", "surrogateescape")[:max(0, room)].decode("utf-8", "ignore")
    return f".{head}.{rand}{suffix}"


def write_file_atomic(path: str, data: bytes, *, create_only: bool = False, mode: int = 0o666,
                      exact_mode: bool = False, fsync: bool = True, strict_dir_fsync: bool = True,
                      dir_mode: Optional[int] = 0o777, tmp_suffix: str = ".tmp") -> None:
    """Write ``data`` as the file ``path``, atomically and (with ``fsync``) durably.

    Args:
        path: the file's path; its folder is created (``dir_mode``) unless ``dir_mode`` is None.
        data: the whole content.
        create_only: raise ``FileExistsError`` (and change nothing) if ``path`` exists.
        mode: the new file's permissions, less the umask (as ``open`` makes files); with
            ``exact_mode``, exactly these (the umask ignored).
        fsync: fsync the file before it gets its name, and the folder after (off for a tmpfs).
        strict_dir_fsync: raise when the folder cannot be fsync'd; False: the file is in place
            all the same (some network file systems refuse a folder's fsync).
        dir_mode: permissions of folders created on the way (less the umask).
        tmp_suffix: ends the temporary file's name (so a framework's glob never matches it).

    Raises:
        FileExistsError: ``create_only`` and ``path`` exists.
        OSError: the write failed; the temporary file is removed and ``path`` is as it was.
    """
    folder = os.path.dirname(os.path.abspath(path))
    if dir_mode is not None:
        os.makedirs(folder, mode=dir_mode, exist_ok=True)
    tmp = os.path.join(folder, _tmp_name(os.path.basename(path), tmp_suffix))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            if exact_mode:
                os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        if create_only:
            os.link(tmp, path)  # atomic; EEXIST if someone else created it first
            os.unlink(tmp)
        else:
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if fsync:
        try:
            fsync_dir(folder)
        except OSError:
            if strict_dir_fsync:
                raise


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
        if isinstance(info, dict) and info.get("compression") is not None:
            return self._read_compressed(path, info, expected_bytes)
        with open_regular(path) as f:
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
                count_mapping(f.fileno(), path, mm)
        # The whole shard is read (checksums, then copies): start reading all of it from disk now,
        # in large requests, instead of page fault by page fault with a small readahead window.
        if hasattr(mmap, "MADV_WILLNEED"):
            mm.madvise(mmap.MADV_WILLNEED)
        return memoryview(mm)

    def _read_compressed(self, path: str, info: dict[str, Any], expected_bytes: Optional[int]) -> Buffer:
        """A shard a compressing remote tier wrote into this folder (a ``file://`` ``RemoteTier``, or
        a bucket copied to disk): its frames decoded as the remote backend decodes them, since the
        storage info alone decides the decoding (:meth:`Storage.read_buffer`)."""
        from nebula_ckpt.storage.remote.frames import download, plan_read  # the remote backends' one decoder

        with open_regular(path) as f:
            fd = f.fileno()
            plan = plan_read(info, os.fstat(fd).st_size, path, part_bytes=1 << 62, concurrency=1,
                             expected_bytes=expected_bytes)

            def corrupt(message: str, op: str) -> BaseException:
                return CorruptCheckpointError(f"{path}: {message} ({op})")
            return download(plan, lambda t: os.pread(fd, t.stored_len, t.stored_off), 1, corrupt)

    def write_small(self, rel: str, data: bytes, *, create_only: bool = False) -> None:
        """Atomic and durable (:func:`~nebula_ckpt.storage.local.write_file_atomic`)."""
        write_file_atomic(self._p(rel), data, create_only=create_only, mode=self._file_mode, fsync=self.fsync,
                          dir_mode=self._dir_mode)

    def read_small(self, rel: str, max_bytes: int = MAX_SMALL_BYTES) -> bytes:
        """The content of ``rel``, a regular file of at most ``max_bytes`` bytes (:func:`read_small_file`)."""
        return read_small_file(self._p(rel), max_bytes)

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
