"""The sweep: the leftovers of saves that never committed, which files no live writer owns, and
their removal; shared by every writer of checkpoints (the tier writers, :mod:`nebula_ckpt.save.writer`,
and the DCP writer, :class:`nebula_ckpt.dcp.writer.NebulaStorageWriter`).

A file of an uncommitted step folder is *stale* (:meth:`Ownership.stale`) when no writer that may
still run owns it: a shard of an older generation, or of this very rank of this generation; a
manifest (or a temp file) when this rank is the one that commits on this storage. A same-generation
peer rank's shard is in flight, a newer generation's belongs to the writer that took over; neither
is ever removed. A committed step's files are never leftovers (a ``REMOVED`` record in a folder
whose ``COMMIT`` is gone is a leftover like the manifest), but a committed folder may hold
*strays*: the files of a save that was to replace the step and never committed (its own variant
of names, :func:`~nebula_ckpt.format.names.new_variant`), or of the write it replaced, where a
process was killed before it removed them; the files no marker owns
(:func:`committed_files`) and no live writer owns are removed like
leftovers (:func:`stray_files`; a writer looks once, at its first deletion pass), after the
committed steps that refer to them (:func:`drop_stray_referrers`). Also: the steps ``remove()`` deferred
while later steps referred to them, recorded on the tier and deleted once none does, whichever
process deletes there next (:class:`Removals`).

The commit itself, and the marker's whole life, is :mod:`nebula_ckpt.format.commit`.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Container, ContextManager, Iterable, Iterator, Mapping, Optional

from nebula_ckpt import knobs
from nebula_ckpt.errors import CorruptCheckpointError
from nebula_ckpt.format.commit import (
    Commit,
    CommitProgress,
    WriterFence,
    committed_steps,
    delete_checkpoint,
    deletion_order,
    read_commit,
    read_commits,
    read_committed_manifest,
    read_references,
    references,
    referrers,
    settle_manifest,
)
from nebula_ckpt.format.manifest import Manifest
from nebula_ckpt.format.names import (
    COMMIT,
    MANIFEST,
    RANKS_FILE,
    REMOVED,
    is_manifest_name,
    name_variant,
    parse_step_dir,
    records_name,
    shard_generation,
    shard_name,
    shard_owner,
    step_dir,
)
from nebula_ckpt.format.removal import Removal, read_removal, write_removal
from nebula_ckpt.storage.base import Storage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ownership:
    """Who owns the files of uncommitted step folders, as one writer rank sees them.

    Args:
        generation: this writer's generation.
        rank: this writer's rank.
        commits_here: whether this rank writes the manifests on this storage (the coordinator
            on a shared tier; every rank on its own tier).
    """

    generation: int
    rank: int
    commits_here: bool

    def stale(self, name: str, ours_failed: bool = False) -> bool:
        """Whether file ``name`` of an uncommitted step belongs to no writer that may still run.

        ``ours_failed``: this generation's save of the step is known to have ended without a
        commit, so every rank's shard of this generation in it is stale too.
        """
        owner = shard_owner(name)
        if owner is None:  # the manifest (or a temp file) of whoever commits on this storage
            return self.commits_here
        if ours_failed and owner[0] == self.generation:
            return True
        return owner[0] < self.generation or owner == (self.generation, self.rank)


def leftover_steps(storage: Storage, steps: list[int], owner: Ownership, failed: Container[int] = ()) -> list[int]:
    """Those of the uncommitted ``steps`` whose every file is stale (``failed``: steps this
    generation's save of which ended without a commit)."""
    return [s for s in steps if all(owner.stale(n, s in failed) for n in storage.list(step_dir(s)))]


def abandoned_uploads(storage: Storage, generation: int) -> list[tuple[str, str]]:
    """Incomplete uploads (``(rel, upload id)``) of shards of ``generation`` or older: none of
    this writer's is in flight while it sweeps, and an older writer's never completes."""
    out = []
    for rel, upload_id in storage.incomplete_uploads():
        g = shard_generation(rel.rsplit("/", 1)[-1])
        if g is not None and g <= generation:
            out.append((rel, upload_id))
    return out


def remove_leftovers(storage: Storage, steps: list[int], uploads: list[tuple[str, str]], where: str,
                     strays: Iterable[str] = ()) -> None:
    """Remove the leftover step folders ``steps`` and the ``strays`` (:func:`stray_files`), and
    abort the abandoned ``uploads`` (the caller checked its fence first). The committed steps
    that refer to a stray go first (:func:`drop_stray_referrers`)."""
    for rel in drop_stray_referrers(storage, list(strays), where):
        log.info("nebula_ckpt: %s: removing %s, of no committed write of its step", where, rel)
        storage.remove(rel)
    for s in steps:
        log.info("nebula_ckpt: %s: removing uncommitted leftovers of step %d", where, s)
        storage.remove_dir(step_dir(s))
    for rel, upload_id in uploads:
        log.info("nebula_ckpt: %s: aborting the abandoned upload of %s", where, rel)
        storage.abort_upload(rel, upload_id)


def drop_stray_referrers(storage: Storage, strays: list[str], where: str) -> list[str]:
    """Before the ``strays`` (:func:`stray_files`) go: the committed steps that refer to one of
    them (the bytes of a write replaced by a process killed before :func:`replaced` dropped its
    referrers), and the steps that refer to those, go, marker first (the caller checked its
    fence); a step that refers only to files its steps' committed writes keep stays. Returns the
    strays that may go: all but those of a folder a multi-rank step refers to (its files, in its
    ranks' records, are not read here). Only a folder with strays costs a read of the later
    committed steps' manifests.

    Raises:
        OSError: the storage's errors other than a missing file (then nothing goes).
    """
    gone: dict[int, set[str]] = {}
    for rel in strays:
        folder, name = rel.rsplit("/", 1)
        step = parse_step_dir(folder)
        if step is not None:
            gone.setdefault(step, set()).add(name)
    if not gone:
        return strays
    refs: dict[int, dict[int, Optional[set[str]]]] = {}  # step -> step referred to -> its files (None: not known)
    for t in [t for t in committed_steps(storage) if t > min(gone)]:
        refs[t] = referred_files(storage, t)
    doomed = with_referrers(refs, {t for t, by in refs.items()
                                   if any(files and files & gone.get(s, set()) for s, files in by.items())})
    unsure = {s for t, by in refs.items() if t not in doomed for s, files in by.items() if s in gone and files is None}
    if doomed:
        log.warning("nebula_ckpt: %s: step(s) %s refer to the bytes of a write that was replaced (the process that "
                    "saved the step again ended before it removed them): they are deleted", where, sorted(doomed)[:8])
    for t in deletion_order(storage, doomed):
        delete_checkpoint(storage, t)
    return [rel for rel in strays if parse_step_dir(rel.rsplit("/", 1)[0]) not in unsure]


def referred_files(storage: Storage, step: int) -> dict[int, Optional[set[str]]]:
    """The earlier steps committed ``step`` refers to, each with the names of its files it
    refers to (None: not known, a multi-rank step's); nothing where its manifest is missing or
    malformed (it cannot be restored anyway, and it is reported where it is read).

    Raises:
        OSError: the storage's errors other than a missing file.
    """
    where = f"{storage.display_url} step {step}"
    try:
        man = Manifest.parse(read_committed_manifest(storage, step, where)[1], where, step)
    except (FileNotFoundError, CorruptCheckpointError) as e:
        log.debug("nebula_ckpt: %s: no references read (%s)", where, e)
        return {}
    if man.layout is not None:
        return dict.fromkeys(references(man))
    out: dict[int, Optional[set[str]]] = {}
    for sh in man.shards:
        if sh.step is not None:
            files = out.setdefault(sh.step, set())
            assert files is not None
            files.add(sh.file)
    return out


def discard_files(storage: Storage, step: int, doomed: Callable[[str], bool], where: str) -> None:
    """After a save of ``step`` that certainly did not commit: remove what it wrote (the files
    ``doomed`` names), then the folder if that left it empty. Nothing is removed from a folder
    holding a ``COMMIT`` (not this save's marker, but a checkpoint all the same). Each rank
    removes its own files and the last one removes the folder (``remove_empty_dir`` is atomic),
    so no empty folder is left behind. Best effort: a failure is logged."""
    d = step_dir(step)
    try:
        names = storage.list(d)
        if COMMIT in names:
            log.warning("nebula_ckpt: %s: %s holds a COMMIT; nothing of it is removed", where, d)
            return
        for n in names:
            if doomed(n):
                storage.remove(f"{d}/{n}")
        storage.remove_empty_dir(d)
    except Exception as e:
        log.warning("nebula_ckpt: %s: cannot remove the files of failed step folder %s: %s", where, d, e)


def committed_files(storage: Storage, step: int) -> Optional[set[str]]:
    """The names of the files of committed ``step``'s folder that its committed write needs or
    keeps: the marker, the manifest it names, ``REMOVED``, and the step's own shards that manifest
    lists; None when that is not known (the marker or manifest unreadable, or a checkpoint of
    several ranks, whose records and ``ranks.json`` lie beside them): then none may be removed.

    Raises:
        OSError: the storage's errors other than a missing file.
    """
    where = f"{storage.display_url} step {step}"
    try:
        commit, raw = read_committed_manifest(storage, step, where)
    except (FileNotFoundError, CorruptCheckpointError) as e:
        log.debug("nebula_ckpt: %s: its files are not known (%s)", where, e)
        return None
    return kept_files(commit, raw, where)


def kept_files(commit: Commit, raw: bytes, where: str) -> Optional[set[str]]:
    """:func:`committed_files` of a step whose marker ``commit`` and manifest bytes ``raw`` are read."""
    try:
        man = Manifest.parse(raw, where, commit.step)
    except CorruptCheckpointError as e:
        log.debug("nebula_ckpt: %s: its files are not known (%s)", where, e)
        return None
    if man.layout is not None or man.multi_rank and len(man.ranks) != 1:
        return None
    return {COMMIT, REMOVED, commit.manifest_file} | {sh.file for sh in man.shards if sh.step is None}


def marker_of(storage: Storage, step: int, where: str) -> Optional[Commit]:
    """The marker of committed ``step``, None where it cannot be parsed (logged: no reader takes that step).

    Raises:
        OSError: it cannot be read (the caller then changes nothing).
    """
    try:
        return read_commit(storage, step, f"{where} step {step}")
    except CorruptCheckpointError as e:
        log.warning("nebula_ckpt: %s: %s", where, e)
        return None


def stray_files(storage: Storage, committed: Iterable[int], owner: Ownership) -> list[str]:
    """The stray files (see the module docstring) of the ``committed`` steps' folders, as paths.
    One listing per folder; the marker and manifest are read only where a file of another write
    may lie (a variant's name, a temporary file: a step that was saved again)."""
    out: list[str] = []
    for s in committed:
        d = step_dir(s)
        names = storage.list(d)
        if not any(name_variant(n) is not None or n.startswith(".") or (is_manifest_name(n) and n != MANIFEST)
                   for n in names):
            continue  # one write's plain names: nothing another write left
        keep = committed_files(storage, s)
        if keep is not None:  # unknown: none goes
            out += [f"{d}/{n}" for n in names if n not in keep and owner.stale(n)]
    return out


def replaced(storage: Storage, fence: WriterFence, step: int, where: str, unlisted: Iterable[int] = ()) -> None:
    """After a new write of ``step`` replaced its marker: the files of the steps that referred to
    the replaced write (``unlisted`` before the switch: :func:`referrers_unlisted`) go, the manifest
    gets its usual name again (:func:`~nebula_ckpt.format.commit.settle_manifest`), then the files
    of the replaced write (every file of the folder the committed write does not keep,
    :func:`committed_files`). Best effort: a failure is logged (the sweep of a later writer removes
    what is left, :func:`stray_files`). The caller holds its deletion lock."""
    d = step_dir(step)
    try:
        for s in unlisted:
            delete_checkpoint(storage, s)
        commit, mbytes = read_committed_manifest(storage, step, f"{where} step {step}")
        if commit.manifest is not None:
            commit = settle_manifest(storage, fence, commit, mbytes, where)
        log.debug("nebula_ckpt: phase=replaced %s step %d: the old write's files go", where, step)
        keep = kept_files(commit, mbytes, f"{storage.display_url} step {step}")
        if keep is not None:  # not known: none goes
            for n in [n for n in storage.list(d) if n not in keep]:
                storage.remove(f"{d}/{n}")
    except Exception as e:
        log.warning("nebula_ckpt: %s: step %d is replaced; removing the old write's files "
                    "failed (a later sweep removes them): %s", where, step, e)


def discard_save(storage: Storage, step: int, owner: Ownership, rank: int, where: str) -> None:
    """After a save of ``step`` by ``owner`` (rank ``rank``) that certainly did not commit:
    remove what it wrote of the step (this rank's shard and records file; the manifest when this
    rank commits here and no newer writer is in the folder), then the folder if that left it
    empty (:func:`discard_files`)."""
    gen = owner.generation
    names = []
    try:
        names = storage.list(step_dir(step))
    except Exception as e:  # discard_files reports it
        log.debug("nebula_ckpt: %s: cannot list step %d: %s", where, step, e)
    newer = any((o := shard_owner(n)) is not None and o[0] > gen for n in names)
    mine_manifest = not newer and owner.commits_here
    own = (shard_name(gen, rank), records_name(gen, rank))
    discard_files(storage, step, lambda n: n in own or (n in (MANIFEST, RANKS_FILE) and mine_manifest), where)


def _referrers_of(storage: Storage, step: int) -> list[int]:
    """The committed steps that refer to ``step``'s bytes (the run resumed from an older step; they
    are of the timeline it left), and those that refer to theirs (:func:`with_referrers`), in
    :func:`deletion_order`."""
    later = {t: read_references(storage, t) for t in committed_steps(storage) if t > step}
    return deletion_order(storage, with_referrers(later, {t for t, by in later.items() if step in by}))


def drop_referrers(storage: Storage, step: int, where: str) -> None:
    """As the committed ``step`` is replaced (before its new write, on a shared tier): the steps
    that refer to its bytes go, marker first (:func:`unlist_referrers`), then their files (the
    caller holds its deletion lock)."""
    for s, _ in unlist_referrers(storage, step, where):
        delete_checkpoint(storage, s)


def unlist_referrers(storage: Storage, step: int, where: str) -> list[tuple[int, bytes]]:
    """Before a new write of the committed ``step`` replaces its marker: the markers of
    :func:`_referrers_of` it go (each ``(step, its marker's bytes)`` is returned), so no step
    listed at any instant refers to a write that is no longer its base's. Their files go once the
    new marker is in (:func:`replaced`); a replacement that certainly did not land puts the
    markers back (:func:`relist`), the steps whole as they were; a process killed meanwhile leaves
    them as leftovers, which the next writer's sweep removes. The caller holds its deletion lock."""
    out: list[tuple[int, bytes]] = []
    try:
        for s in _referrers_of(storage, step):
            out.append((s, storage.read_small(f"{step_dir(s)}/{COMMIT}")))
            storage.remove(f"{step_dir(s)}/{COMMIT}")
    except BaseException:  # the replacement does not go ahead: what was unlisted is listed again
        relist(storage, out, where)
        raise
    if out:
        log.warning("nebula_ckpt: %s: step(s) %s refer to the bytes of step %d, which is saved again: they "
                    "are deleted (the run resumed from an older step)", where, sorted(s for s, _ in out)[:8], step)
    return out


@contextlib.contextmanager
def referrers_unlisted(storage: Storage, fence: WriterFence, step: int, replacing: bool, progress: CommitProgress,
                       lock: ContextManager[Any], where: str) -> Iterator[list[int]]:
    """Around the commit of a new write of ``step`` (``replacing``: one is committed): the steps
    that refer to the replaced write's bytes are unlisted first (:func:`unlist_referrers`, under
    the writer's deletion ``lock``, fence checked), and listed again (:func:`relist`) when the
    commit raises and certainly did not land (``progress``); yields the steps unlisted."""
    unlisted: list[tuple[int, bytes]] = []
    if replacing:
        with lock:
            fence.check(f"replace step {step}")
            unlisted = unlist_referrers(storage, step, where)
    try:
        yield [s for s, _ in unlisted]
    except BaseException:
        if not progress.may_commit:  # the step stays the old write: what referred to it is listed again
            relist(storage, unlisted, where)
        raise


def settle(storage: Storage, uncertain: Mapping[int, float], now: float) -> tuple[set[int], set[int]]:
    """Of the steps whose ``COMMIT`` write reported an error (``uncertain``: step -> when, on the
    monotonic clock), those whose write can no longer land (a file system's at once; an object
    store's, whose lost response may still land, once older than ``NEBULA_REMOTE_TIMEOUT_S``), and
    the leftovers among them (no marker: the others are ordinary checkpoints). Raises: the
    store's error (then every step stays uncertain)."""
    wait = 0.0 if storage.failed_create_is_final else knobs.get("remote_timeout_s")
    due = {s for s, t in uncertain.items() if now - t >= wait}
    return due, {s for s in due if not storage.exists(f"{step_dir(s)}/{COMMIT}")}


def relist(storage: Storage, unlisted: list[tuple[int, bytes]], where: str) -> None:
    """Put back the markers :func:`unlist_referrers` took away (the replacement did not land)."""
    for s, marker in reversed(unlisted):
        try:
            storage.write_small(f"{step_dir(s)}/{COMMIT}", marker, create_only=True)
        except Exception as e:  # the step stays a leftover: the next writer's sweep removes it
            log.warning("nebula_ckpt: %s: could not put back step %d's marker (it is lost): %s", where, s, e)


def with_referrers(refs: Mapping[int, Iterable[int]], doomed: set[int]) -> set[int]:
    """``doomed`` and every step of ``refs`` (a committed step -> the steps it refers to) that
    refers to one of them, directly or through others: a step that refers to a deleted one would
    refer to bytes that are gone (a step refers to the shards its tensors lie in, which need not
    include its base's base)."""
    out = set(doomed)
    while more := {t for t, by in refs.items() if t not in out and out & set(by)}:
        out |= more
    return out


def discard_variant(storage: Storage, step: int, variant: str, where: str) -> None:
    """After a save that was to replace the committed ``step`` certainly did not commit: remove
    what it wrote (its ``variant``'s files), never a file the step's committed write keeps. Best effort."""
    d = step_dir(step)
    try:
        keep = committed_files(storage, step) or set()
        for n in storage.list(d):
            if name_variant(n) == variant and n not in keep:
                storage.remove(f"{d}/{n}")
    except Exception as e:
        log.warning("nebula_ckpt: %s: cannot remove the files of the failed save of step %d: %s", where, step, e)


class Removals:
    """``remove()``'s requests on one tier for steps that later steps refer to (deferred removals).

    Each is recorded on the tier itself, in the step's folder (:mod:`nebula_ckpt.format.removal`),
    before ``remove()`` returns, tied to the commit it removes; so every later deletion on the tier,
    this writer's or a later process's (retention, ``remove()``), deletes the step once no committed
    step refers to it and no save in flight builds on it, and a save that commits the step number
    again is never taken for it. The tier's records are read once per writer, at its first deletion
    pass (one read per committed step, no listing); after that this writer knows every request, as
    it makes every one while it owns the tier (a newer writer fences it).

    Args:
        storage: the tier's storage.
        tier: the tier's name, for the logs.
    """

    def __init__(self, storage: Storage, tier: str) -> None:
        self.storage = storage
        self.tier = tier
        self._pending: dict[int, Removal] = {}
        self._loaded = False

    def load(self, committed: Iterable[int]) -> None:
        """Read the requests recorded on the tier for the ``committed`` steps (once per writer)."""
        if self._loaded:
            return
        for s in committed:
            r = read_removal(self.storage, s)
            if r is not None:
                self._pending.setdefault(s, r)
        self._loaded = True
        if self._pending:
            log.info("nebula_ckpt: tier %s: remove() asked for step(s) %s earlier; each goes once nothing refers to "
                     "it", self.tier, sorted(self._pending)[:8])

    def request(self, step: int) -> None:
        """Record on the tier, durably, ``remove()``'s request for the committed ``step`` (kept
        while later steps refer to it), naming the commit its marker names now.

        Raises:
            CorruptCheckpointError: the step's marker cannot be read (nothing recorded).
            OSError and others: the storage's errors (nothing recorded, or a record not yet sure).
        """
        where = f"tier {self.tier} step {step}"
        try:
            commit = read_commit(self.storage, step, where)
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"{e}: remove({step}) cannot record its removal while later steps refer "
                                         "to it; remove those steps first (the step then goes at once)") from None
        removal = Removal.of(commit)
        write_removal(self.storage, removal)
        self._pending[step] = removal

    def due(self, committed: list[int]) -> set[int]:
        """The steps of ``committed`` (the tier's committed steps) that ``remove()`` asked for:
        those whose marker names the commit removed (read here, for the requested steps only: none
        in the usual case). A request for a step no longer committed, or committed again by
        another save, is forgotten; one whose marker cannot be read now is kept, and not due."""
        self.load(committed)
        listed = set(committed)
        for s in [s for s in self._pending if s not in listed]:
            del self._pending[s]
        commits = read_commits(self.storage, sorted(self._pending))
        for s, c in commits.items():
            if c is not None and not self._pending[s].matches(c):
                log.info("nebula_ckpt: tier %s: step %d was committed again since remove() asked for it: kept",
                         self.tier, s)
                del self._pending[s]
        return {s for s, c in commits.items() if c is not None and s in self._pending}

    def drop_unreferenced(self, may_go: Callable[[int], bool]) -> None:
        """Delete the steps ``remove()`` asked for that no committed step refers to any more and
        ``may_go`` lets go of (no save in flight builds on them), marker first (the caller checked
        its fence). Dropping one may free another (a base of the one dropped), so it repeats
        until none goes. Nothing requested (the usual ``remove()``, once the writer's first
        deletion pass has read the tier's records): no listing, no read."""
        if not self._loaded:
            self.load(committed_steps(self.storage))
        while self._pending:
            committed = committed_steps(self.storage)
            due = self.due(committed)
            free = [s for s in sorted(due) if not referrers(self.storage, committed, s) and may_go(s)]
            if not free:
                return
            for s in free:
                log.info("nebula_ckpt: tier %s: removing step %d (remove() asked for it; nothing refers to it now)",
                         self.tier, s)
                delete_checkpoint(self.storage, s)
                del self._pending[s]
