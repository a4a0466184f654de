"""DeepSpeed's files under :mod:`nebula_ckpt.integrations.deepspeed`: the pointer file left at each
path DeepSpeed saved, what ``torch.load`` of one returns (:func:`open_pointer`), the tag folders
holding them, and :func:`materialize` (real ``torch.save`` files for tools that need them).

This module needs no DeepSpeed: ``torch.load`` of a pointer file imports it (``zero_to_fp32.py``).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from nebula_ckpt import Checkpointer
from nebula_ckpt.adapters import LocalCoordinator, canonical_root, check_tag
from nebula_ckpt.errors import NotFoundError, OtherRanksError, ValidationError
from nebula_ckpt.integrations.pointers import (
    NAME_MAX,
    candidate_roots,
    check_record,
    encode_pointer,
    loading_path,
    parse_pointer,
    read_pointer_head,
    relative_root,
    safe_name,
    write_local_pointer,
)

#: ``format`` field of the record of a pointer file left at each path DeepSpeed saved (its version
#: is the number after the slash)
POINTER_FORMAT = "nebula_ckpt.deepspeed/1"
_FIELDS: dict[str, type] = {"root": str, "tag": str, "key": str, "step": int}


def read_pointer(path: str) -> Optional[dict[str, Any]]:
    """The pointer stored at ``path``, or None when ``path`` holds something else (a torch.save file)."""
    head = read_pointer_head(path)  # never blocks on a FIFO, never follows a symlink loop
    return parse_pointer(head, path, POINTER_FORMAT, _FIELDS)


def write_pointer(path: str, root: str, tag: str, step: int, key: str) -> None:
    """The pointer file of part ``key`` of checkpoint ``tag`` (step ``step``) under ``root``, at ``path``."""
    record: dict[str, Any] = {"format": POINTER_FORMAT, "root": root, "tag": tag, "step": step, "key": key}
    rel = relative_root(root, path)
    if rel is not None:
        record["root_rel"] = rel
    write_local_pointer(path, encode_pointer(record, open_pointer))


def root_of(ptr: dict[str, Any], path: Optional[str]) -> str:
    """The root a pointer read at ``path`` names: where its run folder is now, else where it was written."""
    roots = candidate_roots(ptr, path)
    return roots[0]


def materialize(save_dir: str, tag: Optional[str] = None, *, checkpointer: Optional[Checkpointer] = None) -> list[str]:
    """Replace the pointer files of DeepSpeed checkpoint ``tag`` (default: the one ``save_dir/latest``
    names) by the ``torch.save`` files DeepSpeed would have written, for tools that read them
    directly (``zero_to_fp32.py``, universal checkpoint conversion). Returns the paths written.

    Reads through ``checkpointer`` when given, else opens the root the pointers name (read only).
    In a multi-rank job call it on every rank (the read is collective); each rank writes its parts.
    """
    if tag is None:
        with open(os.path.join(save_dir, "latest")) as f:
            tag = f.read().strip()
    tag_dir = os.path.join(save_dir, tag)
    pointers: dict[str, dict[str, Any]] = {}
    for dirpath, _, files in os.walk(tag_dir):
        for name in files:
            p = os.path.join(dirpath, name)
            ptr = read_pointer(p)
            if ptr is not None:
                pointers[p] = ptr
    if not pointers:
        return []
    roots = {root_of(ptr, p) for p, ptr in pointers.items()}
    tags = {p["tag"] for p in pointers.values()}
    if len(roots) != 1 or len(tags) != 1:
        raise ValidationError(f"{tag_dir}: pointers name several roots / tags: {sorted(roots)} {sorted(tags)}")
    # the root a file names is only read: nothing is created there (not even its folder)
    ck = checkpointer or Checkpointer(roots.pop(), allow_pickle=True, read_only=True)
    try:
        _, tree = ck.read(tag=tags.pop(), map_location="cpu")
        written = []
        for p, ptr in sorted(pointers.items()):
            if ptr["key"] not in tree:
                if ck.coordinator.world_size > 1:
                    continue  # another rank's part: that rank writes it
                raise NotFoundError(f"{p}: checkpoint {ptr['tag']!r} under {ptr['root']} has no part {ptr['key']!r}")
            tmp = os.path.join(os.path.dirname(p), safe_name(f"{os.path.basename(p)}.nebula-tmp-{os.getpid()}"))
            torch.save(tree[ptr["key"]], tmp)
            os.replace(tmp, p)
            written.append(p)
        return written
    finally:
        if checkpointer is None:
            ck.close()


def check_tag_folder(tag: str) -> None:
    """DeepSpeed keeps a tag's files in the folder ``<save_dir>/<tag>``: refuse, before anything is
    written, a (valid) tag whose folder name a file system cannot hold."""
    check_tag(tag)
    long = [c for c in tag.split("/") if len(c.encode()) > NAME_MAX]
    if long:
        raise ValidationError(f"DeepSpeed tag {tag[:40]!r}... ({len(tag)} characters) names the folder "
                              f"<save_dir>/{tag[:20]}...: a folder name longer than {NAME_MAX} bytes, which no file "
                              f"system holds; give save_checkpoint a shorter tag")


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor in it moved to ``device`` (dicts in place; lists, tuples rebuilt)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        for k, v in obj.items():
            obj[k] = to_device(v, device)
        return obj
    if isinstance(obj, list):
        return [to_device(v, device) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(to_device(v, device) for v in obj)
    return obj


def tag_folders(save_dir: str) -> list[str]:
    """The folders directly under ``save_dir`` (DeepSpeed's tag folders and anything else)."""
    try:
        with os.scandir(save_dir) as it:
            return [e.path for e in it if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def pointers_in(folder: str) -> dict[str, dict[str, Any]]:
    """Path -> record of every DeepSpeed pointer file under ``folder`` (other files are skipped)."""
    out = {}
    for dirpath, _, files in os.walk(folder):
        for name in files:
            p = os.path.join(dirpath, name)
            try:
                ptr = read_pointer(p)
            except (OSError, ValidationError):
                continue
            if ptr is not None:
                out[p] = ptr
    return out


def remove_empty_folders(top: str) -> bool:
    """Remove ``top`` and the folders under it that hold nothing; whether ``top`` went."""
    for dirpath, _, _ in sorted(os.walk(top), key=lambda w: -len(w[0])):
        try:
            os.rmdir(dirpath)
        except OSError:
            pass  # not empty: another file (a real torch.save file) stays, with its folder
    return not os.path.exists(top)


#: (root, tag) -> (step, parts not served yet) of the checkpoint open_pointer read last
_OPENED: dict[tuple[str, str], tuple[int, dict[str, Any]]] = {}


def open_pointer(record: dict[str, Any]) -> Any:
    """What ``torch.load(path, weights_only=False)`` of a pointer file returns: the part of the
    checkpoint it names (a pointer's pickle is the call ``open_pointer(record)``), read from its
    root (read only; found where the save folder is now when it moved with its root). So
    ``zero_to_fp32.py`` and DeepSpeed's stock engine read the engine's files (of a one-rank save;
    a multi-rank save needs :func:`materialize` on every rank first). It reads in the calling
    process alone, never with the other ranks, so it never waits for a rank that does not call
    it (DeepSpeed calls ``torch.load`` on one rank or on all, as it likes). Not an allowed
    global of ``weights_only=True``: DeepSpeed's states need pickle (``torch.load`` then refuses
    the file, naming this function). Tensors are on the CPU.
    """
    path = loading_path()
    where = path or "the file torch.load reads"
    ptr = check_record(record, where, POINTER_FORMAT, _FIELDS)
    if ptr is None:
        raise ValidationError(f"{where} is not a NebulaCkptEngine pointer: {record!r}")
    root, tag, key = canonical_root(root_of(ptr, path)), ptr["tag"], ptr["key"]
    if (root, tag) not in _OPENED or key not in _OPENED[(root, tag)][1]:
        _OPENED.clear()
        # this process alone, never a collective: DeepSpeed calls torch.load on whichever ranks it
        # likes (ZeRO-3's load_checkpoint runs zero_to_fp32 on every rank, zero_to_fp32.py in one
        # process), so a rank waiting here for the others could wait for ever
        with Checkpointer(root, allow_pickle=True, read_only=True, coordinator=LocalCoordinator()) as ck:
            try:
                _OPENED[(root, tag)] = ck.read(tag=tag, map_location="cpu")
            except OtherRanksError as e:  # a save by several ranks: no process reads it alone
                raise NotFoundError(f"{where}: checkpoint {tag!r} under {root} cannot be read by this one process: "
                                    f"{e}. A torch.load of a pointer file reads alone; a save by several ranks needs "
                                    "materialize(save_dir, tag) on every rank of the job first (then its files "
                                    "load anywhere)") from e
    step, tree = _OPENED[(root, tag)]
    if not isinstance(tree, dict) or key not in tree:
        raise NotFoundError(f"{where}: checkpoint {tag!r} (step {step}) under {root} has no part {key!r} (another "
                            "rank's part of a multi-rank save, which one process cannot read: run "
                            "materialize(save_dir, tag) on every rank of the job first)")
    part = tree.pop(key)
    if not tree:
        _OPENED.clear()
    return part
