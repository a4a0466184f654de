"""The memory tier's test of "unchanged": the staged bytes compared with the base's, byte for byte.

The memory tier's base is still in host memory (its shard files in the tmpfs), so it needs no
hash: a tensor whose CRC32C, device and DTensor record equal the base's (the cheap filter of
:mod:`nebula_ckpt.save.incremental`) is unchanged only when its staged bytes equal the base's.
The compare is libc's ``memcmp`` (called through ``ctypes``, which releases the GIL) over 16 MiB
chunks, on ``hash_threads`` threads niced by ``hash_nice`` like the hash threads of the persistent
tiers: it runs on the tier's writer thread's behalf, never on the training thread, and yields to
training where no core is idle. Bytes, not values, are compared: NaN payloads, -0.0 and +0.0 are
told apart.

**The hashes it spares** (:func:`staged_hashes`, the rest of this module): the SHA-256 a persistent
tier needs, known from the memory tier's byte compare instead of hashed. A disk or remote tier
knows a tensor unchanged by the SHA-256 of its staged bytes (:mod:`nebula_ckpt.save.incremental`);
hashing a large frozen state on every save is most of an incremental save's cost. The memory tier
compares the staged bytes with its base's bytes, byte for byte (above), at memory speed. When the
memory tier's base and a persistent tier's base were both committed *from the same snapshot* of
this process (the same :attr:`~nebula_ckpt.save.snapshot.Snapshot.write_id`, so the same step and
the same staged bytes), the SHA-256 of a tensor the compare found equal is known without hashing
it:

* its staged bytes equal the memory base's bytes of it (``memcmp``, just now, on the stager thread);
* the memory base's bytes of it are that snapshot's staged bytes (written from them, or referred to
  after an equal compare of them);
* the persistent base recorded the SHA-256 of that snapshot's staged bytes of it (hashed then, or
  known the same way).

So that recorded SHA-256 *is* the SHA-256 of the new staged bytes, and it goes into the snapshot's
``hashes`` as if it had been taken now: every tier then decides as before (CRC32C, device and
DTensor record, and the SHA-256 against its own base's), and the manifest records a SHA-256 for the
tensor. A tensor the compare found changed (a change through ``.data`` or NumPy, one with an
unchanged CRC32C) or did not compare, one whose SHA-256 the persistent base did not record, and
every tensor when the bases are not from the same snapshot (a restored base, a tier that dropped a
save) are hashed as before. The compare's answer is kept on the snapshot (:class:`Compared`), so
the memory tier's own save does not compare those bytes again.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from nebula_ckpt import knobs
from nebula_ckpt.format.commit import shard_path
from nebula_ckpt.format.manifest import Manifest
from nebula_ckpt.format.records import TensorRecord
from nebula_ckpt.ranks.shards import prefixed
from nebula_ckpt.save.incremental import hash_staged, same_kind, same_record, wanted_keys, yield_to_training
from nebula_ckpt.workers import Workers

if TYPE_CHECKING:
    from nebula_ckpt.storage.base import Storage

log = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class Compared:
    """The staged bytes of a snapshot already compared with the memory tier's base ``base``
    (the very object that tier's :class:`Incremental` held) on the stager thread: ``candidates``,
    the keys compared; ``same``, those equal byte for byte (keys as in ``base``)."""

    base: Manifest
    candidates: frozenset[str]
    same: frozenset[str]


# -- the hashes the compare spares the persistent tiers -------------------------------------------


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
