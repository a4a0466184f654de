"""What :mod:`nebula_ckpt.integrations.lightning` stands on: the Lightning flavours installed, the
tag of a checkpoint path, the pointer file at it, and the file operations the plugin makes on
local paths and URLs.

Public through :mod:`nebula_ckpt.integrations.lightning` (``tag_for_path``, ``read_pointer``,
``write_pointer``, ``POINTER_FORMAT``); the rest serves the plugin.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

from nebula_ckpt import Checkpointer, SaveHandle
from nebula_ckpt.adapters import MAX_TAG_CHARS, LocalCoordinator, canonical_root, check_tag
from nebula_ckpt.errors import NebulaError, NotFoundError, ValidationError
from nebula_ckpt.integrations.inflight import wait_committed, wait_for, writer_alive, writer_identity
from nebula_ckpt.integrations.pointers import (
    MAX_POINTER_BYTES,
    candidate_roots,
    encode_pointer,
    parse_pointer,
    read_pointer_head,
    relative_root,
    write_local_pointer,
)

#: ``format`` field of a pointer record (its version is the number after the slash)
POINTER_FORMAT = "nebula_ckpt.lightning/1"
#: the fields every Lightning pointer record holds, with their types
POINTER_FIELDS: dict[str, type] = {"root": str, "tag": str, "step": int}

_INSTALL_HINT = ("nebula_ckpt.integrations.lightning needs PyTorch Lightning: pip install 'nebula_ckpt[lightning]' "
                 "(pytorch-lightning) or pip install lightning")


def lightning_bases() -> list[tuple[Any, Any]]:
    """``(CheckpointIO, TorchCheckpointIO)`` of each Lightning flavour installed, unified
    ``lightning`` first, then ``pytorch_lightning``'s ``lightning_fabric``."""
    found: list[tuple[Any, Any]] = []
    for pkg in ("lightning.fabric.plugins.io", "lightning_fabric.plugins.io"):
        try:
            base = importlib.import_module(f"{pkg}.checkpoint_io").CheckpointIO
            torch_io = importlib.import_module(f"{pkg}.torch_io").TorchCheckpointIO
        except ImportError:
            continue
        found.append((base, torch_io))
    if not found:
        raise ImportError(_INSTALL_HINT)
    return found


@dataclass
class InFlight:
    """The plugin's one save in flight: its handle, its tag and path, Lightning's global step."""

    handle: SaveHandle
    tag: str
    path: str
    global_step: Optional[int]


#: ``(CheckpointIO, TorchCheckpointIO)`` of each Lightning flavour installed (an ImportError without one)
BASES = lightning_bases()

_TAG_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:@=+,/-")


def tag_for_path(path: str) -> str:
    """The tag a checkpoint saved at ``path`` carries: the absolute path (local paths through the
    real path of their folder, so ``ckpts/x.ckpt`` and ``./ckpts/x.ckpt`` agree; the file name
    itself is kept, so a ``last.ckpt`` symlink is not resolved), URLs as they are.

    Characters a tag cannot hold (and ``~``, the escape character) become ``~XX`` (UTF-8 bytes in
    hex); a result longer than a tag may be becomes ``~h<hash>~`` and its last characters. The
    mapping is deterministic, and injective up to the hash.
    """
    if "://" not in path:
        path = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(os.path.expanduser(path)))),
                            os.path.basename(path))
    out = []
    for ch in path:
        if ch in _TAG_CHARS:
            out.append(ch)
        else:
            out.extend(f"~{b:02x}" for b in ch.encode("utf-8", "surrogateescape"))
    tag = "".join(out)
    if len(tag) > MAX_TAG_CHARS:
        digest = hashlib.sha256(path.encode("utf-8", "surrogateescape")).hexdigest()[:32]
        head = f"~h{digest}~"
        start = len(tag) - (MAX_TAG_CHARS - len(head))
        for back in (1, 2):  # never start inside an escape sequence (3 characters, "~" first)
            if tag[start - back] == "~":
                start += 3 - back
                break
        tag = head + tag[start:]
    check_tag(tag)
    return tag


def _is_trainer(obj: Any) -> bool:
    """Whether ``obj`` is a Lightning ``Trainer`` (either flavour, or a subclass)."""
    return any(c.__name__ == "Trainer" and c.__module__.startswith(("pytorch_lightning.", "lightning.pytorch."))
               for c in type(obj).__mro__)


def in_trainer_stage(names: tuple[str, ...] = ("_run_stage",)) -> bool:
    """Whether the caller runs inside a Lightning Trainer's running stage (``Trainer._run_stage``
    on the stack: the fit / validate / test / predict loop), which the strategy's ``teardown``
    ends. A ``trainer.save_checkpoint`` before or after ``fit``, from ``on_fit_end`` or from an
    exception handler, or a direct call of the plugin, is not. ``names=("_run",)``: inside
    ``Trainer._run``, which restores the ``ckpt_path`` before the stage and tears down after it."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in names and _is_trainer(frame.f_locals.get("self")):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def is_local(path: str) -> bool:
    """A local path (or ``file://`` URL), not a remote URL."""
    return "://" not in path or path.startswith("file://")


def local(path: str) -> str:
    """``path`` without a ``file://`` prefix."""
    return path[len("file://"):] if path.startswith("file://") else path


def fs_of(path: str) -> Any:
    """The fsspec file system of the URL ``path``."""
    import fsspec

    return fsspec.core.url_to_fs(path)[0]


def write_pointer_file(path: str, pointer: dict[str, Any], opener: Callable[[dict[str, Any]], Any]) -> None:
    """Write the pointer file of record ``pointer`` at ``path`` atomically: a local file under a
    temporary name in the same folder, fsync'd and renamed over ``path`` (its temporary name never
    matches Lightning's ``last*.ckpt`` glob); a URL with one PUT (blob stores replace an object
    atomically). ``opener``: what ``torch.load`` of the file calls (the adapter's ``open_pointer``)."""
    data = encode_pointer(pointer, opener)
    if not is_local(path):
        fs = fs_of(path)
        fs.makedirs(os.path.dirname(path), exist_ok=True)
        fs.pipe_file(path, data)
        return
    write_local_pointer(local(path), data)


def read_pointer(path: str) -> Optional[dict[str, Any]]:
    """The pointer record at ``path``, or ``None`` when ``path`` is not one (missing, too large,
    not a pointer: e.g. a ``torch.save`` file). A pointer with our format but bad fields raises
    :class:`NebulaError` naming the field."""
    try:
        if is_local(path):
            data = read_pointer_head(local(path))  # never blocks on a FIFO, never follows a link loop
        else:
            fs = fs_of(path)
            if not fs.exists(path) or fs.size(path) > MAX_POINTER_BYTES:
                return None
            data = fs.cat_file(path)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    ptr = parse_pointer(data, path, POINTER_FORMAT, POINTER_FIELDS)
    if ptr is None:
        return None
    for field in ("tag", "prev_tag"):
        if field in ptr:
            try:
                check_tag(ptr[field])
            except ValidationError as e:
                raise NebulaError(f"{path}: pointer field {field!r}: {e}") from None
    return ptr


def remove_file(path: str) -> None:
    """Delete what is at ``path``, if anything, as Lightning's ``TorchCheckpointIO`` does (fsspec's
    ``rm(path, recursive=True)``): a file (a pointer, a foreign checkpoint) or a link, the link only
    (never its target); a folder (a sharded or DeepSpeed checkpoint) with everything in it, the
    links inside unlinked, never followed out of it."""
    if is_local(path):
        p = local(path)
        if os.path.isdir(p) and not os.path.islink(p):
            if os.path.abspath(p) == os.getcwd():
                raise ValueError(f"{path} is the current working directory: not removed (as Lightning's fsspec)")
            shutil.rmtree(p)  # links inside are unlinked, not followed (fd-based on Linux)
        elif os.path.lexists(p):
            os.remove(p)
        return
    fs = fs_of(path)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def pointer_record(root: str, step: int, tag: str, path: str, checkpoint: dict[str, Any],
                   replaced: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The record of the pointer file of a save at ``path``: step ``step`` of ``root`` tagged ``tag``;
    ``replaced``: the pointer it replaces (whose checkpoint is the path's until this save commits)."""
    record = {"format": POINTER_FORMAT, "root": root, "step": step, "tag": tag, "path": abs_path(path),
              "global_step": plain_int(checkpoint.get("global_step")), "epoch": plain_int(checkpoint.get("epoch")),
              "writer": writer_identity()}  # a reader in another process waits while this one saves
    if replaced is not None:
        record.update(prev_tag=replaced["tag"], prev_step=replaced["step"])
    rel = relative_root(root, path)
    if rel is not None:
        record["root_rel"] = rel
    return record


def nothing_committed(ptr: dict[str, Any], path: str, tried: list[str]) -> NotFoundError:
    """The error of a pointer (``ptr``, read at ``path``) under which no tier holds a committed
    checkpoint (``tried``: what each root answered): the root it names no longer exists, or no
    save of its path ever committed there."""
    roots = candidate_roots(ptr, path)
    if not any(_may_exist(r) for r in roots):
        return NotFoundError(
            f"{path}: the nebula_ckpt root it names, {' or '.join(roots)}, no longer exists (deleted, or moved "
            f"without this file), and no memory tier holds its checkpoint (step {ptr['step']}) any more: put the "
            f"root back where it was (a run folder moves whole: the pointers find their root in it), or remove "
            f"{path} (and the other pointer files naming that root) to start afresh")
    return NotFoundError(f"{path}: no committed checkpoint of this path (its save of step {ptr['step']} never "
                         f"committed and there is no earlier one): {'; '.join(tried)}")


def _may_exist(root: str) -> bool:
    """Whether anything is at ``root`` (True when that cannot be told: a remote store refusing)."""
    try:
        return exists(root)
    except Exception:  # an unreachable store is not proof that the root is gone
        return True


def plain_int(v: Any) -> Optional[int]:
    """``int(v)``, or None when ``v`` is None or not a number."""
    try:
        return int(v) if v is not None else None
    except (TypeError, ValueError):
        return None


def abs_path(path: str) -> str:
    """``path`` as the pointer files record it: local paths absolute (folder resolved, as
    :func:`tag_for_path`), URLs as they are."""
    if is_local(path):
        p = local(path)
        return os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(os.path.expanduser(p)))),
                            os.path.basename(p))
    return path


def folder_of(path: str) -> str:
    """The folder of ``path`` (absolute, as :func:`abs_path`)."""
    return os.path.dirname(abs_path(path))


def small_files(folder: str) -> list[str]:
    """Paths of the files in ``folder`` small enough to be pointers (none when it is missing)."""
    if is_local(folder):
        try:
            with os.scandir(local(folder)) as it:
                # a symlink is not a copy: it names whatever its target names (save_last="link")
                return [os.path.join(folder, e.name) for e in it if e.is_file(follow_symlinks=False)
                        and e.stat(follow_symlinks=False).st_size <= MAX_POINTER_BYTES]
        except OSError:
            return []
    try:
        entries = fs_of(folder).ls(folder, detail=True)
    except (OSError, ValueError):
        return []
    return [e["name"] if "://" in e["name"] else f"{folder.split('://')[0]}://{e['name']}" for e in entries
            if e.get("type") == "file" and (e.get("size") or 0) <= MAX_POINTER_BYTES]


def exists(path: str) -> bool:
    """Whether anything is at the local path or URL ``path``."""
    if is_local(path):
        return os.path.exists(local(path))
    return bool(fs_of(path).exists(path))


def reader(root: str, options: dict[str, Any], own: bool) -> Checkpointer:
    """A read-only Checkpointer on the root a pointer names: it creates nothing there, not even the
    root's folder. ``own``: the plugin's root, read through the plugin's tiers (``options``: the
    plugin's Checkpointer options); else the root's default tiers."""
    o = options
    if own:
        return Checkpointer(root, storage_options=o["storage_options"], tiers=o["tiers"],
                            memory_tier=o["memory_tier"], allow_pickle=o["allow_pickle"],
                            coordinator=LocalCoordinator(), read_only=True)
    return Checkpointer(root, storage_options=o["storage_options"] if not is_local(root) else None,
                        allow_pickle=o["allow_pickle"], coordinator=LocalCoordinator(), read_only=True)


def await_save(ptr: dict[str, Any], path: str, options: dict[str, Any], own_root: str) -> dict[str, Any]:
    """Wait for the save the pointer ``ptr`` (read at ``path``) names while it is in flight: in this
    process (whichever object saves it), or in another live process of this host (see
    :mod:`~nebula_ckpt.integrations.inflight`). Returns the pointer to read: the file again when a
    newer save replaced it meanwhile. ``options``, ``own_root``: the reading plugin's."""
    roots = candidate_roots(ptr, path)
    for root in roots:
        wait_for(canonical_root(root), ptr["tag"])
    if not writer_alive(ptr.get("writer")):
        return ptr
    seen = {"ptr": ptr}
    readers = [reader(r, options, canonical_root(r) == own_root) for r in roots]

    def committed() -> bool:
        now = read_pointer(path)
        if now is not None:
            seen["ptr"] = now
        want = seen["ptr"]["step"]
        return any(want in ck.steps(check_shards=False) for ck in readers)

    try:
        wait_committed(committed, ptr.get("writer"), f"{path} (step {ptr['step']})")
    finally:
        for ck in readers:
            ck.close()
    return seen["ptr"]
