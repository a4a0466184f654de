"""The remote storage base class: everything S3, Azure and generic fsspec backends share.

:class:`FsspecStorage` implements :class:`~nebula_ckpt.storage.base.Storage` over an fsspec
filesystem. ``FsspecStorage(url, storage_options, compression=None)`` returns an instance of the
backend class for the URL's scheme (:func:`~.registry.storage_class_for`); a backend overrides a
few hooks:

* ``_set_default_options`` / ``_configure_client``: timeouts and SDK retries of its client;
* ``_sink``: how one object is uploaded (:class:`~.upload.Sink`);
* ``_probe``: the cheap request of :meth:`check_access`;
* ``_close_client``; and where the service differs, ``write_small`` / ``remove_dir`` /
  ``incomplete_uploads`` / ``abort_upload``.

Every request runs under one retry policy (:mod:`.retry`): transient errors are retried with
backoff until the attempts or the operation's deadline (knob ``remote_timeout_s``) run out;
on async filesystems (S3, Azure) each attempt is also cut off at the deadline. Every error
and log line names the tier by its display URL and goes through the tier's scrubber.

Threading: ``write_*`` / ``remove*`` run on the tier's writer thread (uploads fan out to a
pool of their own); ``read_*``, ``list``, ``exists`` and ``size`` may run on any thread.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from typing import Any, Callable, ClassVar, Optional, TypeVar, cast

from nebula_ckpt import knobs
from nebula_ckpt.storage.base import MAX_SMALL_BYTES, Buffer, Storage, too_large
from nebula_ckpt.storage.remote.calls import abandoned_error, call_with_retries
from nebula_ckpt.storage.remote.create import create_small
from nebula_ckpt.storage.remote.errors import CorruptRemoteDataError, RemoteStorageError, storage_error
from nebula_ckpt.storage.remote.frames import ReadTask, compressor, download, plan_read, zstd_module
from nebula_ckpt.storage.remote.paths import child_names, object_path, objects_under, where
from nebula_ckpt.storage.remote.registry import filesystem_class, storage_class_for
from nebula_ckpt.storage.remote.retry import Attempt, RetryPolicy, classify, describe
from nebula_ckpt.storage.remote.scrub import SafeUrl, Scrubber, collect_secrets
from nebula_ckpt.storage.remote.upload import PartLimits, PartUpload, Sink, byte_view
from nebula_ckpt.workers import serve_loop

logger = logging.getLogger("nebula_ckpt.storage.remote")

T = TypeVar("T")

_DEFAULT_CONNECT_TIMEOUT_S = 10.0
_DEFAULT_READ_TIMEOUT_S = 60.0


class FsspecStorage(Storage):
    """:class:`Storage` over an fsspec filesystem (Azure Blob, S3, GCS, memory, file).

    Args:
        url: tier root, e.g. ``"az://container/prefix"``, ``"s3://bucket/prefix"``,
            ``"memory://ckpt"``. A query string in the URL is never shown; a ``user:password@``
            is refused (credentials go in ``storage_options``).
        storage_options: passed to the fsspec filesystem (credentials, endpoint, ...). Defaults
            added when absent: connect / read timeouts of 10 s / 60 s, capped by the knob
            ``remote_timeout_s`` (S3: ``config_kwargs`` ``connect_timeout`` /
            ``read_timeout``; Azure: ``connection_timeout`` / ``read_timeout``), no listings
            cache, and the SDKs' own retries disabled (this class retries per the
            ``remote_*`` knobs). The filesystem instance is private to this object.
        compression: how :meth:`write_buffer` encodes what it uploads: ``None`` (raw bytes) or
            ``"zstd"`` (each upload part one zstd frame, level knob ``zstd_level``). Reading
            never depends on it: :meth:`read_buffer` decodes by the storage info recorded
            with each object, so a storage built without compression reads compressed objects.

    Attributes:
        display_url: the URL without credentials or query string (safe to log).
        compression: the ``compression`` it was built with.
        on_part_uploaded: optional test/progress hook ``f(rel, part_index)`` called from the
            upload thread after each part of a multi-part upload has been accepted.
        fs: the fsspec filesystem (private to this object: never from fsspec's instance cache).
            For backends and their upload sinks (:mod:`.s3`, :mod:`.azure`, :mod:`.generic`),
            which make the service's own calls through it.
        scrub: the tier's :class:`~.scrub.Scrubber`: every text a backend logs or raises goes
            through it.

    Raises:
        ImportError: the fsspec backend for the URL's scheme, or for ``compression="zstd"`` the
            ``zstandard`` package, is not installed (the message says what to install).
        ValueError: unknown scheme, no container / bucket in the URL, or an unknown
            ``compression``.
        RemoteStorageError: the client could not be created.

    Example::

        st = FsspecStorage("s3://bucket/run-1", {"key": ..., "secret": ...},
                           compression="zstd")  # -> S3Storage
        st.check_access()
    """

    is_local = False
    #: concrete backends set this; ``FsspecStorage(url)`` picks one by the URL's scheme
    _is_backend: ClassVar[bool] = False
    #: the service's multi-part upload limits
    part_limits: ClassVar[PartLimits] = PartLimits()
    #: the URL must name a container / bucket
    needs_container: ClassVar[bool] = True

    def __new__(cls, url: str, storage_options: Optional[dict[str, Any]] = None, *,
                compression: Optional[str] = None) -> "FsspecStorage":
        if cls is FsspecStorage:
            cls = cast("type[FsspecStorage]", storage_class_for(url))  # a subclass of FsspecStorage
        elif not cls._is_backend:
            raise TypeError(f"{cls.__name__} subclasses FsspecStorage, which only dispatches by URL "
                            f"scheme; subclass the backend instead: storage_class_for(url)")
        return super().__new__(cls)

    def __init__(self, url: str, storage_options: Optional[dict[str, Any]] = None, *,
                 compression: Optional[str] = None) -> None:
        safe = SafeUrl.parse(url)
        self.display_url = safe.display
        if compression not in (None, "zstd"):
            raise ValueError(f"remote tier {self.display_url}: unsupported compression "
                             f"{compression!r}; use None (raw bytes) or 'zstd'")
        if compression == "zstd":
            zstd_module()  # a missing package fails here, before anything is uploaded
        self.compression = compression
        options = dict(storage_options or {})
        self.scrub = Scrubber(collect_secrets(options) | safe.secrets)
        self.on_part_uploaded: Optional[Callable[[str, int], None]] = None
        self._closed = False
        self._protocol = safe.scheme
        fs_cls = filesystem_class(safe.scheme, self.display_url)
        for k, v in (fs_cls._get_kwargs_from_urls(safe.clean) or {}).items():
            options.setdefault(k, v)
        timeout = RetryPolicy.from_knobs().timeout_s
        self._set_default_options(options, min(_DEFAULT_CONNECT_TIMEOUT_S, timeout),
                                  min(_DEFAULT_READ_TIMEOUT_S, timeout))
        self.fs = self._open_filesystem(fs_cls, options)
        # async filesystems (s3fs, adlfs) accept a per-call timeout that cancels the request
        self._bounded_calls = bool(getattr(self.fs, "async_impl", False))
        if self._bounded_calls and getattr(self.fs, "loop", None) is not None:
            serve_loop(self.fs.loop)  # its DNS and credential helpers keep working at interpreter exit
        self._root = fs_cls._strip_protocol(safe.clean).rstrip("/")
        if not self._root and self.needs_container:
            raise ValueError(f"remote tier {self.display_url}: the URL needs a container/bucket "
                             f"name, e.g. s3://bucket/prefix or az://container/prefix")
        logger.debug("remote tier %s: %s over %s", self.display_url, type(self).__name__,
                     fs_cls.__name__)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.display_url!r})"

    # ------------------------------------------------------------------ hooks for backends

    def _set_default_options(self, options: dict[str, Any], connect_timeout: float,
                             read_timeout: float) -> None:
        """Add the backend's defaults (timeouts, no SDK retries) where the user set none."""

    def _configure_client(self, fs: Any, options: dict[str, Any]) -> None:
        """Adjust the filesystem's client after creation (e.g. turn off SDK retries)."""

    def _sink(self, path: str) -> Sink:
        """How the object at ``path`` is uploaded."""
        raise NotImplementedError

    def _probe(self, attempt: Attempt) -> None:
        """One cheap request proving endpoint, credentials and container (check_access)."""
        raise NotImplementedError

    def _close_client(self) -> None:
        """Close the backend's HTTP sessions."""

    # ------------------------------------------------------------------ plumbing

    def _open_filesystem(self, fs_cls: type, options: dict[str, Any]) -> Any:
        try:
            # skip fsspec's instance cache: the instance (and its credentials) is ours alone
            fs = fs_cls(skip_instance_cache=True, **options)
        except Exception as e:  # noqa: BLE001 - classified, scrubbed and raised below
            err = self._error("connect", "", e, classify(e), 1)
        else:
            self._configure_client(fs, options)
            return fs
        raise err  # outside the except block: no __context__ with the unscrubbed exception

    def _limit(self, attempt: Attempt) -> dict[str, Any]:
        """Keyword arguments that cut an fsspec call off at the operation's deadline."""
        return {"timeout": attempt.timeout} if self._bounded_calls else {}

    def _path(self, rel: str) -> str:
        return object_path(self._root, rel, self.display_url)

    def _where(self, rel: str) -> str:
        return where(self.display_url, rel)

    def _invalidate(self, path: str = "") -> None:
        try:
            self.fs.invalidate_cache(path or None)
        except Exception:  # noqa: BLE001 - best effort
            pass

    def _check_open(self) -> None:
        if self._closed:
            raise RemoteStorageError(f"remote tier {self.display_url} is closed; create a new storage (or "
                                     "Checkpointer) to use it again", url=self.display_url)

    def _error(self, op: str, rel: str, exc: BaseException, kind: str, attempts: int) -> BaseException:
        """Our scrubbed exception for backend exception ``exc`` (raise it outside ``except``)."""
        return storage_error(exc, kind, op=op, url=self.display_url, rel=rel, attempts=attempts,
                             scrub=self.scrub)

    def _abandoned(self, op: str, rel: str) -> RemoteStorageError:
        return abandoned_error(op, rel, self.display_url)

    def _retry(self, op: str, rel: str, fn: Callable[[Attempt], T], *,
               abort: Optional[threading.Event] = None) -> T:
        """Run ``fn(attempt)`` under the retry policy (:func:`.calls.call_with_retries`)."""
        self._check_open()
        return call_with_retries(fn, op=op, rel=rel, url=self.display_url, scrub=self.scrub, abort=abort)

    # ------------------------------------------------------------------ Storage API: writes

    def check_access(self) -> None:
        """One cheap listing of the tier root to verify endpoint, credentials and container.

        Called by the Checkpointer at creation so a wrong key or a missing bucket fails at once
        instead of at the first save.

        Raises:
            RemoteAuthError: credentials rejected / operation denied.
            RemoteContainerNotFoundError: the container / bucket does not exist.
            RemoteUnavailableError: the endpoint did not answer within the retries / deadline.
        """
        t0 = time.monotonic()
        self._retry("check access", "", self._probe)
        logger.debug("remote tier %s: access ok (%.3fs)", self.display_url, time.monotonic() - t0)

    def write_buffer(self, rel: str, data: Buffer) -> dict[str, Any]:
        """Upload ``data`` to ``rel`` (a new, unique name), durable on return.

        Buffers larger than one part (knob ``remote_part_bytes``) go up as parallel parts (at
        most ``remote_concurrency`` in flight), each streamed from a slice of ``data`` (no
        whole copy). On a storage built with ``compression="zstd"`` each part is compressed
        independently (level knob ``zstd_level``, read per call) so parts stay parallel and
        can be decompressed in parallel.

        Returns:
            ``{"stored_bytes": n}``, plus ``"compression": "zstd"``, ``"raw_bytes"`` and
            ``"frames": [[raw_len, stored_len], ...]`` when compressed.

        Raises:
            ValueError: a non-contiguous buffer.
            RemoteStorageError (or a subclass): the upload failed; the message names the tier
                and ``rel``.
        """
        self._check_open()
        mv = byte_view(data)
        path, n = self._path(rel), len(mv)
        conc = max(1, int(knobs.get("remote_concurrency")))
        part = self.part_limits.part_size(n, int(knobs.get("remote_part_bytes")), conc)
        compress = compressor(int(knobs.get("zstd_level"))) if self.compression == "zstd" else None
        t0 = time.monotonic()
        if n <= part:
            stored, frames = self._write_single(rel, path, mv, compress)
            nparts = 1
        else:
            up = PartUpload(self._sink(path), mv, part, conc, compress,
                            retry=lambda op, fn, abort: self._retry(op, rel, fn, abort=abort),
                            abandoned=lambda: self._abandoned("upload", rel),
                            on_part=lambda index: self._part_uploaded(rel, index))
            nparts = self._run_upload(up, rel)
            stored, frames = up.stored, up.frames
        dt = time.monotonic() - t0
        logger.debug("remote tier %s: wrote %s (%d bytes, %d stored, %d part(s)) in %.3fs (%.1f MB/s)",
                     self.display_url, rel, n, stored, nparts, dt, n / max(dt, 1e-9) / 1e6)
        info: dict[str, Any] = {"stored_bytes": stored}
        if compress is not None:
            info.update(compression="zstd", raw_bytes=n, frames=frames)
        return info

    def _write_single(self, rel: str, path: str, mv: memoryview,
                      compress: Optional[Callable[[memoryview], bytes]]) -> tuple[int, list[list[int]]]:
        body: Any = mv if compress is None else compress(mv)
        sink = self._sink(path)
        self._retry("upload", rel, lambda attempt: sink.put_single(body, attempt))
        return len(body), ([[len(mv), len(body)]] if compress is not None else [])

    def _run_upload(self, up: PartUpload, rel: str) -> int:
        if up.sink.parallel:
            return up.run()
        try:
            return up.run_sequential()
        except (RemoteStorageError, FileNotFoundError, FileExistsError, ValueError):
            raise
        except Exception as e:  # noqa: BLE001 - a generic stream: wrap the backend's exception
            err = self._error("upload", rel, e, classify(e), 1)
        raise err  # outside the except block: no __context__ with the unscrubbed exception

    def _part_uploaded(self, rel: str, index: int) -> None:
        hook = self.on_part_uploaded
        if hook is not None:
            hook(rel, index)

    def write_small(self, rel: str, data: bytes, *, create_only: bool = False) -> None:
        """Write a small object in one request (atomic on object stores).

        With ``create_only=True`` the write is conditional (``If-None-Match: *`` on S3 and
        Azure) and raises ``FileExistsError`` if ``rel`` exists. A retry after a lost response
        that finds our own bytes there counts as success; the read-back that tells runs under
        the retry policy too (:func:`.create.create_small`).

        Raises:
            FileExistsError: ``create_only`` and the object exists (not our own bytes).
            RemoteStorageError (or a subclass): the write failed; or (``create_only``) a retry
                found the object there and it could not be read back: the message says it may
                be this write's own.
        """
        self._check_open()
        path, payload = self._path(rel), bytes(data)
        if not create_only:
            self._retry("write", rel, lambda attempt: self.fs.pipe_file(path, payload, **self._limit(attempt)))
            return
        create_small(payload, url=self.display_url, rel=rel,
                     put=lambda attempt: self.fs.pipe_file(path, payload, mode="create", **self._limit(attempt)),
                     read=lambda attempt: self._head(path, len(payload), attempt),
                     retry=lambda op, fn: self._retry(op, rel, fn))

    def remove(self, rel: str) -> None:
        """Delete object ``rel``; a missing object is not an error (same on every backend)."""
        path = self._path(rel)
        try:
            self._retry("remove", rel, lambda attempt: self.fs.rm_file(path, **self._limit(attempt)))
        except FileNotFoundError:
            pass
        self._invalidate(path)

    def remove_dir(self, rel: str) -> None:
        """Delete every object under ``rel/`` (and ``rel`` itself if it is an object).

        Never deletes the container / bucket, and never touches siblings sharing a name prefix
        (``step-1`` does not match ``step-10``). A missing directory is not an error.
        """
        path = self._path(rel)

        def find(attempt: Attempt) -> list[str]:
            self._invalidate(path)
            return list(self.fs.find(path, withdirs=False, **self._limit(attempt)))

        try:
            found = self._retry("list for remove", rel, find)
        except FileNotFoundError:
            found = []
        victims = objects_under(found, path)
        if victims:
            def rm_many(attempt: Attempt) -> None:
                try:
                    self.fs.rm(victims, **self._limit(attempt))
                except FileNotFoundError:
                    pass

            self._retry("remove dir", rel, rm_many)
        self._invalidate(path)
        logger.debug("remote tier %s: removed %d object(s) under %s", self.display_url, len(victims), rel or "/")

    def incomplete_uploads(self) -> list[tuple[str, str]]:
        """``(rel, upload_id)`` of multi-part uploads never completed under this root.

        Only S3 keeps (and bills) the parts of an upload its writer never finished; the other
        services discard them by themselves, so this base version has none.
        """
        return []

    def abort_upload(self, rel: str, upload_id: str) -> None:
        """Abort one incomplete multi-part upload (a no-op where there are none)."""

    def close(self) -> None:
        """Close the backend's HTTP sessions. Idempotent; the object is unusable afterwards."""
        if self._closed:
            return
        self._closed = True
        if getattr(self, "fs", None) is None:
            return
        try:
            self._close_client()
        except Exception as e:  # noqa: BLE001 - best effort
            logger.debug("remote tier %s: close: %s", self.display_url, self.scrub(describe(e)))

    # ------------------------------------------------------------------ Storage API: reads

    def read_buffer(self, rel: str, info: Optional[dict[str, Any]] = None, *,
                    expected_bytes: Optional[int] = None) -> Buffer:
        """Download ``rel`` into one preallocated buffer with parallel ranged reads: a writable
        memoryview over a ``bytearray`` holding the raw bytes.

        ``info`` (its storage info, what :meth:`write_buffer` returned, from the manifest; None: a
        plain object) is validated against the object's real size, and ``expected_bytes`` (the raw
        size the caller expects) checked, *before* the buffer is allocated (:func:`.frames.plan_read`).
        zstd frames are fetched and decompressed in parallel straight into their raw offsets.
        At most ``remote_concurrency`` ranges are in flight.

        Raises:
            FileNotFoundError: ``rel`` does not exist.
            StorageInfoError: ``info`` is malformed or contradicts the object (a
                ``CorruptCheckpointError`` and a ``ValueError``).
            CorruptRemoteDataError: a frame does not decode to its recorded size.
            RemoteStorageError (or a subclass): the download failed.
        """
        self._check_open()
        path, where = self._path(rel), self._where(rel)
        conc = max(1, int(knobs.get("remote_concurrency")))
        t0 = time.monotonic()
        plan = plan_read(info, self.size(rel), where, concurrency=conc,
                         part_bytes=int(knobs.get("remote_part_bytes")), expected_bytes=expected_bytes)

        def fetch(t: ReadTask) -> bytes:
            end = t.stored_off + t.stored_len
            return self._retry(f"read range {t.stored_off}-{end}", rel, lambda attempt: self.fs.cat_file(
                path, start=t.stored_off, end=end, **self._limit(attempt)))

        def corrupt(message: str, op: str) -> BaseException:
            return CorruptRemoteDataError(f"read {where}: {message}", url=self.display_url,
                                          rel=rel, op=op)

        out = download(plan, fetch, conc, corrupt)
        dt = time.monotonic() - t0
        logger.debug("remote tier %s: read %s (%d bytes, %d range(s)) in %.3fs (%.1f MB/s)", self.display_url,
                     rel, plan.raw_bytes, len(plan.tasks), dt, plan.raw_bytes / max(dt, 1e-9) / 1e6)
        return out

    def read_small(self, rel: str, max_bytes: int = MAX_SMALL_BYTES) -> bytes:
        """The whole content of ``rel``, one ranged read of ``max_bytes + 1`` bytes at most; larger: refused."""
        path = self._path(rel)
        data = self._retry("read", rel, lambda attempt: self._head(path, max_bytes, attempt))
        if len(data) > max_bytes:
            raise too_large(self._where(rel), self.size(rel), max_bytes)
        return data

    def _head(self, path: str, max_bytes: int, attempt: Attempt) -> bytes:
        """One try at the first ``max_bytes + 1`` bytes of ``path`` (one ranged read)."""
        try:
            return bytes(self.fs.cat_file(path, start=0, end=max_bytes + 1, **self._limit(attempt)))
        except Exception as e:  # HTTP 416: no byte 0 to range over, an empty object: read it whole
            if getattr(e, "status_code", None) != 416 and getattr(e, "errno", None) != errno.EINVAL:
                raise
            return bytes(self.fs.cat_file(path, **self._limit(attempt)))

    def list(self, rel_dir: str = "") -> list[str]:
        """Sorted names (not paths) of the direct children of ``rel_dir``; ``[]`` if missing.

        Never served from a listings cache. Names are normalised across backends: no prefix,
        no trailing slash. Pseudo-directories (common prefixes) are listed by name too.

        Raises:
            RemoteContainerNotFoundError: the container / bucket itself is missing.
        """
        path = self._path(rel_dir)

        def ls(attempt: Attempt) -> list[Any]:
            self._invalidate(path)
            return self.fs.ls(path, detail=True, **self._limit(attempt))

        try:
            entries = self._retry("list", rel_dir, ls)
        except FileNotFoundError:
            return []
        return child_names(entries, path)

    def _info(self, rel: str) -> Optional[dict[str, Any]]:
        path = self._path(rel)

        def info(attempt: Attempt) -> dict[str, Any]:
            self._invalidate(path)
            return self.fs.info(path, **self._limit(attempt))

        try:
            return self._retry("stat", rel, info)
        except FileNotFoundError:
            return None

    def exists(self, rel: str) -> bool:
        """Whether the *file* (object) ``rel`` exists; a bare prefix / directory is not a file.

        An outage raises (:class:`RemoteUnavailableError`) rather than answering ``False``.
        """
        i = self._info(rel)
        return i is not None and i.get("type") != "directory"

    def size(self, rel: str) -> int:
        """Size in bytes of object ``rel``. Raises ``FileNotFoundError``."""
        i = self._info(rel)
        if i is None or i.get("type") == "directory":
            raise FileNotFoundError(errno.ENOENT, "no such object on the remote tier (size)",
                                    self._where(rel))
        return int(i["size"])
