"""Any other fsspec filesystem (``memory://``, ``file://``, ``gs://``, ...): one stream per object.

Parts are written in order to one ``fs.open(path, "wb")`` stream (compression still runs in
parallel); a failed stream is aborted and the partial object removed. On ``file://`` small
files are written tmp + fsync + rename (or link for create-only) + directory fsync.
"""

from __future__ import annotations

import io
import logging
import os
from typing import Any

from nebula_ckpt.storage.local import write_file_atomic
from nebula_ckpt.storage.remote.base import FsspecStorage
from nebula_ckpt.storage.remote.retry import Attempt
from nebula_ckpt.storage.remote.upload import Sink

logger = logging.getLogger("nebula_ckpt.storage.remote")

#: schemes whose ``pipe_file(mode="create")`` is known to be a real conditional create
#: (verified by the tests); for others, fsspec's generic version is exists-then-write
_CREATE_ONLY_VERIFIED = {"memory", "file", "local"}
_warned_create_only: set[str] = set()
#: schemes with real folders, where a failed step's emptied folder is removed
_FOLDER_SCHEMES = {"memory", "file", "local"}


class _StreamSink(Sink):
    """Parts written in order to one stream (not retryable per part)."""

    parallel = False

    def __init__(self, storage: "GenericFsspecStorage", path: str) -> None:
        self._st = storage
        self._path = path
        self._f: Any = None

    def put_single(self, body: Any, attempt: Attempt) -> None:
        self.begin(attempt)
        try:
            self.put_part(0, body, attempt)
            self.complete([], len(body), attempt)
        except BaseException:
            self.abort()
            raise

    def begin(self, attempt: Attempt) -> None:
        self._st.prepare_parent(self._path)
        self._f = self._st.fs.open(self._path, "wb")

    def put_part(self, index: int, body: Any, attempt: Attempt) -> Any:
        self._f.write(body)
        return index

    def complete(self, tokens: list[Any], stored_bytes: int, attempt: Attempt) -> None:
        f, self._f = self._f, None
        try:
            f.flush()
            if self._st.is_local_fs:
                try:
                    os.fsync(f.fileno())
                except (AttributeError, OSError, io.UnsupportedOperation):
                    pass
        finally:
            f.close()

    def abort(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            try:
                f.close()
            except Exception:  # noqa: BLE001 - best effort
                pass
        try:
            self._st.fs.rm_file(self._path)
        except Exception:  # noqa: BLE001 - best effort
            pass


class GenericFsspecStorage(FsspecStorage):
    """Remote tier on any other fsspec filesystem (``memory://``, ``file://``, ``gs://``, ...).

    See :class:`FsspecStorage` for the arguments (``storage_options`` go to the filesystem
    unchanged). The URL may name no container (``memory://``).

    Attributes:
        is_local_fs: the filesystem is a local one (``file://``): streams are fsync'd, folders
            made, small files written by :func:`~nebula_ckpt.storage.local.write_file_atomic`.
    """

    _is_backend = True
    needs_container = False

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *,
                 compression: str | None = None) -> None:
        super().__init__(url, storage_options, compression=compression)
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.is_local_fs = "file" in protocols

    def _sink(self, path: str) -> Sink:
        return _StreamSink(self, path)

    def prepare_parent(self, path: str) -> None:
        """Make the folder of ``path`` before an object is streamed to it (on ``file://``, writing
        into a missing folder fails unless the fs has auto_mkdir; elsewhere nothing to do)."""
        if self.is_local_fs:
            parent = path.rsplit("/", 1)[0]
            if parent:
                self.fs.makedirs(parent, exist_ok=True)

    def _probe(self, attempt: Attempt) -> None:
        if self.is_local_fs:
            self.fs.makedirs(self._root, exist_ok=True)
        try:
            self.fs.ls(self._root, detail=False)
        except FileNotFoundError:
            pass

    def write_small(self, rel: str, data: bytes, *, create_only: bool = False) -> None:
        """See :meth:`FsspecStorage.write_small`; on ``file://``: tmp + fsync + rename / link."""
        if self.is_local_fs:
            path, payload = self._path(rel), bytes(data)
            self._retry("write", rel, lambda attempt: write_file_atomic(path, payload, create_only=create_only))
            return
        if create_only and self._protocol not in _CREATE_ONLY_VERIFIED \
                and self._protocol not in _warned_create_only:
            _warned_create_only.add(self._protocol)
            logger.warning("remote tier scheme '%s://': create-only writes rely on the fsspec "
                           "backend honouring pipe_file(mode='create'); this was not verified for "
                           "this scheme, so the commit marker may not be protected against a "
                           "concurrent writer", self._protocol)
        super().write_small(rel, data, create_only=create_only)

    def remove_dir(self, rel: str) -> None:
        """See :meth:`FsspecStorage.remove_dir` (here: a recursive ``rm`` of the folder)."""
        path = self._path(rel)

        def rm_tree(attempt: Attempt) -> None:
            self._invalidate(path)
            self.fs.rm(path, recursive=True)

        try:
            self._retry("remove dir", rel, rm_tree)
        except FileNotFoundError:
            pass
        self._invalidate(path)


    def remove_empty_dir(self, rel: str) -> None:
        """An empty folder of a file system with folders (``file://``, ``memory://``) goes; a
        non-empty or missing one is left as it is. Other schemes: nothing (their ``rmdir`` may
        mean a bucket, and an object store has no empty folders)."""
        if self._protocol not in _FOLDER_SCHEMES:
            return
        path = self._path(rel)
        try:
            self.fs.rmdir(path)
        except (OSError, NotImplementedError) as e:  # not empty, missing, or no folders at all
            logger.debug("remote tier %s: %s stays: %s", self.display_url, rel, e)
        self._invalidate(path)
