"""Finding committed checkpoints of ``torch_nebula``: the newest, by tag, all of them, and the
newest one's part as a ``torch.load``-able file (also under another run's root: ``persist_path``)."""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Any, Optional

import torch

from nebula_ckpt import Checkpointer
from nebula_ckpt.adapters import canonical_root, check_tag
from nebula_ckpt.compat.nebula.checkpoint import Checkpoint, committed_checkpoint
from nebula_ckpt.compat.nebula.session import Session, current_session, reader_for, settle
from nebula_ckpt.errors import CorruptCheckpointError, NotFoundError, ValidationError
from nebula_ckpt.integrations.pointers import safe_name


def _tagged(s: Session, persist_path: Optional[str]) -> tuple[Optional[str], Checkpointer, dict[str, int]]:
    settle(s)
    path, ck = reader_for(s, persist_path)
    return (None if ck is s.ck else path), ck, ck.tags()


def get_latest_checkpoint(persist_path: Optional[str] = None) -> Optional[Checkpoint]:
    """The newest committed checkpoint (on any tier: memory first) not marked suspect, the one
    ``load_latest`` restores; ``None`` when there is none.

    ``persist_path``: look under another root than ``init``'s (another run's).

    Raises:
        CorruptCheckpointError: committed checkpoints exist but every one is marked suspect (Azure
            ML Nebula has no health marks): handing one back would restore the diverged state on
            every restart, and ``None`` would start afresh silently. The message names them and
            ``nebula-ckpt mark ROOT --healthy STEP``, which clears a mark.
    """
    s = current_session()
    try:
        root, ck, tags = _tagged(s, persist_path)
    except NotFoundError:
        return None
    if not tags:
        return None
    tag, step = newest_tagged(ck, tags)
    return committed_checkpoint(s, root, tag, step)


def newest_tagged(ck: Checkpointer, tags: dict[str, int]) -> tuple[str, int]:
    """The tag and step of ``tags`` (``ck.tags()``, not empty) a restart resumes from
    (:meth:`~nebula_ckpt.Checkpointer.latest`: the newest writer's, not marked suspect); the
    newest one not above it when that one carries no tag.

    Raises:
        CorruptCheckpointError: none is (every checkpoint is marked suspect), as ``load_latest``
            raises: naming them, and the command that clears a mark.
    """
    got = ck.latest()
    if got is not None and got[1] is not None and tags.get(got[1]) == got[0]:
        return got[1], got[0]
    below = [(t, s) for t, s in tags.items() if got is not None and s <= got[0]]
    if below:
        return max(below, key=lambda kv: kv[1])
    named = sorted(tags.items(), key=lambda kv: kv[1])
    root = canonical_root(ck.root)
    raise CorruptCheckpointError(
        f"torch_nebula: no checkpoint of {root} is left to resume from: every one is marked suspect "
        f"({', '.join(f'{t} (step {s})' for t, s in named[-20:])}; `nebula-ckpt ls` says why). Resuming one "
        f"again would repeat the failure: fix its cause, then clear a mark with "
        f"`nebula-ckpt mark {root} --healthy STEP` (STEP: one of those), or start afresh")


def get_checkpoint(tag: str, persist_path: Optional[str] = None) -> Checkpoint:
    """The committed checkpoint tagged ``tag`` (its newest commit, if saved several times).

    Raises:
        ValidationError: a malformed tag.
        NotFoundError: no committed checkpoint has that tag (the message lists the tags).
    """
    s = current_session()
    check_tag(tag)
    if tag is None:
        raise ValidationError("torch_nebula.get_checkpoint(): give the tag of the checkpoint "
                              "(get_latest_checkpoint() gives the newest)")
    root, ck, tags = _tagged(s, persist_path)
    if tag not in tags:
        with s.lock:
            pending = tag in s.pending
        hint = " (it has parts saved but is not committed: commit() it)" if pending else ""
        raise NotFoundError(f"torch_nebula: no committed checkpoint tagged {tag!r} under "
                            f"{canonical_root(ck.root)}{hint}; tags: {sorted(tags, key=tags.__getitem__)[-20:]}")
    return committed_checkpoint(s, root, tag, tags[tag])


def list_checkpoints(persist_path: Optional[str] = None) -> list[dict[str, Any]]:
    """Every committed checkpoint, oldest first: ``[{"tag", "step", "tiers"}, ...]`` (JSON-serialisable;
    ``tiers``: the tiers holding it, fastest first). A tag saved several times is listed once
    (its newest commit)."""
    s = current_session()
    _, ck, tags = _tagged(s, persist_path)
    per_tier = ck.list(detailed=True)
    return [{"tag": tag, "step": step, "tiers": [t for t, steps in per_tier.items() if step in steps]}
            for tag, step in sorted(tags.items(), key=lambda kv: kv[1])]


def get_latest_checkpoint_path(name: str = "checkpoint", persist_path: Optional[str] = None) -> Optional[str]:
    """A ``torch.load``-able file of part ``name`` of the newest checkpoint not marked suspect
    (:func:`get_latest_checkpoint`: ``None`` without one, CorruptCheckpointError when every one is).

    nebula_ckpt keeps no file per part, so the part is exported (``torch.save``) into a private
    temporary folder, removed by :func:`shutdown` / at exit; Lightning's
    ``load_from_checkpoint(path)`` and ``torch.load(path)`` read it.
    """
    latest = get_latest_checkpoint(persist_path)
    if latest is None:
        return None
    obj = latest.load(name)
    s = current_session()
    with s.lock:
        if s.export_dir is None:
            s.export_dir = tempfile.mkdtemp(prefix="torch_nebula-export-")
        safe = "".join(c if c.isalnum() or c in "._-=" else "_" for c in f"{latest.tag}__{name}")
        # the readable part is lossy ("a/b" and "a_b"), so a hash of (tag, name) keeps two parts
        # apart; a name longer than NAME_MAX is cut and hashed whole (safe_name)
        digest = hashlib.sha256(f"{latest.tag}\0{name}".encode("utf-8", "surrogateescape")).hexdigest()[:12]
        path = os.path.join(s.export_dir, safe_name(f"{safe}~{digest}"))
    torch.save(obj, path)
    return path
