"""The commit marker's record (:class:`Commit`), and which markers this process changed.

``COMMIT`` names the write of its step it commits and the manifest's size and CRC32C; its whole
life (the commit, the listing, deletion) is :mod:`nebula_ckpt.format.commit`'s.

The marker journal (:func:`marker_changed`, :func:`marker_marks`): every write or removal of a
marker that :mod:`nebula_ckpt.format.commit` makes in this process (any writer's: a tier writer,
the drain, the DCP writer, a fenced save's take-back) gives the step a new mark. A writer that
keeps what it read of a tier's markers (:mod:`nebula_ckpt.save.kept`) reads a step again when
its mark moved, instead of every marker at every save; a writer of another process changes a
marker only as a newer writer generation, which fences this one.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Collection, Optional

from nebula_ckpt.errors import CorruptCheckpointError
from nebula_ckpt.format.checks import as_int, as_obj, as_step, bad, short
from nebula_ckpt.format.names import COMMIT, FORMAT, MANIFEST, VERSION, is_manifest_name

if TYPE_CHECKING:
    from nebula_ckpt.storage.base import Storage

#: ``(writer generation, step, save number)`` of one write of a step (see :attr:`Commit.write`)
Write = tuple[int, int, int]

#: the largest commit marker a reader reads (one is some 200 bytes): a larger ``COMMIT`` (a
#: crafted or sparse file) is refused unread, like a garbled one
MAX_COMMIT_BYTES = 1 << 16


@dataclass(frozen=True)
class Commit:
    """Content of the ``COMMIT`` marker."""

    step: int
    generation: int
    manifest_bytes: int
    manifest_crc32c: int
    #: the number of the save that wrote this step in its generation (None: not recorded)
    save: Optional[int] = None
    #: the manifest's file name in the step's folder (None: ``manifest.json``); a write that
    #: replaced a committed step names its own (:func:`~nebula_ckpt.format.names.manifest_name`)
    manifest: Optional[str] = None

    @property
    def manifest_file(self) -> str:
        """The file name of the manifest this marker commits."""
        return self.manifest or MANIFEST

    @property
    def write(self) -> Write:
        """``(generation, step, save)``: which write of the step this is, in the order a restore
        prefers (newest generation, then step, then the later save of one step; ``-1``: unknown)."""
        return (self.generation, self.step, -1 if self.save is None else self.save)

    def to_bytes(self, fmt: str = FORMAT, version: int = VERSION) -> bytes:
        """Serialise (as a ``fmt`` record of ``version``: the removal record names a commit by the
        same fields, :mod:`nebula_ckpt.format.removal`)."""
        out: dict[str, Any] = {"format": fmt, "version": version, "step": self.step,
                               "generation": self.generation, "manifest_bytes": self.manifest_bytes,
                               "manifest_crc32c": self.manifest_crc32c, "time": time.time()}
        if self.save is not None:
            out["save"] = self.save
        if self.manifest is not None:
            out["manifest"] = self.manifest
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
            save, name = d.get("save"), d.get("manifest")
            if name is not None and (type(name) is not str or not is_manifest_name(name)):
                raise bad(w, f"manifest {short(name)} is no manifest file name (manifest.json or "
                             "manifest-v<8 hex digits>.json)")
            return Commit(as_step(d.get("step"), w), as_int(d.get("generation"), w, "generation"),
                          as_int(d.get("manifest_bytes"), w, "manifest_bytes"),
                          as_int(d.get("manifest_crc32c"), w, "manifest_crc32c", hi=2**32 - 1),
                          None if save is None else as_int(save, w, "save"), name)
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"commit marker is unreadable: {e}") from None


_JOURNAL_LOCK = threading.Lock()
#: a storage's ``display_url`` -> step -> the mark of its marker's last change in this process
_JOURNAL: dict[str, dict[int, int]] = {}
_MARKS = itertools.count(1)


def marker_changed(storage: "Storage", step: int) -> None:
    """This process wrote, replaced or removed the marker of ``step`` on ``storage`` (or tried
    to: it may have landed): the step gets a new mark. A marker rewritten for the same write
    (:func:`~nebula_ckpt.format.commit.settle_manifest`) keeps its mark."""
    with _JOURNAL_LOCK:
        _JOURNAL.setdefault(storage.display_url, {})[step] = next(_MARKS)


def marker_marks(storage: "Storage") -> dict[int, int]:
    """The marks of the steps of ``storage`` whose markers this process changed (a step not
    named: 0, none): what was read of a marker under one mark is what it holds while the mark
    stays."""
    with _JOURNAL_LOCK:
        return dict(_JOURNAL.get(storage.display_url, {}))


def markers_listed(storage: "Storage", folders: Collection[int]) -> None:
    """A listing of ``storage`` found the step folders ``folders``: the marks of steps whose
    folders are gone are dropped (a marker written there again gets a new one), so the journal
    holds no more than the steps a tier holds and those it changed since its last listing."""
    with _JOURNAL_LOCK:
        steps = _JOURNAL.get(storage.display_url)
        if steps:
            for s in [s for s in steps if s not in folders]:
                del steps[s]
