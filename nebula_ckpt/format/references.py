"""References between checkpoints: which earlier steps' bytes a committed step needs.

An incremental checkpoint writes only the tensors that changed since the checkpoint it builds
on; its manifest lists, beside its own shard, the shards of earlier steps of the same tier that
hold the rest (a :class:`~nebula_ckpt.format.records.ShardRecord` with ``step``). A reference
always names the step that physically holds the file, so one level is the whole story: the steps
a committed step needs are exactly the ``step`` fields of its shards.

This module is the one place that answers "which steps must stay because a kept step needs
them": writer retention, ``Checkpointer.remove``, the sweep, ``nebula-ckpt gc`` and the fencing
of a stale writer all ask it (:func:`protected_steps`), so none of them drops bytes a committed
checkpoint refers to. It also answers "in which order may several steps go"
(:func:`deletion_order`): a step before the steps it refers to, so that a process killed between
two deletions leaves no committed step whose bytes are gone.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterable

from nebula_ckpt.errors import CorruptCheckpointError
from nebula_ckpt.format.manifest import Manifest
from nebula_ckpt.format.names import MANIFEST, step_dir

if TYPE_CHECKING:
    from nebula_ckpt.storage.base import Storage

log = logging.getLogger(__name__)


def references(man: Manifest) -> set[int]:
    """The earlier steps whose folders hold shards of ``man`` (empty for a full checkpoint; a
    version 4 manifest names them itself, its shards being in ``ranks.json``)."""
    if man.layout is not None:
        return set(man.layout.references)
    return {s.step for s in man.shards if s.step is not None}


def shard_path(man: Manifest, i: int) -> str:
    """Path of shard ``i`` of ``man`` relative to the tier root (``step-<S>/<file>``)."""
    sh = man.shards[i]
    return f"{step_dir(sh.folder_step(man.step))}/{sh.file}"


def read_references(storage: "Storage", step: int) -> set[int]:
    """The steps the committed ``step`` on ``storage`` refers to.

    A manifest that is missing or malformed names nothing (its checkpoint cannot be restored
    anyway, and it is reported where it is read). Any other error (an unreachable remote tier)
    propagates: the caller must then delete nothing, since it cannot know what is needed.
    """
    where = f"{storage.display_url} step {step}"
    try:
        raw = storage.read_small(f"{step_dir(step)}/{MANIFEST}")
        return references(Manifest.parse(raw, where, step))
    except (FileNotFoundError, CorruptCheckpointError) as e:
        log.debug("nebula_ckpt: %s: no references read (%s)", where, e)
        return set()


def protected_steps(storage: "Storage", kept: Iterable[int]) -> set[int]:
    """``kept`` and every step a kept committed step refers to: what deletion must leave alone."""
    kept = set(kept)
    out = set(kept)
    for s in kept:
        out |= read_references(storage, s)
    return out


def referrers(storage: "Storage", committed: Iterable[int], step: int) -> list[int]:
    """The committed steps (of ``committed``, other than ``step``) that refer to ``step``."""
    return sorted(s for s in committed if s > step and step in read_references(storage, s))


def deletion_order(storage: "Storage", doomed: Iterable[int]) -> list[int]:
    """``doomed`` (committed steps to delete together) in an order that keeps every step still
    committed restorable at every instant: a step goes before every step of ``doomed`` it refers
    to (its bases), newest first among the free ones. A process killed between two deletions thus
    leaves only whole checkpoints: what is left of ``doomed`` is referred to by nothing that is
    gone. (References of the steps that stay are the caller's: :func:`protected_steps`.)

    Raises:
        what :func:`read_references` raises (an unreachable tier): then nothing may be deleted.
    """
    left = set(doomed)
    if len(left) < 2:
        return sorted(left)  # nothing to order (the usual pass of retention): no manifest read
    refs = {s: read_references(storage, s) & left for s in left}
    order: list[int] = []
    while left:
        needed = set().union(*(refs[s] for s in left))
        free = sorted(left - needed, reverse=True) or [max(left)]  # a cycle cannot be written; still ends
        order.extend(free)
        left -= set(free)
    return order
