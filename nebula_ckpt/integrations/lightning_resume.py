"""What a Lightning resume from a ``last*.ckpt`` path loads: the checkpoint it names, unless that one
was passed over (newer than :meth:`~nebula_ckpt.Checkpointer.latest`, the newest one not marked
suspect, docs/health.md): then that one.

Lightning resolves ``fit(ckpt_path="last")`` itself (``_CheckpointConnector._parse_ckpt_path``:
the newest ``last*.ckpt`` of its ``ModelCheckpoint`` folders, or an ``OnExceptionCheckpoint``
file, by mtime) and hands the ``CheckpointIO`` the path alone; ``fit(ckpt_path="ckpts/last.ckpt")``
arrives the same way. So a ``last*.ckpt`` file (Lightning's moving name for the newest checkpoint,
written at every save) means "the newest" whichever way it was asked for; any other file names
its own checkpoint, loaded whatever its mark (with a warning), as a step asked for by number is.
"""

from __future__ import annotations

import fnmatch
import logging
import posixpath
from typing import Any, Callable

from nebula_ckpt import Checkpointer
from nebula_ckpt.errors import CorruptCheckpointError
from nebula_ckpt.integrations.pointers import candidate_roots

log = logging.getLogger(__name__)

__all__ = ["is_last", "newest_pointer", "other_rank", "LAST"]

#: the file names ModelCheckpoint's ``save_last`` writes and ``ckpt_path="last"`` looks for
LAST = "last*.ckpt"


def is_last(path: str) -> bool:
    """Whether ``path`` (a local path or a URL) is a ``last*.ckpt`` file."""
    return fnmatch.fnmatchcase(posixpath.basename(path.replace("\\", "/").rstrip("/")), LAST)


def newest_pointer(opener: Callable[[str], tuple[Checkpointer, bool]], ptr: dict[str, Any],
                   path: str) -> dict[str, Any]:
    """The pointer record a resume from the ``last*.ckpt`` file ``path`` (its record ``ptr``) loads:
    ``ptr``, unless the checkpoint it names is newer than the one a restart resumes from
    (:meth:`~nebula_ckpt.Checkpointer.latest` of its root, else the newest tag not above it), i.e.
    passed over (marked suspect, or not restorable): then that one's, logged at WARNING.
    ``opener(root)``: the Checkpointer to read ``root`` with, and whether to close it after.

    Raises:
        CorruptCheckpointError: every checkpoint of the root is marked suspect: loading one would
            repeat the failure (a restart loop). It names them and the command that clears a mark.
    """
    ck, temporary = opener(candidate_roots(ptr, path)[0])
    try:
        return _choose(ck, ptr, path)
    finally:
        if temporary:
            ck.close()


def _choose(ck: Checkpointer, ptr: dict[str, Any], path: str) -> dict[str, Any]:
    tags, got = ck.tags(), ck.latest()
    own = tags.get(ptr["tag"], tags.get(ptr.get("prev_tag") or ""))  # the step load_pointer reads
    if own is None or (got is not None and own <= got[0]):
        return ptr  # not passed over (or nothing committed: the load says so)
    below = [(s, t) for t, s in tags.items() if got is not None and s <= got[0]]
    if got is not None and got[1] is not None and tags.get(got[1]) == got[0]:
        step, tag = got[0], got[1]
    elif below:
        step, tag = max(below)
    else:
        named = ", ".join(f"{t} (step {s})" for s, t in sorted((s, t) for t, s in tags.items())[-20:])
        raise CorruptCheckpointError(
            f"{path}: no checkpoint of {ck.root} is left to resume from: every one is marked suspect ({named}; "
            f"`nebula-ckpt ls {ck.root}` says why). Resuming one again would repeat the failure: fix its cause, then "
            f"clear a mark with `nebula-ckpt mark {ck.root} --healthy STEP` (STEP: one of those), resume from a "
            "checkpoint file by its own name (not last*.ckpt), or start afresh (ckpt_path=None)")
    log.warning("nebula_ckpt: %s names step %d of %s, which a restart does not resume from (marked suspect or not "
                "restorable: `nebula-ckpt ls` says why); loading step %d (%s), the newest checkpoint not marked "
                "suspect (a last*.ckpt file means the newest; resume from another file by its own name)", path, own,
                ck.root, step, tag)
    return {**ptr, "tag": tag, "step": step, "prev_tag": None}


def other_rank() -> bool:
    """Whether this process is a rank other than 0 of a started process group (Lightning saves on
    rank 0 alone: another rank never makes a writer of the root)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_rank() != 0
