"""Owned copies of restored tensors: what a restore creates rather than copies into.

An optimizer's state, a new value in a dict, the tensors of :meth:`Checkpointer.read`: each is a
tensor the restore makes and hands over. :func:`owned_batch` makes many at once, one host buffer
per dtype filled by the native copy engine's threads, a chunk at a time (the mapped source pages
dropped once copied, the checksums taken while copying compared with the manifest), or hands out
the memory tier's own pages (:mod:`nebula_ckpt.tiers.memory.adopt`). :func:`target_device` is
``map_location`` as :func:`torch.load` takes it.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from nebula_ckpt.arguments import check_device
from nebula_ckpt.errors import ValidationError
from nebula_ckpt.format.records import TensorRecord
from nebula_ckpt.native import get_ops
from nebula_ckpt.restore.open import OpenCheckpoint, chunks

log = logging.getLogger(__name__)

#: a restored tensor of at most this many bytes gets storage of its own instead of a view into a
#: shared buffer: some torch APIs read a tensor's storage from its start (``torch.set_rng_state``
#: and ``Generator.set_state`` crash on a view at an offset), and RNG states are this small
OWN_STORAGE_BYTES = 64 << 10


def owned(view: torch.Tensor, device: Optional[torch.device]) -> torch.Tensor:
    """An owned copy of ``view`` (on ``device``, or the CPU for None)."""
    # Copy as bytes: works for every dtype, shell dtypes (int1, uint4, ...) included.
    raw = view.reshape(-1).view(torch.uint8).clone() if view.numel() else \
        torch.empty(0, dtype=torch.uint8)
    out = raw.view(view.dtype).reshape(view.shape)
    if device is not None and device.type != "cpu":
        out = out.to(device)
    return out


def target_device(rec: TensorRecord, map_location: Any) -> Optional[torch.device]:
    """Where a created tensor goes, with ``map_location`` as :func:`torch.load` takes it.

    ``None`` (the saved device, CPU where CUDA is missing), a device or string, a dict mapping
    saved locations to new ones (``{"cuda:1": "cuda:0"}``; other locations stay), or a callable
    ``f(storage, location)`` returning a storage (or tensor) on the target device, or None for
    the default.
    """
    saved = torch.device(rec.device)  # validated: "cpu", "cuda" or "cuda:<n>"
    if isinstance(map_location, dict):
        mapped = map_location.get(rec.device, map_location.get(str(saved)))
        if mapped is not None:  # the caller's mapping, not the checkpoint: a device it lacks is its error
            check_device(mapped, f"map_location[{rec.device!r}]")
        return target_device(rec, mapped)
    if callable(map_location):
        # torch.load passes the tensor's CPU storage; an empty one tells the target as well
        # without copying anything to where the callable moves it.
        try:
            got = map_location(torch.empty(0, dtype=torch.uint8).untyped_storage(), rec.device)
        except Exception as e:  # the caller's function, not the checkpoint: never reported as damage
            raise ValidationError(f"restore: map_location({rec.device!r}) raised {type(e).__name__}: {e} (the "
                                  "checkpoint is not damaged; fix the map_location function)") from e
        if got is None:
            return target_device(rec, None)
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


def all_cpu(map_location: Any) -> bool:
    """Whether ``map_location`` leaves created tensors on the CPU (what adoption can hand out)."""
    if map_location is None:
        return True
    try:
        return torch.device(map_location).type == "cpu"
    except (TypeError, RuntimeError, ValueError):
        return False  # a dict or callable: per-tensor devices, copied as before


def owned_batch(ck: OpenCheckpoint, keys: list[str], map_location: Any) -> dict[str, torch.Tensor]:
    """Owned copies of many tensors (``keys`` of ``ck``'s tree): one host buffer per dtype, filled
    by parallel native copies.

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
    cpu: list[str] = []
    other: list[tuple[str, Optional[torch.device]]] = []
    for k in first.values():
        dev = target_device(ck.resolve(k), map_location)
        if dev is None or dev.type == "cpu":
            cpu.append(k)
        else:
            other.append((k, dev))
    out = _adopted(ck, cpu)
    if not out:
        groups: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
        for k in cpu:  # one buffer per dtype: tensors of different dtypes sharing a storage trip torch.save
            v = ck.view(k)
            groups.setdefault(v.dtype, []).append((k, v))
        for items in groups.values():
            out.update(_copy_group(ck, items, first))
    for k, dev in other:
        out[k] = owned(ck.view(k), dev)
    for k, t in out.items():  # small tensors get storage of their own (see OWN_STORAGE_BYTES)
        if t.storage_offset() and t.numel() * t.element_size() <= OWN_STORAGE_BYTES:
            out[k] = _own_storage(t)
    for k in keys:
        out[k] = out[first[ck.resolve(k).key]]
    return out


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the bytes it spans copied into a storage of its own at offset 0, strides kept.
    Byte for byte, so it works for every dtype (``clone`` has no copy kernel for some, e.g. int1)."""
    esz = t.element_size()
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) if t.numel() else 0
    start = t.storage_offset() * esz
    storage = torch.UntypedStorage(span * esz)
    if span:
        storage.copy_(t.untyped_storage()[start:start + span * esz])
    return torch.empty(0, dtype=t.dtype).set_(storage, 0, t.shape, t.stride())


def _adopted(ck: OpenCheckpoint, cpu: list[str]) -> dict[str, torch.Tensor]:
    """Views of the memory tier's pages for ``cpu`` (all of them), when ``ck`` may adopt them;
    else empty (copied instead)."""
    if ck.adoption is None or ck.adoption.refused or not cpu:
        return {}
    try:
        adopted = ck.adoption.tensors([ck.resolve(k) for k in cpu])
    except OSError as e:  # the file cannot be mapped for writing: copy, as without adoption
        log.info("nebula_ckpt: %s: copying instead of adopting the memory tier's pages (%s)", ck.where, e)
        ck.adoption.refused = True  # what an earlier group adopted is copied at the end of staging
        return {}
    return dict(zip(cpu, adopted, strict=True))


def _copy_group(ck: OpenCheckpoint, items: list[tuple[str, torch.Tensor]],
                first: dict[str, str]) -> dict[str, torch.Tensor]:
    """Owned copies of ``items`` (tree key, view; one dtype) as views of one new host buffer,
    copied a chunk at a time (source pages dropped, checksums compared, after each chunk)."""
    ops = get_ops()
    offsets, total = [], 0
    for _, v in items:
        offsets.append(total)
        total += -(-(v.numel() * v.element_size()) // 64) * 64
    # not pre-faulted: the copy threads fault the pages as they fill them,
    # so the buffer is written once, not zeroed first and then copied into
    buf = ops.alloc(total, prefault=False) if total else torch.empty(0, dtype=torch.uint8)
    at = {k: off for (k, _), off in zip(items, offsets, strict=True)}
    views = dict(items)
    for chunk in chunks([ck.resolve(k) for k, _ in items]):
        names = [first[r.key] for r in chunk]
        job = ops.enqueue_copy([views[n] for n in names], buf, [at[n] for n in names])
        job.wait()
        ck.drop(chunk)
        ck.verified_by_copy(chunk, job.checksums())
    out = {}
    for k, v in items:
        n = v.numel() * v.element_size()
        out[k] = buf[at[k]:at[k] + n].view(v.dtype).reshape(v.shape)
    return out
