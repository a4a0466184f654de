"""Pointer files: what a framework sees at a checkpoint path when the bytes live in our tiers.

Lightning and DeepSpeed check, glob and list their checkpoint paths themselves, so their adapters
write a small JSON record at each path (which root, step and tag hold the checkpoint) and read it
back on load. One format family per adapter (``nebula_ckpt.<adapter>/<version>``); anything else
at a path (a ``torch.save`` file) is not a pointer and is loaded the framework's own way.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from typing import Any, Optional

from nebula_ckpt import write_file_atomic
from nebula_ckpt.errors import ValidationError

#: a pointer is a few hundred bytes; anything larger at a path is some other file
MAX_POINTER_BYTES = 64 << 10
#: the suffix of a pointer file being written (a crash may leave one): never a pointer itself
TMP_SUFFIX = ".nebula-tmp"
#: the longest file or folder name (bytes) Linux file systems take (NAME_MAX)
NAME_MAX = 255


def safe_name(name: str, limit: int = NAME_MAX) -> str:
    """``name`` as one path component of at most ``limit`` bytes (UTF-8): unchanged when it fits,
    else its head (never cut inside a character), ``~`` and a hash of the whole name, so two
    long names that share a head still differ. Whatever names the file (a tag) stays in its content.
    """
    raw = name.encode("utf-8", "surrogateescape")
    if len(raw) <= limit:
        return name
    digest = "~" + hashlib.sha256(raw).hexdigest()[:32]
    head = raw[: max(0, limit - len(digest))].decode("utf-8", "ignore")  # "ignore": drop a split character
    return head + digest


def read_pointer_head(path: str) -> bytes:
    """The first ``MAX_POINTER_BYTES + 1`` bytes of the local file ``path`` (symlinks followed,
    as a framework's ``last.ckpt`` link is), never blocking: a FIFO, socket or device at ``path``
    is refused instead of being read.

    Raises:
        FileNotFoundError / IsADirectoryError / NotADirectoryError: as ``open``.
        ValidationError: ``path`` is not a regular file (named, with what it is).
        OSError: ``ELOOP`` for a symlink loop, naming the path.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, f"{path}: a loop of symbolic links, not a checkpoint file (remove it)",
                          path) from None
        raise
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        if not stat.S_ISREG(st.st_mode):
            raise ValidationError(f"{path} is not a regular file (mode {stat.filemode(st.st_mode)}): a checkpoint "
                                  "path holds a file; refusing to read it")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(MAX_POINTER_BYTES + 1)
    finally:
        os.close(fd)


def parse_pointer(data: bytes, path: str, fmt: str, fields: dict[str, type]) -> Optional[dict[str, Any]]:
    """The pointer record in ``data`` (read from ``path``), or None when it is not one of ``fmt``'s
    family (``"nebula_ckpt.lightning/1"``: family ``nebula_ckpt.lightning/``).

    Raises:
        ValidationError: a pointer of the family with another version or a missing / mistyped
            field in ``fields`` (name -> type), naming the file and the field.
    """
    if len(data) > MAX_POINTER_BYTES or not data.lstrip().startswith(b"{"):
        return None
    try:
        ptr = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        return None
    family = fmt.rsplit("/", 1)[0] + "/"
    if not isinstance(ptr, dict) or not str(ptr.get("format", "")).startswith(family):
        return None
    if ptr["format"] != fmt:
        raise ValidationError(f"{path}: pointer format {ptr['format']!r} is not {fmt!r} (written by a newer "
                              "nebula_ckpt? upgrade it)")
    for name, typ in fields.items():
        if type(ptr.get(name)) is not typ:
            raise ValidationError(f"{path}: pointer field {name!r} must be a {typ.__name__}, got {ptr.get(name)!r}")
    return ptr


def write_local_pointer(path: str, pointer: dict[str, Any], mode: Optional[int] = None) -> None:
    """Write ``pointer`` at the local ``path`` atomically: a temporary file in the same folder
    (never matching a ``*.ckpt`` / ``*.pt`` glob), fsync'd, renamed over ``path``, folder fsync'd.

    ``mode``: the file's permissions (default: as ``open`` would make it, under the umask).
    """
    data = (json.dumps(pointer, indent=1, sort_keys=True) + "\n").encode()
    # ``mode`` None: 0o666 less the umask, as ``open`` makes files; a folder that cannot be fsync'd
    # (some network file systems) leaves the pointer in place all the same
    write_file_atomic(path, data, mode=0o666 if mode is None else mode, exact_mode=mode is not None,
                      strict_dir_fsync=False, tmp_suffix=TMP_SUFFIX)
