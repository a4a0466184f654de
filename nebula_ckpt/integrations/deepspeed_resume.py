"""Which DeepSpeed checkpoint a restart resumes from: the newest one not marked suspect
(docs/health.md), not blindly the tag DeepSpeed's ``latest`` file names (a restart loop when
that one went bad). Used by :mod:`~nebula_ckpt.integrations.deepspeed`."""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from nebula_ckpt import Checkpointer
from nebula_ckpt.errors import CorruptCheckpointError

log = logging.getLogger("nebula_ckpt")

__all__ = ["resume_tag", "latest_tag"]


def resume_tag(ck: Checkpointer, root: str, held: Optional[dict[str, int]] = None) -> Optional[str]:
    """The tag a restart resumes from: that of :meth:`~nebula_ckpt.Checkpointer.latest` (the newest
    checkpoint not marked suspect), else the newest tag below it (``latest`` is untagged); None
    when no tagged checkpoint is held. ``held``: ``ck.tags()``, when already read. Multi-rank: call
    it on every rank; they agree on a tag every rank holds, not above any rank's newest healthy step.

    Raises:
        CorruptCheckpointError: every checkpoint held is marked suspect: loading one would repeat
            the failure (a restart loop). It names them and the command that clears a mark.
    """
    held = ck.tags() if held is None else held
    seen: list[Any] = [(sorted(held.items()), ck.latest())]
    if ck.coordinator.world_size > 1:
        seen = ck.coordinator.exchange(seen[0])
    common = set.intersection(*[{(str(t), int(s)) for t, s in h} for h, _ in seen])
    newest = [(int(g[0]), g[1]) if g is not None else None for _, g in seen]
    if not common:
        return None
    first = newest[0]
    if first is not None and newest.count(first) == len(newest) and (first[1], first[0]) in common:
        return str(first[1])
    if None not in newest:
        bound = min(g[0] for g in newest if g is not None)
        below = [(s, t) for t, s in common if s <= bound]
        if below:
            return max(below)[1]
    named = ", ".join(f"{t} (step {s})" for s, t in sorted((s, t) for t, s in common)[-20:])
    raise CorruptCheckpointError(
        f"DeepSpeed: no checkpoint of {root} is left to resume from: every one is marked suspect ({named}; "
        f"`nebula-ckpt ls {root}` says why). Loading one again would repeat the failure: fix its cause, then "
        f"clear a mark with `nebula-ckpt mark {root} --healthy STEP` (STEP: one of those), load a tag by name "
        "(load_checkpoint(save_dir, tag=...)), or start afresh")


def latest_tag(ck: Checkpointer, root: str, load_dir: str) -> tuple[Optional[str], bool]:
    """``(tag, other)``: the tag ``load_checkpoint(load_dir)`` loads without one, and whether it is
    not the one DeepSpeed's ``latest`` file there names (logged at WARNING then). Where ``latest``
    names a checkpoint ``ck`` holds: that one, unless it is newer than the one a restart resumes
    from (:func:`resume_tag`), i.e. passed over (marked suspect, or not restorable): then that
    one. Else ``(None, False)``: DeepSpeed reads ``latest`` as usual (no such file, a stock
    checkpoint). A tag saved without moving ``latest`` (``save_latest=False``) is not picked up.
    Multi-rank: every rank calls it.

    Raises:
        CorruptCheckpointError: ``latest`` names a checkpoint ``ck`` holds, and every one is marked
            suspect (:func:`resume_tag`).
    """
    latest = os.path.join(load_dir, "latest")
    try:
        with open(latest) as f:
            named: Optional[str] = f.read().strip()
    except OSError:
        named = None
    held = ck.tags()
    try:
        tag = resume_tag(ck, root, held)  # on every rank, before any return: it may be a collective
    except CorruptCheckpointError:
        if named in held:
            raise
        return None, False
    if named is None or named not in held:
        return None, False
    if tag is None or held[named] <= held[tag]:
        return named, False
    log.warning("nebula_ckpt: %s names DeepSpeed checkpoint %r (step %d), which a restart does not resume from "
                "(marked suspect or not restorable: `nebula-ckpt ls %s` says why); loading %r (step %d), the newest "
                "checkpoint not marked suspect", latest, named, held[named], root, tag, held[tag])
    return tag, True
