"""The on-disk format: directory names, the manifest and the commit marker.

A checkpoint of step N on a tier is the folder ``step-N/`` holding::

    shard-g<G>-r<R>.safetensors   tensor bytes (safetensors layout, openable by any tool)
    manifest.json                 format version, step, tensor index with checksums, typed tree
    COMMIT                        written last; names the manifest's size and CRC32C

``G`` is the writer generation (see :mod:`nebula_ckpt.fencing`), ``R`` the rank. A folder
without ``COMMIT`` is not a checkpoint: readers ignore it and writers clean it up.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any, Optional

from .errors import CorruptCheckpointError

FORMAT = "nebula_ckpt"
VERSION = 1
MANIFEST = "manifest.json"
COMMIT = "COMMIT"
_STEP_RE = re.compile(r"^step-(\d+)$")


def step_dir(step: int) -> str:
    """Folder name of ``step``."""
    return f"step-{step}"


def parse_step_dir(name: str) -> Optional[int]:
    """``"step-42"`` -> 42; anything else -> None."""
    m = _STEP_RE.match(name.rstrip("/"))
    return int(m.group(1)) if m else None


def shard_name(generation: int, rank: int = 0) -> str:
    """File name of a shard."""
    return f"shard-g{generation}-r{rank}.safetensors"


def shard_generation(name: str) -> Optional[int]:
    """Writer generation encoded in a shard file name, or None."""
    m = re.match(r"^shard-g(\d+)-r\d+\.safetensors", name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Commit:
    """Content of the ``COMMIT`` marker."""

    step: int
    generation: int
    manifest_bytes: int
    manifest_crc32c: int

    def to_bytes(self) -> bytes:
        """Serialise."""
        return json.dumps({"format": FORMAT, "version": VERSION, "step": self.step,
                           "generation": self.generation, "manifest_bytes": self.manifest_bytes,
                           "manifest_crc32c": self.manifest_crc32c, "time": time.time()}).encode()

    @staticmethod
    def parse(data: bytes, where: str) -> "Commit":
        """Parse; raise :class:`CorruptCheckpointError` naming ``where``."""
        try:
            d = json.loads(data)
            return Commit(int(d["step"]), int(d["generation"]), int(d["manifest_bytes"]),
                          int(d["manifest_crc32c"]))
        except Exception as e:
            raise CorruptCheckpointError(f"{where}: commit marker is unreadable ({e})") from None


def build_manifest(*, step: int, generation: int, shards: list[dict[str, Any]],
                   tensors: dict[str, dict[str, Any]], aliases: dict[str, str], tree: Any,
                   stats: dict[str, Any]) -> dict[str, Any]:
    """The manifest dict (see the README's format section)."""
    return {"format": FORMAT, "version": VERSION, "step": step, "generation": generation,
            "time": time.time(), "checksum": "crc32c", "shards": shards, "tensors": tensors,
            "aliases": aliases, "tree": tree, "stats": stats}


def parse_manifest(data: bytes, where: str) -> dict[str, Any]:
    """Parse and sanity-check a manifest; raise :class:`CorruptCheckpointError` naming ``where``."""
    try:
        m = json.loads(data)
    except Exception as e:
        raise CorruptCheckpointError(f"{where}: manifest is not valid JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{where}: not a nebula_ckpt manifest")
    if int(m.get("version", 0)) > VERSION:
        raise CorruptCheckpointError(f"{where}: manifest version {m.get('version')} is newer than this "
                                     f"nebula_ckpt understands ({VERSION}); upgrade nebula_ckpt")
    for k in ("step", "shards", "tensors", "tree"):
        if k not in m:
            raise CorruptCheckpointError(f"{where}: manifest lacks '{k}'")
    return m
