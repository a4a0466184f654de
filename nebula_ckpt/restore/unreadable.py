"""Internal: a failure to read a checkpoint that is not damage.

A restore passes a damaged candidate over for an older one (a flipped byte, a truncated shard, a
garbled manifest). Two failures say nothing about the checkpoint and must never make it do so,
or a job silently resumes from an older step while the newest is whole:

* a store that did not answer (unreachable, timed out, credentials refused, bucket gone):
  :func:`outage`;
* this process that cannot read files it may well read later (out of file descriptors or
  memory, no permission): :func:`refused_here`, raised again with what to change.

Both are raised out of the restore (every rank of a job stops together).
"""

from __future__ import annotations

import errno
from typing import Optional

#: local errors that say this process cannot read a file, with the fix
_HERE = {
    errno.EMFILE: "raise the open-file limit of the process (ulimit -n) and restart",
    errno.ENFILE: "the system's open-file table is full: close other processes' files and restart",
    errno.ENOMEM: "free host memory and restart",
    errno.EACCES: "give the user running the job read access to the checkpoint's files and restart",
    errno.EPERM: "give the user running the job read access to the checkpoint's files and restart",
}


def outage(e: BaseException) -> bool:
    """Whether ``e`` says a checkpoint could not be read though it may be whole: a store that did not
    answer, or this process refused a file (:func:`refused_here`). Never damage."""
    from nebula_ckpt.storage.remote.errors import CorruptRemoteDataError, RemoteStorageError  # loaded on first use
    if isinstance(e, (RemoteStorageError, TimeoutError)) and not isinstance(e, CorruptRemoteDataError):
        return True
    return isinstance(e, OSError) and e.errno in _HERE


def refused_here(e: BaseException, where: str) -> Optional[OSError]:
    """``e`` again, naming ``where`` (a checkpoint) and the fix, when it says this process cannot read
    a file of it (``EMFILE``, ``ENFILE``, ``ENOMEM``, ``EACCES``, ``EPERM``); else None."""
    if not isinstance(e, OSError) or e.errno not in _HERE:
        return None
    msg = (f"{where}: this process cannot read it ({e.strerror or e}); the checkpoint is not damaged and "
           f"is not passed over for an older one: {_HERE[e.errno]}")
    try:
        out = type(e)(e.errno, msg, e.filename)
    except Exception:  # a subclass with another constructor
        out = OSError(e.errno, msg, e.filename)
    return out
