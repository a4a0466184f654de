"""One remote request under the retry policy, failing with our scrubbed exception.

Every request of a remote tier runs through :func:`call_with_retries`: transient errors are
retried with backoff until the attempts or the operation's deadline (knobs ``remote_retries``,
``remote_timeout_s``; delays :data:`~.retry.REMOTE_BACKOFF_S` doubling up to
:data:`~.retry.REMOTE_BACKOFF_MAX_S`) run out, each retry is logged
through the tier's scrubber, and what finally fails is raised as one of our exceptions
(:mod:`.errors`), never the backend's.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Optional, TypeVar

from nebula_ckpt.storage.remote import retry
from nebula_ckpt.storage.remote.errors import RemoteStorageError, storage_error
from nebula_ckpt.storage.remote.paths import where
from nebula_ckpt.storage.remote.retry import Attempt, RetryPolicy, describe

logger = logging.getLogger("nebula_ckpt.storage.remote")

T = TypeVar("T")


def abandoned_error(op: str, rel: str, url: str) -> RemoteStorageError:
    """The error of a part given up because a sibling part failed."""
    err = RemoteStorageError(f"{op} {where(url, rel)} abandoned: a sibling part failed", url=url, rel=rel, op=op)
    err.abandoned = True
    return err


def call_with_retries(fn: Callable[[Attempt], T], *, op: str, rel: str, url: str, scrub: Callable[[str], str],
                      abort: Optional[threading.Event] = None) -> T:
    """Run ``fn(attempt)`` under the retry policy of the ``remote_*`` knobs.

    Args:
        fn: one attempt of the request (``attempt.timeout``: what is left of the deadline).
        op, rel: the operation and the object, for messages.
        url: the tier's display URL.
        scrub: the tier's scrubber (every logged or raised text goes through it).
        abort: set by a failed sibling part: stop retrying early.

    Raises:
        RemoteStorageError (or a subclass): attempts or the deadline are exhausted, or the error is
            permanent; scrubbed, the backend's exception never raised as itself.
    """
    policy = RetryPolicy.from_knobs()

    def log_retry(e: BaseException, attempt: int, delay: float) -> None:
        logger.warning("remote tier %s: %s %s failed (attempt %d/%d): %s; retrying in %.2fs",
                       url, op, rel or "/", attempt, policy.attempts, scrub(describe(e)), delay)

    out = retry.run(fn, policy, on_retry=log_retry, passthrough=(RemoteStorageError,), abort=abort)
    if out.ok:
        return out.value  # type: ignore[return-value]
    if out.abandoned or out.failure is None:
        raise abandoned_error(op, rel, url)
    err = storage_error(out.failure, out.kind, op=op, url=url, rel=rel, attempts=out.attempts, scrub=scrub,
                        elapsed_s=out.elapsed_s if out.out_of_time else None,
                        deadline_s=policy.timeout_s if out.out_of_time else None)
    out.failure = None  # keep the unscrubbed exception out of the traceback's frames
    try:
        raise err
    finally:  # err's traceback holds this frame: no cycle keeps the caller's frames (a mapping) alive
        del err
