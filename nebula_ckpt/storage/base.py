"""The primitives a tier's storage backend implements.

A tier (memory, local, remote) writes a checkpoint as: shard files, then ``manifest.json``,
then the commit marker. Storage backends only provide these primitives; the ordering and the
commit protocol live in :mod:`nebula_ckpt.save.writer`.

Threading: ``write_*`` / ``remove*`` are called from the tier's own writer thread; ``read_*``,
``list``, ``exists`` and ``size`` may be called from any thread (restore, CLI).

Paths are relative to the storage root and ``/``-separated (``"step-42/manifest.json"``).
"""

from __future__ import annotations

import builtins
import errno
import logging
from abc import ABC, abstractmethod
from typing import Any, Optional

from nebula_ckpt.errors import CorruptCheckpointError

Buffer = memoryview

log = logging.getLogger(__name__)

#: the largest small file (a manifest, a commit marker, a record) a reader reads unless it asks for
#: less: a crafted or sparse file of a terabyte is refused before a byte of it is read
MAX_SMALL_BYTES = 1 << 32


def too_large(where: str, size: int, max_bytes: int) -> CorruptCheckpointError:
    """The error for a small file larger than its readers take (``where`` names it)."""
    return CorruptCheckpointError(f"{where} is {size} bytes, more than the {max_bytes} a reader takes of it: not "
                                  "the file nebula_ckpt wrote (a crafted, replaced or sparse one); it is not read "
                                  "(remove or replace it)")


def never_created(storage: "Storage", rel: str) -> bool:
    """After a ``create_only`` write of ``rel`` raised: whether it certainly created nothing, now
    or later (the file is absent and the storage's failed creates are final). False when unsure."""
    if not storage.failed_create_is_final:
        return False
    try:
        return not storage.exists(rel)
    except Exception as e:  # cannot look: it may be there
        log.warning("nebula_ckpt: %s: cannot tell whether %s exists: %s", storage.display_url, rel, e)
        return False


class Storage(ABC):
    """Abstract storage backend rooted at one directory / URL prefix.

    Call order for one checkpoint (see :mod:`nebula_ckpt.save.writer`):
    ``write_buffer`` for every shard -> ``write_small("step-N/manifest.json")`` ->
    ``write_small("step-N/COMMIT", create_only=True)``. Deletion goes the other way:
    ``remove("step-N/COMMIT")`` first, then ``remove_dir("step-N")``.
    """

    #: URL for messages and the CLI, never containing credentials.
    display_url: str
    #: True when files live on a POSIX file system reachable with ``open``/``mmap``.
    is_local: bool = False
    #: True when a ``create_only`` write that raised and left no file can no longer create it (a
    #: POSIX file system: the ``link`` is done or not when the call returns). False for object
    #: stores: a request whose response was lost may still land later.
    failed_create_is_final: bool = False

    @abstractmethod
    def write_buffer(self, rel: str, data: Buffer) -> dict[str, Any]:
        """Write ``data`` as a new file / object at ``rel``, durable on return.

        Local backends fsync the file and its directory; remote backends return once the
        (multi-part) upload has completed. The name is new (unique per writer generation), so
        a partial object left by a crash is harmless: no marker names it.

        How the bytes are encoded on the storage (e.g. zstd frames) is the backend's own
        setting, fixed when it is built (``FsspecStorage(url, ..., compression="zstd")``), never
        chosen per call; whatever a reader needs to decode them goes into the returned info.

        Args:
            rel: relative path.
            data: the bytes (a memoryview over the staging buffer; never copied whole).

        Returns:
            Storage info to record in the manifest for this file (e.g. ``{"stored_bytes": n}``
            and, when the backend encodes, the frame table). Must be JSON-serialisable.
        """

    def write_parts(self, rel: str, parts: "builtins.list[memoryview]") -> dict[str, Any]:
        """Write ``parts`` back to back as one new file / object (like :meth:`write_buffer`).

        A rank's share of a multi-rank checkpoint is a new header and ranges of the staged
        snapshot. The default joins them (one copy) and calls :meth:`write_buffer`; local file
        systems write them in place.
        """
        if len(parts) == 1:
            return self.write_buffer(rel, parts[0])
        joined = bytearray(sum(len(p) for p in parts))
        pos = 0
        for p in parts:
            joined[pos:pos + len(p)] = p
            pos += len(p)
        return self.write_buffer(rel, memoryview(joined))

    @abstractmethod
    def read_buffer(self, rel: str, info: Optional[dict[str, Any]] = None, *,
                    expected_bytes: Optional[int] = None) -> Buffer:
        """Return the (decompressed) bytes of file ``rel`` as a buffer.

        Local backends return a memory map; remote ones download in parallel.
        ``info`` is what ``write_buffer`` returned: it alone decides the decoding, so a backend
        reads objects written with another encoding setting than its own. ``expected_bytes``: the
        size the manifest promises; a backend refuses (``CorruptCheckpointError``) before
        allocating anything when the stored object cannot decode to it.
        """

    @abstractmethod
    def write_small(self, rel: str, data: bytes, *, create_only: bool = False) -> None:
        """Write a small file atomically and durably (tmp + fsync + rename on file systems).

        With ``create_only=True`` raise ``FileExistsError`` if ``rel`` already exists (the
        commit primitive on blob stores: ``If-None-Match: *``).
        """

    @abstractmethod
    def read_small(self, rel: str, max_bytes: int = MAX_SMALL_BYTES) -> bytes:
        """Return the whole content of a small file of at most ``max_bytes`` bytes.

        Raises:
            FileNotFoundError: ``rel`` does not exist.
            CorruptCheckpointError: ``rel`` holds more than ``max_bytes`` bytes (:func:`too_large`),
                or is no regular file (a folder, a FIFO, a socket, a device), naming its path.
        """

    @abstractmethod
    def list(self, rel_dir: str = "") -> list[str]:
        """Names (not paths) of the direct children of ``rel_dir``; ``[]`` if it is missing."""

    @abstractmethod
    def exists(self, rel: str) -> bool:
        """Whether file ``rel`` exists."""

    @abstractmethod
    def size(self, rel: str) -> int:
        """Size in bytes of file ``rel``. Raises ``FileNotFoundError``."""

    @abstractmethod
    def remove(self, rel: str) -> None:
        """Delete file ``rel``; a missing file is not an error."""

    @abstractmethod
    def remove_dir(self, rel: str) -> None:
        """Delete ``rel`` and everything under it; a missing directory is not an error."""

    # -- optional capabilities: the defaults are what a storage without them does -------------------

    def remove_empty_dir(self, rel: str) -> None:
        """Delete folder ``rel`` only if nothing is in it (one atomic step: a file another writer
        creates meanwhile keeps it). Default: nothing (an object store has no empty folders)."""

    def check_access(self) -> None:
        """Fail fast (before anything is written) if the storage cannot be reached or written.

        Called once by the ``Checkpointer`` constructor. Default: nothing to check.
        """

    def local_path(self, rel: str) -> Optional[str]:
        """Absolute POSIX path of ``rel`` when the storage is a local file system, else ``None``."""
        return None

    def link_file(self, src: str, rel: str) -> dict[str, Any]:
        """Make the existing local file ``src`` appear as ``rel`` without copying its bytes.

        Returns the storage info as :meth:`write_buffer` does. Raises ``OSError`` when the storage
        cannot (default: ``EXDEV``); callers then write the bytes instead.
        """
        raise OSError(errno.EXDEV, f"{self.display_url} cannot link files")

    def incomplete_uploads(self) -> "builtins.list[tuple[str, str]]":
        """``(rel, upload id)`` of multi-part uploads started but never completed (default: none)."""
        return []

    def abort_upload(self, rel: str, upload_id: str) -> None:
        """Abort one incomplete upload listed by :meth:`incomplete_uploads`."""

    def close(self) -> None:
        """Release connections / thread pools. Idempotent."""
