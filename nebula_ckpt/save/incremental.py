"""Incremental saves: write only the tensors that changed since the checkpoint a tier builds on.

Each persistent tier's writer keeps its *base*: the last checkpoint it committed there in this
process (:class:`Incremental`). A save whose tensors have the base's keys, dtypes and shapes
writes a shard of the tensors that changed and refers to the base's shards for the rest
(:func:`nebula_ckpt.format.commit.references`); any other save is full, and so is every
``full_every``-th save of a tier (knob ``incremental_full_every``), which keeps the steps a
checkpoint refers to few and lets retention drop old ones.

Equality is known, never guessed. A tensor is unchanged only when its CRC32C, dtype, shape,
device and DTensor record equal the base's **and** the SHA-256 of its staged bytes equals the one
the base recorded. The CRC is a cheap filter (a different CRC is a change, nothing more is
done); a 32-bit CRC equal by chance (or by construction: CRC is linear) is caught by the SHA-256.
The hashes are taken of the staged bytes (what is written), so a change made in any way (an
optimizer, ``.data``, NumPy, a raw pointer) is seen; they are taken on the stager thread by
``io_threads`` threads (``hashlib`` releases the GIL) niced by :data:`HASH_NICE`, never on the
training thread, only for the tensors whose CRC equals the base's (and for every tensor of a
tier's first save, which has no base), and recorded in the manifest (``sha256``; in a multi-rank checkpoint of format
version 4, in each rank's records file, :mod:`nebula_ckpt.format.rank_records`). A tensor that
changes save after save (dense training) is never hashed: its CRC already differs.

The memory tier (``compare=True``) hashes nothing: its base's bytes are still in host memory (the
base step's shard files in the tmpfs), so a tensor whose CRC32C, device and DTensor record equal
the base's is unchanged only when its staged bytes equal the base's byte for byte
(:class:`nebula_ckpt.save.tier_image.BaseBytes`, at memory speed on niced threads, never on the training thread).

This module keeps each tier's base (:meth:`Incremental.claim` hands it to a save); what a save
writes on it, whole or a delta with references, is decided by :mod:`nebula_ckpt.save.tier_image`.
"""

from __future__ import annotations

import hashlib
import threading
from typing import TYPE_CHECKING, Any, Iterable, Optional

from nebula_ckpt import knobs
from nebula_ckpt.format.commit import Commit, read_committed_manifest, shard_path
from nebula_ckpt.format.header import safetensors_header
from nebula_ckpt.format.manifest import SINCE_FULL, Manifest
from nebula_ckpt.format.records import ShardRecord, TensorRecord
from nebula_ckpt.priority import lower_priority
from nebula_ckpt.workers import Workers

if TYPE_CHECKING:
    from nebula_ckpt.storage.base import Storage

#: the threads that hash staged tensors run this much nicer than the process (Linux, 0-19; 0: same
#: priority), so that on a machine without idle cores hashing yields to training
HASH_NICE = 10


def hash_staged(view: memoryview, index: dict[str, dict[str, Any]], keys: Iterable[str]) -> dict[str, str]:
    """SHA-256 (hex) of the staged bytes of ``keys`` (their ``offsets`` in ``view``), in parallel."""
    todo = [k for k in keys if k in index]
    if not todo:
        return {}

    def one(k: str) -> str:
        start, end = index[k]["offsets"]
        return hashlib.sha256(view[start:end]).hexdigest()

    threads = max(1, min(len(todo), int(knobs.get("io_threads"))))
    with Workers(threads, thread_name_prefix="nebula-hash", initializer=yield_to_training) as ex:
        return dict(zip(todo, ex.map(one, todo), strict=True))


def yield_to_training() -> None:
    """Lower the calling thread's scheduling priority by :data:`HASH_NICE`, so that where no
    core is idle the hash threads take what training leaves (:mod:`nebula_ckpt.priority`)."""
    lower_priority(int(HASH_NICE))


def same_kind(rec: dict[str, Any], old: TensorRecord) -> bool:
    """Same dtype and shape (else the save is full)."""
    return rec["dtype"] == old.dtype and tuple(rec["shape"]) == old.shape


def same_record(rec: dict[str, Any], old: TensorRecord) -> bool:
    """The cheap filter: CRC32C, device and DTensor record equal the base's (else it changed)."""
    dt = None if old.dtensor is None else old.dtensor.to_json()
    return rec["crc32c"] == old.crc32c and rec.get("device", "cpu") == old.device and rec.get("dtensor") == dt


class Incremental:
    """One tier's incremental state: its base and the cadence of full saves (thread-safe).

    Args:
        enabled: False makes every save full (``Checkpointer(incremental=False)``, a memory tier
            with replicas).
        full_every: every ``full_every``-th save is full (1: all of them).
        compare: equality is decided by comparing the staged bytes with the base's bytes, which
            the decision reads (:mod:`nebula_ckpt.save.tier_image`; the memory tier): nothing is hashed.
    """

    def __init__(self, enabled: bool, full_every: Optional[int] = None, compare: bool = False) -> None:
        self.enabled = enabled
        self.compare = compare
        self.full_every = max(1, int(full_every if full_every is not None else knobs.get("incremental_full_every")))
        self._lock = threading.Lock()
        self._base: Optional[Manifest] = None
        self._since_full = 0
        self._pinned: set[int] = set()
        #: the snapshot the base was committed from (:attr:`Snapshot.write_id`; None: seeded, copied)
        self._origin: Optional[str] = None

    def current(self) -> tuple[Optional[Manifest], Optional[str]]:
        """The base (None: the next save is full whatever its bytes) and the write id of the
        snapshot it was committed from in this process (None: not known, e.g. a restored step)."""
        with self._lock:
            return self._base, self._origin

    def _next_is_full(self) -> bool:
        return self._base is None or self._since_full + 1 >= self.full_every

    def hash_keys(self, index: dict[str, dict[str, Any]]) -> Optional[set[str]]:
        """The keys of a staged save whose SHA-256 this tier needs (None: all of them).

        Without a base (a tier's first save in this process, or after a failure) every tensor is
        hashed, so that the next save can build on this one. With a base, only the tensors whose
        CRC32C equals the base's are candidates for "unchanged", and only they are hashed, in a
        full save too (a cadence-full save is the next one's base: a frozen tensor's CRC matches
        there as well, so its hash is recorded for it). A tensor that changed from the base is
        written anyway and needs no hash; in dense training, where every tensor changes, a save
        hashes next to nothing. A tier that compares bytes (``compare``) needs no hash."""
        if not self.enabled or self.compare:
            return set()
        with self._lock:
            base = self._base
        if base is None:
            return None
        return {k for k, rec in index.items()
                if (old := base.tensors.get(k)) is not None and rec["crc32c"] == old.crc32c}

    def claim(self) -> Optional[Manifest]:
        """The base the next save builds on, pinned until that save is over (None: the save is
        whole whatever its bytes: no base, or the cadence of full saves says so). What it writes is
        decided by :func:`~nebula_ckpt.save.tier_image.tier_image` (a base that is not older than
        the step, or of another generation, makes it whole too)."""
        with self._lock:
            base = self._base
            if not self.enabled or self._next_is_full() or base is None:
                return None
            self._pinned = {base.step} | {s.step for s in base.shards if s.step is not None}
            return base

    def seed(self, base: Manifest, since_full: Optional[int] = None) -> bool:
        """Build the next save on ``base``, a committed checkpoint this process did not write (the
        one a restarted job just restored and verified on this tier), when this tier has no base yet.

        ``base.generation`` must be the writer's current one (the caller sets it: the bytes referred
        to are a committed step's, which no generation deletes while a step refers to them). Its
        full-save cadence goes on from ``since_full``, the saves of its chain since the last full
        one, ``base`` included (:data:`SINCE_FULL`; an upper bound will do): so a job restarted
        every few saves still writes every ``full_every``-th save full. ``base`` refers to no
        other step: 0; None (not known): the next save is full. A base without SHA-256 hashes
        leaves every tensor unmatched: that save is full, and the next builds on it.
        Returns whether it became the base."""
        with self._lock:
            if not self.enabled or self._base is not None:
                return False
            self._base = base
            if not any(s.step is not None for s in base.shards):
                self._since_full = 0
            else:
                self._since_full = self.full_every - 1 if since_full is None else max(0, since_full)
            self._pinned = set()
            self._origin = None
            return True

    def checked(self, manifest: dict[str, Any], where: str) -> Optional[Manifest]:
        """``manifest``, about to be committed, with the tier's full-save cadence recorded in its
        ``stats`` (:data:`SINCE_FULL`, what a restarted job's :meth:`seed` goes on from), parsed
        as every reader parses it (None when saves are not incremental: nothing here reads it
        back, and nothing is recorded). Called before the manifest is encoded and its marker is
        written, so a manifest its readers would refuse is never committed.

        Raises:
            CorruptCheckpointError: naming ``where`` and the field its readers would refuse.
        """
        if not self.enabled:
            return None
        since = self.since_full(not any("step" in sh for sh in manifest["shards"]))
        # a fresh stats dict: the one it holds may be the draft's, which the other tiers' manifests share
        manifest["stats"] = dict(manifest.get("stats") or {}, **{SINCE_FULL: since})
        return Manifest.parse(manifest, where, manifest["step"])

    def since_full(self, full: bool) -> int:
        """What the manifest of this tier's save about to commit records as :data:`SINCE_FULL`
        (a one-process manifest: :meth:`checked`; rank 0's of a multi-rank save: the largest of
        the ranks' counts): 0 when the save (this rank's share of it) is ``full``, else one more
        than its base's."""
        with self._lock:
            return 0 if full else self._since_full + 1

    def committed(self, manifest: Manifest, full: bool, origin: Optional[str] = None) -> None:
        """The tier committed ``manifest`` (:meth:`checked`; written from snapshot ``origin``, when
        known): the next save builds on it."""
        self._set_base(manifest, full, origin)

    def committed_share(self, step: int, generation: int, share: dict[str, Any], origin: Optional[str] = None) -> None:
        """A multi-rank save committed on a shared tier: the next one builds on this rank's
        ``share`` of it (its shard record, ``refs``, tensor index and ``sha256``; written from
        snapshot ``origin``, when known)."""
        where = f"step {step}: this rank's share"
        shards = (ShardRecord.parse(share["shard"], where),
                  *(ShardRecord.parse(r, where) for r in share.get("refs", [])))
        tensors = {k: TensorRecord.parse(k, v, shards, where) for k, v in share["tensors"].items()}
        base = Manifest(step=step, generation=generation, shards=shards, tensors=tensors, aliases={}, tree={},
                        hashes=dict(share.get("sha256", {})))
        self._set_base(base, not share.get("refs"), origin)

    def _set_base(self, base: Manifest, full: bool, origin: Optional[str]) -> None:
        with self._lock:
            self._base = base
            self._since_full = 0 if full else self._since_full + 1
            self._pinned = set()
            self._origin = origin

    def declare(self) -> Optional[int]:
        """Multi-rank: the step this rank's next save would build on (None: it will be full),
        pinned until that save is over; the ranks build on it only when every rank names the
        same step (so that rank 0, which deletes, holds it too)."""
        with self._lock:
            base = self._base
            if not self.enabled or self._next_is_full() or base is None:
                return None
            self._pinned = {base.step} | {s.step for s in base.shards if s.step is not None}
            return base.step

    def forget(self) -> None:
        """The base is no longer certain (a failed or uncertain commit, a removal): next save is full."""
        with self._lock:
            self._base = None
            self._pinned = set()

    def let_go(self, step: int) -> bool:
        """Whether committed ``step`` may be deleted now (no save in flight refers to it); when it
        is the base, the next save is full."""
        with self._lock:
            if step in self._pinned:
                return False
            if self._base is not None and self._base.step == step:
                self._base = None
            return True

    def pinned(self) -> set[int]:
        """Steps this tier's base or a save in flight refers to: never deleted meanwhile."""
        with self._lock:
            base = self._base
            out = set(self._pinned)
        if base is not None:
            out.add(base.step)
            out.update(s.step for s in base.shards if s.step is not None)
        return out


def wanted_keys(targets: list[Any], index: dict[str, dict[str, Any]]) -> set[str]:
    """The keys of ``index`` whose SHA-256 the tiers ``targets`` (tier writers, each with an
    ``incremental`` :class:`Incremental`) need (:meth:`Incremental.hash_keys`), for all of them."""
    want: set[str] = set()
    for t in targets:
        keys = t.incremental.hash_keys(index)
        if keys is None:
            return set(index)
        want |= keys
    return want


def whole_image(man: Manifest, shards: list[Any]) -> tuple[list[memoryview], dict[str, dict[str, Any]], int]:
    """The one-shard safetensors image of checkpoint ``man`` (``shards[i]``: the bytes of its
    shard ``i``, which may lie in earlier steps): ``(parts, tensor records, bytes)``. Tensors go
    largest element first, so each stays naturally aligned; records keep the manifest's order."""
    keys = sorted(man.tensors, key=lambda k: -man.tensors[k].torch_dtype.itemsize)
    head, spans = safetensors_header([(k, man.tensors[k].torch_dtype, man.tensors[k].shape, man.tensors[k].nbytes)
                                      for k in keys])
    parts: list[memoryview] = [memoryview(head)]
    at: dict[str, list[int]] = {}
    for k, (p, e) in zip(keys, spans, strict=True):
        rec = man.tensors[k]
        if rec.nbytes:
            parts.append(memoryview(shards[rec.shard]).cast("B")[rec.start:rec.end])
        at[k] = [len(head) + p, len(head) + e]
    records = {}
    for k, rec in man.tensors.items():
        out = rec.to_json()
        out.pop("shard", None)
        records[k] = dict(out, offsets=at[k])
    return parts, records, len(head) + (spans[-1][1] if spans else 0)


def committed_whole(src: "Storage", step: int, at: str) -> tuple[Commit, bytes, Manifest, list[memoryview],
                                                                     dict[str, dict[str, Any]], int]:
    """The committed checkpoint ``step`` of ``src`` (``at`` names it in errors) as one image, to be
    written elsewhere whole: ``(its COMMIT, the manifest's bytes, the parsed manifest, parts,
    tensor records, bytes)`` (see :func:`whole_image`; an incremental step's bytes read from the
    steps it refers to)."""
    commit, raw = read_committed_manifest(src, step, at)
    man = Manifest.parse(raw, at, step)
    data = [src.read_buffer(shard_path(man, i), dict(sh.storage or {})) for i, sh in enumerate(man.shards)]
    return (commit, raw, man, *whole_image(man, data))


def may_build_on_base(tier: Any, world_size: int, storage: "Storage") -> bool:
    """Whether saves on ``tier`` may be incremental: a tier that hashes, of a one-process job or a
    shared one; a tier that keeps its base in RAM (it compares bytes: the memory tier) of a
    one-process job, or of each rank of a multi-rank job (a rank's own tier: each rank builds on
    its own previous step, no agreement needed; with replicas too, which their holders make whole:
    :mod:`~nebula_ckpt.tiers.memory.replica_whole`) on a local file system."""
    caps = tier.capabilities
    if caps.keeps_base_in_ram:
        return (world_size == 1 or caps.per_rank) and storage.local_path("") is not None
    return world_size == 1 or bool(tier.shared)
