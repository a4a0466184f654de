"""Exceptions of the remote tier, and the one function that turns a backend exception into ours.

Every message names the operation, the tier (display URL, never credentials) and the relative
path, and says what to check. The backend SDK's exception is chained as ``__cause__`` in
scrubbed form (:class:`RemoteBackendError`), never as itself.
"""

from __future__ import annotations

import errno
from typing import Any, Callable, Optional

from nebula_ckpt.errors import CorruptCheckpointError, NebulaError
from nebula_ckpt.storage.remote.retry import Kind, describe


class RemoteStorageError(NebulaError, OSError):
    """A remote-tier operation failed.

    The message names the operation, the tier (display URL, never credentials) and the relative
    path. The backend's exception is chained as ``__cause__`` in scrubbed form
    (:class:`RemoteBackendError`: type name and message with secrets removed, original traceback).

    Attributes:
        url: display URL of the tier.
        rel: relative path of the object ("" for the tier root).
        op: the operation that failed (``"upload part 3"``, ``"list"``, ...).
        attempts: how many attempts were made.
        abandoned: True when this part was given up because a sibling part failed.
    """

    abandoned = False

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
    """Transient errors (unreachable endpoint, timeouts, throttling, 5xx) outlasted the retries
    or the operation's deadline (knob ``remote_timeout_s``)."""


class CorruptRemoteDataError(RemoteStorageError, CorruptCheckpointError):
    """An object's bytes do not match its storage info (short object, undecodable zstd frame)."""


class StorageInfoError(CorruptCheckpointError, ValueError):
    """The storage info of an object (from its manifest) is malformed or contradicts the object.

    Raised by ``read_buffer`` *before* any buffer is allocated, so that a damaged or crafted
    manifest cannot make a restore allocate memory the object could never fill.
    """


class RemoteBackendError(Exception):
    """Scrubbed stand-in for a backend SDK exception, chained as ``__cause__``.

    Carries the original exception's type name and message with credentials removed, and the
    original traceback (frames only; no secrets live in source lines).
    """


def storage_error(exc: BaseException, kind: str, *, op: str, url: str, rel: str, attempts: int,
                  scrub: Callable[[str], str], elapsed_s: Optional[float] = None,
                  deadline_s: Optional[float] = None) -> BaseException:
    """Our exception for backend exception ``exc`` (scrubbed, cause chained, no context).

    Args:
        exc: what the backend raised.
        kind: its :class:`~.retry.Kind`.
        op: the operation (``"upload part 2"``).
        url: the tier's display URL.
        rel: the object's relative path.
        attempts: attempts made.
        scrub: removes credentials from text.
        elapsed_s: time spent on the operation, when it ran out of time.
        deadline_s: the operation's deadline, when it ran out of time.

    Returns:
        ``FileNotFoundError`` / ``FileExistsError`` (standard meaning) or a
        :class:`RemoteStorageError` subclass; raise it outside any ``except`` block.
    """
    where = f"{url}/{rel}" if rel else url
    said = scrub(describe(exc))
    tries = f" after {attempts} attempts" if attempts > 1 else ""
    if deadline_s is not None and elapsed_s is not None:
        tries += f" in {elapsed_s:.1f} s (deadline NEBULA_REMOTE_TIMEOUT_S={deadline_s:g} s)"
    meta: dict[str, Any] = dict(url=url, rel=rel, op=op, attempts=attempts)
    err: BaseException
    if kind == Kind.NOTFOUND:
        err = FileNotFoundError(errno.ENOENT, f"no such object on the remote tier ({op})", where)
    elif kind == Kind.EXISTS:
        err = FileExistsError(errno.EEXIST, "object already exists on the remote tier "
                              "(create-only write)", where)
    elif kind == Kind.AUTH:
        err = RemoteAuthError(
            f"{op} {where}: the object store rejected the request as unauthorized (HTTP 401/403). "
            f"Check the credentials in storage_options (access key / secret, account key, SAS "
            f"token or connection string), that they are for this endpoint, and that they "
            f"allow read, write, list and delete on {url}. Backend said: {said}", **meta)
    elif kind == Kind.CONTAINER:
        err = RemoteContainerNotFoundError(
            f"{op} {where}: the container/bucket of {url} does not exist. Create it "
            f"(or fix the URL / endpoint) before using this tier. Backend said: {said}", **meta)
    elif kind == Kind.TRANSIENT:
        err = RemoteUnavailableError(
            f"{op} {where} failed{tries} with transient errors (endpoint unreachable, timeout, "
            f"throttling or HTTP 5xx). Check that the endpoint is reachable; for flaky or slow "
            f"links raise NEBULA_REMOTE_TIMEOUT_S / NEBULA_REMOTE_RETRIES. Last error: {said}",
            **meta)
    else:
        err = RemoteStorageError(f"{op} {where} failed{tries}: {said}", **meta)
    cause = RemoteBackendError(
        f"{type(exc).__module__}.{type(exc).__qualname__}: {scrub(' '.join(str(exc).split()))}")
    cause.__traceback__ = exc.__traceback__
    cause.__suppress_context__ = True
    err.__cause__ = cause
    err.__suppress_context__ = True
    return err
