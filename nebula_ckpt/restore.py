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
    """A verified checkpoint: its validated manifest and zero-copy tensor views of its shard bytes."""

    def __init__(self, manifest: mf.Manifest, buffers: list[torch.Tensor], where: str) -> None:
        self.manifest = manifest
        self.step = manifest.step
        self.where = where
        self.tier_name: Optional[str] = None
        self._buffers = buffers
        self._views: dict[str, torch.Tensor] = {}

    def keys(self) -> list[str]:
        """Stored tensor keys (aliases excluded)."""
        return list(self.manifest.tensors)

    def view(self, key: str) -> torch.Tensor:
        """Read-only use view of tensor ``key`` (or of the key it is tied to) over the shard bytes."""
        rec = self.manifest.resolve(key)
        v = self._views.get(rec.key)
        if v is None:
            raw = self._buffers[rec.shard][rec.start:rec.end]
            v = raw.view(rec.torch_dtype).reshape(rec.shape)
            self._views[rec.key] = v
        return v

    def tree(self, materialize: Callable[[str, torch.Tensor], Any], allow_pickle: bool) -> Any:
        """Decode the whole state tree, turning each tensor view into ``materialize(key, view)``."""
        made: dict[str, Any] = {}

        def tensor(key: str) -> Any:
            real = self.manifest.resolve(key).key
            if real not in made:
                made[real] = materialize(real, self.view(real))
            return made[real]

        return decode(self.manifest.tree, tensor, allow_pickle)


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


def open_checkpoint(storage: Storage, step: int, verify: str, where: str) -> OpenCheckpoint:
    """Read and verify one checkpoint; raise :class:`CorruptCheckpointError` naming what is wrong.

    Only ``step-N/COMMIT``, ``step-N/manifest.json`` and the shard files named by the validated
    manifest (plain ``shard-g<G>-r<R>.safetensors`` names) are opened: nothing outside the folder.
    """
    ops = get_ops()
    d = mf.step_dir(step)
    try:
        commit = mf.Commit.parse(storage.read_small(f"{d}/{mf.COMMIT}"), where)
        mbytes = storage.read_small(f"{d}/{mf.MANIFEST}")
    except FileNotFoundError as e:
        raise CorruptCheckpointError(f"{where}: {e.filename or e} is missing") from None
    if len(mbytes) != commit.manifest_bytes or ops.crc32c_bytes(mbytes) != commit.manifest_crc32c:
        raise CorruptCheckpointError(f"{where}: manifest.json does not match its commit marker "
                                     "(size or checksum differs): garbled or replaced")
    if commit.step != step:
        raise CorruptCheckpointError(f"{where}: {mf.COMMIT} is for step {commit.step}, but lies in {d}/")
    man = mf.Manifest.parse(mbytes, where, step)
    buffers = [_read_shard(storage, man, i, where) for i in range(len(man.shards))]
    if verify == "full":
        _verify_checksums(man, buffers, where)
    return OpenCheckpoint(man, buffers, where)


def _read_shard(storage: Storage, man: mf.Manifest, i: int, where: str) -> torch.Tensor:
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


def _verify_checksums(man: mf.Manifest, buffers: list[torch.Tensor], where: str) -> None:
    ops = get_ops()
    by_shard: dict[int, list[mf.TensorRecord]] = {}
    for rec in man.tensors.values():  # ranges were checked against their shard by Manifest.parse
        by_shard.setdefault(rec.shard, []).append(rec)
    for si, recs in by_shard.items():
        got = ops.crc32c(buffers[si], [r.start for r in recs], [r.nbytes for r in recs])
        for rec, have in zip(recs, got, strict=True):
            if have != rec.crc32c:
                raise CorruptCheckpointError(f"{where}: checksum mismatch in tensor '{rec.key}' "
                                             f"(crc32c {have:#010x}, manifest {rec.crc32c:#010x})")


def find_and_open(tiers: list[tuple[Tier, Storage]], step: Optional[int] = None,
                  verify: Optional[str] = None, on_all_damaged: str = "raise") -> Optional[OpenCheckpoint]:
    """Open the newest healthy checkpoint (or the healthy copy of ``step``).

    Every candidate that fails to open, for whatever reason, is skipped with a warning.

    Args:
        tiers: ``(tier, storage)`` pairs, fastest first.
        step: only this step; None: the newest healthy one.
        verify: ``"full"`` or ``"size"``; None: each tier's own setting.
        on_all_damaged: when committed candidates exist but none is healthy: ``"raise"`` a
            :class:`CorruptCheckpointError` listing them, or ``"warn"`` (log) and return None.

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
            ck = open_checkpoint(c.storage, c.step, verify or c.tier.verify, where)
        except Exception as e:  # KeyError, OverflowError, struct.error, OSError...: all mean damaged
            why = str(e) if isinstance(e, CorruptCheckpointError) else \
                f"{where}: cannot read it ({type(e).__name__}: {e})"
            log.warning("nebula_ckpt: skipping %s", why)
            skipped.append(why)
            continue
        ck.tier_name = c.tier.name
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
    _apply_node(ck, ck.manifest.tree, into, "", map_location, strict, allow_pickle)


def materialize(ck: OpenCheckpoint, *, map_location: Any = None, allow_pickle: bool = False) -> Any:
    """Decode the whole checkpoint as a fresh tree of owned tensors and plain values."""
    return _decode_owned(ck, ck.manifest.tree, map_location, allow_pickle, "")


def _tensor_keys(node: Any, out: list[str]) -> list[str]:
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
    aliases = ck.manifest.aliases
    # Each stored tensor once, however often the tree names it: with the ranges validated as
    # disjoint by Manifest.parse, the buffers below never exceed the shard's own bytes.
    real = list(dict.fromkeys(aliases.get(k, k) for k in keys))
    cpu: list[tuple[str, Optional[torch.device]]] = []
    other: list[tuple[str, Optional[torch.device]]] = []
    for k in real:
        dev = _target_device(ck.manifest.tensors[k], map_location)
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
        out[k] = out[aliases.get(k, k)]
    return out


def _decode_owned(ck: OpenCheckpoint, node: Mapping[str, Any], map_location: Any, allow_pickle: bool,
                  path: str) -> Any:
    owned = _owned_batch(ck, _tensor_keys(node, []), map_location)
    return decode(node, owned.__getitem__, allow_pickle, path)


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
            state = decode(node["state"], ck.view, allow_pickle, path)
            target.load_state_dict(state, strict=strict)
        else:
            # Optimizers etc. keep the tensors they are given: hand them owned copies.
            target.load_state_dict(_decode_owned(ck, node["state"], map_location, allow_pickle, path))
        return target
    if t == "tensor":
        if isinstance(target, torch.Tensor):
            src = ck.view(node["k"])
            if tuple(target.shape) != tuple(src.shape) or target.dtype != src.dtype:
                raise ValidationError(
                    f"restore: key '{shown}': checkpoint has {src.dtype} {tuple(src.shape)}, the tensor in "
                    f"`into` is {target.dtype} {tuple(target.shape)}; pass a matching tensor or use read()")
            with torch.no_grad():
                target.copy_(src)
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
