"""A create-only write of a small object on a remote tier, and its read-back after a lost response.

A conditional create (``If-None-Match: *`` on S3 and Azure) whose first attempt landed but whose
response was lost is answered "exists" when it is retried. Whether the object there is this
write's is told by reading it back, and that read is a request like any other: it runs under the
retry policy (its own retries and deadline, knobs ``remote_retries`` / ``remote_timeout_s``). So a
create-only write that met "exists" after a retry ends in one of three ways:

* the object holds our bytes: the write succeeded (our earlier attempt landed);
* it holds other bytes: ``FileExistsError`` (another writer's object);
* it could not be read back even after the retries: a :class:`~.errors.RemoteStorageError`
  (:class:`~.errors.RemoteUnavailableError` when the read met an outage) whose message says that
  the object may be this write's or another writer's. Never ``FileExistsError``, which would call
  our own object someone else's.
"""

from __future__ import annotations

import logging
from typing import Callable, TypeVar

from nebula_ckpt.storage.remote.errors import RemoteStorageError, RemoteUnavailableError
from nebula_ckpt.storage.remote.paths import where
from nebula_ckpt.storage.remote.retry import Attempt

logger = logging.getLogger("nebula_ckpt.storage.remote")

T = TypeVar("T")
#: ``retry(op, fn)``: run ``fn(attempt)`` under the tier's retry policy (raising our exceptions)
Retry = Callable[[str, Callable[[Attempt], T]], T]


def create_small(payload: bytes, *, put: Callable[[Attempt], None], read: Callable[[Attempt], bytes],
                 retry: Retry, url: str, rel: str) -> None:
    """Create ``rel`` holding ``payload`` only if it does not exist, telling our own lost write apart.

    Args:
        payload: the object's bytes.
        put: one conditional create of the object (raises ``FileExistsError`` if it exists).
        read: one read of at most ``len(payload) + 1`` bytes of the object.
        retry: runs one attempt function under the tier's retry policy, for ``rel``.
        url, rel: the tier's display URL and the object, for messages.

    Raises:
        FileExistsError: the object exists and is not ours (or exists at the first attempt).
        RemoteStorageError (or a subclass): the create failed; or it met "exists" after a retry
            and the read-back failed too (the message says the object may be ours).
    """
    tried = [0]

    def create(attempt: Attempt) -> None:
        tried[0] = attempt.number
        put(attempt)

    try:
        retry("create", create)
        return
    except FileExistsError as e:
        if tried[0] < 2:  # no earlier attempt of ours could have landed
            raise
        exists = e
    try:
        there = retry("read back", read)
    except OSError as e:  # ours, scrubbed (retry raises nothing else): not known whose it is
        failure = e
    else:
        if bytes(there) == payload:
            logger.info("remote tier %s: create-only write of %s found its own earlier attempt "
                        "(its response was lost); treating as success", url, rel)
            return
        raise exists
    raise uncertain(failure, url, rel) from failure


def uncertain(failure: OSError, url: str, rel: str) -> RemoteStorageError:
    """The error of a create-only write that met "exists" after a retry and could not read the
    object back (``failure``): it may be ours (an earlier attempt whose response was lost)."""
    cls = RemoteUnavailableError if isinstance(failure, RemoteUnavailableError) else RemoteStorageError
    return cls(f"create {where(url, rel)}: uncertain whether this write created it: an earlier attempt's "
               "response was lost and the object exists now, but it could not be read back to compare "
               f"({failure}), so it may be this write's own object or another writer's",
               url=url, rel=rel, op="create", attempts=getattr(failure, "attempts", 1))
