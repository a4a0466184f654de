"""The commit marker: what makes a step folder a checkpoint, and the one listing of checkpoints.

``COMMIT`` is written last, create-only, and names the manifest's size and CRC32C; a folder
without it is not a checkpoint (readers ignore it, writers clean it up). :func:`read_commit` is
the one reader of markers, :func:`committed_steps` the one listing of checkpoints and
:func:`delete_checkpoint` the one removal of one (its marker first).

A marker also names which *write* of the step it commits: the writer generation, and ``save``,
the number of the save in that generation (``save_async`` calls are numbered from 0 by every
rank alike). A step number saved twice in one generation is two writes; the copies of one write
on different tiers and ranks (a rank's memory tier, a partner's replica, the shared tier, a copy
made by ``persist-memory``) carry the same ``(generation, step, save)``, so copies of two writes
are never taken for one (:attr:`Commit.write`). ``save`` is optional (absent: unknown, ``-1``).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from nebula_ckpt.errors import CorruptCheckpointError
from nebula_ckpt.format.checks import as_int, as_obj, bad
from nebula_ckpt.format.names import COMMIT, FORMAT, VERSION, parse_step_dir, step_dir

if TYPE_CHECKING:
    from nebula_ckpt.storage.base import Storage

#: ``(writer generation, step, save number)`` of one write of a step (see :attr:`Commit.write`)
Write = tuple[int, int, int]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Commit:
    """Content of the ``COMMIT`` marker."""

    step: int
    generation: int
    manifest_bytes: int
    manifest_crc32c: int
    #: the number of the save that wrote this step in its generation (None: not recorded)
    save: Optional[int] = None

    @property
    def write(self) -> Write:
        """``(generation, step, save)``: which write of the step this is, in the order a restore
        prefers (newest generation, then step, then the later save of one step; ``-1``: unknown)."""
        return (self.generation, self.step, -1 if self.save is None else self.save)

    def to_bytes(self) -> bytes:
        """Serialise."""
        out: dict[str, Any] = {"format": FORMAT, "version": VERSION, "step": self.step,
                               "generation": self.generation, "manifest_bytes": self.manifest_bytes,
                               "manifest_crc32c": self.manifest_crc32c, "time": time.time()}
        if self.save is not None:
            out["save"] = self.save
        return json.dumps(out).encode()

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
            save = d.get("save")
            return Commit(as_int(d.get("step"), w, "step"), as_int(d.get("generation"), w, "generation"),
                          as_int(d.get("manifest_bytes"), w, "manifest_bytes"),
                          as_int(d.get("manifest_crc32c"), w, "manifest_crc32c", hi=2**32 - 1),
                          None if save is None else as_int(save, w, "save"))
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"commit marker is unreadable: {e}") from None


def step_dirs(storage: "Storage") -> list[int]:
    """Steps that have a folder on ``storage`` (committed or not), ascending."""
    return sorted(s for s in (parse_step_dir(n) for n in storage.list("")) if s is not None)


def committed_steps(storage: "Storage") -> list[int]:
    """Steps with a commit marker on ``storage``, ascending (the one listing of checkpoints)."""
    return [s for s in step_dirs(storage) if storage.exists(f"{step_dir(s)}/{COMMIT}")]


def committed_writes(storage: "Storage") -> list[Write]:
    """The writes ``(generation, step, save)`` committed on ``storage``, ascending (markers that
    cannot be read are left out: no checkpoint of anyone's)."""
    out = []
    for s in committed_steps(storage):
        try:
            out.append(read_commit(storage, s, f"{storage.display_url} step {s}").write)
        except (OSError, CorruptCheckpointError):
            continue
    return sorted(out)


def read_commit(storage: "Storage", step: int, where: str) -> Commit:
    """The parsed commit marker of ``step`` on ``storage`` (the one reader of markers).

    Raises:
        FileNotFoundError / OSError: it cannot be read.
        CorruptCheckpointError: it is malformed (naming ``where``).
    """
    return Commit.parse(storage.read_small(f"{step_dir(step)}/{COMMIT}"), where)


def delete_checkpoint(storage: "Storage", step: int) -> None:
    """Delete a checkpoint: marker first (it stops being listed, and no reader opens it), then its
    data. Several at once: in :func:`~nebula_ckpt.format.references.deletion_order`."""
    d = step_dir(step)
    storage.remove(f"{d}/{COMMIT}")
    log.debug("nebula_ckpt: phase=unlisted %s step %d: its marker is gone; its files go next", storage.display_url,
              step)
    storage.remove_dir(d)
