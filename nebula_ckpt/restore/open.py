"""Open one checkpoint: commit marker, manifest, shard sizes and checksums, then zero-copy views.

:func:`open_checkpoint` reads and verifies one committed step (commit marker, manifest checksum,
shard sizes and, with ``verify="full"``, the CRC32C of every tensor) before a single byte reaches
the user's tensors, and returns an :class:`OpenCheckpoint`: the validated manifest and views of
the shard bytes. Local tiers are memory-mapped, so tensors are copied once, from the page cache
straight into the existing parameters; :func:`chunks` bounds what is mapped at once.
Which step to open, on which tier, is :mod:`nebula_ckpt.restore.select`'s.
"""

from __future__ import annotations

import logging
import mmap
from typing import Any, Callable, Iterable, Mapping, Optional

import torch

from nebula_ckpt.errors import CorruptCheckpointError, ValidationError
from nebula_ckpt.format import manifest as mf
from nebula_ckpt.format.commit import read_committed_manifest, shard_path
from nebula_ckpt.format.header import data_start
from nebula_ckpt.format.names import RANKS_FILE, shard_owner, step_dir
from nebula_ckpt.format.records import ShardRecord, TensorRecord
from nebula_ckpt.format.split_records import load_split, with_index
from nebula_ckpt.native import get_ops
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.storage.prefault import advise

#: most bytes checksummed or copied between two drops of the mapped source pages (what a restore
#: keeps resident beyond the owned bytes)
RESTORE_CHUNK_BYTES = 64 << 20

log = logging.getLogger(__name__)

# madvise advice value (Linux)
_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)

class OpenCheckpoint:
    """A verified checkpoint: its validated manifest and zero-copy tensor views of its shard bytes.

    For a multi-rank checkpoint opened for one rank (``rank``), keys, tree and views are that
    rank's (its tensors may live in other ranks' shards: replicated ones are stored once).
    Opened without a rank, a multi-rank checkpoint is the whole job's (for resharding, the CLI).
    """

    def __init__(self, manifest: mf.Manifest, buffers: dict[int, torch.Tensor], where: str,
                 rank: Optional[int] = None, maps: Optional[dict[int, mmap.mmap]] = None) -> None:
        self.manifest = manifest
        self.step = manifest.step
        self.where = where
        self.rank = rank
        self.tier_name: Optional[str] = None
        #: the storage it was read from (set by :func:`~nebula_ckpt.restore.select.find_and_open`)
        self.storage: Optional[Storage] = None
        #: the save number its commit marker names (-1: not recorded; set with :attr:`storage`)
        self.save = -1
        self._buffers = buffers
        #: shard index -> the file mapping under its buffer (local and memory tiers)
        self._maps = maps or {}
        #: records whose checksum is still to be checked (opened with ``defer_verify``)
        self.unverified: dict[int, list[TensorRecord]] = {}
        #: the restore staged for this checkpoint while it was opened (run it to apply; see
        #: :func:`~nebula_ckpt.restore.select.find_and_open`'s ``stage``)
        self.pending: Optional[Callable[[], None]] = None
        self._views: dict[str, torch.Tensor] = {}
        #: DeviceMesh by mesh shape, found in the objects restored into (for DTensor records)
        self.meshes: dict[tuple[int, ...], Any] = {}
        #: the memory tier's pages handed to this process instead of owned copies
        #: (:mod:`nebula_ckpt.tiers.memory.adopt`)
        self.adoption: Optional[Any] = None
        #: why ``into`` takes this checkpoint resharded although it was opened for this rank (a
        #: DTensor of ``into`` laid out otherwise than saved: :meth:`fits`); None: restored as stored
        self.other_layout: Optional[str] = None

    def as_saved(self, key: str, local: torch.Tensor) -> Any:
        """``local`` as it was saved: a DTensor again when ``key`` was one (same mesh shape and
        placements, on the mesh of the objects restored into), else ``local`` itself."""
        info = self.resolve(key).dtensor
        if info is None:
            return local
        from torch.distributed.tensor import DTensor, Replicate, Shard

        mesh = self.meshes.get(info.mesh)
        if mesh is None:
            raise ValidationError(f"restore: key '{key}' was a DTensor on a device mesh of shape {list(info.mesh)}; "
                                  "`into` holds no DTensor on such a mesh (restore into the model and optimizer "
                                  "sharded as when saved, or into DCP-style state dicts from get_state_dict)")
        placements = [Replicate() if p == "R" else Shard(int(p[2:-1])) for p in info.placements]
        stride, acc = [], 1
        for n in reversed(info.shape):
            stride.append(acc)
            acc *= max(n, 1)
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(info.shape),
                                  stride=tuple(reversed(stride)))

    @property
    def tree(self) -> Any:
        """The state tree to restore (the rank's, for a multi-rank checkpoint opened for a rank)."""
        if self.manifest.multi_rank and self.rank is not None:
            return self.manifest.rank_tree_of(self.rank)
        return self.manifest.tree

    @property
    def same_layout(self) -> bool:
        """Whether the keys of :attr:`tree` are this process's own and ``into`` lays them out as
        stored (no resharding needed)."""
        return (not self.manifest.multi_rank or self.rank is not None) and self.other_layout is None

    def fits(self, key: str, target: torch.Tensor, shown: str) -> bool:
        """Whether stored tensor ``key`` is restored into ``target`` (at ``shown`` in ``into``) as
        stored: a DTensor's local shard into a DTensor holding the same piece of it (placements,
        mesh shape, offsets and local shape alike), a plain tensor into a plain tensor. False, with
        :attr:`other_layout` set, where the global shapes match and only the layout differs
        (another mesh or placements; a full tensor of a sharded one): the restore reshards.

        Raises:
            ValidationError: ``target``'s global shape is not the saved one.
        """
        rec = self.resolve(key)
        info = rec.dtensor
        dt = hasattr(target, "placements") and hasattr(target, "to_local")
        if info is None and not dt:
            return True  # a plain tensor: its shape is checked where it is copied
        have = tuple(target.shape)
        want = tuple(rec.shape) if info is None else info.shape
        if have != want:
            what = "shape" if info is None else "global shape"
            raise ValidationError(
                f"restore: key '{shown}': the checkpoint of step {self.step} has a tensor of {what} {want}, `into` "
                f"holds a {'DTensor' if dt else 'tensor'} of global shape {have}; build `into` with the saved model "
                "and shapes (the layout may differ, the global shapes may not)")
        if info is not None and dt:
            mine = _layout(target)
            if mine == (info.placements, info.mesh, info.offsets, tuple(rec.shape)):
                return True
            how = f"as placements {list(mine[0])} on a mesh of shape {list(mine[1])}, this rank's piece at " \
                  f"offsets {list(mine[2])} of shape {list(mine[3])}"
        elif info is not None:
            if info.shape == tuple(rec.shape):
                return True  # this rank's piece is the whole tensor
            how = "as a full (plain) tensor"
        else:
            how = f"as a DTensor (placements {list(_layout(target)[0])})"
        saved = "a plain tensor" if info is None else \
            f"placements {list(info.placements)} on a mesh of shape {list(info.mesh)}, this rank's piece at " \
            f"offsets {list(info.offsets)} of shape {list(rec.shape)}"
        if self.other_layout is None:
            self.other_layout = f"key '{shown}' was saved as {saved}; `into` lays it out {how}"
        return False

    def resolve(self, key: str) -> TensorRecord:
        """The stored record of ``key`` (a key of :attr:`tree`)."""
        return self.manifest.resolve(key, self.rank)

    def keys(self) -> list[str]:
        """Stored tensor keys (aliases excluded)."""
        return list(self.manifest.tensors)

    def buffer(self, shard: int) -> torch.Tensor:
        """The bytes of shard ``shard`` (read and verified when the checkpoint was opened)."""
        return self._buffers[shard]

    def drop(self, recs: list[TensorRecord]) -> None:
        """Unmap the pages under ``recs`` from this process (they stay in the page cache / tmpfs).

        The shard mappings are private and never written, so dropping a page loses nothing: a
        later read maps it again. Restores call this for bytes already copied, which keeps the
        mapped shard from adding its whole size to the process's resident memory.
        """
        for si, lo, hi in _runs(recs):
            _advise(self._maps.get(si), lo, hi, _MADV_DONTNEED)

    def verified_by_copy(self, recs: list[TensorRecord], crcs: list[int]) -> None:
        """Compare the checksums the copy engine took of ``recs`` while copying them with the
        manifest; those still unverified count as verified now.

        Raises:
            CorruptCheckpointError: naming the tensor whose bytes differ.
        """
        if not crcs:
            return  # a path that takes none (device copies): verify_rest() checks them
        for rec, have in zip(recs, crcs, strict=True):
            if have != rec.crc32c:
                raise CorruptCheckpointError(mismatch(self.where, rec, have, self.manifest))
        done = {id(r) for r in recs}
        for si in list(self.unverified):
            self.unverified[si] = [r for r in self.unverified[si] if id(r) not in done]

    def verify_rest(self) -> None:
        """Check the checksums of every record not verified yet (parallel, a chunk at a time).

        Raises:
            CorruptCheckpointError: naming the tensor whose bytes differ.
        """
        todo = {si: recs for si, recs in self.unverified.items() if recs}
        self.unverified = {}
        _verify_checksums(todo, self._buffers, self.where, self._maps, self.manifest)

    def view(self, key: str) -> torch.Tensor:
        """Read-only use view of tensor ``key`` (or of the key it is tied to) over the shard bytes."""
        rec = self.resolve(key)
        v = self._views.get(rec.key)
        if v is None:
            raw = self._buffers[rec.shard][rec.start:rec.end]
            v = raw.view(rec.torch_dtype).reshape(rec.shape)
            self._views[rec.key] = v
        return v



def _layout(t: Any) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``(placements, mesh shape, offsets, local shape)`` of this rank's piece of DTensor ``t``,
    placements as the manifest writes them (``"R"``, ``"S(d)"``; any other placement by its name)."""
    from torch.distributed.tensor import Replicate, Shard

    codes = tuple("R" if type(p) is Replicate else f"S({p.dim})" if type(p) is Shard else repr(p)
                  for p in t.placements)
    chunks = t.__create_chunk_list__()
    offsets = tuple(int(o) for o in chunks[0].offsets) if len(chunks) == 1 else ()
    return codes, tuple(int(n) for n in t.device_mesh.shape), offsets, tuple(t.to_local().shape)


def _needed(man: mf.Manifest, rank: Optional[int]) -> dict[int, list[TensorRecord]]:
    """Shard index -> the records a restore of ``rank`` reads from it (every shard without a rank)."""
    if rank is None or not man.multi_rank:
        recs = list(man.tensors.values())
    else:
        p = man.prefix(rank)
        keys = [k for k in list(man.tensors) + list(man.aliases) if k.startswith(p)]
        recs = list({id(r): r for r in (man.tensors[man.aliases.get(k, k)] for k in keys)}.values())
    out: dict[int, list[TensorRecord]] = {i: [] for i in range(len(man.shards))} \
        if rank is None or not man.multi_rank else {}
    for r in recs:
        out.setdefault(r.shard, []).append(r)
    return out


def read_manifest(storage: Storage, step: int, where: Optional[str] = None,
                  ranks: Optional[Iterable[int]] = None) -> mf.Manifest:
    """The validated manifest of committed ``step`` on ``storage``, holding the tensor records of
    ``ranks`` (None: of every rank; a version 4 manifest reads them from the ranks' records
    files, :func:`load_records`). A version 4 checkpoint's ``ranks.json`` is read only for every
    rank (``ranks`` None): the records files of some ranks check themselves.

    Raises:
        CorruptCheckpointError: naming ``where`` and what is wrong (missing files included).
    """
    where = where or f"{storage.display_url} step {step}"
    man = read_main_manifest(storage, step, where, index=ranks is None)
    return load_records(storage, man, man.ranks if ranks is None else ranks, where)


def load_records(storage: Storage, man: mf.Manifest, ranks: Iterable[int], where: str) -> mf.Manifest:
    """``man`` holding the records of ``ranks`` (and of the ranks storing the replicated tensors
    they alias): a version 4 manifest reads and validates their records files; versions 1 and 2
    hold every record already (returned as they are)."""
    if man.layout is None:
        return man
    d = step_dir(man.step)

    def read(name: str) -> bytes:
        try:
            return storage.read_small(f"{d}/{name}", mf.MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{where}: records file {name} is missing") from None

    return load_split(man, read, get_ops().crc32c_bytes, ranks, where)


def read_main_manifest(storage: Storage, step: int, where: Optional[str] = None, index: bool = True) -> mf.Manifest:
    """The validated manifest of committed ``step`` alone, the one its ``COMMIT`` names (a version
    4 manifest's tensor records are not read: :func:`load_records`). ``index``: complete a version 4 manifest
    from its ``ranks.json`` (every rank's shard, records file and tree; not needed to load the
    records of some ranks).

    Checks the commit marker (step, manifest size and CRC32C) before parsing the manifest.

    Raises:
        CorruptCheckpointError: naming ``where`` and what is wrong (missing files included).
    """
    where = where or f"{storage.display_url} step {step}"
    try:
        mbytes = read_committed_manifest(storage, step, where)[1]
    except FileNotFoundError as e:
        raise CorruptCheckpointError(f"{where}: {e.filename or e} is missing") from None
    man = mf.Manifest.parse(mbytes, where, step)
    return with_ranks_file(storage, man, where) if index else man


def with_ranks_file(storage: Storage, man: mf.Manifest, where: str) -> mf.Manifest:
    """``man`` completed from its ``ranks.json`` (version 4: every rank's shard, records file and
    tree, checked against the manifest); any other manifest as it is."""
    if man.layout is None:
        return man
    try:
        data = storage.read_small(f"{step_dir(man.step)}/{RANKS_FILE}", mf.MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: {RANKS_FILE} is missing") from None
    return with_index(man, data, get_ops().crc32c_bytes, where)


class NotThisLayout(Exception):
    """A healthy checkpoint this process cannot restore: it holds other ranks of another layout
    (a rank's own memory tier after the world size changed)."""


def open_checkpoint(storage: Storage, step: int, verify: str, where: str,
                    rank: Optional[int] = None, world: int = 1, defer_verify: bool = False) -> OpenCheckpoint:
    """Read and verify one checkpoint; raise :class:`CorruptCheckpointError` naming what is wrong.

    Only ``step-N/COMMIT``, the manifest it names and the shard files named by the validated
    manifest (plain ``shard-g<G>-r<R>[-v<V>].safetensors`` names) are opened: nothing outside the folder.
    ``rank`` / ``world``: who restores. A multi-rank checkpoint of the same world size holding
    ``rank`` is opened for that rank (only the shards holding its tensors are read and verified);
    one holding every rank of another layout is opened whole (to be resharded); one holding only
    some ranks of another layout raises :class:`NotThisLayout`.
    ``defer_verify``: with ``verify="full"``, leave the checksums to the caller (the copies of a
    staged restore check them as they go; :meth:`OpenCheckpoint.verify_rest` checks the rest).
    """
    man = read_main_manifest(storage, step, where, index=False)
    if man.multi_rank:
        if man.world_size == world and rank in man.ranks:
            pass  # a version 4 checkpoint: this rank's records file and its owners' are all it reads
        elif len(man.ranks) == man.world_size:
            rank = None  # the whole job's checkpoint: resharded by the caller
            man = with_ranks_file(storage, man, where)
        else:
            raise NotThisLayout(f"{where}: holds rank(s) {list(man.ranks)[:8]} of a {man.world_size}-rank job; "
                                f"this process is rank {rank or 0} of {world}")
    man = load_records(storage, man, man.ranks if rank is None else [rank], where)
    needed = _needed(man, rank)
    check_references(storage, man, {i: recs for i, recs in needed.items() if man.shards[i].step is not None}, where)
    read = {i: _read_shard(storage, man, i, where) for i in sorted(needed)}
    buffers = {i: b for i, (b, _) in read.items()}
    maps = {i: m for i, (_, m) in read.items() if m is not None}
    ck = OpenCheckpoint(man, buffers, where, rank if man.multi_rank else None, maps)
    if verify == "full":
        ck.unverified = needed
        if not defer_verify:
            ck.verify_rest()
    return ck


def check_references(storage: Storage, man: mf.Manifest, refs: Mapping[int, list[TensorRecord]],
                     where: str) -> None:
    """Check the shards of ``man`` that lie in earlier steps' folders (``refs``: shard index -> the
    records read from it): each such step is committed on ``storage``, its manifest lists the
    very file (same size and storage info) as its own, and each record read from it is that
    step's own record of those bytes (same offsets, dtype, shape and CRC32C), so bytes of another
    run or another save are refused even where only sizes are checked. Their tensors' checksums
    are checked with the rest (``verify="full"``).

    Raises:
        CorruptCheckpointError: naming the referenced step and shard (and the tensor).
    """
    for i in sorted(refs):
        sh = man.shards[i]
        assert sh.step is not None
        at = f"{where}: shards[{i}] refers to step {sh.step}'s {sh.file}"
        try:
            base = _base_of(storage, sh, f"{where} (referenced step {sh.step})")
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"{at}, which is not a healthy committed checkpoint: {e}") from None
        own = next((j for j, b in enumerate(base.shards) if b.step is None and b.file == sh.file), None)
        b = None if own is None else base.shards[own]
        if b is None or b.bytes != sh.bytes or dict(b.storage or {}) != dict(sh.storage or {}):
            raise CorruptCheckpointError(f"{at}, but step {sh.step}'s manifest lists "
                                         f"{'no such shard' if b is None else 'it with another size or storage'}")
        assert own is not None
        _check_records(refs[i], base, own, at)


def _check_records(recs: list[TensorRecord], base: mf.Manifest, own: int, at: str) -> None:
    """Refuse a record of ``recs`` that is not ``base``'s own record of the same bytes (in its
    shard ``own``): same offsets, dtype, shape and CRC32C."""
    theirs: dict[tuple[int, int], list[TensorRecord]] = {}
    for b in base.tensors.values():
        if b.shard == own:
            theirs.setdefault((b.start, b.end), []).append(b)  # zero-size tensors may share an offset
    for r in recs:
        same = theirs.get((r.start, r.end), [])
        if not any((b.dtype, b.shape, b.crc32c) == (r.dtype, r.shape, r.crc32c) for b in same):
            held = "" if not same else f" ({same[0].dtype} {list(same[0].shape)}, crc32c {same[0].crc32c:#010x})"
            raise CorruptCheckpointError(
                f"{at}, but tensor '{r.key}' ({r.dtype} {list(r.shape)}, crc32c {r.crc32c:#010x}) is not what "
                f"step {base.step} holds at bytes [{r.start}, {r.end}) of it{held}: the referenced "
                "step was replaced (by another run or another save)")


def _base_of(storage: Storage, sh: ShardRecord, where: str) -> mf.Manifest:
    """The manifest of the step holding ``sh`` (an earlier step's shard), holding that shard's
    entry: a version 4 step's from the records file of the rank that wrote it (not ``ranks.json``)."""
    assert sh.step is not None
    base = read_main_manifest(storage, sh.step, where, index=False)
    if base.layout is None:
        return base
    owner = shard_owner(sh.file)
    if owner is None or owner[0] != base.generation or not 0 <= owner[1] < base.world_size:
        raise CorruptCheckpointError(f"{where}: {sh.file} is no shard of step {sh.step} (generation "
                                     f"{base.generation}, {base.world_size} ranks)")
    return load_records(storage, base, [owner[1]], where)


def read_shard(storage: Storage, man: mf.Manifest, i: int, where: str) -> torch.Tensor:
    """Shard ``i`` as a uint8 tensor, after checking its size and its header length."""
    return _read_shard(storage, man, i, where)[0]


def _read_shard(storage: Storage, man: mf.Manifest, i: int, where: str) -> tuple[torch.Tensor, Optional[mmap.mmap]]:
    """:func:`read_shard`, and the file mapping under the tensor (None for bytes read into memory)."""
    sh = man.shards[i]
    rel = shard_path(man, i)
    name = sh.file if sh.step is None else f"{rel} (referenced: step {sh.step} holds it)"
    try:
        stored = storage.size(rel)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: shard {name} is missing") from None
    if stored != sh.stored_bytes:
        raise CorruptCheckpointError(f"{where}: shard {name} has {stored} bytes, manifest says "
                                     f"{sh.stored_bytes} (truncated or torn write)")
    mv = storage.read_buffer(rel, dict(sh.storage or {}), expected_bytes=sh.bytes)
    if len(mv) != sh.bytes:
        raise CorruptCheckpointError(f"{where}: shard {name} decodes to {len(mv)} bytes, "
                                     f"expected {sh.bytes}")
    man.check_data_start(i, data_start(mv), where)
    mm = getattr(mv, "obj", None)
    return torch.frombuffer(mv, dtype=torch.uint8), mm if isinstance(mm, mmap.mmap) else None



def _runs(recs: list[TensorRecord]) -> list[tuple[int, int, int]]:
    """``(shard, start, end)`` of the byte runs ``recs`` cover: records less than a page apart
    merged, so a chunk of consecutive tensors takes one ``madvise`` call, not one per tensor."""
    out: list[list[int]] = []
    for r in sorted(recs, key=lambda r: (r.shard, r.start)):
        if out and out[-1][0] == r.shard and r.start <= out[-1][2] + mmap.PAGESIZE:
            out[-1][2] = max(out[-1][2], r.end)
        else:
            out.append([r.shard, r.start, r.end])
    return [(si, lo, hi) for si, lo, hi in out]


def _advise(mm: Optional[mmap.mmap], start: int, end: int, advice: int) -> None:
    """``madvise`` the pages of ``mm`` covering ``[start, end)``; a no-op without a map or on error."""
    if mm is not None and end > start:
        advise(mm, start, end - start, advice)  # without the GIL


def chunks(recs: list[TensorRecord]) -> list[list[TensorRecord]]:
    """``recs`` in shard order, in consecutive groups of at most a sixteenth of their bytes (4 to
    :data:`RESTORE_CHUNK_BYTES`; a larger record is a group of its own): what is mapped at once
    stays small."""
    limit = max(4 << 20, min(RESTORE_CHUNK_BYTES, sum(r.nbytes for r in recs) // 16))
    out: list[list[TensorRecord]] = []
    size = 0
    for r in sorted(recs, key=lambda r: r.start):
        if not out or size + r.nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(r)
        size += r.nbytes
    return out


def mismatch(where: str, rec: TensorRecord, have: int, man: Optional[mf.Manifest] = None) -> str:
    """The error of tensor ``rec`` whose bytes have CRC32C ``have``: in an incremental checkpoint
    (``man``), bytes an earlier step's folder holds are named with that step and file."""
    sh = None if man is None else man.shards[rec.shard]
    held = "" if man is None or sh is None or sh.step is None else \
        f" (bytes held by step {sh.step}: {shard_path(man, rec.shard)})"
    return f"{where}: checksum mismatch in tensor '{rec.key}' (crc32c {have:#010x}, manifest {rec.crc32c:#010x}){held}"


def _verify_checksums(needed: dict[int, list[TensorRecord]], buffers: dict[int, torch.Tensor],
                      where: str, maps: Optional[dict[int, mmap.mmap]] = None,
                      man: Optional[mf.Manifest] = None) -> None:
    """Check the CRC32C of every record, on all threads, a chunk at a time.

    The checksum threads take the page faults of a mapped chunk between them (a read fault maps
    up to 16 pages of the page cache or tmpfs; a populate call first would do that work on one
    thread while the others wait), and the chunk is dropped once checked, so verifying a shard
    never makes the whole shard resident in this process.
    """
    ops = get_ops()
    maps = maps or {}
    for si, recs in needed.items():  # ranges were checked against their shard by Manifest.parse
        mm = maps.get(si)
        for group in chunks(recs):
            lo, hi = group[0].start, group[-1].end
            got = ops.crc32c(buffers[si], [r.start for r in group], [r.nbytes for r in group])
            _advise(mm, lo, hi, _MADV_DONTNEED)
            for rec, have in zip(group, got, strict=True):
                if have != rec.crc32c:
                    raise CorruptCheckpointError(mismatch(where, rec, have, man))

