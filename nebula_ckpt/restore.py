"""Restore: find the newest healthy checkpoint on any tier, verify it, load it in place.

Candidates are every committed step on every tier, newest step first and, for one step, the
fastest tier first. Each is verified (commit marker, manifest checksum, shard sizes and, with
``verify="full"``, the CRC32C of every tensor) before a single byte reaches the user's
tensors; on any mismatch the next candidate is tried. Local tiers are memory-mapped, so tensors
are copied once, from the page cache straight into the existing parameters.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch

from . import manifest as mf
from .errors import CorruptCheckpointError, ValidationError
from .native import get_ops
from .storage.base import Storage
from .structure import decode
from .tiers import Tier

log = logging.getLogger(__name__)

#: What :func:`find_and_open` does when committed checkpoints exist but none is healthy.
ON_ALL_DAMAGED = ("raise", "warn")


@dataclass(frozen=True)
class Candidate:
    """A committed step on one tier."""

    step: int
    tier: Tier
    storage: Storage


class OpenCheckpoint:
    """A verified checkpoint: its validated manifest and zero-copy tensor views of its shard bytes.

    For a multi-rank checkpoint opened for one rank (``rank``), keys, tree and views are that
    rank's (its tensors may live in other ranks' shards: replicated ones are stored once).
    Opened without a rank, a multi-rank checkpoint is the whole job's (for resharding, the CLI).
    """

    def __init__(self, manifest: mf.Manifest, buffers: dict[int, torch.Tensor], where: str,
                 rank: Optional[int] = None) -> None:
        self.manifest = manifest
        self.step = manifest.step
        self.where = where
        self.rank = rank
        self.tier_name: Optional[str] = None
        #: the storage it was read from (set by :func:`find_and_open`)
        self.storage: Optional[Storage] = None
        self._buffers = buffers
        self._views: dict[str, torch.Tensor] = {}
        #: DeviceMesh by mesh shape, found in the objects restored into (for DTensor records)
        self.meshes: dict[tuple[int, ...], Any] = {}

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

    def resolve(self, key: str) -> mf.TensorRecord:
        """The stored record of ``key`` (a key of :attr:`tree`)."""
        return self.manifest.resolve(key, self.rank)

    def keys(self) -> list[str]:
        """Stored tensor keys (aliases excluded)."""
        return list(self.manifest.tensors)

    def buffer(self, shard: int) -> torch.Tensor:
        """The bytes of shard ``shard`` (read and verified when the checkpoint was opened)."""
        return self._buffers[shard]

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
    """Every committed step on every tier: newest first, fastest tier first within a step."""
    cands: list[tuple[int, int, Candidate]] = []
    for i, (tier, st) in enumerate(tiers):
        try:
            steps = mf.committed_steps(st)
        except Exception as e:
            log.warning("nebula_ckpt: cannot list tier %s: %s", tier.name, e)
            continue
        cands.extend((-s, i, Candidate(s, tier, st)) for s in steps)
    return [c for _, _, c in sorted(cands, key=lambda x: (x[0], x[1]))]


def _needed(man: mf.Manifest, rank: Optional[int]) -> dict[int, list[mf.TensorRecord]]:
    """Shard index -> the records a restore of ``rank`` reads from it (every shard without a rank)."""
    if rank is None or not man.multi_rank:
        recs = list(man.tensors.values())
    else:
        p = man.prefix(rank)
        keys = [k for k in list(man.tensors) + list(man.aliases) if k.startswith(p)]
        recs = list({id(r): r for r in (man.tensors[man.aliases.get(k, k)] for k in keys)}.values())
    out: dict[int, list[mf.TensorRecord]] = {i: [] for i in range(len(man.shards))} \
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
    d = mf.step_dir(step)
    try:
        commit = mf.Commit.parse(storage.read_small(f"{d}/{mf.COMMIT}"), where)
        mbytes = storage.read_small(f"{d}/{mf.MANIFEST}")
    except FileNotFoundError as e:
        raise CorruptCheckpointError(f"{where}: {e.filename or e} is missing") from None
    if len(mbytes) != commit.manifest_bytes or get_ops().crc32c_bytes(mbytes) != commit.manifest_crc32c:
        raise CorruptCheckpointError(f"{where}: manifest.json does not match its commit marker "
                                     "(size or checksum differs): garbled or replaced")
    if commit.step != step:
        raise CorruptCheckpointError(f"{where}: {mf.COMMIT} is for step {commit.step}, but lies in {d}/")
    return mf.Manifest.parse(mbytes, where, step)


class NotThisLayout(Exception):
    """A healthy checkpoint this process cannot restore: it holds other ranks of another layout
    (a rank's own memory tier after the world size changed)."""


def open_checkpoint(storage: Storage, step: int, verify: str, where: str,
                    rank: Optional[int] = None, world: int = 1) -> OpenCheckpoint:
    """Read and verify one checkpoint; raise :class:`CorruptCheckpointError` naming what is wrong.

    Only ``step-N/COMMIT``, ``step-N/manifest.json`` and the shard files named by the validated
    manifest (plain ``shard-g<G>-r<R>.safetensors`` names) are opened: nothing outside the folder.
    ``rank`` / ``world``: who restores. A multi-rank checkpoint of the same world size holding
    ``rank`` is opened for that rank (only the shards holding its tensors are read and verified);
    one holding every rank of another layout is opened whole (to be resharded); one holding only
    some ranks of another layout raises :class:`NotThisLayout`.
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
    buffers = {i: read_shard(storage, man, i, where) for i in sorted(needed)}
    if verify == "full":
        _verify_checksums(needed, buffers, where)
    return OpenCheckpoint(man, buffers, where, rank if man.multi_rank else None)


def read_shard(storage: Storage, man: mf.Manifest, i: int, where: str) -> torch.Tensor:
    """Shard ``i`` as a uint8 tensor, after checking its size and its header length."""
    sh = man.shards[i]
    rel = f"{mf.step_dir(man.step)}/{sh.file}"
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
    man.check_data_start(i, 8 + int.from_bytes(bytes(mv[:8]), "little"), where)
    return torch.frombuffer(mv, dtype=torch.uint8)


def _verify_checksums(needed: dict[int, list[mf.TensorRecord]], buffers: dict[int, torch.Tensor],
                      where: str) -> None:
    ops = get_ops()
    for si, recs in needed.items():  # ranges were checked against their shard by Manifest.parse
        got = ops.crc32c(buffers[si], [r.start for r in recs], [r.nbytes for r in recs])
        for rec, have in zip(recs, got, strict=True):
            if have != rec.crc32c:
                raise CorruptCheckpointError(f"{where}: checksum mismatch in tensor '{rec.key}' "
                                             f"(crc32c {have:#010x}, manifest {rec.crc32c:#010x})")


def find_and_open(tiers: list[tuple[Tier, Storage]], step: Optional[int] = None,
                  verify: Optional[str] = None, on_all_damaged: str = "raise", rank: Optional[int] = None,
                  world: int = 1) -> Optional[OpenCheckpoint]:
    """Open the newest healthy checkpoint (or the healthy copy of ``step``).

    Every candidate that fails to open, for whatever reason, is skipped with a warning.

    Args:
        tiers: ``(tier, storage)`` pairs, fastest first.
        step: only this step; None: the newest healthy one.
        verify: ``"full"`` or ``"size"``; None: each tier's own setting.
        on_all_damaged: when committed candidates exist but none is healthy: ``"raise"`` a
            :class:`CorruptCheckpointError` listing them, or ``"warn"`` (log) and return None.
        rank, world: the restoring process's rank and world size (see :func:`open_checkpoint`).

    Returns:
        The open checkpoint, or None when there is no committed checkpoint (of ``step``) at all
        (or all are damaged and ``on_all_damaged="warn"``).
    """
    if on_all_damaged not in ON_ALL_DAMAGED:
        raise ValidationError(f"on_all_damaged must be one of {ON_ALL_DAMAGED}, got {on_all_damaged!r}")
    skipped: list[str] = []
    for c in list_candidates(tiers):
        if step is not None and c.step != step:
            continue
        where = f"tier {c.tier.name} step {c.step}"
        try:
            ck = open_checkpoint(c.storage, c.step, verify or c.tier.verify, where, rank, world)
        except NotThisLayout as e:
            log.info("nebula_ckpt: not restoring %s", e)
            continue
        except Exception as e:  # KeyError, OverflowError, struct.error, OSError...: all mean damaged
            why = str(e) if isinstance(e, CorruptCheckpointError) else \
                f"{where}: cannot read it ({type(e).__name__}: {e})"
            log.warning("nebula_ckpt: skipping %s", why)
            skipped.append(why)
            continue
        ck.tier_name = c.tier.name
        ck.storage = c.storage
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


def _target_device(rec: mf.TensorRecord, map_location: Any) -> Optional[torch.device]:
    if map_location is not None:
        return torch.device(map_location)
    dev = torch.device(rec.device)  # validated: "cpu", "cuda" or "cuda:<n>"
    if dev.type == "cuda" and not torch.cuda.is_available():
        return torch.device("cpu")
    return dev


def apply(ck: OpenCheckpoint, into: Any, *, map_location: Any = None, strict: bool = True,
          allow_pickle: bool = False) -> None:
    """Restore ``ck`` into ``into`` in place (same tree shape as what was saved)."""
    if any(r.dtensor is not None for r in ck.manifest.tensors.values()):
        ck.meshes.update(_meshes(into))
    _apply_node(ck, ck.tree, into, "", map_location, strict, allow_pickle)


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
    return _decode_owned(ck, ck.tree, map_location, allow_pickle, "")


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
    """Owned copies of many tensors: one pre-faulted host buffer, one parallel native copy.

    Cloning tensor by tensor pays an allocation and a page fault per 4 KiB page for each; a
    single (huge-page) buffer filled by the copy engine avoids both. The tensors are views of it.
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
    # One buffer per dtype: tensors of different dtypes sharing a storage would trip torch.save.
    groups: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for k, _ in cpu:
        v = ck.view(k)
        groups.setdefault(v.dtype, []).append((k, v))
    ops = get_ops()
    jobs = []
    for items in groups.values():
        offsets, total = [], 0
        for _, v in items:
            offsets.append(total)
            total += -(-(v.numel() * v.element_size()) // 64) * 64
        buf = ops.alloc(total) if total else torch.empty(0, dtype=torch.uint8)
        jobs.append(ops.enqueue_copy([v for _, v in items], buf, offsets))
        for (k, v), off in zip(items, offsets, strict=True):
            n = v.numel() * v.element_size()
            out[k] = buf[off:off + n].view(v.dtype).reshape(v.shape)
    for job in jobs:
        job.wait()
    for k, dev in other:
        out[k] = _owned(ck.view(k), dev)
    for k in keys:
        out[k] = out[first[ck.resolve(k).key]]
    return out


def _decode_owned(ck: OpenCheckpoint, node: Mapping[str, Any], map_location: Any, allow_pickle: bool,
                  path: str) -> Any:
    owned = _owned_batch(ck, tensor_keys(node, []), map_location)
    return decode(node, lambda k: ck.as_saved(k, owned[k]), allow_pickle, path)


def _apply_node(ck: OpenCheckpoint, node: Mapping[str, Any], target: Any, path: str, map_location: Any,
                strict: bool, allow_pickle: bool) -> Any:
    """Restore ``node`` into ``target`` where possible; return the value to store in the parent."""
    t = node["t"]
    shown = path or "<root>"
    if t == "stateful":
        load = getattr(target, "load_state_dict", None)
        if not callable(load):
            if target is None or not strict:
                return _decode_owned(ck, node, map_location, allow_pickle, path)
            raise ValidationError(f"restore: checkpoint key '{shown}' holds a {node.get('cls')} state, but "
                                  f"the object given in `into` ({type(target).__name__}) has no load_state_dict()")
        if isinstance(target, torch.nn.Module):
            # Zero-copy views: load_state_dict copies them straight into the parameters.
            state = decode(node["state"], lambda k: ck.as_saved(k, ck.view(k)), allow_pickle, path)
            target.load_state_dict(state, strict=strict)
        else:
            # Optimizers etc. keep the tensors they are given: hand them owned copies.
            target.load_state_dict(_decode_owned(ck, node["state"], map_location, allow_pickle, path))
        return target
    if t == "tensor":
        if isinstance(target, torch.Tensor):
            src = ck.view(node["k"])
            dest = target
            if ck.resolve(node["k"]).dtensor is not None and hasattr(target, "to_local"):
                dest = target.to_local()  # a DTensor: this rank's shard is restored into its local part
            if tuple(dest.shape) != tuple(src.shape) or dest.dtype != src.dtype:
                raise ValidationError(
                    f"restore: key '{shown}': checkpoint has {src.dtype} {tuple(src.shape)}, the tensor in "
                    f"`into` is {dest.dtype} {tuple(dest.shape)}; pass a matching tensor or use read()")
            with torch.no_grad():
                dest.copy_(src)
            return target
        return _decode_owned(ck, node, map_location, allow_pickle, path)
    if t in ("dict", "odict") and isinstance(target, dict):
        saved_keys = []
        for k_node, v_node in node["v"]:
            k = decode(k_node, ck.view, False, path)
            saved_keys.append(k)
            sub = f"{path}/{k}" if path else str(k)
            target[k] = _apply_node(ck, v_node, target.get(k), sub, map_location, strict, allow_pickle)
        missing = [k for k in target if k not in saved_keys]
        if missing and strict:
            raise ValidationError(f"restore: `into` has key(s) {missing} under '{shown}' that the checkpoint "
                                  f"of step {ck.step} does not have; pass strict=False to leave them as they are")
        return target
    if t == "list" and isinstance(target, list) and len(target) == len(node["v"]):
        for i, v_node in enumerate(node["v"]):
            target[i] = _apply_node(ck, v_node, target[i], f"{path}/{i}", map_location, strict, allow_pickle)
        return target
    if t == "tuple" and isinstance(target, tuple) and len(target) == len(node["v"]):
        # Tuples are immutable: restore what can be restored in place, rebuild the tuple.
        return tuple(_apply_node(ck, v, target[i], f"{path}/{i}", map_location, strict, allow_pickle)
                     for i, v in enumerate(node["v"]))
    return _decode_owned(ck, node, map_location, allow_pickle, path)
