"""The commit marker: what makes a step folder a checkpoint, the one listing of checkpoints, and
which earlier checkpoints each one needs.

``COMMIT`` is written last, create-only, and names the manifest's size and CRC32C; a folder
without it is not a checkpoint (readers ignore it, writers clean it up). :func:`read_commit` is
the one reader of markers, :func:`committed_steps` the one listing of checkpoints and
:func:`delete_checkpoint` the one removal of one (its marker first).

A marker also names which *write* of the step it commits: the writer generation, and ``save``,
the number of the save in that generation (``save_async`` calls are numbered from 0 by every
rank alike). A step number saved twice in one generation is two writes; the copies of one write
on different tiers and ranks (a rank's memory tier, a partner's replica, the shared tier, a copy
made by ``persist-memory``) carry the same ``(generation, step, save)``, so copies of two writes
are never taken for one (:attr:`Commit.write`). ``save`` is optional (absent: unknown, ``-1``).
The marker's record and the journal of the markers this process wrote or removed (what lets a
writer read a step's marker once, not at every save) are :mod:`nebula_ckpt.format.marker`'s.

**References between checkpoints** (the rest of this module): which earlier steps' bytes a
committed step needs. An incremental checkpoint writes only the tensors that changed since the
checkpoint it builds on; its manifest lists, beside its own shard, the shards of earlier steps of
the same tier that hold the rest (a :class:`~nebula_ckpt.format.records.ShardRecord` with
``step``). A reference always names the step that physically holds the file, so one level is the
whole story: the steps a committed step needs are exactly the ``step`` fields of its shards.

This module is the one place that answers "which steps must stay because a kept step needs
them": writer retention, ``Checkpointer.remove``, the sweep, ``nebula-ckpt gc`` and the fencing
of a stale writer all ask it (:func:`protected_steps`), so none of them drops bytes a committed
checkpoint refers to. It also answers "in which order may several steps go"
(:func:`deletion_order`): a step before the steps it refers to, so that a process killed between
two deletions leaves no committed step whose bytes are gone.

**The commit** (:func:`commit_manifest`): every writer of checkpoints (the tier writers, the
multi-rank rounds, the drain, the memory tier's epilogue, the DCP writer) commits a step the same
way, once every rank's shard of it is durable and the ranks agreed::

    step-N/manifest.json   (the committing rank's; tmp + fsync + rename, or a new object)
    -- fence check: no newer writer took over this storage --
    step-N/COMMIT          (create-only, last; names the manifest's size and CRC32C)

From the moment the marker's write begins, the step *may* be committed
(:attr:`CommitProgress.may_commit`): a write that reports an error may still have created it (a
lost response on a blob store, a failed directory fsync). Then nothing of the step may be deleted,
and a later writer of a newer generation removes the files if it never committed. The marker is
written inside the fence's ``committing``: once the writer is fenced none is written. A save fenced
after some tier committed its step takes that step back (:func:`retract_step`): a step of a writer
that was told it was fenced must never be listed or loaded.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Collection, ContextManager, Iterable, Optional, Protocol

from nebula_ckpt.errors import CorruptCheckpointError
from nebula_ckpt.format.checks import MAX_STEP, as_int, as_list, as_obj, as_step, bad
from nebula_ckpt.format.manifest import MAX_MANIFEST_BYTES, Manifest
from nebula_ckpt.format.marker import MAX_COMMIT_BYTES, Commit, Write, marker_changed
from nebula_ckpt.format.names import (
    COMMIT,
    FORMAT,
    MANIFEST,
    RANKS_FILE,
    READ_VERSIONS,
    SPLIT_VERSION,
    is_manifest_name,
    manifest_name,
    parse_step_dir,
    shard_owner,
    step_dir,
)
from nebula_ckpt.format.records import ShardRecord
from nebula_ckpt.native import get_ops
from nebula_ckpt.storage.base import never_created
from nebula_ckpt.storage.local import read_small_file

if TYPE_CHECKING:
    from nebula_ckpt.storage.base import Storage

log = logging.getLogger(__name__)


def step_dirs(storage: "Storage") -> list[int]:
    """Steps that have a folder on ``storage`` (committed or not), ascending. A folder named for a
    step no save takes (beyond ``[0, 2**63-1]``: :func:`~nebula_ckpt.format.names.check_step`) is
    no checkpoint's, as one named ``step-042`` is not: never listed, retained, read or removed."""
    return sorted(s for s in (parse_step_dir(n) for n in storage.list("")) if s is not None and s <= MAX_STEP)


def committed_steps(storage: "Storage") -> list[int]:
    """Steps with a commit marker on ``storage``, ascending (the one listing of checkpoints)."""
    return scan_steps(storage)[0]


def committed_writes(storage: "Storage", steps: Optional[list[int]] = None) -> list[Write]:
    """The writes ``(generation, step, save)`` committed on ``storage``, ascending (markers that
    cannot be read are left out: no checkpoint of anyone's); ``steps``: its committed steps when
    the caller listed them already (None: listed here)."""
    commits = read_commits(storage, committed_steps(storage) if steps is None else steps)
    return sorted(c.write for c in commits.values() if c is not None)


def read_commits(storage: "Storage", steps: Iterable[int]) -> dict[int, Optional[Commit]]:
    """The commit markers of the committed ``steps`` (None: one that cannot be read, no write of anyone's)."""
    out: dict[int, Optional[Commit]] = {}
    for s in steps:
        try:
            out[s] = read_commit(storage, s, f"{storage.display_url} step {s}")
        except (OSError, CorruptCheckpointError):
            out[s] = None
    return out


def read_commit(storage: "Storage", step: int, where: str) -> Commit:
    """The parsed commit marker of ``step`` on ``storage`` (the one reader of markers).

    Raises:
        FileNotFoundError / OSError: it cannot be read.
        CorruptCheckpointError: it is malformed (naming ``where``), larger than
            :data:`MAX_COMMIT_BYTES` or no regular file (naming its path).
    """
    try:
        raw = storage.read_small(f"{step_dir(step)}/{COMMIT}", MAX_COMMIT_BYTES)
    except CorruptCheckpointError as e:  # too large or no regular file: never read
        raise CorruptCheckpointError(f"{where}: {e}") from None
    return Commit.parse(raw, where)


def delete_checkpoint(storage: "Storage", step: int) -> None:
    """Delete a checkpoint: marker first (it stops being listed, and no reader opens it), then its
    data. Several at once: in :func:`deletion_order`."""
    d = step_dir(step)
    storage.remove(f"{d}/{COMMIT}")
    marker_changed(storage, step)
    log.debug("nebula_ckpt: phase=unlisted %s step %d: its marker is gone; its files go next", storage.display_url,
              step)
    storage.remove_dir(d)


def scan_steps(storage: "Storage", known: Collection[int] = ()) -> tuple[list[int], list[int]]:
    """``(committed, uncommitted)``: the step folders on ``storage`` with and without a ``COMMIT``,
    ascending (the one place that tells them apart; :func:`committed_steps` is its first half).
    ``known``: steps the caller knows to be committed (a writer's own knowledge of its tier,
    :mod:`nebula_ckpt.save.kept`): their folders are listed, their markers not looked up."""
    committed: list[int] = []
    uncommitted: list[int] = []
    for s in step_dirs(storage):
        (committed if s in known or storage.exists(f"{step_dir(s)}/{COMMIT}") else uncommitted).append(s)
    return committed, uncommitted


def clear_step(storage: "Storage", step: int, stale: Callable[[str], bool]) -> None:
    """Before writing ``step``: remove the files of its folder that ``stale`` names (leftovers of
    crashed writers of the step, never a live peer's: :meth:`nebula_ckpt.save.sweep.Ownership.stale`)."""
    d = step_dir(step)
    for name in storage.list(d):
        if stale(name):
            storage.remove(f"{d}/{name}")


# -- the commit: the protocol's last step, and a step taken back ----------------------------------


class WriterFence(Protocol):
    """What the commit needs of a writer's fence (:class:`nebula_ckpt.ranks.fencing.TierFence`)."""

    @property
    def generation(self) -> int:
        """The writer's generation."""

    def check(self, what: str) -> None:
        """Raise :class:`~nebula_ckpt.errors.FencedError` if a newer writer took over."""

    def committing(self, what: str) -> ContextManager[None]:
        """The marker is written inside this (refused once fenced)."""


@dataclass
class CommitProgress:
    """How far the commit of one step got (decides what its failure path may remove)."""

    #: the step's COMMIT may exist (or still appear): a failure deletes nothing of the step
    may_commit: bool = False


def commit_manifest(storage: "Storage", fence: WriterFence, step: int, mbytes: bytes,
                    progress: CommitProgress, tier: str, save: Optional[int] = None,
                    replaces: Optional[Commit] = None, variant: Optional[str] = None) -> Commit:
    """Write ``step``'s manifest (``mbytes``, atomic), check the fence, then create its ``COMMIT``;
    return the marker written.

    ``tier`` names the storage in the logs; ``save``: the number of the save that wrote the step
    in its generation (the marker records it: :attr:`Commit.write`). ``progress.may_commit`` is
    set once the marker's write begins, and cleared again only when a failed write certainly
    created nothing (:func:`~nebula_ckpt.storage.base.never_created`).

    ``replaces``: the marker of the committed step this write replaces; the manifest is then
    written as ``manifest-v<variant>.json`` beside the committed one and the marker *replaced*
    by one naming it, in one atomic write (a file renamed over it, or one object put over it), so
    the step is at every instant one whole write or the other (:func:`replace_landed`).

    Raises:
        FencedError: a newer writer took over ``storage`` (nothing was committed).
        FileExistsError: the step already has a ``COMMIT`` (another writer's).
        CorruptCheckpointError: the marker would not read back as written (a field out of the
            format's range); nothing was written.
        OSError and others: the storage's errors, as they come.
    """
    d = step_dir(step)
    name = manifest_name(variant if replaces is not None else None)
    commit = Commit(step, fence.generation, len(mbytes), get_ops().crc32c_bytes(mbytes), save,
                    None if replaces is None else name)
    marker = commit.to_bytes()
    # Read back by the readers' own parser before anything is written: a marker its readers would
    # refuse (a step out of the format's range) must never make a step committed and unreadable.
    if Commit.parse(marker, f"{tier} step {step}") != commit:
        raise CorruptCheckpointError(f"{tier} step {step}: the commit marker does not read back as written")
    log.debug("nebula_ckpt: phase=manifest tier=%s step=%d", tier, step)
    if replaces is None:  # the plain manifest.json of a step another writer committed (a newer run's,
        fence.check(f"commit step {step}")  # after a long shard write) is never written over
        if storage.exists(f"{d}/{COMMIT}"):
            raise FileExistsError(f"{tier}: {d}/{COMMIT} exists: step {step} was committed by another write")
    storage.write_small(f"{d}/{name}", mbytes)
    fence.check(f"commit step {step}")
    log.debug("nebula_ckpt: phase=%s tier=%s step=%d", "commit" if replaces is None else "replace", tier, step)
    with fence.committing(f"commit step {step}"):  # refused once fenced; stop() waits for it
        if replaces is not None and read_commit(storage, step, f"{tier} step {step}") != replaces:
            raise FileExistsError(f"{tier}: {d}/{COMMIT} changed since this save of step {step} began "
                                  "(another writer's)")
        progress.may_commit = True
        try:
            storage.write_small(f"{d}/{COMMIT}", marker, create_only=replaces is None)
        except BaseException:
            progress.may_commit = replace_landed(storage, commit, tier) if replaces is not None else \
                not never_created(storage, f"{d}/{COMMIT}")
            raise
        finally:
            marker_changed(storage, step)  # written, or it may be
    return commit


def replace_landed(storage: "Storage", commit: Commit, tier: str) -> bool:
    """After the replacing write of a marker (``commit``) raised: whether it may have landed, now
    or later. False only when it certainly did not: the storage's failed writes are final (a file
    system: the rename is done or not) and the marker there is still another one."""
    if not storage.failed_create_is_final:
        return True
    try:
        there = read_commit(storage, commit.step, f"{tier} step {commit.step}")
    except Exception as e:  # cannot look: it may be there
        log.warning("nebula_ckpt: %s: cannot tell which COMMIT step %d holds: %s", tier, commit.step, e)
        return True
    return there.manifest_file == commit.manifest_file


def settle_manifest(storage: "Storage", fence: WriterFence, commit: Commit, mbytes: bytes, where: str) -> Commit:
    """After ``commit`` replaced a step's marker (its manifest ``manifest-v<V>.json``, of bytes
    ``mbytes``; ``where``: the tier, as the logs name it): give the manifest its usual name again.
    ``manifest.json`` is replaced by the same bytes, then the marker by one naming it (checked to
    be ``commit`` still, and the fence), each in one atomic write, so the marker names a whole
    manifest of that write at every instant; the ``manifest-v<V>.json`` left is the caller's to
    remove. Returns the marker now committed.

    Raises:
        FencedError / FileExistsError (the marker changed) / the storage's errors: the step
        stays committed as ``commit`` left it.
    """
    d = step_dir(commit.step)
    storage.write_small(f"{d}/{MANIFEST}", mbytes)
    fence.check(f"settle step {commit.step}")
    plain = Commit(commit.step, commit.generation, commit.manifest_bytes, commit.manifest_crc32c, commit.save)
    log.debug("nebula_ckpt: phase=settle %s step=%d", where, commit.step)
    with fence.committing(f"settle step {commit.step}"):
        if read_commit(storage, commit.step, f"{where} step {commit.step}") != commit:
            raise FileExistsError(f"{where}: {d}/{COMMIT} changed since step {commit.step} was committed")
        storage.write_small(f"{d}/{COMMIT}", plain.to_bytes())
    return plain


def read_committed_manifest(storage: "Storage", step: int, where: str) -> tuple[Commit, bytes]:
    """The marker of committed ``step`` and the bytes of the manifest it names (the one way any
    reader reaches a step's manifest), checked against it: never more than the size it names,
    and that size and CRC32C.

    Raises:
        FileNotFoundError: the marker or the manifest is missing.
        CorruptCheckpointError: naming ``where`` and what is wrong.
        OSError: the storage's other errors.
    """
    commit = read_commit(storage, step, where)
    return commit, manifest_of(storage, commit, step, where)


def manifest_of(storage: "Storage", commit: Commit, step: int, where: str) -> bytes:
    """The bytes of the manifest the marker ``commit`` of ``step`` names, checked against it
    (:func:`read_committed_manifest` once the marker is read). Raises as it does."""
    name = commit.manifest_file
    try:  # never more than the marker says: a sparse file of a terabyte is refused unread
        mbytes = storage.read_small(f"{step_dir(step)}/{name}", min(commit.manifest_bytes, MAX_MANIFEST_BYTES))
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"{where}: {e}") from None
    if len(mbytes) != commit.manifest_bytes or get_ops().crc32c_bytes(mbytes) != commit.manifest_crc32c:
        raise CorruptCheckpointError(f"{where}: {name} does not match its commit marker "
                                     "(size or checksum differs): garbled or replaced")
    if commit.step != step:
        raise CorruptCheckpointError(f"{where}: {COMMIT} is for step {commit.step}, but lies in {step_dir(step)}/")
    return mbytes


def is_committed(storage: "Storage", step: int, generation: int) -> bool:
    """Whether ``generation``'s ``COMMIT`` of ``step`` is on ``storage`` (read back; False when unsure)."""
    try:
        c = read_commit(storage, step, f"{storage.display_url}/{step_dir(step)}")
    except Exception as e:  # missing, unreadable: not known to be committed
        log.debug("nebula_ckpt: %s: no readable COMMIT of step %d: %s", storage.display_url, step, e)
        return False
    return c.step == step and c.generation == generation


def retract_step(storage: "Storage", step: int, generation: int, tier: str) -> bool:
    """Take back ``generation``'s committed ``step`` (a save of it ended fenced): its marker
    first, then the files of that generation (and the manifest, unless a newer writer's files
    are in the folder), then the folder if that left it empty. True when it was taken back.

    Never another generation's step of the same number: the marker is taken back only if it
    names ``generation``; on a local file system it is first renamed away (atomic) and its
    generation read from the renamed file, so a newer writer's marker written meanwhile is put
    back, never removed. A step that a committed step still refers to (an incremental one) is
    kept, with a warning. Best effort: an error is logged, never raised.
    """
    d = step_dir(step)
    try:
        if not storage.exists(f"{d}/{COMMIT}") or \
                read_commit(storage, step, f"{tier} step {step}").generation != generation:
            return False
        users = referrers(storage, committed_steps(storage), step)
        if users:
            log.warning("nebula_ckpt: tier %s: step %d of a fenced save is kept: step(s) %s refer to its bytes",
                        tier, step, users[:8])
            return False
        if not _take_marker(storage, f"{d}/{COMMIT}", generation):
            return False
        marker_changed(storage, step)
        names = storage.list(d)
        newer = any((o := shard_owner(n)) is not None and o[0] > generation for n in names)
        for n in names:
            o = shard_owner(n)
            if (o is not None and o[0] == generation) or (not newer and (is_manifest_name(n) or n == RANKS_FILE)):
                storage.remove(f"{d}/{n}")
        storage.remove_empty_dir(d)
    except Exception as e:
        log.warning("nebula_ckpt: tier %s: cannot take back step %d of a fenced save: %s", tier, step, e)
        return False
    log.warning("nebula_ckpt: tier %s: step %d taken back: its save was fenced by a newer writer", tier, step)
    return True


def _take_marker(storage: "Storage", marker: str, generation: int) -> bool:
    """Remove the commit marker ``marker`` if it names ``generation`` (see :func:`retract_step`)."""
    path = storage.local_path(marker)
    if path is None:  # a blob store: read, then remove (the fence's check-then-act window)
        storage.remove(marker)
        return True
    taken = f"{path}.taken-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(path, taken)
    except FileNotFoundError:
        return False
    try:
        mine = Commit.parse(read_small_file(taken, MAX_COMMIT_BYTES), path).generation == generation
    except Exception:  # unreadable now: not known to be ours, so it goes back
        mine = False
    if not mine:  # a newer writer's marker, written since it was read: back in place
        try:
            os.link(taken, path)
        except FileExistsError:
            pass
    os.unlink(taken)
    return mine


# -- references: which earlier steps a committed step needs ---------------------------------------


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


def manifest_references(raw: bytes, where: str, step: int) -> set[int]:
    """The steps the manifest ``raw`` of ``step`` refers to, read from its ``references`` (version
    4) or its shards' ``step`` fields alone: none of its tensor records or tree is parsed, so a
    step's references cost its manifest's JSON, not a validation of it (that is the reader's,
    :meth:`Manifest.parse`, which checks these fields the same way).

    Raises:
        CorruptCheckpointError: naming ``where`` and the field (then no reference is known).
    """
    try:
        m = json.loads(raw)
    except Exception as e:  # RecursionError (deep nesting), UnicodeDecodeError, ...
        raise bad(where, f"{MANIFEST} is not valid JSON ({type(e).__name__}: {e})") from None
    w = f"{where}: {MANIFEST}"
    m = as_obj(m, w, "the manifest")
    version = as_int(m.get("version"), w, "version", lo=1, hi=2**31)
    if m.get("format") != FORMAT or version not in READ_VERSIONS or as_step(m.get("step"), w) != step:
        raise bad(w, f"is no manifest of step {step} this nebula_ckpt reads")
    if version >= SPLIT_VERSION:
        return {as_int(s, w, "references[]", hi=step - 1) for s in as_list(m.get("references", []), w, "references")}
    shards = [ShardRecord.parse(sh, f"{w}: shards[{i}]") for i, sh in enumerate(as_list(m.get("shards"), w, "shards"))]
    refs = {sh.step for sh in shards if sh.step is not None}
    if refs and max(refs) >= step:
        raise bad(w, f"shards refer to step {max(refs)}, not an earlier step than {step}")
    return refs


def read_references(storage: "Storage", step: int) -> set[int]:
    """The steps the committed ``step`` on ``storage`` refers to (:func:`manifest_references`).

    A manifest that is missing or malformed names nothing (its checkpoint cannot be restored
    anyway, and it is reported where it is read). Any other error (an unreachable remote tier)
    propagates: the caller must then delete nothing, since it cannot know what is needed.
    """
    return read_kept(storage, step)[1]


def read_kept(storage: "Storage", step: int) -> tuple[Optional[Commit], set[int]]:
    """The marker of the committed ``step`` on ``storage`` (None: one that cannot be read, no write
    of anyone's) and the steps it refers to (:func:`read_references`): what retention needs of
    a step, read once (its marker, then its manifest).

    Raises:
        OSError other than FileNotFoundError: the storage's errors (nothing may be deleted).
    """
    where = f"{storage.display_url} step {step}"
    try:
        commit = read_commit(storage, step, where)
    except (FileNotFoundError, CorruptCheckpointError) as e:
        log.debug("nebula_ckpt: %s: no references read (%s)", where, e)
        return None, set()
    try:
        return commit, manifest_references(manifest_of(storage, commit, step, where), where, step)
    except (FileNotFoundError, CorruptCheckpointError) as e:
        log.debug("nebula_ckpt: %s: no references read (%s)", where, e)
        return commit, set()


def protected_steps(storage: "Storage", kept: Iterable[int],
                    refs: Optional[Callable[[int], set[int]]] = None) -> set[int]:
    """``kept`` and every step a kept committed step refers to: what deletion must leave alone
    (``refs``: a step's references where the caller knows them; None: :func:`read_references`)."""
    kept = set(kept)
    out = set(kept)
    for s in kept:
        out |= refs(s) if refs is not None else read_references(storage, s)
    return out


def referrers(storage: "Storage", committed: Iterable[int], step: int) -> list[int]:
    """The committed steps (of ``committed``, other than ``step``) that refer to ``step``."""
    return sorted(s for s in committed if s > step and step in read_references(storage, s))


def deletion_order(storage: "Storage", doomed: Iterable[int],
                   refs: Optional[Callable[[int], set[int]]] = None) -> list[int]:
    """``doomed`` (committed steps to delete together) in an order that keeps every step still
    committed restorable at every instant: a step goes before every step of ``doomed`` it refers
    to (its bases), newest first among the free ones. A process killed between two deletions thus
    leaves only whole checkpoints: what is left of ``doomed`` is referred to by nothing that is
    gone. (References of the steps that stay are the caller's: :func:`protected_steps`; ``refs``:
    as there.)

    Raises:
        what :func:`read_references` raises (an unreachable tier): then nothing may be deleted.
    """
    left = set(doomed)
    if len(left) < 2:
        return sorted(left)  # nothing to order (the usual pass of retention): no manifest read
    needs = {s: (refs(s) if refs is not None else read_references(storage, s)) & left for s in left}
    order: list[int] = []
    while left:
        needed = set().union(*(needs[s] for s in left))
        free = sorted(left - needed, reverse=True) or [max(left)]  # a cycle cannot be written; still ends
        order.extend(free)
        left -= set(free)
    return order
