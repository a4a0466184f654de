"""A read-only storage whose files are buffers in this process's memory, over another storage.

A memory-tier copy pulled from a partner at restore is received into anonymous memory and
checked there (:mod:`~nebula_ckpt.tiers.memory.replica_pull`); the restore then reads it as if it
were in the memory tier: :class:`BufferStorage` serves those files from the buffers and every other
path from the tier's own storage (its other steps stay visible). Nothing can be written through
it. Its buffers are this process's alone, so a restore may hand them out as its tensors instead
of copying them (:mod:`~nebula_ckpt.tiers.memory.adopt_memory`).
"""

from __future__ import annotations

import builtins
import errno
from typing import Any, Optional

import torch

from nebula_ckpt.storage.base import MAX_SMALL_BYTES, Buffer, Storage, too_large


class BufferStorage(Storage):
    """Files ``rel -> uint8 tensor`` in memory, read-only, over ``base`` (None: nothing else).

    Args:
        files: the files, by path relative to the root (``"step-7/manifest.json"``).
        base: the storage every other path is read from.
        what: how messages name these files (``"step 7 pulled from rank 2"``).
    """

    def __init__(self, files: dict[str, torch.Tensor], base: Optional[Storage] = None, what: str = "in memory") -> None:
        self._files = dict(files)
        self._base = base
        self.display_url = f"{base.display_url} ({what})" if base is not None else what

    def _mine(self, rel: str) -> bool:
        """Whether ``rel`` lies in a folder these buffers hold (that folder of the base is hidden:
        a damaged copy of the same step there is never read instead)."""
        top = rel.strip("/").split("/", 1)[0]
        return any(p.split("/", 1)[0] == top for p in self._files)

    # -- reading ------------------------------------------------------------------------------------
    def read_buffer(self, rel: str, info: Optional[dict[str, Any]] = None, *,
                    expected_bytes: Optional[int] = None) -> Buffer:
        """The bytes of ``rel`` (no copy; never a file mapping, so no ``madvise`` reaches them)."""
        t = self._files.get(rel)
        if t is None:
            return self._need_base(rel).read_buffer(rel, info, expected_bytes=expected_bytes)
        if set(info or {}) - {"stored_bytes"}:
            raise OSError(errno.EINVAL, f"{self.display_url}: {rel} is held as stored, not encoded ({info})")
        return t.numpy().data

    def read_small(self, rel: str, max_bytes: int = MAX_SMALL_BYTES) -> bytes:
        t = self._files.get(rel)
        if t is None:
            return self._need_base(rel).read_small(rel, max_bytes)
        if t.numel() > max_bytes:
            raise too_large(f"{self.display_url}: {rel}", int(t.numel()), max_bytes)
        return t.numpy().tobytes()

    def list(self, rel_dir: str = "") -> builtins.list[str]:
        rel_dir = rel_dir.strip("/")
        prefix = f"{rel_dir}/" if rel_dir else ""
        mine = {p[len(prefix):].split("/", 1)[0] for p in self._files if p.startswith(prefix)}
        base = self._base.list(rel_dir) if self._base is not None and not (rel_dir and self._mine(rel_dir)) else []
        return sorted(set(base) | mine)

    def exists(self, rel: str) -> bool:
        if rel in self._files or any(p.startswith(rel.strip("/") + "/") for p in self._files):
            return True
        return self._base is not None and not self._mine(rel) and self._base.exists(rel)

    def size(self, rel: str) -> int:
        t = self._files.get(rel)
        return self._need_base(rel).size(rel) if t is None else int(t.numel())

    def local_path(self, rel: str) -> Optional[str]:
        """None for a buffer (it is no file); the base's path otherwise."""
        if self._base is None or self._mine(rel):
            return None
        return self._base.local_path(rel)

    def _need_base(self, rel: str) -> Storage:
        if self._base is None or self._mine(rel):
            raise FileNotFoundError(errno.ENOENT, f"{self.display_url}: no file {rel}", rel)
        return self._base

    # -- writing: refused ---------------------------------------------------------------------------
    def _refuse(self, rel: str) -> OSError:
        return PermissionError(errno.EROFS, f"{self.display_url} is read-only (writing {rel})", rel)

    def write_buffer(self, rel: str, data: Buffer) -> dict[str, Any]:
        raise self._refuse(rel)

    def write_small(self, rel: str, data: bytes, *, create_only: bool = False) -> None:
        raise self._refuse(rel)

    def remove(self, rel: str) -> None:
        raise self._refuse(rel)

    def remove_dir(self, rel: str) -> None:
        raise self._refuse(rel)

    def close(self) -> None:
        """Drop the buffers (the base is not this storage's to close)."""
        self._files.clear()
