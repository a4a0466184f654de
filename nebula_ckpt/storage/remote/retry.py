"""Error classification and the retry loop with a deadline.

A backend exception is classified once (:func:`classify`) from its service code, HTTP status,
type and causes. Transient ones are retried with capped exponential backoff and jitter until
the attempts (knob ``remote_retries``) *or* the operation's deadline (knob
``remote_timeout_s``) run out, whichever comes first. Each attempt is told how much time is
left (:class:`Attempt`) so that a hung request can be cut off at the deadline rather than
after the transport's own timeouts.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Generic, Optional, TypeVar

from nebula_ckpt import knobs

#: first retry delay on a remote tier (doubles, capped at REMOTE_BACKOFF_MAX_S, with jitter)
REMOTE_BACKOFF_S = 0.2
#: largest retry delay on a remote tier
REMOTE_BACKOFF_MAX_S = 5.0
#: the jitter's own generator: a retry (often on a writer thread) never draws from the program's
#: global ``random`` stream, which a resumed training loop restores and expects untouched
_JITTER = random.Random()

T = TypeVar("T")


class Kind:
    """What a backend exception means for the caller."""

    AUTH = "auth"
    CONTAINER = "container"
    EXISTS = "exists"
    NOTFOUND = "notfound"
    TRANSIENT = "transient"
    PERMANENT = "permanent"


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
_NOTFOUND_CODES = {"nosuchkey", "blobnotfound", "nosuchupload", "resourcenotfound"}
_TRANSIENT_CODES = {
    "slowdown", "throttling", "throttlingexception", "requesttimeout", "requesttimeoutexception",
    "internalerror", "internalservererror", "serviceunavailable", "serverbusy",
    "operationtimedout", "requestlimitexceeded", "toomanyrequestsexception",
    "provisionedthroughputexceededexception", "bandwidthlimitexceeded",
}
#: matched by name so that no SDK has to be imported to classify its exceptions
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


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes/contexts (breadth first, at most 12, no cycles)."""
    out: list[BaseException] = []
    seen: set[int] = set()
    todo = [exc]
    while todo and len(out) < 12:
        e = todo.pop(0)
        if id(e) in seen:
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


def _kind_of_one(e: BaseException) -> Optional[str]:
    code, status = _code_and_status(e)
    if code in _AUTH_CODES or status in (401, 403) or isinstance(e, PermissionError):
        return Kind.AUTH
    if code in _CONTAINER_CODES:
        return Kind.CONTAINER
    if isinstance(e, FileExistsError):
        return Kind.EXISTS
    if (code in _TRANSIENT_CODES or (status is not None and (status >= 500 or status in (408, 429)))
            or isinstance(e, (ConnectionError, TimeoutError))
            or any(t.__name__ in _TRANSIENT_TYPE_NAMES for t in type(e).__mro__)):
        return Kind.TRANSIENT
    if isinstance(e, FileNotFoundError) or status == 404 or code in _NOTFOUND_CODES:
        return Kind.NOTFOUND
    msg = str(e).lower()
    if "bucket does not exist" in msg or "container does not exist" in msg:
        return Kind.CONTAINER
    return None


def classify(exc: BaseException) -> str:
    """The :class:`Kind` of a backend exception, looking through its causes too.

    Args:
        exc: what the backend raised.

    Returns:
        One of the :class:`Kind` values; the most telling kind found in the chain wins
        (auth > container > exists > transient > not found > permanent).
    """
    kinds = {k for k in map(_kind_of_one, _chain(exc)) if k is not None}
    for k in (Kind.AUTH, Kind.CONTAINER, Kind.EXISTS, Kind.TRANSIENT, Kind.NOTFOUND):
        if k in kinds:
            return k
    return Kind.PERMANENT


def describe(exc: BaseException, limit: int = 400) -> str:
    """Short one-line description of a backend exception (type, code, status, message).

    Not scrubbed: pass the result through the tier's scrubber before showing it.
    """
    code, status = "", None
    for e in _chain(exc):
        c, s = _code_and_status(e)
        code, status = code or c, status or s
    msg = str(exc).split("\nContent:", 1)[0]  # azure appends the raw XML error body
    msg = " ".join(msg.split())
    if len(msg) > limit:
        msg = msg[:limit] + "..."
    extra = [f"code={code}"] if code else []
    if status:
        extra.append(f"HTTP {status}")
    tail = f" [{', '.join(extra)}]" if extra else ""
    return f"{type(exc).__name__}: {msg}{tail}"


@dataclass(frozen=True)
class Attempt:
    """One try of an operation.

    Attributes:
        number: 1 for the first try.
        timeout: seconds left until the operation's deadline (always > 0); a request should
            not outlive it.
    """

    number: int
    timeout: float


@dataclass(frozen=True)
class RetryPolicy:
    """How long and how often one operation is tried.

    Attributes:
        attempts: most tries (>= 1).
        backoff_s: first delay; doubles per retry, capped at ``backoff_max_s``, times a random
            factor in [0.5, 1] (jitter, from a generator of its own: the global ``random``
            stream is never drawn from).
        backoff_max_s: largest delay.
        timeout_s: deadline of the whole operation, all tries and delays included.
    """

    attempts: int
    backoff_s: float
    backoff_max_s: float
    timeout_s: float

    @classmethod
    def from_knobs(cls) -> "RetryPolicy":
        """The policy the ``remote_*`` knobs and the backoff constants say, read now (tests override
        knobs at any time)."""
        base = max(0.0, float(REMOTE_BACKOFF_S))
        return cls(attempts=max(1, int(knobs.get("remote_retries"))), backoff_s=base,
                   backoff_max_s=max(base, float(REMOTE_BACKOFF_MAX_S)),
                   timeout_s=max(0.1, float(knobs.get("remote_timeout_s"))))

    def delay(self, attempt: int) -> float:
        """Backoff after failed attempt number ``attempt`` (1-based)."""
        return min(self.backoff_max_s, self.backoff_s * (2 ** (attempt - 1))) * _JITTER.uniform(0.5, 1.0)


@dataclass
class Outcome(Generic[T]):
    """The result of :func:`run`: a value, or the last failure and how it came about.

    Attributes:
        ok: the operation succeeded.
        value: what the operation returned (when ``ok``).
        failure: the last backend exception.
        kind: its :class:`Kind`.
        attempts: tries made.
        elapsed_s: time spent.
        out_of_time: the deadline ended the retries.
        abandoned: the ``abort`` event ended the retries (a sibling part failed).
    """

    ok: bool = False
    value: Optional[T] = None
    failure: Optional[BaseException] = None
    kind: str = Kind.PERMANENT
    attempts: int = 0
    elapsed_s: float = 0.0
    out_of_time: bool = False
    abandoned: bool = False


def run(fn: Callable[[Attempt], T], policy: RetryPolicy, *,
        on_retry: Callable[[BaseException, int, float], None],
        passthrough: tuple[type[BaseException], ...] = (),
        abort: Optional[threading.Event] = None) -> Outcome[T]:
    """Call ``fn`` until it succeeds, fails permanently, or attempts / deadline run out.

    Args:
        fn: the operation; gets the :class:`Attempt`.
        policy: attempts, backoff and deadline.
        on_retry: called as ``on_retry(exc, attempt, delay)`` before each retry (logging).
        passthrough: exception types raised as they are (already ours, scrubbed).
        abort: when set (by a failed sibling), stop retrying.

    Returns:
        The :class:`Outcome`; the caller turns a failure into its own exception, outside any
        ``except`` block so that the backend's exception is not attached as ``__context__``.
    """
    t0 = time.monotonic()
    deadline = t0 + policy.timeout_s
    out: Outcome[T] = Outcome()
    for number in range(1, policy.attempts + 1):
        out.attempts = number
        left = deadline - time.monotonic()
        try:
            out.value = fn(Attempt(number, max(left, 0.05)))
            out.ok, out.failure = True, None
            return out
        except passthrough:
            raise
        except Exception as e:  # noqa: BLE001 - classified here
            out.failure, out.kind = e, classify(e)
        if out.kind != Kind.TRANSIENT or number >= policy.attempts or (abort is not None and abort.is_set()):
            break
        delay = policy.delay(number)
        left = deadline - time.monotonic()
        if left <= delay:
            out.out_of_time = True
            break
        on_retry(out.failure, number, delay)
        if abort is not None and abort.wait(delay):
            out.abandoned = True
            break
        if abort is None:
            time.sleep(delay)
    out.elapsed_s = time.monotonic() - t0
    return out
