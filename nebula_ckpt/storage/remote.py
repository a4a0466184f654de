"""Remote (object store) storage backend over fsspec: Azure Blob, S3, GCS, memory, file.

:class:`FsspecStorage` implements :class:`~nebula_ckpt.storage.base.Storage` for any fsspec URL
(``az://container/prefix``, ``abfs://``, ``s3://bucket/prefix``, ``gs://``, ``memory://``,
``file://``). Blob stores have no atomic rename, so shard data is written straight to its final
(unique) name and the commit marker uses a create-only write (``If-None-Match: *``).

Large buffers go up as parallel parts with bounded memory:

* **S3** (s3fs): ``create_multipart_upload`` / ``upload_part`` / ``complete_multipart_upload``
  through the filesystem's event loop; each part body is a zero-copy reader over a slice of the
  caller's memoryview (botocore rejects a bare ``memoryview``). Parts are at least 5 MiB (S3's
  minimum); zstd frames smaller than that are coalesced into upload parts.
* **Azure** (adlfs + azure-storage-blob): ``stage_block`` / ``commit_block_list`` with the
  filesystem's async ``BlobServiceClient``; block bodies are memoryview slices (no copy).
* **Other schemes**: one sequential stream per file (``fs.open(path, "wb")``), compression still
  in parallel.

Transient errors (connection refused/reset, timeouts, throttling, HTTP 5xx) are retried per
part with capped exponential backoff and jitter (knobs ``remote_retries``,
``remote_backoff_s``, ``remote_backoff_max_s``); the backend SDKs' own retries are turned off so
the knobs govern everything. Permanent errors (HTTP 401/403, missing container/bucket) fail
fast with a message that says what to check. Every error names the tier by its display URL and
the relative path, and never contains credentials (the backend's message is scrubbed before it
is put into our message or chained as the cause).
"""

from __future__ import annotations

import base64
import errno
import io
import logging
import math
import os
import random
import re
import threading
import time
import urllib.parse
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator, Optional, TypeVar, Union

from .. import knobs
from ..errors import NebulaError
from .base import Buffer, Storage

logger = logging.getLogger("nebula_ckpt.storage.remote")

T = TypeVar("T")

_MiB = 1 << 20
#: S3: every part but the last must be >= 5 MiB; at most 10,000 parts.
_S3_MIN_PART = 5 * _MiB
_S3_MAX_PARTS = 10_000
#: Azure block blobs: at most 50,000 blocks of at most 4000 MiB.
_AZ_MAX_BLOCKS = 50_000
_AZ_MAX_BLOCK = 4000 * _MiB
#: Azure single-request uploads of a memoryview up to this size are copied to bytes first
_AZ_SMALL_COPY = 4 * _MiB

_DEFAULT_CONNECT_TIMEOUT_S = 10
_DEFAULT_READ_TIMEOUT_S = 60

_AZURE_HINT = "pip install 'nebula_ckpt[azure]'  (adlfs, azure-storage-blob)"
_S3_HINT = "pip install 'nebula_ckpt[s3]'  (s3fs)"
_GCS_HINT = "pip install 'nebula_ckpt[gcs]'  (gcsfs)"
_INSTALL_HINTS = {
    "az": _AZURE_HINT, "abfs": _AZURE_HINT, "abfss": _AZURE_HINT, "adl": _AZURE_HINT,
    "s3": _S3_HINT, "s3a": _S3_HINT,
    "gs": _GCS_HINT, "gcs": _GCS_HINT,
}


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


class RemoteStorageError(NebulaError, OSError):
    """A remote-tier operation failed.

    The message names the operation, the tier (display URL, never credentials) and the relative
    path. The backend's exception is chained as ``__cause__`` in scrubbed form
    (:class:`RemoteBackendError`: type name and message with secrets removed, original traceback).

    Attributes:
        url: display URL of the tier.
        rel: relative path of the object ("" for the tier root).
        op: the operation that failed (``"upload part 3/8"``, ``"list"``, ...).
        attempts: how many attempts were made.
    """

    def __init__(self, message: str, *, url: str = "", rel: str = "", op: str = "",
                 attempts: int = 1) -> None:
        super().__init__(message)
        self.url = url
        self.rel = rel
        self.op = op
        self.attempts = attempts

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class RemoteAuthError(RemoteStorageError, PermissionError):
    """The object store rejected the credentials or denied the operation (HTTP 401/403)."""


class RemoteContainerNotFoundError(RemoteStorageError):
    """The container (Azure) / bucket (S3, GCS) named in the tier URL does not exist.

    Deliberately not a ``FileNotFoundError``: a missing bucket must never read as "no
    checkpoint here".
    """


class RemoteUnavailableError(RemoteStorageError):
    """Transient errors (unreachable endpoint, timeouts, throttling, 5xx) outlasted the retries."""


class RemoteBackendError(Exception):
    """Scrubbed stand-in for a backend SDK exception, chained as ``__cause__``.

    Carries the original exception's type name and message with credentials removed, and the
    original traceback (frames only; no secrets live in source lines).
    """


# --------------------------------------------------------------------------------------------
# Credential scrubbing
# --------------------------------------------------------------------------------------------

_SENSITIVE_KEY = re.compile(
    r"(?i)(key|secret|token|passw|sas|signature|credential|connection_string|conn_str|auth|sig)")
_SECRET_PATTERNS = [
    # connection-string fields
    (re.compile(r"(?i)((?:AccountKey|SharedAccessSignature|SharedAccessKey|SharedAccessKeyName)=)"
                r"[^;\s\"'&]+"), r"\1***"),
    # SAS / presigned-URL query parameters
    (re.compile(r"(?i)((?:^|[?&;,\s])(?:sig|X-Amz-Signature|X-Amz-Credential|X-Amz-Security-Token|"
                r"Signature|AWSAccessKeyId|x-goog-signature|x-goog-credential)=)[^&\s\"';,]+"),
     r"\1***"),
    # HTTP Authorization headers: "SharedKey account:signature", "Bearer token", ...
    (re.compile(r"(?i)(authorization['\"]?\s*[:=]\s*['\"]?(?:[\w-]+\s+)?)[^\s'\",}]+"), r"\1***"),
]


def _collect_secrets(obj: Any, key: str = "", out: Optional[set[str]] = None) -> set[str]:
    """Every string in ``obj`` (nested dicts/lists) stored under a credential-looking key."""
    if out is None:
        out = set()
    if isinstance(obj, dict):
        for k, v in obj.items():
            _collect_secrets(v, str(k), out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect_secrets(v, key, out)
    elif isinstance(obj, str) and obj:
        if _SENSITIVE_KEY.search(key) and not key.lower().endswith(("_version", "_id_type")):
            out.add(obj)
            # connection strings: also each credential field on its own
            for part in obj.split(";"):
                name, _, value = part.partition("=")
                if value and _SENSITIVE_KEY.search(name):
                    out.add(value)
            # SAS token: each query value
            for _, value in urllib.parse.parse_qsl(obj.lstrip("?")):
                if len(value) >= 4:
                    out.add(value)
    return out


class _Scrubber:
    """Removes known secrets (and secret-looking fields) from text."""

    def __init__(self, secrets: Iterable[str]) -> None:
        # longest first so that a connection string is replaced before the key inside it
        self._secrets = sorted({s for s in secrets if len(s) >= 4}, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for s in self._secrets:
            if s in text:
                text = text.replace(s, "***")
        for pattern, repl in _SECRET_PATTERNS:
            text = pattern.sub(repl, text)
        return text


# --------------------------------------------------------------------------------------------
# Error classification
# --------------------------------------------------------------------------------------------

_AUTH_CODES = {
    "accessdenied", "invalidaccesskeyid", "signaturedoesnotmatch", "authenticationfailed",
    "authorizationfailure", "authorizationpermissionmismatch", "authorizationresourcetypemismatch",
    "authorizationsourceipmismatch", "authorizationprotocolmismatch",
    "authorizationservicemismatch", "insufficientaccountpermissions", "accountisdisabled",
    "invalidtoken", "expiredtoken", "invalidclienttokenid", "noauthenticationinformation",
    "invalidauthenticationinfo", "unauthorizedaccess", "allaccessdisabled",
}
_CONTAINER_CODES = {"nosuchbucket", "containernotfound", "containerbeingdeleted",
                    "containerdisabled"}
_TRANSIENT_CODES = {
    "slowdown", "throttling", "throttlingexception", "requesttimeout", "requesttimeoutexception",
    "internalerror", "internalservererror", "serviceunavailable", "serverbusy",
    "operationtimedout", "requestlimitexceeded", "toomanyrequestsexception",
    "provisionedthroughputexceededexception", "bandwidthlimitexceeded",
}
_TRANSIENT_TYPE_NAMES = {
    # botocore
    "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError",
    "ConnectTimeoutError", "HTTPClientError", "IncompleteReadError", "ResponseStreamingError",
    "ProxyConnectionError",
    # aiohttp
    "ClientConnectionError", "ClientConnectorError", "ServerDisconnectedError",
    "ClientPayloadError", "ClientOSError", "ServerTimeoutError", "ConnectionTimeoutError",
    "SocketTimeoutError",
    # azure-core
    "ServiceRequestError", "ServiceResponseError", "ServiceRequestTimeoutError",
    "ServiceResponseTimeoutError",
    # fsspec / http.client
    "FSTimeoutError", "IncompleteRead", "RemoteDisconnected",
}

# classification results
_K_AUTH = "auth"
_K_CONTAINER = "container"
_K_EXISTS = "exists"
_K_NOTFOUND = "notfound"
_K_TRANSIENT = "transient"
_K_PERMANENT = "permanent"


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes/contexts (breadth first, at most 12, no cycles)."""
    out: list[BaseException] = []
    seen: set[int] = set()
    todo = [exc]
    while todo and len(out) < 12:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        out.append(e)
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return out


def _code_and_status(e: BaseException) -> tuple[str, Optional[int]]:
    """Service error code (lower case, "" if none) and HTTP status of a backend exception."""
    code: Any = ""
    status: Optional[int] = None
    resp = getattr(e, "response", None)
    if isinstance(resp, dict):  # botocore ClientError
        code = (resp.get("Error") or {}).get("Code") or ""
        status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    else:  # azure HttpResponseError
        code = getattr(e, "error_code", None) or ""
        sc = getattr(e, "status_code", None)
        if isinstance(sc, int):
            status = sc
        elif resp is not None and isinstance(getattr(resp, "status_code", None), int):
            status = resp.status_code
    code = str(getattr(code, "value", code) or "")
    if status is None and code.isdigit():
        status = int(code)
    return code.lower(), status


def _classify(exc: BaseException) -> str:
    """One of auth / container / exists / notfound / transient / permanent."""
    kinds: set[str] = set()
    for e in _chain(exc):
        code, status = _code_and_status(e)
        if code in _AUTH_CODES or status in (401, 403) or isinstance(e, PermissionError):
            kinds.add(_K_AUTH)
        elif code in _CONTAINER_CODES:
            kinds.add(_K_CONTAINER)
        elif isinstance(e, FileExistsError):
            kinds.add(_K_EXISTS)
        elif (code in _TRANSIENT_CODES or (status is not None and (status >= 500 or status in (408, 429)))
              or isinstance(e, (ConnectionError, TimeoutError))
              or any(t.__name__ in _TRANSIENT_TYPE_NAMES for t in type(e).__mro__)):
            kinds.add(_K_TRANSIENT)
        elif isinstance(e, FileNotFoundError) or status == 404 or code in (
                "nosuchkey", "blobnotfound", "nosuchupload", "resourcenotfound"):
            kinds.add(_K_NOTFOUND)
        else:
            msg = str(e).lower()
            if "bucket does not exist" in msg or "container does not exist" in msg:
                kinds.add(_K_CONTAINER)
    for k in (_K_AUTH, _K_CONTAINER, _K_EXISTS, _K_TRANSIENT, _K_NOTFOUND):
        if k in kinds:
            return k
    return _K_PERMANENT


def _describe(exc: BaseException, limit: int = 400) -> str:
    """Short one-line description of a backend exception (type, code, status, message)."""
    code, status = "", None
    for e in _chain(exc):
        c, s = _code_and_status(e)
        code, status = code or c, status or s
    msg = str(exc).split("\nContent:", 1)[0]  # azure appends the raw XML error body
    msg = " ".join(msg.split())
    if len(msg) > limit:
        msg = msg[:limit] + "..."
    extra = []
    if code:
        extra.append(f"code={code}")
    if status:
        extra.append(f"HTTP {status}")
    tail = f" [{', '.join(extra)}]" if extra else ""
    return f"{type(exc).__name__}: {msg}{tail}"


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


class _ViewReader(io.RawIOBase):
    """Read-only, seekable file object over a buffer, without copying it.

    botocore accepts ``bytes``/``bytearray``/file objects as a request body but not a
    ``memoryview``; this reader lets an upload part stream straight from a slice of the
    caller's staging buffer (aiohttp reads it in small chunks).
    """

    def __init__(self, data: Union[bytes, bytearray, memoryview]) -> None:
        super().__init__()
        self._mv = memoryview(data).cast("B") if not isinstance(data, memoryview) else data
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        else:
            pos = len(self._mv) + offset
        self._pos = max(0, pos)
        return self._pos

    def readinto(self, b: Any) -> int:
        n = min(len(b), len(self._mv) - self._pos)
        if n <= 0:
            return 0
        b[:n] = self._mv[self._pos:self._pos + n]
        self._pos += n
        return n

    def read(self, size: Optional[int] = -1) -> bytes:
        end = len(self._mv) if size is None or size < 0 else min(len(self._mv), self._pos + size)
        out = bytes(self._mv[self._pos:end])
        self._pos = max(self._pos, end)
        return out

    def __len__(self) -> int:
        return len(self._mv)


class _ViewWriter:
    """Minimal writable file object that fills a fixed memoryview (zstd decompression target)."""

    def __init__(self, target: memoryview) -> None:
        self._mv = target
        self.pos = 0

    def write(self, b: Any) -> int:
        n = len(b)
        if self.pos + n > len(self._mv):
            raise ValueError("decompressed data is larger than the frame table says")
        self._mv[self.pos:self.pos + n] = b
        self.pos += n
        return n

    def flush(self) -> None:
        pass


def _byte_view(data: Any) -> memoryview:
    """``data`` as a flat, contiguous, unsigned-byte memoryview (no copy)."""
    mv = data if isinstance(data, memoryview) else memoryview(data)
    if not mv.contiguous:
        raise ValueError("write_buffer needs a contiguous buffer")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("compression='zstd' needs the 'zstandard' package: pip install zstandard") from e
    return zstandard


def _in_order(pool: ThreadPoolExecutor, fn: Callable[[Any], T], items: Iterable[Any],
              window: int, stop: threading.Event) -> Iterator[T]:
    """``map(fn, items)`` on ``pool`` with at most ``window`` results pending, yielded in order."""
    pending: list[Future] = []
    it = iter(items)
    try:
        for item in it:
            if stop.is_set():
                break
            pending.append(pool.submit(fn, item))
            if len(pending) >= window:
                yield pending.pop(0).result()
        while pending and not stop.is_set():
            yield pending.pop(0).result()
    finally:
        for f in pending:
            f.cancel()


def _coalesce(chunks: Iterable[Any], min_size: int) -> Iterator[Any]:
    """Concatenate consecutive chunks until each output is >= ``min_size`` (but the last).

    Chunks already large enough pass through without a copy.
    """
    if min_size <= 0:
        yield from chunks
        return
    buf: Optional[bytearray] = None
    for c in chunks:
        if buf is None and len(c) >= min_size:
            yield c
            continue
        if buf is None:
            buf = bytearray()
        buf += c
        if len(buf) >= min_size:
            yield buf
            buf = None
    if buf is not None:
        yield buf


# --------------------------------------------------------------------------------------------
# Backend-specific upload sinks
# --------------------------------------------------------------------------------------------


class _Sink:
    """How one object is uploaded: whole in one request, or as parts then a commit."""

    #: every part but the last must be at least this long
    min_part = 0
    #: whether parts can be uploaded concurrently
    parallel = True

    def put_single(self, body: Any) -> None:
        raise NotImplementedError

    def begin(self) -> None:
        """Start a multi-part upload."""

    def put_part(self, index: int, body: Any) -> Any:
        """Upload part ``index`` (0-based); returns a token for :meth:`complete`."""
        raise NotImplementedError

    def complete(self, tokens: list[Any], stored_bytes: int, attempt: int) -> None:
        """Publish the object from the uploaded parts."""
        raise NotImplementedError

    def abort(self) -> None:
        """Best-effort cleanup of an unfinished upload."""


class _S3Sink(_Sink):
    min_part = _S3_MIN_PART

    def __init__(self, storage: "FsspecStorage", path: str) -> None:
        self._st = storage
        self._fs = storage._fs
        self._bucket, self._key, _ = self._fs.split_path(path)
        self._upload_id: Optional[str] = None

    def _call(self, method: str, **kw: Any) -> Any:
        from fsspec.asyn import sync
        return sync(self._fs.loop, self._fs._call_s3, method, Bucket=self._bucket, Key=self._key, **kw)

    def put_single(self, body: Any) -> None:
        self._call("put_object", Body=_ViewReader(body), ContentLength=len(body))

    def begin(self) -> None:
        self._upload_id = self._call("create_multipart_upload")["UploadId"]

    def put_part(self, index: int, body: Any) -> Any:
        r = self._call("upload_part", UploadId=self._upload_id, PartNumber=index + 1,
                       Body=_ViewReader(body), ContentLength=len(body))
        return {"PartNumber": index + 1, "ETag": r["ETag"]}

    def complete(self, tokens: list[Any], stored_bytes: int, attempt: int) -> None:
        try:
            self._call("complete_multipart_upload", UploadId=self._upload_id,
                       MultipartUpload={"Parts": tokens})
        except Exception as e:
            # A retried complete whose first try succeeded server-side answers NoSuchUpload.
            if attempt > 1 and _classify(e) == _K_NOTFOUND:
                head = self._call("head_object")
                if int(head.get("ContentLength", -1)) == stored_bytes:
                    return
            raise
        self._upload_id = None

    def abort(self) -> None:
        if self._upload_id is None:
            return
        try:
            self._call("abort_multipart_upload", UploadId=self._upload_id)
        except Exception as e:
            logger.warning("%s: could not abort the multipart upload of %s/%s (%s); "
                           "its parts stay until a bucket lifecycle rule removes them",
                           self._st.display_url, self._bucket, self._key,
                           self._st._scrub(_describe(e)))


class _AzureSink(_Sink):
    def __init__(self, storage: "FsspecStorage", path: str) -> None:
        self._st = storage
        container, blob, _ = storage._fs.split_path(path)
        self._client = storage._fs.service_client.get_blob_client(container, blob)
        self._kw = storage._az_request_kw

    def _run(self, coro_fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        from fsspec.asyn import sync
        return sync(self._st._fs.loop, coro_fn, *args, **kw, **self._kw)

    @staticmethod
    def _block_id(index: int) -> str:
        return base64.b64encode(f"nebula-{index:010d}".encode()).decode()

    def put_single(self, body: Any) -> None:
        # upload_blob cannot take a memoryview (it concatenates bytes); small views are copied
        # (cheaper than a second round trip), large ones go up as one block (no copy)
        if isinstance(body, memoryview) and len(body) > _AZ_SMALL_COPY:
            self.complete([self.put_part(0, body)], len(body), 1)
            return
        if isinstance(body, memoryview):
            body = body.tobytes()
        self._run(self._client.upload_blob, body, length=len(body), overwrite=True)

    def put_part(self, index: int, body: Any) -> Any:
        bid = self._block_id(index)
        self._run(self._client.stage_block, bid, body, length=len(body))
        return bid

    def complete(self, tokens: list[Any], stored_bytes: int, attempt: int) -> None:
        from azure.storage.blob import BlobBlock
        self._run(self._client.commit_block_list, [BlobBlock(block_id=b) for b in tokens])


class _StreamSink(_Sink):
    """Generic fsspec filesystems: parts written in order to one stream (not retryable per part)."""

    parallel = False

    def __init__(self, storage: "FsspecStorage", path: str) -> None:
        self._st = storage
        self._path = path
        self._f: Any = None

    def put_single(self, body: Any) -> None:
        self.begin()
        self.put_part(0, body)
        self.complete([], len(body), 1)

    def begin(self) -> None:
        self._st._prepare_parent(self._path)
        self._f = self._st._fs.open(self._path, "wb")

    def put_part(self, index: int, body: Any) -> Any:
        self._f.write(body)
        return index

    def complete(self, tokens: list[Any], stored_bytes: int, attempt: int) -> None:
        f, self._f = self._f, None
        try:
            f.flush()
            if self._st._is_local_fs:
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
            except Exception:
                pass
        try:
            self._st._fs.rm_file(self._path)
        except Exception:
            pass


# --------------------------------------------------------------------------------------------
# The storage backend
# --------------------------------------------------------------------------------------------


#: schemes whose ``pipe_file(mode="create")`` is known to be a real conditional create
#: (S3 and Azure send ``If-None-Match: *``; verified against moto and Azurite by the tests)
_CREATE_ONLY_VERIFIED = {"memory", "file", "local", "s3", "s3a", "az", "abfs", "abfss"}
_warned_create_only: set[str] = set()


def _warn_unverified_create_only(protocol: str) -> None:
    if protocol not in _warned_create_only:
        _warned_create_only.add(protocol)
        logger.warning("remote tier scheme '%s://': create-only writes rely on the fsspec backend "
                       "honouring pipe_file(mode='create'); this was not verified for this "
                       "scheme, so the commit marker may not be protected against a concurrent "
                       "writer", protocol)


def _display_url(url: str) -> tuple[str, set[str]]:
    """URL without credentials / query string, and the secrets found in the URL."""
    secrets: set[str] = set()
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        if ":" in userinfo:  # user:password@host -> drop it (az's container@account stays)
            user, _, password = userinfo.partition(":")
            secrets.update(x for x in (user, password) if x)
            netloc = host
    if parts.query:
        secrets.add(parts.query)
        secrets.update(v for _, v in urllib.parse.parse_qsl(parts.query) if len(v) >= 4)
    if not parts.scheme:
        return url.split("?", 1)[0].rstrip("/") or "/", secrets
    shown = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))
    if shown.endswith("/") and not shown.endswith("://") and not shown.endswith(":///"):
        shown = shown.rstrip("/")
    return shown, secrets


class FsspecStorage(Storage):
    """:class:`Storage` over an fsspec filesystem (Azure Blob, S3, GCS, memory, file).

    Args:
        url: tier root, e.g. ``"az://container/prefix"``, ``"s3://bucket/prefix"``,
            ``"memory://ckpt"``. A query string or ``user:password@`` in the URL is never shown.
        storage_options: passed to the fsspec filesystem (credentials, endpoint, ...). Defaults
            added when absent: connect/read timeouts of 10 s / 60 s (S3: ``config_kwargs``
            ``connect_timeout`` / ``read_timeout``; Azure: ``connection_timeout`` /
            ``read_timeout``), no listings cache, and the SDKs' own retries disabled (this
            class retries per the ``remote_*`` knobs). The filesystem instance is private to
            this object (fsspec's instance cache is skipped).

    Attributes:
        display_url: the URL without credentials or query string (safe to log).
        on_part_uploaded: optional test/progress hook ``f(rel, part_index)`` called from the
            upload thread after each part of a multi-part upload has been accepted.

    Raises:
        ImportError: the fsspec backend for the URL's scheme is not installed (the message
            says which extra to install).
    """

    is_local = False

    def __init__(self, url: str, storage_options: Optional[dict[str, Any]] = None) -> None:
        self.display_url, url_secrets = _display_url(url)
        options = dict(storage_options or {})
        self._scrub = _Scrubber(_collect_secrets(options) | url_secrets)
        self.on_part_uploaded: Optional[Callable[[str, int], None]] = None
        self._closed = False

        import fsspec

        clean_url = url.split("?", 1)[0]
        parts = urllib.parse.urlsplit(clean_url)
        if "@" in parts.netloc and ":" in parts.netloc.rpartition("@")[0]:
            clean_url = urllib.parse.urlunsplit(
                (parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))
        protocol = parts.scheme or "file"
        try:
            cls = fsspec.get_filesystem_class(protocol)
        except ImportError:
            hint = _INSTALL_HINTS.get(protocol, "install the fsspec implementation for this scheme")
            raise ImportError(
                f"remote tier {self.display_url}: the '{protocol}://' backend is not installed; "
                f"{hint}") from None
        except ValueError as e:
            raise ValueError(f"remote tier {self.display_url}: unknown URL scheme "
                             f"'{protocol}://' ({e})") from None

        module = cls.__module__
        if module.startswith("s3fs"):
            self._kind = "s3"
        elif module.startswith("adlfs"):
            self._kind = "azure"
        else:
            self._kind = "generic"
        self._protocol = protocol

        for k, v in (cls._get_kwargs_from_urls(clean_url) or {}).items():
            options.setdefault(k, v)
        connect_timeout = float(_DEFAULT_CONNECT_TIMEOUT_S)
        read_timeout = float(_DEFAULT_READ_TIMEOUT_S)
        self._az_request_kw: dict[str, Any] = {}
        if self._kind == "s3":
            cfg = dict(options.get("config_kwargs") or {})
            cfg.setdefault("connect_timeout", connect_timeout)
            cfg.setdefault("read_timeout", read_timeout)
            cfg.setdefault("retries", {"max_attempts": 0, "mode": "standard"})
            cfg.setdefault("max_pool_connections",
                           max(10, 2 * int(knobs.get("remote_concurrency"))))
            options["config_kwargs"] = cfg
            options.setdefault("use_listings_cache", False)
        elif self._kind == "azure":
            options.setdefault("connection_timeout", connect_timeout)
            options.setdefault("read_timeout", read_timeout)
            options.setdefault("use_listings_cache", False)
            self._az_request_kw = {"connection_timeout": options["connection_timeout"],
                                   "read_timeout": options["read_timeout"],
                                   "retry_total": 0}
        try:
            self._fs = cls(skip_instance_cache=True, **options)
        except Exception as e:
            err = self._error("connect", "", e, _classify(e), 1)
        else:
            err = None
        if err is not None:
            raise err
        if self._kind == "s3":
            # our own retry loop governs (knobs); s3fs would otherwise retry 5x on its own
            self._fs.retries = 1
        elif self._kind == "azure":
            self._tune_azure_client(connect_timeout=options["connection_timeout"],
                                    read_timeout=options["read_timeout"])
        self._is_local_fs = "file" in (cls.protocol if isinstance(cls.protocol, tuple)
                                       else (cls.protocol,))
        self._root = cls._strip_protocol(clean_url).rstrip("/")
        if not self._root and self._kind != "generic":
            raise ValueError(f"remote tier {self.display_url}: the URL needs a container/bucket "
                             f"name, e.g. s3://bucket/prefix or az://container/prefix")
        logger.debug("remote tier %s: %s backend (%s)", self.display_url, self._kind, cls.__name__)

    # ---------------------------------------------------------------- plumbing

    def __repr__(self) -> str:
        return f"FsspecStorage({self.display_url!r})"

    def _tune_azure_client(self, connect_timeout: float, read_timeout: float) -> None:
        """Turn off the Azure SDK's retries (15 s+ backoff, ~85 s per refused call) and set
        transport timeouts on the client adlfs built, so adlfs calls fail fast into our loop."""
        sc = getattr(self._fs, "service_client", None)
        policy = getattr(getattr(sc, "_config", None), "retry_policy", None)
        if policy is not None:
            for attr in ("total_retries", "connect_retries", "read_retries", "status_retries"):
                if hasattr(policy, attr):
                    setattr(policy, attr, 0)
        else:  # pragma: no cover - depends on the SDK version
            logger.debug("azure client has no retry policy to tune; outages may be slow to report")
        transport = getattr(getattr(sc, "_pipeline", None), "_transport", None)
        cc = getattr(transport, "connection_config", None)
        if cc is not None:
            cc.timeout = connect_timeout
            cc.read_timeout = read_timeout

    def _path(self, rel: str) -> str:
        rel = (rel or "").strip("/")
        if rel:
            for comp in rel.split("/"):
                if comp in ("", ".", ".."):
                    raise ValueError(f"remote tier {self.display_url}: invalid relative path {rel!r}")
        if not rel:
            return self._root
        return f"{self._root}/{rel}" if self._root else rel

    def _where(self, rel: str) -> str:
        rel = (rel or "").strip("/")
        return f"{self.display_url}/{rel}" if rel else self.display_url

    def _prepare_parent(self, path: str) -> None:
        if self._is_local_fs:
            parent = path.rsplit("/", 1)[0]
            if parent:
                self._fs.makedirs(parent, exist_ok=True)

    def _invalidate(self, path: str = "") -> None:
        try:
            self._fs.invalidate_cache(path or None)
        except Exception:  # pragma: no cover - best effort
            pass

    def _check_open(self) -> None:
        if self._closed:
            raise RemoteStorageError(f"remote tier {self.display_url} is closed",
                                     url=self.display_url)

    def _error(self, op: str, rel: str, exc: BaseException, kind: str, attempts: int) -> BaseException:
        """Our exception for backend exception ``exc`` (scrubbed, cause chained, no context)."""
        where = self._where(rel)
        said = self._scrub(_describe(exc))
        tries = f" after {attempts} attempts" if attempts > 1 else ""
        err: BaseException
        if kind == _K_NOTFOUND:
            err = FileNotFoundError(errno.ENOENT, f"no such object on the remote tier ({op})", where)
        elif kind == _K_EXISTS:
            err = FileExistsError(errno.EEXIST, "object already exists on the remote tier "
                                  "(create-only write)", where)
        elif kind == _K_AUTH:
            err = RemoteAuthError(
                f"{op} {where}: the object store rejected the request as unauthorized (HTTP 401/403). "
                f"Check the credentials in storage_options (access key / secret, account key, SAS "
                f"token or connection string), that they are for this endpoint, and that they "
                f"allow read, write, list and delete on {self.display_url}. Backend said: {said}",
                url=self.display_url, rel=rel, op=op, attempts=attempts)
        elif kind == _K_CONTAINER:
            err = RemoteContainerNotFoundError(
                f"{op} {where}: the container/bucket of {self.display_url} does not exist. Create it "
                f"(or fix the URL / endpoint) before using this tier. Backend said: {said}",
                url=self.display_url, rel=rel, op=op, attempts=attempts)
        elif kind == _K_TRANSIENT:
            err = RemoteUnavailableError(
                f"{op} {where} failed{tries} with transient errors (endpoint unreachable, timeout, "
                f"throttling or HTTP 5xx). Check that the endpoint is reachable; for flaky links "
                f"raise NEBULA_REMOTE_RETRIES / NEBULA_REMOTE_BACKOFF_MAX_S. Last error: {said}",
                url=self.display_url, rel=rel, op=op, attempts=attempts)
        else:
            err = RemoteStorageError(f"{op} {where} failed{tries}: {said}",
                                     url=self.display_url, rel=rel, op=op, attempts=attempts)
        cause = RemoteBackendError(
            f"{type(exc).__module__}.{type(exc).__qualname__}: {self._scrub(' '.join(str(exc).split()))}")
        cause.__traceback__ = exc.__traceback__
        cause.__suppress_context__ = True
        err.__cause__ = cause
        err.__suppress_context__ = True
        return err

    def _retry(self, op: str, rel: str, fn: Callable[[int], T], *,
               abort: Optional[threading.Event] = None) -> T:
        """Run ``fn(attempt)``; retry transient errors with capped exponential backoff + jitter.

        Raises our scrubbed exception (never the backend's) once attempts are exhausted or the
        error is permanent. ``abort`` (set by a failed sibling part) stops retrying early.
        """
        self._check_open()
        tries = max(1, int(knobs.get("remote_retries")))
        base = max(0.0, float(knobs.get("remote_backoff_s")))
        cap = max(base, float(knobs.get("remote_backoff_max_s")))
        failure: Optional[BaseException] = None
        kind = _K_PERMANENT
        attempt = 0
        for attempt in range(1, tries + 1):
            try:
                return fn(attempt)
            except RemoteStorageError:
                raise  # already ours (scrubbed)
            except Exception as e:  # noqa: BLE001 - classified below
                kind = _classify(e)
                if kind != _K_TRANSIENT or attempt >= tries or (abort is not None and abort.is_set()):
                    failure = e
                    break
                delay = min(cap, base * (2 ** (attempt - 1))) * random.uniform(0.5, 1.0)
                logger.warning("remote tier %s: %s %s failed (attempt %d/%d): %s; retrying in %.2fs",
                               self.display_url, op, rel or "/", attempt, tries,
                               self._scrub(_describe(e)), delay)
            if abort is not None:
                if abort.wait(delay):
                    break
            else:
                time.sleep(delay)
        assert failure is not None or (abort is not None and abort.is_set())
        if failure is None:
            raise RemoteStorageError(f"{op} {self._where(rel)} abandoned: a sibling part failed",
                                     url=self.display_url, rel=rel, op=op, attempts=attempt)
        # raised outside the except block: no __context__ pointing at the unscrubbed exception
        err = self._error(op, rel, failure, kind, attempt)
        del failure
        raise err

    def _part_size(self, n: int) -> int:
        # Split even mid-sized files across every upload slot, but never into tiny parts.
        conc = max(1, int(knobs.get("remote_concurrency")))
        part = max(1, min(int(knobs.get("remote_part_bytes")), max(8 << 20, math.ceil(n / conc))))
        if self._kind == "s3":
            part = max(part, _S3_MIN_PART, math.ceil(n / _S3_MAX_PARTS))
        elif self._kind == "azure":
            part = min(max(part, math.ceil(n / _AZ_MAX_BLOCKS)), _AZ_MAX_BLOCK)
        return part

    def _sink(self, path: str) -> _Sink:
        if self._kind == "s3":
            return _S3Sink(self, path)
        if self._kind == "azure":
            return _AzureSink(self, path)
        return _StreamSink(self, path)

    # ---------------------------------------------------------------- Storage API

    def check_access(self) -> None:
        """One cheap listing of the tier root to verify endpoint, credentials and container.

        Called by the Checkpointer at creation so a wrong key or a missing bucket fails at once
        instead of at the first save.

        Raises:
            RemoteAuthError: credentials rejected / operation denied.
            RemoteContainerNotFoundError: the container / bucket does not exist.
            RemoteUnavailableError: the endpoint did not answer within the retries.
        """
        def probe(attempt: int) -> None:
            if self._kind == "s3":
                bucket, key, _ = self._fs.split_path(self._root)
                prefix = f"{key}/" if key else ""
                from fsspec.asyn import sync
                sync(self._fs.loop, self._fs._call_s3, "list_objects_v2", Bucket=bucket,
                     Prefix=prefix, MaxKeys=1)
            elif self._kind == "azure":
                container, key, _ = self._fs.split_path(self._root)
                prefix = f"{key}/" if key else None
                cc = self._fs.service_client.get_container_client(container)

                async def first_page() -> None:
                    pages = cc.list_blobs(name_starts_with=prefix, results_per_page=1,
                                          **self._az_request_kw).by_page()
                    async for page in pages:
                        async for _ in page:
                            break
                        break

                from fsspec.asyn import sync
                sync(self._fs.loop, first_page)
            else:
                if self._is_local_fs:
                    self._fs.makedirs(self._root, exist_ok=True)
                try:
                    self._fs.ls(self._root, detail=False)
                except FileNotFoundError:
                    pass

        t0 = time.monotonic()
        self._retry("check access", "", probe)
        logger.debug("remote tier %s: access ok (%.3fs)", self.display_url, time.monotonic() - t0)

    def write_buffer(self, rel: str, data: Buffer, *, compression: Optional[str] = None) -> dict[str, Any]:
        """Upload ``data`` to ``rel`` (a new, unique name), durable on return.

        Buffers larger than ``remote_part_bytes`` go up as parallel parts (at most
        ``remote_concurrency`` in flight), each streamed from a slice of ``data`` (no whole
        copy). With ``compression="zstd"`` each part is compressed independently (level knob
        ``zstd_level``) so parts stay parallel and can be decompressed in parallel.

        Returns:
            ``{"stored_bytes": n}``, plus ``"compression": "zstd"`` and
            ``"frames": [[raw_len, stored_len], ...]`` when compressed.

        Raises:
            ValueError: unknown ``compression``.
            RemoteStorageError (or a subclass): the upload failed; the message names the tier
                and ``rel``.
        """
        if compression not in (None, "zstd"):
            raise ValueError(f"remote tier {self.display_url}: unsupported compression "
                             f"{compression!r} (use None or 'zstd')")
        self._check_open()
        mv = _byte_view(data)
        path = self._path(rel)
        n = len(mv)
        part = self._part_size(n)
        conc = max(1, int(knobs.get("remote_concurrency")))
        level = int(knobs.get("zstd_level"))
        zstd = _zstd() if compression == "zstd" else None
        ranges = [(off, min(part, n - off)) for off in range(0, n, part)]
        frames: list[list[int]] = []
        t0 = time.monotonic()

        def compress(r: tuple[int, int]) -> bytes:
            return zstd.ZstdCompressor(level=level).compress(mv[r[0]:r[0] + r[1]])

        if len(ranges) <= 1:
            body: Any = mv
            if zstd is not None:
                body = compress((0, n))
                frames.append([n, len(body)])
            sink = self._sink(path)

            def single(attempt: int) -> None:
                sink.put_single(body)

            self._retry("upload", rel, single)
            stored = len(body)
            nparts = 1
        else:
            stored, nparts = self._write_parts(rel, path, mv, ranges, conc,
                                               compress if zstd is not None else None, frames)
        dt = time.monotonic() - t0
        logger.debug("remote tier %s: wrote %s (%d bytes, %d stored, %d part(s)) in %.3fs (%.1f MB/s)",
                     self.display_url, rel, n, stored, nparts, dt, n / max(dt, 1e-9) / 1e6)
        info: dict[str, Any] = {"stored_bytes": stored}
        if zstd is not None:
            info["compression"] = "zstd"
            info["frames"] = frames
        return info

    def _write_parts(self, rel: str, path: str, mv: memoryview, ranges: list[tuple[int, int]],
                     conc: int, compress: Optional[Callable[[tuple[int, int]], bytes]],
                     frames: list[list[int]]) -> tuple[int, int]:
        """Multi-part upload pipeline; returns (stored bytes, number of upload parts).

        Memory bound: at most ``conc`` compressed frames pending plus ``conc`` parts in flight
        (uncompressed parts are slices of ``mv``: no copy at all).
        """
        sink = self._sink(path)
        nraw = len(ranges)
        failed = threading.Event()
        workers = conc if sink.parallel else max(1, conc if compress else 1)

        def stored_chunks(pool: ThreadPoolExecutor) -> Iterator[Any]:
            if compress is None:
                for off, ln in ranges:
                    yield mv[off:off + ln]
                return
            for (off, ln), blob in zip(ranges, _in_order(pool, compress, ranges, conc, failed)):
                frames.append([ln, len(blob)])
                yield blob

        def upload(index: int, body: Any) -> Any:
            if failed.is_set():
                raise RemoteStorageError(f"upload {self._where(rel)} abandoned", url=self.display_url,
                                         rel=rel, op="upload part")
            try:
                token = self._retry(f"upload part {index + 1}", rel,
                                    lambda attempt: sink.put_part(index, body), abort=failed)
            except BaseException:
                failed.set()
                raise
            hook = self.on_part_uploaded
            if hook is not None:
                hook(rel, index)
            return token

        stored = 0
        tokens: list[Any] = []
        begun = False
        try:
            if sink.parallel:
                self._retry("start multipart upload", rel, lambda attempt: sink.begin())
            else:
                sink.begin()
            begun = True
            with ThreadPoolExecutor(max_workers=workers,
                                    thread_name_prefix="nebula-remote-up") as pool:
                slots = threading.BoundedSemaphore(conc)
                futures: list[Future] = []
                try:
                    for index, body in enumerate(_coalesce(stored_chunks(pool), sink.min_part)):
                        stored += len(body)
                        if not sink.parallel:
                            tokens.append(sink.put_part(index, body))
                            continue
                        while not slots.acquire(timeout=0.5):
                            if failed.is_set():
                                break
                        if failed.is_set():
                            break
                        fut = pool.submit(upload, index, body)
                        fut.add_done_callback(lambda f: slots.release())
                        futures.append(fut)
                        del body
                    if sink.parallel:
                        tokens = [f.result() for f in futures]
                except BaseException:
                    failed.set()
                    pool.shutdown(wait=True, cancel_futures=True)
                    # report the first real part failure rather than a follow-on abandonment
                    for f in futures:
                        if f.done() and not f.cancelled() and f.exception() is not None:
                            exc = f.exception()
                            if not (type(exc) is RemoteStorageError and "abandoned" in str(exc)):
                                raise exc  # our scrubbed error; keep its __cause__
                    raise
            if failed.is_set():  # pragma: no cover - defensive
                raise RemoteStorageError(f"upload {self._where(rel)} failed", url=self.display_url,
                                         rel=rel, op="upload")
            if sink.parallel:
                self._retry("complete multipart upload", rel,
                            lambda attempt: sink.complete(tokens, stored, attempt))
            else:
                sink.complete(tokens, stored, 1)
        except BaseException as e:
            if begun:
                sink.abort()
            if sink.parallel or not isinstance(e, Exception) or isinstance(
                    e, (RemoteStorageError, FileNotFoundError, FileExistsError, ValueError)):
                raise
            # generic stream: wrap the backend's exception (raised below, outside this block,
            # so that the unscrubbed exception is not attached as __context__)
            wrapped = self._error("upload", rel, e, _classify(e), 1)
        else:
            wrapped = None
        if wrapped is not None:
            raise wrapped
        if compress is not None and len(frames) != nraw:  # pragma: no cover - defensive
            raise RemoteStorageError(f"upload {self._where(rel)}: compressed {len(frames)} of "
                                     f"{nraw} frames", url=self.display_url, rel=rel, op="upload")
        return stored, len(tokens) if sink.parallel else max(1, len(tokens))

    def read_buffer(self, rel: str, info: Optional[dict[str, Any]] = None) -> Buffer:
        """Download ``rel`` into one preallocated buffer with parallel ranged reads.

        zstd frames (from ``info["frames"]``) are fetched and decompressed in parallel straight
        into their raw offsets. At most ``remote_concurrency`` ranges are in flight.

        Returns:
            A writable memoryview over a ``bytearray`` holding the raw bytes.

        Raises:
            FileNotFoundError: ``rel`` does not exist.
            ValueError: ``info`` names an unknown compression or an inconsistent frame table.
            RemoteStorageError (or a subclass): the download failed.
        """
        self._check_open()
        info = info or {}
        path = self._path(rel)
        comp = info.get("compression")
        if comp not in (None, "zstd"):
            raise ValueError(f"{self._where(rel)}: unknown compression {comp!r} in storage info")
        conc = max(1, int(knobs.get("remote_concurrency")))
        t0 = time.monotonic()
        # tasks: (stored offset, stored length, raw offset, raw length)
        tasks: list[tuple[int, int, int, int]] = []
        if comp == "zstd":
            zstd = _zstd()
            soff = roff = 0
            for raw_len, stored_len in info.get("frames") or []:
                tasks.append((soff, int(stored_len), roff, int(raw_len)))
                soff += int(stored_len)
                roff += int(raw_len)
            total = roff
            if "stored_bytes" in info and int(info["stored_bytes"]) != soff:
                raise ValueError(f"{self._where(rel)}: frame table ({soff} bytes) does not match "
                                 f"stored_bytes={info['stored_bytes']}")
        else:
            total = int(info["stored_bytes"]) if "stored_bytes" in info else self.size(rel)
            conc = max(1, int(knobs.get("remote_concurrency")))
            part = max(1, min(int(knobs.get("remote_part_bytes")), max(16 << 20, math.ceil(total / conc))))
            tasks = [(off, min(part, total - off), off, min(part, total - off))
                     for off in range(0, total, part)]
        out = bytearray(total)
        omv = memoryview(out)

        def fetch(task: tuple[int, int, int, int]) -> None:
            soff, slen, roff, rlen = task

            def get(attempt: int) -> bytes:
                return self._fs.cat_file(path, start=soff, end=soff + slen)

            blob = self._retry(f"read range {soff}-{soff + slen}", rel, get)
            if len(blob) != slen:
                raise RemoteStorageError(
                    f"read {self._where(rel)}: short read at offset {soff} ({len(blob)} of {slen} "
                    f"bytes); the object is smaller than its manifest says", url=self.display_url,
                    rel=rel, op="read")
            if comp == "zstd":
                w = _ViewWriter(omv[roff:roff + rlen])
                try:
                    with zstd.ZstdDecompressor().stream_writer(w, write_size=_MiB, closefd=False) as d:
                        d.write(blob)
                except zstd.ZstdError as e:
                    raise RemoteStorageError(f"read {self._where(rel)}: zstd frame at raw offset "
                                             f"{roff} is corrupt ({e})", url=self.display_url,
                                             rel=rel, op="decompress") from None
                if w.pos != rlen:
                    raise RemoteStorageError(f"read {self._where(rel)}: zstd frame at raw offset "
                                             f"{roff} gave {w.pos} bytes, expected {rlen}",
                                             url=self.display_url, rel=rel, op="decompress")
            else:
                omv[roff:roff + rlen] = blob

        if len(tasks) <= 1:
            for t in tasks:
                fetch(t)
        else:
            with ThreadPoolExecutor(max_workers=min(conc, len(tasks)),
                                    thread_name_prefix="nebula-remote-down") as pool:
                futures = [pool.submit(fetch, t) for t in tasks]
                try:
                    for f in futures:
                        f.result()
                except BaseException:
                    pool.shutdown(wait=True, cancel_futures=True)
                    raise
        dt = time.monotonic() - t0
        logger.debug("remote tier %s: read %s (%d bytes, %d range(s)) in %.3fs (%.1f MB/s)",
                     self.display_url, rel, total, len(tasks), dt, total / max(dt, 1e-9) / 1e6)
        return omv

    def write_small(self, rel: str, data: bytes, *, create_only: bool = False) -> None:
        """Write a small object in one request (atomic on object stores).

        With ``create_only=True`` the write is conditional (``If-None-Match: *`` on S3 and
        Azure, ``O_EXCL``-style on file/memory) and raises ``FileExistsError`` if ``rel``
        exists. A retry after a lost response that finds our own bytes there counts as success.
        """
        self._check_open()
        path = self._path(rel)
        payload = bytes(data)

        if self._is_local_fs:
            self._retry("write", rel, lambda attempt: self._local_write_small(path, payload, create_only))
            return
        if create_only and self._kind == "generic" and self._protocol not in _CREATE_ONLY_VERIFIED:
            _warn_unverified_create_only(self._protocol)

        def put(attempt: int) -> None:
            if not create_only:
                self._fs.pipe_file(path, payload)
                return
            try:
                self._fs.pipe_file(path, payload, mode="create")
            except FileExistsError:
                if attempt > 1:
                    # our first attempt may have landed before its response was lost
                    try:
                        if self._fs.cat_file(path) == payload:
                            logger.info("remote tier %s: create-only write of %s found its own "
                                        "earlier attempt; treating as success", self.display_url, rel)
                            return
                    except Exception:  # noqa: BLE001 - report the FileExistsError
                        pass
                raise

        self._retry("create" if create_only else "write", rel, put)

    def _local_write_small(self, path: str, payload: bytes, create_only: bool) -> None:
        """file://: tmp + fsync + rename (or link for create-only) + directory fsync."""
        parent = os.path.dirname(path) or "."
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex}")
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        try:
            if create_only:
                os.link(tmp, path)  # fails with FileExistsError if present
            else:
                os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        fd = os.open(parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def read_small(self, rel: str) -> bytes:
        """Return the whole content of ``rel``. Raises ``FileNotFoundError``."""
        path = self._path(rel)
        return self._retry("read", rel, lambda attempt: self._fs.cat_file(path))

    def list(self, rel_dir: str = "") -> list[str]:
        """Sorted names (not paths) of the direct children of ``rel_dir``; ``[]`` if missing.

        Never served from a listings cache. Names are normalised across backends: no prefix,
        no trailing slash. Pseudo-directories (common prefixes) are listed by name too.

        Raises:
            RemoteContainerNotFoundError: the container / bucket itself is missing.
        """
        path = self._path(rel_dir)

        def ls(attempt: int) -> list[Any]:
            self._invalidate(path)
            return self._fs.ls(path, detail=True)

        try:
            entries = self._retry("list", rel_dir, ls)
        except FileNotFoundError:
            return []
        me = path.strip("/")
        names: set[str] = set()
        for e in entries:
            name = e["name"] if isinstance(e, dict) else str(e)
            name = name.rstrip("/")
            if name.strip("/") == me:
                continue  # the directory (or file) itself
            base = name.rsplit("/", 1)[-1]
            if base:
                names.add(base)
        return sorted(names)

    def _info(self, rel: str) -> Optional[dict[str, Any]]:
        path = self._path(rel)

        def info(attempt: int) -> dict[str, Any]:
            self._invalidate(path)
            return self._fs.info(path)

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

    def remove(self, rel: str) -> None:
        """Delete object ``rel``; a missing object is not an error (same on every backend)."""
        path = self._path(rel)

        def rm(attempt: int) -> None:
            self._fs.rm_file(path)

        try:
            self._retry("remove", rel, rm)
        except FileNotFoundError:
            pass
        self._invalidate(path)

    def incomplete_uploads(self) -> list[tuple[str, str]]:
        """``(rel, upload_id)`` of multipart uploads never completed under this root (S3 only).

        A writer killed mid-upload leaves its parts stored (and billed) with no object to list;
        retention aborts them. Azure discards uncommitted blocks by itself, so it has none here.
        """
        if self._kind != "s3":
            return []
        from fsspec.asyn import sync

        bucket, key, _ = self._fs.split_path(self._path(""))
        prefix = key.rstrip("/") + "/" if key else ""

        def ls(attempt: int) -> list[tuple[str, str]]:
            out, kw = [], {"Bucket": bucket, "Prefix": prefix}
            while True:
                page = sync(self._fs.loop, self._fs._call_s3, "list_multipart_uploads", **kw)
                for u in page.get("Uploads", []):
                    out.append((u["Key"][len(prefix):], u["UploadId"]))
                if not page.get("IsTruncated"):
                    return out
                kw.update(KeyMarker=page["NextKeyMarker"], UploadIdMarker=page["NextUploadIdMarker"])

        return self._retry("list multipart uploads", "", ls)

    def abort_upload(self, rel: str, upload_id: str) -> None:
        """Abort one incomplete multipart upload (S3; a no-op elsewhere)."""
        if self._kind != "s3":
            return
        from fsspec.asyn import sync

        bucket, key, _ = self._fs.split_path(self._path(rel))
        try:
            sync(self._fs.loop, self._fs._call_s3, "abort_multipart_upload", Bucket=bucket, Key=key,
                 UploadId=upload_id)
        except FileNotFoundError:
            pass

    def remove_dir(self, rel: str) -> None:
        """Delete every object under ``rel/`` (and ``rel`` itself if it is an object).

        Never deletes the container / bucket, and never touches siblings sharing a name prefix
        (``step-1`` does not match ``step-10``). A missing directory is not an error.
        """
        path = self._path(rel)
        if self._kind == "generic":
            def rm_tree(attempt: int) -> None:
                self._invalidate(path)
                self._fs.rm(path, recursive=True)

            try:
                self._retry("remove dir", rel, rm_tree)
            except FileNotFoundError:
                pass
            self._invalidate(path)
            return

        def find(attempt: int) -> list[str]:
            self._invalidate(path)
            return list(self._fs.find(path, withdirs=False))

        try:
            found = self._retry("list for remove", rel, find)
        except FileNotFoundError:
            found = []
        me = path.strip("/")
        victims = [f for f in found if f.strip("/") == me or f.strip("/").startswith(me + "/")]
        if victims:
            def rm_many(attempt: int) -> None:
                try:
                    self._fs.rm(victims)
                except FileNotFoundError:
                    pass

            self._retry("remove dir", rel, rm_many)
        self._invalidate(path)
        logger.debug("remote tier %s: removed %d object(s) under %s", self.display_url,
                     len(victims), rel or "/")

    def close(self) -> None:
        """Close the backend's HTTP sessions. Idempotent; the object is unusable afterwards."""
        if self._closed:
            return
        self._closed = True
        fs = getattr(self, "_fs", None)
        if fs is None:
            return
        try:
            from fsspec.asyn import sync
            if self._kind == "azure":
                sync(fs.loop, fs.service_client.close)
            elif self._kind == "s3" and getattr(fs, "_s3", None) is not None:
                sync(fs.loop, fs._s3.close)
                fs._s3 = None
        except Exception as e:  # noqa: BLE001 - best effort
            logger.debug("remote tier %s: close: %s", self.display_url, self._scrub(_describe(e)))
