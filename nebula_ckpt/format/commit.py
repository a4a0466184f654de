"""The commit marker: what makes a step folder a checkpoint, and the one listing of checkpoints.

``COMMIT`` is written last, create-only, and names the manifest's size and CRC32C; a folder
without it is not a checkpoint (readers ignore it, writers clean it up). :func:`read_commit` is
the one reader of markers and :func:`committed_steps` the one listing of checkpoints.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nebula_ckpt.errors import CorruptCheckpointError
from nebula_ckpt.format.checks import as_int, as_obj, bad
from nebula_ckpt.format.names import COMMIT, FORMAT, VERSION, parse_step_dir, step_dir

if TYPE_CHECKING:
    from nebula_ckpt.storage.base import Storage


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
        """Parse; raise :class:`CorruptCheckpointError` naming ``where`` and the bad field."""
        try:
            d = json.loads(data)
        except Exception as e:  # RecursionError and UnicodeDecodeError included
            raise bad(where, f"commit marker is unreadable ({type(e).__name__}: {e})") from None
        w = f"{where}: {COMMIT}"
        try:
            d = as_obj(d, w, "the commit marker")
            return Commit(as_int(d.get("step"), w, "step"), as_int(d.get("generation"), w, "generation"),
                          as_int(d.get("manifest_bytes"), w, "manifest_bytes"),
                          as_int(d.get("manifest_crc32c"), w, "manifest_crc32c", hi=2**32 - 1))
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"commit marker is unreadable: {e}") from None


def step_dirs(storage: "Storage") -> list[int]:
    """Steps that have a folder on ``storage`` (committed or not), ascending."""
    return sorted(s for s in (parse_step_dir(n) for n in storage.list("")) if s is not None)


def committed_steps(storage: "Storage") -> list[int]:
    """Steps with a commit marker on ``storage``, ascending (the one listing of checkpoints)."""
    return [s for s in step_dirs(storage) if storage.exists(f"{step_dir(s)}/{COMMIT}")]


def read_commit(storage: "Storage", step: int, where: str) -> Commit:
    """The parsed commit marker of ``step`` on ``storage`` (the one reader of markers).

    Raises:
        FileNotFoundError / OSError: it cannot be read.
        CorruptCheckpointError: it is malformed (naming ``where``).
    """
    return Commit.parse(storage.read_small(f"{step_dir(step)}/{COMMIT}"), where)
