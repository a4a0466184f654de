"""Pointer files: what a framework sees at a checkpoint path when the bytes live in our tiers.

Lightning and DeepSpeed check, glob and list their checkpoint paths themselves, so their adapters
write a small record at each path (which root, step and tag hold the checkpoint) and read it back
on load. One format family per adapter (``nebula_ckpt.<adapter>/<version>``); anything else at a
path (a ``torch.save`` file) is not a pointer and is loaded the framework's own way.

The file is a ``torch.save`` archive (a zip whose ``data.pkl`` is a call of the adapter's
``open_pointer(record)``), so the tools that open checkpoint files with ``torch.load`` themselves
(``LightningModule.load_from_checkpoint``, DeepSpeed's ``zero_to_fp32.py``) get the checkpoint it
names (with ``weights_only=False``, or once the adapter's ``open_pointer`` is an allowed global),
or torch's refusal naming ``nebula_ckpt...open_pointer``. Reading a pointer here never runs it:
the record is taken from the call's argument by an unpickler that knows no other name. Pointers
written as plain JSON (earlier versions) are read as before.

A run folder moves (``mv``, ``cp -r``): a pointer records the root's absolute path and, when the
root and the pointer share a folder below ``/``, the root's path relative to the pointer's folder
(``root_rel``), which is tried first (:func:`candidate_roots`).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pickle
import stat
import sys
import zipfile
from typing import Any, Callable, Optional

import torch

from nebula_ckpt.adapters import MAX_STEP, canonical_root, write_file_atomic
from nebula_ckpt.errors import ValidationError

#: a pointer is a kilobyte or two; anything larger at a path is some other file
MAX_POINTER_BYTES = 64 << 10
#: the suffix of a pointer file being written (a crash may leave one): never a pointer itself
TMP_SUFFIX = ".nebula-tmp"
#: the longest file or folder name (bytes) Linux file systems take (NAME_MAX)
NAME_MAX = 255
#: the name of the function a pointer's pickle calls (in the adapter's module)
OPENER = "open_pointer"
#: the fields of a pointer that record a step (Lightning's ``prev_step``: the step it replaced)
STEP_FIELDS = ("step", "prev_step")
_ZIP_MAGIC = b"PK\x03\x04"


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


class _Call:
    """What a pointer's pickle builds here instead of calling the adapter: the call's arguments."""

    def __init__(self, *args: Any) -> None:
        self.args = args


class _RecordUnpickler(pickle.Unpickler):
    """Knows one name, an adapter's ``open_pointer``, and never calls it; anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("nebula_ckpt.integrations.") and name == OPENER:
            return _Call
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("a pointer holds no tensors")


def _record_in_archive(data: bytes) -> Any:
    """The record a pointer archive's ``data.pkl`` passes to ``open_pointer``, or None."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            names = [n for n in z.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
            if len(names) != 1:
                return None
            call = _RecordUnpickler(io.BytesIO(z.read(names[0]))).load()
    except (zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError, OSError):
        return None
    return call.args[0] if isinstance(call, _Call) and len(call.args) == 1 else None


def parse_pointer(data: bytes, path: str, fmt: str, fields: dict[str, type]) -> Optional[dict[str, Any]]:
    """The pointer record in ``data`` (read from ``path``), or None when it is not one of ``fmt``'s
    family (``"nebula_ckpt.lightning/1"``: family ``nebula_ckpt.lightning/``): a pointer archive
    or a JSON pointer of an earlier version.

    Raises:
        ValidationError: a pointer of the family with another version, a missing / mistyped
            field in ``fields`` (name -> type) or a step no save takes (:func:`check_steps`),
            naming the file and the field.
    """
    if len(data) > MAX_POINTER_BYTES:
        return None
    if data.startswith(_ZIP_MAGIC):
        ptr = _record_in_archive(data)
    elif data.lstrip().startswith(b"{"):
        try:
            ptr = json.loads(data)
        except (UnicodeDecodeError, ValueError, RecursionError):  # nested past the parser's stack: no pointer
            return None
    else:
        return None
    return check_record(ptr, path, fmt, fields)


def check_record(ptr: Any, path: str, fmt: str, fields: dict[str, type]) -> Optional[dict[str, Any]]:
    """``ptr`` when it is a pointer record of ``fmt`` (see :func:`parse_pointer`), None when it is
    not one of ``fmt``'s family.

    Raises:
        ValidationError: as :func:`parse_pointer`.
    """
    family = fmt.rsplit("/", 1)[0] + "/"
    if not isinstance(ptr, dict) or not str(ptr.get("format", "")).startswith(family):
        return None
    if ptr["format"] != fmt:
        raise ValidationError(f"{path}: pointer format {ptr['format']!r} is not {fmt!r} (written by a newer "
                              "nebula_ckpt? upgrade it)")
    for name, typ in fields.items():
        if type(ptr.get(name)) is not typ:
            raise ValidationError(f"{path}: pointer field {name!r} must be a {typ.__name__}, got {ptr.get(name)!r}")
    rel = ptr.get("root_rel")
    if rel is not None and not isinstance(rel, str):
        raise ValidationError(f"{path}: pointer field 'root_rel' must be a str, got {rel!r}")
    check_steps(ptr, path)
    return ptr


def check_steps(record: dict[str, Any], path: str) -> None:
    """Refuse a step field of ``record`` (a pointer read at ``path``: :data:`STEP_FIELDS`) that is
    not an int in ``[0, MAX_STEP]``, what a save takes: no step a pointer records is acted on or
    shown (a huge int's ``str`` raises) unless a save could have written it.

    Raises:
        ValidationError: naming the file, the field and the range.
    """
    for name in STEP_FIELDS:
        v = record.get(name, 0)
        if type(v) is not int or not 0 <= v <= MAX_STEP:
            shown = f"an int of {v.bit_length()} bits" if type(v) is int and abs(v) > MAX_STEP else f"{v!r:.60}"
            raise ValidationError(f"{path}: pointer field {name!r} must be a step, an int in [0, {MAX_STEP}], got "
                                  f"{shown}: not a pointer nebula_ckpt wrote (remove it, or save that checkpoint "
                                  "again)")


class _Redirect:
    """Pickled as the call ``opener(record)``: what ``torch.load`` of a pointer file runs."""

    def __init__(self, opener: Callable[[dict[str, Any]], Any], record: dict[str, Any]) -> None:
        self.opener, self.record = opener, record

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.opener, (self.record,)


def encode_pointer(pointer: dict[str, Any], opener: Callable[[dict[str, Any]], Any]) -> bytes:
    """The bytes of a pointer file: a ``torch.save`` archive of the call ``opener(pointer)``
    (``opener``: the adapter's module-level ``open_pointer``; ``pointer``: str / int / None values)."""
    if getattr(opener, "__name__", None) != OPENER or not opener.__module__.startswith("nebula_ckpt.integrations."):
        raise ValueError(f"a pointer's opener is an adapter's {OPENER}, not {opener!r}")
    buf = io.BytesIO()
    torch.save(_Redirect(opener, pointer), buf)
    return buf.getvalue()


def write_local_pointer(path: str, data: bytes, mode: Optional[int] = None) -> None:
    """Write the pointer file ``data`` (:func:`encode_pointer`) at the local ``path`` atomically:
    a temporary file in the same folder (never matching a ``*.ckpt`` / ``*.pt`` glob), fsync'd,
    renamed over ``path``, folder fsync'd.

    ``mode``: the file's permissions (default: as ``open`` would make it, under the umask).
    """
    # ``mode`` None: 0o666 less the umask, as ``open`` makes files; a folder that cannot be fsync'd
    # (some network file systems) leaves the pointer in place all the same
    write_file_atomic(path, data, mode=0o666 if mode is None else mode, exact_mode=mode is not None,
                      strict_dir_fsync=False, tmp_suffix=TMP_SUFFIX)


def _is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def _local(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


def relative_root(root: str, pointer_path: str) -> Optional[str]:
    """``root`` (canonical) relative to the folder of the pointer at ``pointer_path``, when both
    are local and share a folder below ``/`` (a run folder holding the root and the checkpoint
    paths: it may be moved or copied whole); else None."""
    if not (_is_local(root) and _is_local(pointer_path)):
        return None
    root = os.path.realpath(_local(root))
    folder = os.path.realpath(os.path.dirname(os.path.abspath(_local(pointer_path))))
    if os.path.commonpath([root, folder]) == os.path.sep:
        return None
    return os.path.relpath(root, folder)


def candidate_roots(ptr: dict[str, Any], pointer_path: Optional[str]) -> list[str]:
    """The roots a pointer read at ``pointer_path`` may mean, most likely first: its ``root_rel``
    resolved from where the pointer is now (the run folder moved or copied), when that folder
    exists, then the absolute ``root`` it was written with."""
    out = []
    rel = ptr.get("root_rel")
    if rel and pointer_path is not None and _is_local(pointer_path):
        folder = os.path.dirname(os.path.abspath(_local(pointer_path)))
        here = os.path.realpath(os.path.join(folder, rel))
        if os.path.isdir(here):
            out.append(here)
    if ptr["root"] not in out:
        out.append(ptr["root"])
    return out


def loading_path() -> Optional[str]:
    """The path of the file ``torch.load`` is reading, when an adapter's ``open_pointer`` runs
    inside it (found on the caller's stack: its ``f`` argument, or that file object's name);
    None when not known (a buffer). Only used to resolve a moved run folder's ``root_rel``."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "load" and code.co_filename.endswith(os.path.join("torch", "serialization.py")):
            f = frame.f_locals.get("f")
            for cand in (f, getattr(f, "path", None), getattr(f, "name", None)):
                if isinstance(cand, (str, os.PathLike)):
                    return os.fspath(cand)
            return None
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _any_record(path: str) -> Optional[dict[str, Any]]:
    """The record of the pointer file ``path`` of any adapter, or None (not a pointer, unreadable)."""
    try:
        data = read_pointer_head(path)
    except (OSError, ValidationError):
        return None
    if len(data) > MAX_POINTER_BYTES:
        return None
    if data.startswith(_ZIP_MAGIC):
        ptr = _record_in_archive(data)
    else:
        try:
            ptr = json.loads(data) if data.lstrip().startswith(b"{") else None
        except (UnicodeDecodeError, ValueError, RecursionError):  # nested past the parser's stack: no pointer
            return None
    ok = isinstance(ptr, dict) and str(ptr.get("format", "")).startswith("nebula_ckpt.")
    return ptr if ok and isinstance(ptr.get("root"), str) else None


def _is_root(folder: str) -> bool:
    """Whether ``folder`` looks like a Checkpointer root (its ``_nebula`` folder or a ``step-<N>`` folder)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    return "_nebula" in names or any(n.startswith("step-") and n[5:].isdigit() for n in names)


def find_roots(path: str, depth: int = 2) -> list[str]:
    """The checkpoint roots ``path`` refers to, for tools given a framework's path (``nebula-ckpt ls``):

    * a pointer file (Lightning's ``last.ckpt``, a DeepSpeed ``mp_rank_00_model_states.pt``): the
      root it names (where its run folder is now, if it moved);
    * a root itself: ``[path]``;
    * a folder holding pointer files within ``depth`` levels (Lightning's ``dirpath``, a DeepSpeed
      save folder and its tag folders) or roots (a Hugging Face ``output_dir`` and its ``nebula``
      root): every root they name.

    Roots come once each (canonical form), in the order found; ``[]`` when nothing refers to one.
    """
    path = _local(os.fspath(path))
    if os.path.isfile(path):
        ptr = _any_record(path)
        return [] if ptr is None else [canonical_root(candidate_roots(ptr, path)[0])]
    if not os.path.isdir(path):
        return []
    if _is_root(path):
        return [os.path.realpath(path)]
    found: list[str] = []
    for dirpath, dirs, files in os.walk(path):
        level = os.path.relpath(dirpath, path).count(os.sep) + (dirpath != path)
        dirs.sort()
        for d in list(dirs):
            if _is_root(os.path.join(dirpath, d)):
                dirs.remove(d)  # a root's own files are not pointers
                found.append(os.path.realpath(os.path.join(dirpath, d)))
        for name in sorted(files):
            p = os.path.join(dirpath, name)
            try:
                if name.endswith(TMP_SUFFIX) or os.path.getsize(p) > MAX_POINTER_BYTES:
                    continue
            except OSError:
                continue  # a dangling link
            ptr = _any_record(p)
            if ptr is not None:
                found.append(canonical_root(candidate_roots(ptr, p)[0]))
        if level >= depth:
            dirs.clear()
    return list(dict.fromkeys(found))


def find_root(path: str) -> str:
    """The one root a command line's ``ROOT`` argument means (``nebula-ckpt ls last.ckpt``):
    ``path`` itself when it is a root, a URL, or refers to no root; else the root
    :func:`find_roots` finds.

    Raises:
        ValidationError: ``path`` refers to several roots (named, to pick one).
    """
    if "://" in path and not path.startswith("file://"):
        return path
    roots = find_roots(path)
    if not roots or (os.path.isdir(_local(path)) and _is_root(_local(path))):
        return path
    if len(roots) > 1:
        raise ValidationError(f"{path} refers to {len(roots)} checkpoint roots: {', '.join(roots)}; give one of them")
    return roots[0]
