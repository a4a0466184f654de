"""The removal record: ``remove()`` of a committed step that later steps still refer to.

An incremental checkpoint refers to an earlier step's shard for its unchanged tensors, so
``Checkpointer.remove`` of such a base keeps it (listed, restorable) until nothing refers to it.
That request lives on the tier, in the step's own folder, so that it outlives the process that
made it (a close, a crash): ``step-N/REMOVED``, written atomically and durably (tmp + fsync +
rename, or a new object) before ``remove()`` returns::

    {"format": "nebula_ckpt.removal", "version": 1, "step": N, "generation": G, "save": S,
     "manifest_bytes": B, "manifest_crc32c": C, "time": T}

It names the very commit it removes: the ``generation``, ``save``, ``manifest_bytes`` and
``manifest_crc32c`` of the step's ``COMMIT`` (``save`` absent where the marker has none). A
request applies only while the step's marker names those (:meth:`Removal.matches`): a later save
that commits the same step number again (a run that went back to an earlier step) is never deleted
by an old request, nor is one whose marker cannot be read. A record that is missing, unreadable,
no regular file, too large (over :data:`MAX_REMOVAL_BYTES`), of a newer ``version`` or of another step is no
request (nothing is deleted on the strength of it); the step's folder goes with the step, the
record with it. Every deletion on the tier (retention, ``remove()``) honours the requests
(:class:`nebula_ckpt.save.sweep.Removals`).
"""

from __future__ import annotations

import errno
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from nebula_ckpt.errors import CorruptCheckpointError
from nebula_ckpt.format.checks import as_int, as_step, bad, load_object, only_fields
from nebula_ckpt.format.commit import Commit
from nebula_ckpt.format.names import REMOVED, step_dir

if TYPE_CHECKING:
    from nebula_ckpt.storage.base import Storage

log = logging.getLogger(__name__)

REMOVAL_FORMAT = "nebula_ckpt.removal"
REMOVAL_VERSION = 1
#: the largest removal record a reader reads (one is some 200 bytes)
MAX_REMOVAL_BYTES = 4096
_FIELDS = ("format", "version", "step", "generation", "save", "manifest_bytes", "manifest_crc32c", "time")


@dataclass(frozen=True)
class Removal:
    """A ``remove()`` request for one commit of ``step`` (the fields of its ``COMMIT``)."""

    step: int
    generation: int
    save: Optional[int]
    manifest_bytes: int
    manifest_crc32c: int

    @staticmethod
    def of(commit: "Commit") -> "Removal":
        """The request to remove the checkpoint ``commit`` commits."""
        return Removal(commit.step, commit.generation, commit.save, commit.manifest_bytes, commit.manifest_crc32c)

    def matches(self, commit: Optional["Commit"]) -> bool:
        """Whether ``commit`` (a step's marker; None: unreadable) is the commit this request removes."""
        return commit is not None and Removal.of(commit) == self

    def to_bytes(self) -> bytes:
        """Serialise (checked by :meth:`parse` before it is written: see :func:`write_removal`): the
        fields of the commit it removes, as a removal record."""
        return Commit(self.step, self.generation, self.manifest_bytes, self.manifest_crc32c,
                      self.save).to_bytes(REMOVAL_FORMAT, REMOVAL_VERSION)

    @staticmethod
    def parse(data: bytes, where: str, step: int) -> "Removal":
        """Parse the record of ``step``'s folder.

        Raises:
            CorruptCheckpointError: not a removal record of ``step`` this version reads, naming
                ``where`` and the field.
        """
        w = f"{where}: {REMOVED}"
        d = load_object(data, w, "a removal record")
        if d.get("format") != REMOVAL_FORMAT:
            raise bad(w, f"format must be {REMOVAL_FORMAT!r}")
        version = as_int(d.get("version"), w, "version", lo=1)
        if version > REMOVAL_VERSION:
            raise bad(w, f"version {version} is newer than this nebula_ckpt reads ({REMOVAL_VERSION})",
                      "upgrade nebula_ckpt")
        only_fields(d, _FIELDS, w, "the removal record")
        got = as_step(d.get("step"), w)
        if got != step:
            raise bad(w, f"names step {got}, not the step of its folder ({step})")
        save, stamp = d.get("save"), d.get("time", 0.0)
        if type(stamp) not in (int, float):
            raise bad(w, f"time must be a number, got {type(stamp).__name__}")
        return Removal(got, as_int(d.get("generation"), w, "generation"), None if save is None else
                       as_int(save, w, "save"), as_int(d.get("manifest_bytes"), w, "manifest_bytes"),
                       as_int(d.get("manifest_crc32c"), w, "manifest_crc32c", hi=2**32 - 1))


def removal_path(step: int) -> str:
    """The path of ``step``'s removal record relative to the tier root."""
    return f"{step_dir(step)}/{REMOVED}"


def write_removal(storage: "Storage", removal: Removal) -> None:
    """Record ``removal`` in its step's folder (atomic and durable: ``Storage.write_small``).

    Raises:
        CorruptCheckpointError: the record would not read back as written (nothing written).
        OSError and others: the storage's errors, as they come.
    """
    raw = removal.to_bytes()
    if Removal.parse(raw, f"{storage.display_url} step {removal.step}", removal.step) != removal:
        raise CorruptCheckpointError(f"{storage.display_url} step {removal.step}: the removal record does not "
                                     "read back as written")
    storage.write_small(removal_path(removal.step), raw)


def read_removal(storage: "Storage", step: int) -> Optional[Removal]:
    """``step``'s removal record on ``storage``; None when there is none, or none that reads (a
    garbled, oversized or newer one is no request: logged by the caller's ``where``).

    Raises:
        OSError (but FileNotFoundError, and ELOOP: a planted link, never followed): the storage's
            errors (an unreachable tier): the caller then deletes nothing on the strength of it.
    """
    where = f"{storage.display_url} step {step}"
    try:
        return Removal.parse(storage.read_small(removal_path(step), MAX_REMOVAL_BYTES), where, step)
    except FileNotFoundError:
        return None
    except CorruptCheckpointError as e:
        log.warning("nebula_ckpt: %s: its removal record is ignored, the step is kept (%s)", where, e)
        return None
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        log.warning("nebula_ckpt: %s: its removal record is a link, ignored: the step is kept (%s)", where, e)
        return None
