"""The one atomic small-file write on a POSIX file system.

A small file (a manifest, a commit marker, a run record, a memory tier's ``ROOT`` file, a
framework's pointer file) is never written in place: its bytes go to a new temporary file in the
same folder, which is fsync'd and then renamed over the name (or, for a create-only write, hard
linked to it: ``link`` fails if the name exists, atomically), and the folder is fsync'd. A crash
leaves the old file or the new one, never a torn or zero-filled one, and a failed write leaves
no temporary file behind.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import Optional

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
