"""Restore: find the newest healthy checkpoint on any tier, verify it, load it in place.

Candidates are every committed step on every tier: the newest writer generation first (a
checkpoint of a stale writer, fenced since, never wins over a newer writer's, whatever its step
number and tier), then the newest step, then, for one step, the fastest tier. Each is verified
(commit marker, manifest checksum, shard sizes and, with ``verify="full"``, the CRC32C of every
tensor) before a single byte reaches the user's tensors; on any mismatch the next candidate is
tried. Local tiers are memory-mapped, so tensors are copied once, from the page cache straight
into the existing parameters.
"""

from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch

from nebula_ckpt.errors import CorruptCheckpointError, ValidationError
from nebula_ckpt.format import manifest as mf
from nebula_ckpt.format.commit import committed_steps, read_commit
from nebula_ckpt.format.header import data_start
from nebula_ckpt.format.names import COMMIT, MANIFEST, step_dir
from nebula_ckpt.format.records import TensorRecord
from nebula_ckpt.format.tree import decode
from nebula_ckpt.native import get_ops
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.tiers.base import Tier

log = logging.getLogger(__name__)

#: What :func:`find_and_open` does when committed checkpoints exist but none is healthy.
ON_ALL_DAMAGED = ("raise", "warn")


@dataclass(frozen=True)
class Candidate:
    """A committed step on one tier, with the writer generation its commit marker names (-1 when
    the marker cannot be read: ``problem`` then says why, and the candidate is reported as
    damaged, never opened)."""

    step: int
    tier: Tier
    storage: Storage
    generation: int = -1
    problem: Optional[str] = None

    @property
    def order(self) -> tuple[int, int]:
        """What makes a candidate newer: its writer generation first, then its step."""
        return (self.generation, self.step)


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
        #: the storage it was read from (set by :func:`find_and_open`)
        self.storage: Optional[Storage] = None
        self._buffers = buffers
        #: shard index -> the file mapping under its buffer (local and memory tiers)
        self._maps = maps or {}
        #: records whose checksum is still to be checked (opened with ``defer_verify``)
        self.unverified: dict[int, list[TensorRecord]] = {}
        #: the restore staged for this checkpoint by :func:`find_and_open`'s ``stage`` (run it to apply)
        self.pending: Optional[Callable[[], None]] = None
        self._views: dict[str, torch.Tensor] = {}
        #: DeviceMesh by mesh shape, found in the objects restored into (for DTensor records)
        self.meshes: dict[tuple[int, ...], Any] = {}
        #: the memory tier's pages handed to this process instead of owned copies (:mod:`.adopt`)
        self.adoption: Optional[Any] = None

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
        """Whether the keys of :attr:`tree` are this process's own (no resharding needed)."""
        return not self.manifest.multi_rank or self.rank is not None

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
        for r in recs:
            _advise(self._maps.get(r.shard), r.start, r.end, _MADV_DONTNEED)

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
                raise CorruptCheckpointError(f"{self.where}: checksum mismatch in tensor '{rec.key}' "
                                             f"(crc32c {have:#010x}, manifest {rec.crc32c:#010x})")
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
        _verify_checksums(todo, self._buffers, self.where, self._maps)

    def view(self, key: str) -> torch.Tensor:
        """Read-only use view of tensor ``key`` (or of the key it is tied to) over the shard bytes."""
        rec = self.resolve(key)
        v = self._views.get(rec.key)
        if v is None:
            raw = self._buffers[rec.shard][rec.start:rec.end]
            v = raw.view(rec.torch_dtype).reshape(rec.shape)
            self._views[rec.key] = v
        return v

    def decode_tree(self, materialize: Callable[[str, torch.Tensor], Any], allow_pickle: bool) -> Any:
        """Decode the whole state tree, turning each tensor view into ``materialize(key, view)``."""
        made: dict[str, Any] = {}

        def tensor(key: str) -> Any:
            real = self.resolve(key).key
            if real not in made:
                made[real] = materialize(key, self.view(key))
            return made[real]

        return decode(self.tree, tensor, allow_pickle)


def list_candidates(tiers: list[tuple[Tier, Storage]]) -> list[Candidate]:
    """Every committed step on every tier: newest writer generation first, then newest step, then
    fastest tier (the order of ``tiers``).

    The generation comes first because a writer fenced by a newer one may have gone on committing
    higher steps on a tier the newer one never wrote (its memory tier): those steps are a run
    that was abandoned, never the one to resume.
    """
    cands: list[tuple[int, int, int, Candidate]] = []
    for i, (tier, st) in enumerate(tiers):
        try:
            steps = committed_steps(st)
        except Exception as e:
            log.warning("nebula_ckpt: cannot list tier %s: %s", tier.name, e)
            continue
        for s in steps:
            g, problem = _commit_generation(st, s)
            cands.append((-g, -s, i, Candidate(s, tier, st, g, problem)))
    return [c for *_, c in sorted(cands, key=lambda x: x[:3])]


def _commit_generation(storage: Storage, step: int) -> tuple[int, Optional[str]]:
    """The writer generation the commit marker of ``step`` names, or ``(-1, why)`` when the marker
    cannot be read (missing since listed, unreadable, garbled)."""
    try:
        return read_commit(storage, step, f"step {step}").generation, None
    except Exception as e:
        return -1, str(e) if isinstance(e, CorruptCheckpointError) else \
            f"commit marker is unreadable ({type(e).__name__}: {e})"


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


def read_manifest(storage: Storage, step: int, where: Optional[str] = None) -> mf.Manifest:
    """The validated manifest of committed ``step`` on ``storage``.

    Checks the commit marker (step, manifest size and CRC32C) before parsing the manifest.

    Raises:
        CorruptCheckpointError: naming ``where`` and what is wrong (missing files included).
    """
    where = where or f"{storage.display_url} step {step}"
    d = step_dir(step)
    try:
        commit = read_commit(storage, step, where)
        mbytes = storage.read_small(f"{d}/{MANIFEST}")
    except FileNotFoundError as e:
        raise CorruptCheckpointError(f"{where}: {e.filename or e} is missing") from None
    if len(mbytes) != commit.manifest_bytes or get_ops().crc32c_bytes(mbytes) != commit.manifest_crc32c:
        raise CorruptCheckpointError(f"{where}: manifest.json does not match its commit marker "
                                     "(size or checksum differs): garbled or replaced")
    if commit.step != step:
        raise CorruptCheckpointError(f"{where}: {COMMIT} is for step {commit.step}, but lies in {d}/")
    return mf.Manifest.parse(mbytes, where, step)


class NotThisLayout(Exception):
    """A healthy checkpoint this process cannot restore: it holds other ranks of another layout
    (a rank's own memory tier after the world size changed)."""


def open_checkpoint(storage: Storage, step: int, verify: str, where: str,
                    rank: Optional[int] = None, world: int = 1, defer_verify: bool = False) -> OpenCheckpoint:
    """Read and verify one checkpoint; raise :class:`CorruptCheckpointError` naming what is wrong.

    Only ``step-N/COMMIT``, ``step-N/manifest.json`` and the shard files named by the validated
    manifest (plain ``shard-g<G>-r<R>.safetensors`` names) are opened: nothing outside the folder.
    ``rank`` / ``world``: who restores. A multi-rank checkpoint of the same world size holding
    ``rank`` is opened for that rank (only the shards holding its tensors are read and verified);
    one holding every rank of another layout is opened whole (to be resharded); one holding only
    some ranks of another layout raises :class:`NotThisLayout`.
    ``defer_verify``: with ``verify="full"``, leave the checksums to the caller (the copies of a
    staged restore check them as they go; :meth:`OpenCheckpoint.verify_rest` checks the rest).
    """
    man = read_manifest(storage, step, where)
    if man.multi_rank:
        if man.world_size == world and rank in man.ranks:
            pass
        elif len(man.ranks) == man.world_size:
            rank = None  # the whole job's checkpoint: resharded by the caller
        else:
            raise NotThisLayout(f"{where}: holds rank(s) {list(man.ranks)[:8]} of a {man.world_size}-rank job; "
                                f"this process is rank {rank or 0} of {world}")
    needed = _needed(man, rank)
    read = {i: _read_shard(storage, man, i, where) for i in sorted(needed)}
    buffers = {i: b for i, (b, _) in read.items()}
    maps = {i: m for i, (_, m) in read.items() if m is not None}
    ck = OpenCheckpoint(man, buffers, where, rank if man.multi_rank else None, maps)
    if verify == "full":
        ck.unverified = needed
        if not defer_verify:
            ck.verify_rest()
    return ck


def read_shard(storage: Storage, man: mf.Manifest, i: int, where: str) -> torch.Tensor:
    """Shard ``i`` as a uint8 tensor, after checking its size and its header length."""
    return _read_shard(storage, man, i, where)[0]


def _read_shard(storage: Storage, man: mf.Manifest, i: int, where: str) -> tuple[torch.Tensor, Optional[mmap.mmap]]:
    """:func:`read_shard`, and the file mapping under the tensor (None for bytes read into memory)."""
    sh = man.shards[i]
    rel = f"{step_dir(man.step)}/{sh.file}"
    try:
        stored = storage.size(rel)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: shard {sh.file} is missing") from None
    if stored != sh.stored_bytes:
        raise CorruptCheckpointError(f"{where}: shard {sh.file} has {stored} bytes, manifest says "
                                     f"{sh.stored_bytes} (truncated or torn write)")
    mv = storage.read_buffer(rel, dict(sh.storage or {}), expected_bytes=sh.bytes)
    if len(mv) != sh.bytes:
        raise CorruptCheckpointError(f"{where}: shard {sh.file} decodes to {len(mv)} bytes, "
                                     f"expected {sh.bytes}")
    man.check_data_start(i, data_start(mv), where)
    mm = getattr(mv, "obj", None)
    return torch.frombuffer(mv, dtype=torch.uint8), mm if isinstance(mm, mmap.mmap) else None


# madvise advice values (Linux): the mmap module lacks MADV_POPULATE_READ before Python 3.13.
_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)
_MADV_POPULATE_READ = 22
#: bytes checksummed or copied between two drops of the mapped source pages
_CHUNK = 64 << 20


def _advise(mm: Optional[mmap.mmap], start: int, end: int, advice: int) -> None:
    """``madvise`` the pages of ``mm`` covering ``[start, end)``; a no-op without a map or on error."""
    if mm is None or end <= start:
        return
    lo = start - start % mmap.PAGESIZE
    try:
        mm.madvise(advice, lo, min(end, len(mm)) - lo)
    except (OSError, ValueError):
        pass  # an old kernel without MADV_POPULATE_READ: pages fault in as they are read


def _chunks(recs: list[TensorRecord]) -> list[list[TensorRecord]]:
    """``recs`` in shard order, in consecutive groups of at most a sixteenth of their bytes (4 to
    64 MiB; a larger record is a group of its own): what is mapped at once stays small."""
    limit = max(4 << 20, min(_CHUNK, sum(r.nbytes for r in recs) // 16))
    out: list[list[TensorRecord]] = []
    size = 0
    for r in sorted(recs, key=lambda r: r.start):
        if not out or size + r.nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(r)
        size += r.nbytes
    return out


def _verify_checksums(needed: dict[int, list[TensorRecord]], buffers: dict[int, torch.Tensor],
                      where: str, maps: Optional[dict[int, mmap.mmap]] = None) -> None:
    """Check the CRC32C of every record, on all threads, a chunk at a time.

    A mapped chunk is populated in one call (not a fault per page) and dropped once checked, so
    verifying a shard never makes the whole shard resident in this process.
    """
    ops = get_ops()
    maps = maps or {}
    for si, recs in needed.items():  # ranges were checked against their shard by Manifest.parse
        mm = maps.get(si)
        for group in _chunks(recs):
            lo, hi = group[0].start, group[-1].end
            _advise(mm, lo, hi, _MADV_POPULATE_READ)
            got = ops.crc32c(buffers[si], [r.start for r in group], [r.nbytes for r in group])
            _advise(mm, lo, hi, _MADV_DONTNEED)
            for rec, have in zip(group, got, strict=True):
                if have != rec.crc32c:
                    raise CorruptCheckpointError(f"{where}: checksum mismatch in tensor '{rec.key}' "
                                                 f"(crc32c {have:#010x}, manifest {rec.crc32c:#010x})")


def find_and_open(tiers: list[tuple[Tier, Storage]], step: Optional[int] = None,
                  verify: Optional[str] = None, on_all_damaged: str = "raise", rank: Optional[int] = None,
                  world: int = 1, stage: Optional[Callable[[OpenCheckpoint], None]] = None,
                  generation: Optional[int] = None) -> Optional[OpenCheckpoint]:
    """Open the newest healthy checkpoint (or the healthy copy of ``step``).

    Every candidate that fails to open, for whatever reason, is skipped with a warning.

    Args:
        tiers: ``(tier, storage)`` pairs, fastest first.
        step: only this step; None: the newest healthy one (newest writer generation first).
        generation: only checkpoints of this writer generation (the one the ranks agreed on).
        verify: ``"full"`` or ``"size"``; None: each tier's own setting.
        on_all_damaged: when committed candidates exist but none is healthy: ``"raise"`` a
            :class:`CorruptCheckpointError` listing them, or ``"warn"`` (log) and return None.
        rank, world: the restoring process's rank and world size (see :func:`open_checkpoint`).
        stage: called with each candidate opened (checksums deferred to it, see
            :func:`stage_restore`); a candidate it finds damaged is skipped like one that fails
            to open, before anything was restored from it. Its ``ValidationError`` (``into``
            does not match) is raised.

    Returns:
        The open checkpoint, or None when there is no committed checkpoint (of ``step``) at all
        (or all are damaged and ``on_all_damaged="warn"``).
    """
    if on_all_damaged not in ON_ALL_DAMAGED:
        raise ValidationError(f"on_all_damaged must be one of {ON_ALL_DAMAGED}, got {on_all_damaged!r}")
    skipped: list[str] = []
    cands = [c for c in list_candidates(tiers) if step is None or c.step == step]
    for c in cands:  # a marker that cannot be read is damage, reported whatever the order says
        if c.problem is not None:
            why = f"tier {c.tier.name} step {c.step}: {c.problem}"
            log.warning("nebula_ckpt: skipping %s", why)
            skipped.append(why)
    for c in cands:
        if c.problem is not None or (generation is not None and c.generation != generation):
            continue
        where = f"tier {c.tier.name} step {c.step}"
        try:
            ck = open_checkpoint(c.storage, c.step, verify or c.tier.verify, where, rank, world,
                                 defer_verify=stage is not None)
            ck.tier_name = c.tier.name
            ck.storage = c.storage
            if stage is not None:
                stage(ck)
        except ValidationError:
            raise  # the caller's `into` does not match: every candidate would say the same
        except NotThisLayout as e:
            log.info("nebula_ckpt: not restoring %s", e)
            continue
        except Exception as e:  # KeyError, OverflowError, struct.error, OSError...: all mean damaged
            why = str(e) if isinstance(e, CorruptCheckpointError) else \
                f"{where}: cannot read it ({type(e).__name__}: {e})"
            log.warning("nebula_ckpt: skipping %s", why)
            skipped.append(why)
            continue
        log.info("nebula_ckpt: restoring step %d from tier %s%s", c.step, c.tier.name,
                 f" (skipped {len(skipped)} damaged candidate(s))" if skipped else "")
        return ck
    if skipped:
        msg = _all_damaged_message(tiers, step, skipped)
        if on_all_damaged == "raise":
            raise CorruptCheckpointError(msg)
        log.warning("nebula_ckpt: %s", msg)
    return None


def _all_damaged_message(tiers: list[tuple[Tier, Storage]], step: Optional[int], skipped: list[str]) -> str:
    roots = ", ".join(sorted({t.name for t, _ in tiers}))
    listing = "\n".join(f"  - {s}" for s in skipped)
    return (f"no healthy checkpoint{f' of step {step}' if step is not None else ''}: all "
            f"{len(skipped)} committed candidate(s) are damaged:\n{listing}\n"
            "To proceed, restore an older copy of the damaged step folders, or delete them (the next "
            f"load then uses an older step, or none); `nebula-ckpt verify ROOT` lists them (tiers: {roots}).")


# -- applying a checkpoint to the user's objects ----------------------------------------------------

def _owned(view: torch.Tensor, device: Optional[torch.device]) -> torch.Tensor:
    # Copy as bytes: works for every dtype, shell dtypes (int1, uint4, ...) included.
    raw = view.reshape(-1).view(torch.uint8).clone() if view.numel() else \
        torch.empty(0, dtype=torch.uint8)
    out = raw.view(view.dtype).reshape(view.shape)
    if device is not None and device.type != "cpu":
        out = out.to(device)
    return out


def _target_device(rec: TensorRecord, map_location: Any) -> Optional[torch.device]:
    """Where a created tensor goes, with ``map_location`` as :func:`torch.load` takes it.

    ``None`` (the saved device, CPU where CUDA is missing), a device or string, a dict mapping
    saved locations to new ones (``{"cuda:1": "cuda:0"}``; other locations stay), or a callable
    ``f(storage, location)`` returning a storage (or tensor) on the target device, or None for
    the default.
    """
    saved = torch.device(rec.device)  # validated: "cpu", "cuda" or "cuda:<n>"
    if isinstance(map_location, dict):
        mapped = map_location.get(rec.device, map_location.get(str(saved)))
        return _target_device(rec, mapped)
    if callable(map_location):
        # torch.load passes the tensor's CPU storage; an empty one tells the target as well
        # without copying anything to where the callable moves it.
        got = map_location(torch.empty(0, dtype=torch.uint8).untyped_storage(), rec.device)
        if got is None:
            return _target_device(rec, None)
        dev = getattr(got, "device", None)
        if not isinstance(dev, torch.device):
            raise ValidationError(f"restore: map_location({rec.device!r}) returned {type(got).__name__}, "
                                  "not a storage or tensor (torch.load's callable form) or None")
        return dev
    if map_location is not None:
        return torch.device(map_location)
    if saved.type == "cuda" and not torch.cuda.is_available():
        return torch.device("cpu")
    return saved


def stage_restore(into: Any, *, map_location: Any = None, strict: bool = True,
                  allow_pickle: bool = False, adopt: Optional[Callable[[OpenCheckpoint], Any]] = None
                  ) -> Callable[[OpenCheckpoint], None]:
    """A ``stage`` for :func:`find_and_open` that prepares restoring each candidate into ``into``.

    Sets ``ck.pending`` to what applies it (same layout), after :func:`stage_apply` read and
    verified everything; for a checkpoint of another layout it only verifies (resharding reads
    what it needs itself). ``adopt(ck)``: the :class:`~nebula_ckpt.restore.adopt.Adoption` of a
    candidate whose pages may be handed over instead of copied, or None.
    """
    def stage(ck: OpenCheckpoint) -> None:
        if ck.same_layout:
            if adopt is not None and _all_cpu(map_location):
                ck.adoption = adopt(ck)
            ck.pending = stage_apply(ck, into, map_location=map_location, strict=strict, allow_pickle=allow_pickle)
        else:
            ck.verify_rest()
    return stage


def apply(ck: OpenCheckpoint, into: Any, *, map_location: Any = None, strict: bool = True,
          allow_pickle: bool = False) -> None:
    """Restore ``ck`` into ``into`` in place (same tree shape as what was saved)."""
    stage_apply(ck, into, map_location=map_location, strict=strict, allow_pickle=allow_pickle)()


def stage_apply(ck: OpenCheckpoint, into: Any, *, map_location: Any = None, strict: bool = True,
                allow_pickle: bool = False) -> Callable[[], None]:
    """Everything of a restore of ``ck`` into ``into`` but the changes; returns what makes them.

    Matches the checkpoint's tree against ``into`` (keys, shapes, dtypes: ``ValidationError``),
    makes the owned copies (optimizer state, new tensors) in parallel while checking their
    checksums, and checks the checksums of the bytes that will be copied into existing tensors
    (``CorruptCheckpointError``). Nothing in ``into`` has changed when this returns or raises;
    the returned function applies it.
    """
    if any(r.dtensor is not None for r in ck.manifest.tensors.values()):
        ck.meshes.update(_meshes(into))
    st = _Staged(ck, map_location, allow_pickle)
    try:
        run = _plan_node(st, ck.tree, into, "", strict)
        if strict:
            st.unmatched.check(f"restore: the checkpoint of step {ck.step}")
        st.materialize()
        ck.verify_rest()
        if ck.adoption is not None and not ck.adoption.give_up():
            # the claim was not won: never write through the file, copy (checked) what it would hand out
            st.own_adopted(ck.adoption.adopted)
    except BaseException:
        if ck.adoption is not None:
            ck.adoption.finish()  # nothing was handed over: the tier keeps its checkpoint
        raise

    def go() -> None:
        adoption = ck.adoption
        try:
            run()
        finally:
            if adoption is not None:
                adoption.finish()
        ck.pending = None
    return go


def _all_cpu(map_location: Any) -> bool:
    """Whether ``map_location`` leaves created tensors on the CPU (what adoption can hand out)."""
    if map_location is None:
        return True
    try:
        return torch.device(map_location).type == "cpu"
    except (TypeError, RuntimeError, ValueError):
        return False  # a dict or callable: per-tensor devices, copied as before


def _meshes(into: Any) -> dict[tuple[int, ...], Any]:
    """Device meshes of the DTensors in ``into`` (parameters of modules and optimizers, leaves)."""
    out: dict[tuple[int, ...], Any] = {}
    stack, seen = [into], set()
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            mesh = getattr(x, "device_mesh", None)
            if mesh is not None:
                out.setdefault(tuple(mesh.shape), mesh)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, torch.nn.Module):
            stack.extend(x.parameters())
        elif isinstance(x, torch.optim.Optimizer):
            stack.extend(p for g in x.param_groups for p in g["params"])
    return out


def materialize(ck: OpenCheckpoint, *, map_location: Any = None, allow_pickle: bool = False) -> Any:
    """Decode the whole checkpoint as a fresh tree of owned tensors and plain values."""
    st = _Staged(ck, map_location, allow_pickle)
    tree = st.decode_owned(ck.tree, "")
    st.materialize()
    ck.verify_rest()
    return tree()


class KeyMismatch:
    """The keys a restore found on one side only: held by the checkpoint but not by ``into``
    (they would not be restored: a forgotten scheduler) and held by ``into`` but not saved."""

    #: keys named in the error, of each side
    SHOWN = 10

    def __init__(self) -> None:
        self.saved_only: list[str] = []
        self.into_only: list[str] = []

    def check(self, what: str) -> None:
        """Raise :class:`ValidationError` naming the keys of either side (``what``: the checkpoint).

        Called after the whole tree is matched, before anything in ``into`` changes."""
        if not self.saved_only and not self.into_only:
            return
        parts, fixes = [], []
        if self.saved_only:
            parts.append(f"holds key(s) {_names(self.saved_only, self.SHOWN)} that `into` lacks (they would not be "
                         "restored)")
            fixes.append("add them to `into` (e.g. the scheduler or value saved under that key)")
        if self.into_only:
            parts.append(f"lacks key(s) {_names(self.into_only, self.SHOWN)} that `into` has")
            fixes.append("build `into` like the saved state")
        raise ValidationError(f"{what} " + " and ".join(parts) + "; " + ", or ".join(fixes)
                              + ", or pass strict=False to restore only the keys both have (a key only the "
                              "checkpoint has is then put into its dict as the saved value)")


def _names(keys: list[str], n: int) -> str:
    return f"{keys[:n]}" + (f" and {len(keys) - n} more" if len(keys) > n else "")


def holds_state(x: Any) -> bool:
    """Whether ``x`` is, or contains (in dicts, lists, tuples), a tensor or an object with
    ``load_state_dict``: something a restore fills, which replacing would leave as it was."""
    stack, seen = [x], set()
    while stack:
        y = stack.pop()
        if id(y) in seen:
            continue
        seen.add(id(y))
        if isinstance(y, torch.Tensor) or (not isinstance(y, type) and callable(getattr(y, "load_state_dict", None))):
            return True
        if isinstance(y, dict):
            stack.extend(y.values())
        elif isinstance(y, (list, tuple)):
            stack.extend(y)
    return False


def describe(x: Any) -> str:
    """``x`` in a few words, for errors (``a list of 2 item(s)``, ``a Linear``)."""
    if isinstance(x, (list, tuple, dict)):
        return f"a {type(x).__name__} of {len(x)} item(s)"
    return f"a {type(x).__name__}"


def describe_node(node: Mapping[str, Any]) -> str:
    """A saved typed-JSON node in a few words (``a list of 3 item(s)``, ``a Linear state``)."""
    t = node["t"]
    if t in ("dict", "odict", "list", "tuple"):
        return f"a {'dict' if t == 'odict' else t} of {len(node['v'])} item(s)"
    if t == "stateful":
        return f"a {node.get('cls', 'object')} state"
    return f"a {t}"


class _Staged:
    """The owned copies a restore makes: registered while planning, made at once, then decoded."""

    def __init__(self, ck: OpenCheckpoint, map_location: Any, allow_pickle: bool) -> None:
        self.ck = ck
        self.map_location = map_location
        self.allow_pickle = allow_pickle
        self._groups: list[list[str]] = []
        self._owned: list[dict[str, torch.Tensor]] = []
        #: keys only one side has (checked after planning, with ``strict``)
        self.unmatched = KeyMismatch()

    def decode_owned(self, node: Mapping[str, Any], path: str) -> Callable[[], Any]:
        """Register the tensors of ``node`` for owned copies; return what decodes ``node`` with them.

        Each node gets buffers of its own (an optimizer's state never shares a storage with
        another object's, so saving one never writes the other's bytes).
        """
        i = len(self._groups)
        self._groups.append(tensor_keys(node, []))

        def decoded() -> Any:
            owned = self._owned[i]
            return decode(node, lambda k: self.ck.as_saved(k, owned[k]), self.allow_pickle, path)
        return decoded

    def materialize(self) -> None:
        """Make every registered owned copy (checksums checked while copying)."""
        self._owned = [_owned_batch(self.ck, keys, self.map_location) for keys in self._groups]

    def own_adopted(self, adopted: Mapping[int, TensorRecord]) -> None:
        """Replace the tensors adopted from the memory tier (ids in ``adopted``, with their
        records) by owned copies, their checksums checked: the claim on the tier's file was not
        won, so it must never be written through them.

        Raises:
            CorruptCheckpointError: a copy's bytes differ from the manifest's checksum.
        """
        copies: dict[int, torch.Tensor] = {}
        for owned in self._owned:
            for k, t in owned.items():
                if id(t) in adopted:
                    if id(t) not in copies:
                        copies[id(t)] = _owned(t, None)
                    owned[k] = copies[id(t)]
        ops = get_ops()
        for i, c in copies.items():
            raw = c.reshape(-1).view(torch.uint8)
            self.ck.verified_by_copy([adopted[i]], ops.crc32c(raw, [0], [raw.numel()]))


def tensor_keys(node: Any, out: list[str]) -> list[str]:
    """Every tensor key referenced under ``node`` (typed JSON), in order (no recursion)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            if n.get("t") == "tensor":
                out.append(n["k"])
            else:
                stack.extend(reversed([v for v in n.values() if isinstance(v, (dict, list))]))
        elif isinstance(n, list):
            stack.extend(reversed(n))
    return out


def _owned_batch(ck: OpenCheckpoint, keys: list[str], map_location: Any) -> dict[str, torch.Tensor]:
    """Owned copies of many tensors: one host buffer per dtype, filled by parallel native copies.

    Cloning tensor by tensor pays an allocation and a page fault per 4 KiB page for each; a
    single buffer filled by the copy engine's threads, which take its page faults
    as they copy, avoids both.
    The tensors are views of it. The copies go a chunk at a time: the source pages of a chunk
    are dropped from this process once copied (the restore's extra resident memory stays near
    the owned bytes), and the checksums the engine takes while copying are compared with the
    manifest again, so bytes that changed in the file since they were verified never pass.
    """
    # Each stored tensor once, however often the tree names it: with the ranges validated as
    # disjoint by Manifest.parse, the buffers below never exceed the shard's own bytes.
    first: dict[str, str] = {}  # stored key -> the first tree key naming it
    for k in keys:
        first.setdefault(ck.resolve(k).key, k)
    real = list(first.values())
    cpu: list[tuple[str, Optional[torch.device]]] = []
    other: list[tuple[str, Optional[torch.device]]] = []
    for k in real:
        dev = _target_device(ck.resolve(k), map_location)
        (cpu if dev is None or dev.type == "cpu" else other).append((k, dev))
    out: dict[str, torch.Tensor] = {}
    if ck.adoption is not None and not ck.adoption.refused and cpu:  # views of the tier's pages
        try:
            adopted = ck.adoption.tensors([ck.resolve(k) for k, _ in cpu])
        except OSError as e:  # the file cannot be mapped for writing: copy, as without adoption
            log.info("nebula_ckpt: %s: copying instead of adopting the memory tier's pages (%s)", ck.where, e)
            ck.adoption.refused = True  # what an earlier group adopted is copied at the end of staging
        else:
            out.update((k, t) for (k, _), t in zip(cpu, adopted, strict=True))
            cpu = []
    # One buffer per dtype: tensors of different dtypes sharing a storage would trip torch.save.
    groups: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for k, _ in cpu:
        v = ck.view(k)
        groups.setdefault(v.dtype, []).append((k, v))
    ops = get_ops()
    for items in groups.values():
        offsets, total = [], 0
        for _, v in items:
            offsets.append(total)
            total += -(-(v.numel() * v.element_size()) // 64) * 64
        # not pre-faulted: the copy threads fault the pages as they fill them,
        # so the buffer is written once, not zeroed first and then copied into
        buf = ops.alloc(total, prefault=False) if total else torch.empty(0, dtype=torch.uint8)
        at = {k: off for (k, _), off in zip(items, offsets, strict=True)}
        views = dict(items)
        for chunk in _chunks([ck.resolve(k) for k, _ in items]):
            names = [first[r.key] for r in chunk]
            job = ops.enqueue_copy([views[n] for n in names], buf, [at[n] for n in names])
            job.wait()
            ck.drop(chunk)
            ck.verified_by_copy(chunk, job.checksums())
        for k, v in items:
            n = v.numel() * v.element_size()
            out[k] = buf[at[k]:at[k] + n].view(v.dtype).reshape(v.shape)
    for k, dev in other:
        out[k] = _owned(ck.view(k), dev)
    for k in keys:
        out[k] = out[first[ck.resolve(k).key]]
    return out


#: the load / state-dict machinery of torch.nn.Module; a module that changes it (a hook, an
#: override outside torch.nn) may load keys or shapes other than its state_dict() shows
_LOAD_HOOKS = ("_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_state_dict_hooks",
               "_state_dict_pre_hooks")
_LOAD_METHODS = ("load_state_dict", "_load_from_state_dict", "state_dict", "_save_to_state_dict")


def _predictable(module: torch.nn.Module) -> bool:
    """Whether ``module.load_state_dict`` does exactly what torch.nn's does: it accepts the keys
    of ``state_dict()`` with their shapes and nothing else (no hooks, no overrides outside torch.nn)."""
    for m in module.modules():
        if any(getattr(m, h, None) for h in _LOAD_HOOKS):
            return False
        for name in _LOAD_METHODS:
            owner = next((c for c in type(m).__mro__ if name in c.__dict__), None)
            if owner is not None and not owner.__module__.startswith("torch.nn."):
                return False
    return True


def _check_module_state(ck: OpenCheckpoint, state: Mapping[str, Any], target: torch.nn.Module, shown: str,
                        strict: bool) -> None:
    """Refuse, before anything changes, a module state that ``load_state_dict`` would refuse only
    after it copied what matches: keys missing or unexpected (``strict``) and shapes that differ
    (always), named. Checked where the module's loading is torch.nn's own (see :func:`_predictable`);
    anything else is left to the module (which may raise after a partial load, as with torch)."""
    if state.get("t") not in ("dict", "odict") or not _predictable(target):
        return
    want = target.state_dict(keep_vars=True)
    saved: dict[str, Any] = {}
    for k_node, v_node in state["v"]:
        k = decode(k_node, ck.view, False, shown)
        saved[k] = v_node
    if strict:
        missing = [k for k in want if k not in saved]
        unexpected = [k for k in saved if k not in want]
        if missing or unexpected:
            raise ValidationError(
                f"restore: the {type(target).__name__} under '{shown}' does not match the checkpoint of step "
                f"{ck.step}: missing in the checkpoint {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
                f"not in the module {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}; build the model the "
                "checkpoint was saved from, or pass strict=False (keys only: shapes must match)")
    for k, v_node in saved.items():
        have = want.get(k)
        if not isinstance(v_node, dict) or v_node.get("t") != "tensor" or have is None or type(have) not in (
                torch.Tensor, torch.nn.Parameter, torch.nn.Buffer):
            continue
        rec = ck.resolve(v_node["k"])
        if rec.dtensor is None and tuple(rec.shape) != tuple(have.shape):
            raise ValidationError(
                f"restore: key '{shown}/{k}': the checkpoint of step {ck.step} has shape {tuple(rec.shape)}, "
                f"the {type(target).__name__} has {tuple(have.shape)}; build the model the checkpoint was saved "
                "from, or use read() to look at it")


def _check_optimizer_state(ck: OpenCheckpoint, state: Mapping[str, Any], target: Any, shown: str) -> None:
    """Refuse, before anything changes, an optimizer state whose parameter groups do not match
    ``target``'s (what ``torch.optim.Optimizer.load_state_dict`` refuses, but only when it is
    applied, after the objects before it in ``into`` were loaded). Optimizers with loading of
    their own are left to it."""
    if not isinstance(target, torch.optim.Optimizer) or state.get("t") not in ("dict", "odict") or \
            type(target).load_state_dict is not torch.optim.Optimizer.load_state_dict:
        return
    node = next((v for k, v in state["v"] if decode(k, ck.view, False, shown) == "param_groups"), None)
    if node is None:
        return
    try:
        groups = decode(node, ck.view, False, shown)
        saved = [len(g["params"]) for g in groups]
    except Exception:  # not the shape torch writes: let load_state_dict say what it thinks
        return
    have = [len(g["params"]) for g in target.param_groups]
    if saved != have:
        raise ValidationError(
            f"restore: the {type(target).__name__} under '{shown}' does not match the checkpoint of step {ck.step}: "
            f"it has {len(have)} parameter group(s) of {have} parameters, the checkpoint {len(saved)} of {saved}; "
            "build the optimizer over the same parameters, in the same groups, as when it was saved")


def _plan_node(st: _Staged, node: Mapping[str, Any], target: Any, path: str, strict: bool) -> Callable[[], Any]:
    """Plan restoring ``node`` into ``target``: validate now, return what restores it and gives
    the value to store in the parent."""
    ck = st.ck
    t = node["t"]
    shown = path or "<root>"
    if t in ("dict", "odict") and not isinstance(target, dict) and callable(getattr(target, "load_state_dict", None)):
        # a state dict saved as a plain dict (DCP's writer, a framework's dict) restored into the
        # object it came from: load it into the object, never replace the object by the dict
        node = {"t": "stateful", "cls": type(target).__name__, "state": node}
        t = "stateful"
    if t == "stateful":
        if not callable(getattr(target, "load_state_dict", None)):
            if target is None or not strict:
                return st.decode_owned(node, path)
            raise ValidationError(f"restore: checkpoint key '{shown}' holds a {node.get('cls')} state, but "
                                  f"the object given in `into` ({type(target).__name__}) has no load_state_dict()")
        if isinstance(target, torch.nn.Module):
            _check_module_state(ck, node["state"], target, shown, strict)
            keys = tensor_keys(node["state"], [])

            def load_module() -> Any:
                # Zero-copy views: load_state_dict copies them straight into the parameters, and
                # each submodule's source pages are unmapped once it is loaded.
                state = decode(node["state"], lambda k: ck.as_saved(k, ck.view(k)), st.allow_pickle, path)
                hooks = _drop_after_each_submodule(ck, target, node["state"])
                try:
                    target.load_state_dict(state, strict=strict)
                finally:
                    for h in hooks:
                        h.remove()
                del state
                ck.drop([ck.resolve(k) for k in keys])
                return target
            return load_module
        # Optimizers etc. keep the tensors they are given: hand them owned copies.
        _check_optimizer_state(ck, node["state"], target, shown)
        state = st.decode_owned(node["state"], path)

        def load_object() -> Any:
            target.load_state_dict(state())
            return target
        return load_object
    if t == "tensor" and isinstance(target, torch.Tensor):
        src = ck.view(node["k"])
        dest = target
        if ck.resolve(node["k"]).dtensor is not None and hasattr(target, "to_local"):
            dest = target.to_local()  # a DTensor: this rank's shard is restored into its local part
        if tuple(dest.shape) != tuple(src.shape) or dest.dtype != src.dtype:
            raise ValidationError(
                f"restore: key '{shown}': checkpoint has {src.dtype} {tuple(src.shape)}, the tensor in "
                f"`into` is {dest.dtype} {tuple(dest.shape)}; pass a matching tensor or use read()")

        def copy_into() -> Any:
            with torch.no_grad():
                dest.copy_(src)
            ck.drop([ck.resolve(node["k"])])
            return target
        return copy_into
    if t in ("dict", "odict") and isinstance(target, dict):
        saved_keys, subs = set(), []
        for k_node, v_node in node["v"]:
            k = decode(k_node, ck.view, False, path)
            saved_keys.add(k)
            sub = f"{path}/{k}" if path else str(k)
            if k not in target:
                st.unmatched.saved_only.append(sub)
                if strict:
                    continue  # refused once every key is known (see KeyMismatch)
            subs.append((k, _plan_node(st, v_node, target.get(k), sub, strict)))
        st.unmatched.into_only.extend(f"{path}/{k}" if path else str(k) for k in target if k not in saved_keys)

        def fill() -> Any:
            for k, f in subs:
                target[k] = f()
            return target
        return fill
    if t in ("list", "tuple") and isinstance(target, list if t == "list" else tuple) \
            and len(target) == len(node["v"]):
        items = [_plan_node(st, v, target[i], f"{path}/{i}", strict) for i, v in enumerate(node["v"])]
        if t == "tuple":  # immutable: restore what can be restored in place, rebuild the tuple
            return lambda: tuple(f() for f in items)

        seq: Any = target

        def fill_list() -> Any:
            for i, f in enumerate(items):
                seq[i] = f()
            return seq
        return fill_list
    if strict and (not path and target is not None or holds_state(target)):
        # the saved value would replace `target` in its parent (at the root: be dropped), and what
        # `target` holds would silently keep its old state
        raise ValidationError(
            f"restore: checkpoint key '{shown}' holds {describe_node(node)} (step {ck.step}), `into` holds "
            f"{describe(target)} there, which it cannot be restored into; build `into` like the saved state, "
            "or pass strict=False to replace it by the saved value")
    return st.decode_owned(node, path)


def _drop_after_each_submodule(ck: OpenCheckpoint, module: torch.nn.Module, state: Mapping[str, Any]) -> list[Any]:
    """Post hooks on ``module`` and its submodules that unmap the source pages of their own
    parameters and buffers as soon as ``load_state_dict`` has copied them (so a model's restore
    never has its whole mapped source resident). Keys it cannot match are dropped by the caller
    after the load."""
    recs: dict[str, TensorRecord] = {}
    if state.get("t") in ("dict", "odict"):
        for k_node, v_node in state["v"]:
            if isinstance(v_node, dict) and v_node.get("t") == "tensor" and isinstance(k_node, dict) \
                    and k_node.get("t") == "str":
                recs[k_node["v"]] = ck.resolve(v_node["k"])
    hooks = []
    for name, sub in module.named_modules():
        mine = [recs[f"{name}.{n}" if name else n] for n in (*sub._parameters, *sub._buffers)
                if (f"{name}.{n}" if name else n) in recs]
        if mine:
            hooks.append(sub.register_load_state_dict_post_hook(lambda _m, _k, mine=mine: ck.drop(mine)))
    return hooks
