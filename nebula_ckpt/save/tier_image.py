"""What a tier writes for a snapshot: whole, or a delta with references to earlier shards.

One entry point, :func:`tier_image`, for every tier writer: a one-process job's tiers and a
rank's own tier (:mod:`nebula_ckpt.save.writer`), and a rank's share of a shared tier
(:mod:`nebula_ckpt.save.rounds`). It takes frozen data (the snapshot's index and hashes as
:class:`Staged`, the tier's base as its :class:`~nebula_ckpt.save.incremental.Incremental`
claimed it, the storage its references are checked against) and returns frozen data, a
:class:`TierImage`: the own shard's parts, its bytes, the manifest's tensor records, the shards
of earlier steps it refers to. A :class:`TierStep` carries it to the tier writer, which then
only writes (:func:`write_image`), commits and prunes.

A tensor is taken from the base (the rules: :mod:`nebula_ckpt.save.incremental`) only when its
dtype and shape, CRC32C, device and DTensor record equal the base's and either its SHA-256 equals
the one the base recorded (a persistent tier) or its staged bytes equal the base's byte for byte
(a tier whose capabilities say it keeps its base in RAM, the memory tier: :class:`BaseBytes`).
Every tensor key must be the base's, the base must be of this writer generation and older than the
step, and the changed tensors may hold at most :data:`MAX_CHANGED_SHARE` of the bytes; else the
image is whole. So is it when a persistent tier's earlier shards are gone from its storage
(:func:`refs_lacking`) or a memory tier's base cannot be read: then :attr:`TierImage.lost_base`
tells the writer to forget that base.

**The byte compare** (:class:`BaseBytes`). A tier that keeps its base in host memory (its shard
files in the tmpfs) needs no hash: a tensor that passes the cheap filter (CRC32C, device, DTensor
record) is unchanged only when its staged bytes equal the base's. The compare is libc's
``memcmp`` (called through ``ctypes``, which releases the GIL) over 16 MiB chunks, on
``io_threads`` threads niced like the hash threads: it runs on the tier's writer thread's (or the
stager's) behalf, never on the training thread, and yields to training where no core is idle.
Bytes, not values, are compared: NaN payloads, -0.0 and +0.0 are told apart.

**The hashes it spares** (:func:`staged_hashes`): the SHA-256 a persistent tier needs, known from
the byte compare instead of hashed (hashing a large frozen state on every save is most of an
incremental save's cost). When the comparing tier's base and a persistent tier's base were both
committed *from the same snapshot* of this process (the same
:attr:`~nebula_ckpt.save.snapshot.Snapshot.write_id`, so the same step and the same staged bytes),
the SHA-256 of a tensor the compare found equal is known without hashing it:

* its staged bytes equal the comparing base's bytes of it (``memcmp``, just now, on the stager);
* the comparing base's bytes of it are that snapshot's staged bytes (written from them, or
  referred to after an equal compare of them);
* the persistent base recorded the SHA-256 of that snapshot's staged bytes of it (hashed then, or
  known the same way).

So that recorded SHA-256 *is* the SHA-256 of the new staged bytes, and it goes into the snapshot's
``hashes`` as if it had been taken now: every tier then decides as before, and the manifest records
a SHA-256 for the tensor. A tensor the compare found changed (a change through ``.data`` or NumPy,
one with an unchanged CRC32C) or did not compare, one whose SHA-256 the persistent base did not
record, and every tensor when the bases are not from the same snapshot (a restored base, a tier
that dropped a save) are hashed as before. The compare's answer is kept on the snapshot
(:class:`Compared`), so the comparing tier's own save does not compare those bytes again.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from nebula_ckpt import knobs
from nebula_ckpt.errors import CorruptCheckpointError
from nebula_ckpt.format.commit import read_commit, shard_path
from nebula_ckpt.format.manifest import Manifest
from nebula_ckpt.format.names import step_dir
from nebula_ckpt.format.records import ShardRecord, TensorRecord
from nebula_ckpt.ranks.shards import prefixed, subset_image
from nebula_ckpt.save.incremental import hash_staged, same_kind, same_record, wanted_keys, yield_to_training
from nebula_ckpt.workers import Workers

if TYPE_CHECKING:
    from nebula_ckpt.storage.base import Storage
    from nebula_ckpt.tiers.runtime import TierRuntime

log = logging.getLogger(__name__)

#: an incremental save whose changed tensors hold more than this share of the bytes is full
MAX_CHANGED_SHARE = 0.5

#: ``same(candidates)``: the keys of ``candidates`` (key -> its record in the base) whose staged
#: bytes equal the base's
SameBytes = Callable[[dict[str, TensorRecord]], set[str]]


@dataclass(frozen=True)
class Staged:
    """A snapshot as one tier sees it: ``index`` (tensor records, ``offsets`` in ``staged``) and
    ``hashes`` (SHA-256 hex) with the tier's key prefix, the step, the writer generation, and the
    memory tier's compare already made on the stager thread (``known``, when made)."""

    step: int
    generation: int
    index: dict[str, dict[str, Any]]
    hashes: dict[str, str]
    staged: memoryview
    known: Optional[Compared] = None


@dataclass(frozen=True)
class TierImage:
    """What a tier writes for one snapshot.

    ``parts``: the own shard's safetensors image as parts of the staged bytes (None: the staged
    snapshot itself, written whole); ``nbytes``: its size; ``records``: the manifest's tensor
    records (the own shard's at index 0, the others numbered into ``refs``, shards of earlier
    steps, 1, 2, ...); ``write``: the keys in the own shard; ``base``: the step built on (None:
    whole); ``lost_base``: the tier's base turned out unusable (its bytes or references gone):
    the writer forgets it.
    """

    step: int
    parts: Optional[tuple[memoryview, ...]]
    nbytes: int
    records: dict[str, dict[str, Any]]
    write: tuple[str, ...]
    refs: tuple[ShardRecord, ...] = ()
    base: Optional[int] = None
    reused_bytes: int = 0
    base_write: Optional[str] = None  #: the base's ``stats.write_id``: which write of that step it is
    lost_base: bool = False

    @property
    def full(self) -> bool:
        """Whether the image refers to no other step."""
        return not self.refs

    def stats(self) -> dict[str, Any]:
        """The manifest's statistics this image adds (an incremental one's base and reused bytes)."""
        if self.full:
            return {}
        return {"base_step": self.base, "reused_bytes": self.reused_bytes, "base_write": self.base_write}

    def shards(self, own: dict[str, Any]) -> list[dict[str, Any]]:
        """The manifest's ``shards``: the own shard record ``own``, then the references."""
        return [own] + [r.to_json() for r in self.refs]


def tier_image(snap: Staged, base: Optional[Manifest], storage: "Storage", tier: str, *, compare: bool = False,
               keep: Optional[list[str]] = None, nbytes: int = 0) -> TierImage:
    """What tier ``tier`` (on ``storage``) writes of ``snap``, building on ``base`` (None: whole;
    the base its :meth:`~nebula_ckpt.save.incremental.Incremental.claim` returned). ``compare``:
    the tier decides by comparing bytes with its base's (the memory tier; else by SHA-256, and the
    references are checked on ``storage``). ``keep``: the keys this rank writes (a share of a
    shared tier; the image is then always ``parts``); None: every key, and a whole image is the
    staged snapshot itself (``nbytes`` long)."""
    index = snap.index if keep is None else {k: snap.index[k] for k in keep}
    image, lost = None, False
    if base is not None:
        image, lost = _delta(snap, base, index, storage, tier, compare)
    if image is not None:
        return image
    if keep is None:
        return TierImage(snap.step, None, nbytes, snap.index, tuple(snap.index), lost_base=lost)
    parts, records, size = subset_image(snap.index, keep, snap.staged)
    return TierImage(snap.step, tuple(parts), size, records, tuple(keep), lost_base=lost)


def _delta(snap: Staged, base: Manifest, index: dict[str, dict[str, Any]], storage: "Storage", tier: str,
           compare: bool) -> tuple[Optional[TierImage], bool]:
    """The incremental image of ``index`` on ``base``, or None (whole); and whether the base was lost."""
    if not compare:
        image = decide(snap, base, index, None)
        lacking = None if image is None else refs_lacking(storage, image)
        if lacking is not None:
            log.warning("nebula_ckpt: tier %s: step %d is saved whole: %s", tier, snap.step, lacking)
            return None, True
        return image, False
    known = snap.known
    try:
        with BaseBytes(storage, snap.staged, index) as bb:
            def same(candidates: dict[str, TensorRecord]) -> set[str]:
                if known is None or known.base is not base:
                    return bb.same(base, candidates)
                rest = {k: v for k, v in candidates.items() if k not in known.candidates}
                return (set(candidates) & known.same) | (bb.same(base, rest) if rest else set())

            return decide(snap, base, index, same), False
    except OSError as e:
        log.warning("nebula_ckpt: tier %s: step %d is saved whole: the bytes of its base cannot be read (%s)",
                    tier, snap.step, e)
        return None, True


def decide(snap: Staged, base: Manifest, index: dict[str, dict[str, Any]],
           same: Optional[SameBytes]) -> Optional[TierImage]:
    """The incremental image of ``index`` (of ``snap``) on ``base``, or None for a whole one (see
    the module). ``same``: a tier that compares bytes (without it, equality is by SHA-256).

    Raises:
        OSError: ``same`` could not read the base's bytes (the caller saves whole).
    """
    if base.generation != snap.generation or base.step >= snap.step or set(index) != set(base.tensors):
        return None
    if not all(same_kind(rec, base.tensors[k]) for k, rec in index.items()):
        return None
    if same is not None:
        equal = same({k: base.tensors[k] for k, rec in index.items() if same_record(rec, base.tensors[k])})
        reused = {k: base.tensors[k] for k in index if k in equal}
    else:
        reused = {k: base.tensors[k] for k, rec in index.items()
                  if _same_bytes(rec, snap.hashes.get(k), base.tensors[k], base.hashes.get(k))}
    total = sum(r["offsets"][1] - r["offsets"][0] for r in index.values())
    kept = sum(r.nbytes for r in reused.values())
    if not reused or total - kept > MAX_CHANGED_SHARE * total:
        return None
    renumber: dict[int, int] = {}
    refs: list[ShardRecord] = []
    for old in reused.values():
        if old.shard not in renumber:
            sh = base.shards[old.shard]
            renumber[old.shard] = len(refs) + 1
            refs.append(ShardRecord(sh.file, sh.bytes, sh.storage, sh.folder_step(base.step)))
    write = [k for k in index if k not in reused]
    parts, image_index, nbytes = subset_image(index, write, snap.staged)
    records = {k: image_index[k] if k in image_index else {**reused[k].to_json(), "shard": renumber[reused[k].shard]}
               for k in index}
    write_id = base.stats.get("write_id")
    return TierImage(snap.step, tuple(parts), nbytes, records, tuple(write), tuple(refs), base.step, kept,
                     write_id if isinstance(write_id, str) else None)


def _same_bytes(rec: dict[str, Any], sha: Optional[str], old: TensorRecord, old_sha: Optional[str]) -> bool:
    """Whether the staged tensor certainly equals the base's: CRC, device, DTensor record and SHA-256."""
    return same_record(rec, old) and sha is not None and sha == old_sha


def refs_lacking(storage: "Storage", image: TierImage) -> Optional[str]:
    """What is missing of the earlier steps ``image`` refers to on ``storage`` (a persistent tier,
    which decides by hashes and never reads its base's bytes): a commit marker, or a shard file
    at its recorded size; None when all are there. An operator who deleted a base by hand must
    not get a committed step that refers to it (never restorable), nor one that refers to a step
    the sweep will delete as an uncommitted leftover."""
    seen: set[str] = set()  # folders whose markers were found (one look per folder, not per shard)
    assert image.base is not None
    for ref in image.refs:
        folder = step_dir(ref.folder_step(image.base))
        try:
            if folder not in seen:  # its marker and the manifest it names (a reader checks its own records)
                name = read_commit(storage, ref.folder_step(image.base), f"{storage.display_url} {folder}")\
                    .manifest_file
                if not storage.exists(f"{folder}/{name}"):
                    return f"{folder}/{name} is gone (that step holds bytes this one would refer to)"
            seen.add(folder)
            size = storage.size(f"{folder}/{ref.file}")
        except FileNotFoundError:
            size = -1
        except CorruptCheckpointError as e:
            return f"{folder}: {e} (that step holds bytes this one would refer to)"
        if size != ref.stored_bytes:
            return f"{folder}/{ref.file} is gone or has another size (it holds bytes this step would refer to)"
    return None


@dataclass(frozen=True)
class TierStep:
    """One step to commit on a tier: what is written (decided, data) and the one effect before its
    commit (``before_commit``: waits for the snapshot's confirmation; raises if it must not commit).

    ``image``: what the tier writes (:func:`tier_image`; None on a
    shared tier of several ranks, whose rounds decide it, :mod:`nebula_ckpt.save.rounds`);
    ``whole``: the whole image written instead where an incremental one's shard fails;
    ``manifest``: the step's manifest but for its generation, shards and tensors, filled at the
    commit (:func:`~nebula_ckpt.format.manifest.finish_manifest`; ``restamp``: with the commit's
    time, else a copy keeps its source's).
    """

    step: int
    source: Any                                               # has .view() -> memoryview (None: a copy)
    before_commit: Callable[[], None]                         # an effect: raises if it must not commit
    image: Optional[TierImage] = None
    whole: Optional[TierImage] = None
    manifest: Optional[dict[str, Any]] = None
    restamp: bool = True
    index: int = 0                                            # the save's number in the job
    meta: Optional[dict[str, Any]] = None                     # multi-rank: tensors, aliases, tree, stats
    tag: Optional[str] = None                                 # multi-rank: the checkpoint's tag
    hashes: Optional[dict[str, str]] = None                   # multi-rank: SHA-256 of staged tensors
    origin: Optional[str] = None                              # the snapshot's write_id (None: a copy)
    save: Optional[int] = None                                # which write: the save number its COMMIT names


def write_image(runtime: "TierRuntime", rel: str, step: TierStep) -> tuple[dict[str, Any], TierImage]:
    """Write ``step``'s shard at ``rel`` to ``runtime``'s storage; return its storage info and the
    image as written. An incremental step whose own shard fails (the memory tier out of room beside
    its staged copy) is written whole instead where the tier can
    (:meth:`~nebula_ckpt.tiers.runtime.TierRuntime.write_whole_instead`); else its error stands."""
    image = step.image
    assert image is not None, "a shared tier's share is written by its rounds"
    if image.parts is None:
        return write_whole_shard(runtime, rel, step.source), image
    try:
        return runtime.storage.write_parts(rel, list(image.parts)), image
    except OSError as e:
        if step.whole is None:
            raise
        info = runtime.write_whole_instead(rel, lambda: write_whole_shard(runtime, rel, step.source), e)
        if info is None:
            raise
        return info, step.whole


def write_whole_shard(runtime: "TierRuntime", rel: str, source: Any) -> dict[str, Any]:
    """The shard image of ``source`` (``.view()``) at ``rel`` on ``runtime``'s storage; its storage
    info. Where the tier's capabilities say it ``links_staged`` and ``source`` is staged in a file
    (its ``path``: the memory tier's slot file), a hard link of that file, no bytes copied; a copy
    where that link fails (another file system, the slot file gone) and for every other tier."""
    path = getattr(source, "path", None)
    if path is not None and runtime.capabilities.links_staged:
        try:
            return runtime.storage.link_file(path, rel)
        except OSError as e:
            log.debug("nebula_ckpt: tier %s: linking %s failed (%s); copying", runtime.name, path, e)
    return runtime.storage.write_buffer(rel, source.view())


# -- the byte compare, and the hashes it spares the persistent tiers -------------------------------

_memcmp = ctypes.CDLL(None).memcmp  # a CDLL call releases the GIL
_memcmp.restype = ctypes.c_int
_memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]

#: bytes one ``memcmp`` call compares (a change is found within one chunk of its place)
_CHUNK = 16 << 20


def equal_at(a: int, b: int, n: int) -> bool:
    """Whether the ``n`` bytes at addresses ``a`` and ``b`` are equal (the caller keeps both alive)."""
    for off in range(0, n, _CHUNK):
        if _memcmp(a + off, b + off, min(_CHUNK, n - off)):
            return False
    return True


class BaseBytes:
    """The bytes of a base checkpoint on a local tier (the memory tier), mapped as needed and
    compared with the staged bytes of a save (:meth:`same`, the test of
    :func:`~nebula_ckpt.save.tier_image.tier_image`). A context manager: the mappings go
    at exit.

    Args:
        storage: the tier's storage (a local file system: ``local_path`` names the files).
        staged: the save's shard image; ``index``: its tensor records (``offsets`` in ``staged``).
    """

    def __init__(self, storage: "Storage", staged: memoryview, index: dict[str, dict[str, Any]]) -> None:
        self._storage = storage
        self._staged = np.frombuffer(staged, dtype=np.uint8)
        self._index = index
        self._maps: dict[str, tuple[mmap.mmap, np.ndarray]] = {}

    def __enter__(self) -> "BaseBytes":
        return self

    def __exit__(self, *exc: object) -> None:
        mms = [mm for mm, _ in self._maps.values()]
        self._maps = {}  # the arrays' exports of the mappings go first
        for mm in mms:
            mm.close()

    def _map(self, base: Manifest, shard: int) -> np.ndarray:
        rel = shard_path(base, shard)
        if rel not in self._maps:
            path = self._storage.local_path(rel)
            if path is None:
                raise OSError(f"{rel}: the tier is not a local file system")
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            self._maps[rel] = (mm, np.frombuffer(mm, dtype=np.uint8))
        return self._maps[rel][1]

    def same(self, base: Manifest, candidates: dict[str, TensorRecord]) -> set[str]:
        """The keys of ``candidates`` (key -> its record in ``base``) whose staged bytes equal the
        base's, compared in parallel.

        Raises:
            OSError: a base shard file cannot be read (gone, or shorter than a record says).
        """
        jobs: list[tuple[str, int, int, int]] = []
        out: set[str] = set()
        for key, old in candidates.items():
            start, end = self._index[key]["offsets"]
            if end - start != old.nbytes:
                continue
            if not old.nbytes:
                out.add(key)
                continue
            theirs = self._map(base, old.shard)
            if len(theirs) < old.end:
                raise OSError(f"{shard_path(base, old.shard)} holds {len(theirs)} bytes, {key} needs {old.end}")
            jobs.append((key, self._staged.ctypes.data + start, theirs.ctypes.data + old.start, old.nbytes))
        if not jobs:
            return out
        threads = max(1, min(len(jobs), int(knobs.get("io_threads"))))
        with Workers(threads, thread_name_prefix="nebula-compare", initializer=yield_to_training) as ex:
            equal = list(ex.map(lambda j: equal_at(j[1], j[2], j[3]), jobs))
        return out | {j[0] for j, eq in zip(jobs, equal, strict=True) if eq}


@dataclass(frozen=True)
class Compared:
    """The staged bytes of a snapshot already compared with the memory tier's base ``base``
    (the very object that tier's :class:`Incremental` held) on the stager thread: ``candidates``,
    the keys compared; ``same``, those equal byte for byte (keys as in ``base``)."""

    base: Manifest
    candidates: frozenset[str]
    same: frozenset[str]


def staged_hashes(targets: list[Any], view: memoryview,
                  index: dict[str, dict[str, Any]]) -> tuple[dict[str, str], Optional[Compared]]:
    """The SHA-256 of the staged tensors that the tiers ``targets`` (tier writers) need, and the
    memory tier's compare of them with its base when it was made (see the module)."""
    known: dict[str, str] = {}
    compared: Optional[Compared] = None
    mem = next((t for t in targets if t.incremental.enabled and t.incremental.compare), None)
    if mem is not None:
        compared, origin = _compare(mem, targets, view, index)
        if compared is not None:
            known = _recorded(compared, origin, mem.key_prefix, targets)
    want = wanted_keys(targets, index) - set(known)
    got = hash_staged(view, index, want)
    if known:
        log.debug("nebula_ckpt: %d tensor(s) found unchanged by the memory tier's compare: their SHA-256 are the "
                  "base's, %d hashed", len(known), len(got))
    return {**known, **got}, compared


def _peers(mem: Any, targets: list[Any], origin: str) -> list[Any]:
    """The persistent tiers among ``targets`` whose base was committed from snapshot ``origin``."""
    return [t for t in targets if t is not mem and t.incremental.enabled and not t.incremental.compare
            and t.incremental.current()[1] == origin]


def _compare(mem: Any, targets: list[Any], view: memoryview,
             index: dict[str, dict[str, Any]]) -> tuple[Optional[Compared], str]:
    """The memory tier's compare of the staged bytes with its base, made only when a persistent
    tier's base comes from the same snapshot (else ``(None, "")``)."""
    base, origin = mem.incremental.current()
    if base is None or origin is None or not _peers(mem, targets, origin):
        return None, ""
    keyed = prefixed(index, mem.key_prefix)
    cands = {k: old for k, rec in keyed.items()
             if (old := base.tensors.get(k)) is not None and same_kind(rec, old) and same_record(rec, old)}
    if not cands:
        return None, ""
    try:
        with BaseBytes(mem.storage, view, keyed) as bb:
            same = bb.same(base, cands)
    except OSError as e:  # the memory tier's own save reports it; here the tensors are hashed
        log.debug("nebula_ckpt: tier %s: its base cannot be compared: %s", mem.name, e)
        return None, ""
    return Compared(base, frozenset(cands), frozenset(same)), origin


def _recorded(compared: Compared, origin: str, prefix: str, targets: list[Any]) -> dict[str, str]:
    """Key -> the SHA-256 a persistent base from snapshot ``origin`` recorded, for the keys the
    compare found equal (keys of the snapshot: ``prefix`` removed)."""
    out: dict[str, str] = {}
    for t in targets:  # checked again: a writer thread may have moved its base on since the compare
        base, got = t.incremental.current()
        if base is None or got != origin or t.incremental.compare:
            continue
        for k in compared.same:
            key = k[len(prefix):]
            h = base.hashes.get(key)
            if h is not None:
                out[key] = h
    return out
