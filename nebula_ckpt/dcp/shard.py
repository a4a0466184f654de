"""A rank's shard of a DCP save: its tensor items resolved, the safetensors image written.

Each tensor's CRC32C is taken before the write and checked again after it, with its version
counter: a tensor modified while it was written fails the save (nothing is committed).
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType

from nebula_ckpt.dcp.plans import GlobalPlanData, Stored, Written
from nebula_ckpt.dcp.values import manifest_key
from nebula_ckpt.errors import ConsistencyError, ValidationError
from nebula_ckpt.format.dtypes import TENSOR_DTYPES, dtype_name
from nebula_ckpt.format.header import safetensors_header
from nebula_ckpt.native import byte_view, get_ops, host_bytes
from nebula_ckpt.save.plan import placement_codes
from nebula_ckpt.storage.base import Storage


def crc32c(b: torch.Tensor) -> int:
    """CRC32C of a byte tensor (0 when empty)."""
    return get_ops().crc32c(b, [0], [b.numel()])[0] if b.numel() else 0


def placements_of(obj: Any, fqn: str, item: WriteItem, world: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Placements and mesh shape of the DTensor behind a SHARD item (derived from the chunk for
    other sharded tensors: ``S(d)`` on the first dimension it does not span, over ``world``)."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        codes = placement_codes(obj.placements, f"NebulaStorageWriter: state key '{fqn}'")
        return codes, tuple(int(n) for n in obj.device_mesh.shape)
    td = item.tensor_data
    assert td is not None and td.chunk is not None
    dims = [d for d, (n, g) in enumerate(zip(td.chunk.sizes, td.size, strict=True)) if n != g]
    return (f"S({dims[0]})" if dims else "R",), (max(1, world),)


def tensor_parts(plan: SavePlan, planner: SavePlanner, info: GlobalPlanData,
                 paths: dict[str, tuple[Any, ...]], shard: dict[str, Any],
                 out: list[tuple[WriteItem, Written, int]]) -> list[Stored]:
    """Resolve the tensor items: ``(key, record, source bytes, version)`` of each tensor stored;
    appends every item's result to ``out`` (records are completed when the shard is written)."""
    objects = getattr(planner, "state_dict", None)
    stored: list[Stored] = []
    tied: dict[tuple[Any, ...], str] = {}
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO:
            continue
        fqn = item.index.fqn
        td = item.tensor_data
        assert td is not None and td.chunk is not None
        t = planner.resolve_data(item)
        if not isinstance(t, torch.Tensor):
            raise ValidationError(f"NebulaStorageWriter: state key '{fqn}': the planner resolved a tensor item "
                                  f"to a {type(t).__name__}")
        if type(t).__name__ == "DTensor":
            t = t.to_local()  # type: ignore[attr-defined]
        sizes = tuple(int(n) for n in td.chunk.sizes)
        if tuple(t.shape) != sizes:
            raise ValidationError(f"NebulaStorageWriter: state key '{fqn}': the planner resolved a tensor of shape "
                                  f"{list(t.shape)} for a chunk of shape {list(sizes)}")
        if t.dtype != td.properties.dtype:
            raise ValidationError(f"NebulaStorageWriter: state key '{fqn}': the tensor is {t.dtype}, its item "
                                  f"says {td.properties.dtype}")
        if t.layout != torch.strided or t.is_quantized or getattr(t, "is_nested", False) or \
                t.device.type == "meta":
            raise ValidationError(f"NebulaStorageWriter: state key '{fqn}': {t.layout} / quantized / nested / "
                                  "meta tensors cannot be stored; convert it to a dense tensor with data")
        offsets = tuple(int(o) for o in td.chunk.offsets)
        key = manifest_key(fqn, paths)
        rec: dict[str, Any] = {"dtype": dtype_name(t.dtype), "shape": list(sizes),
                               "device": f"cuda:{t.get_device()}" if t.is_cuda else "cpu"}
        if item.type == WriteItemType.SHARD:
            obj = objects.get(fqn) if isinstance(objects, dict) else None
            placements, mesh = placements_of(obj, fqn, item, info.world)
            rec["dtensor"] = {"shape": [int(n) for n in td.size], "offsets": list(offsets),
                              "placements": list(placements), "mesh": list(mesh)}
        n = t.numel() * t.element_size()
        # x.conj() and x.neg() views share x's memory but not its values: never tied to x.
        ident = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.is_conj(), t.is_neg(), t.device,
                 json.dumps(rec, sort_keys=True)) if n else None
        first = tied.get(ident) if ident is not None else None
        if first is not None:  # tied to a tensor this rank stores already: stored once
            out.append((item, Written(info.save_id, info.rank, fqn, offsets, key, None, first, None, shard), n))
            continue
        if ident is not None:
            tied[ident] = key
        data = byte_view(t.cpu())  # a view of a contiguous CPU tensor
        stored.append((key, rec, data, data._version))
        out.append((item, Written(info.save_id, info.rank, fqn, offsets, key, rec, None, None, shard), n))
    return stored

def write_shard(storage: Storage, rel: str, tensors: list[Stored], where: str) -> dict[str, Any]:
    """The rank's safetensors image, written straight from the tensors' memory and fsync'd;
    each tensor's CRC32C is taken before the write and checked again after it."""
    order = sorted(range(len(tensors)), key=lambda i: -TENSOR_DTYPES[tensors[i][1]["dtype"]].itemsize)
    head, spans = safetensors_header([(tensors[i][0], TENSOR_DTYPES[tensors[i][1]["dtype"]],
                                       tuple(tensors[i][1]["shape"]), tensors[i][2].numel()) for i in order])
    parts: list[memoryview] = [memoryview(head)]
    for i, (a, b) in zip(order, spans, strict=True):
        key, rec, data, _ = tensors[i]
        rec["offsets"] = [len(head) + a, len(head) + b]
        rec["crc32c"] = crc32c(data)
        if data.numel():
            parts.append(host_bytes(data))  # not data.numpy(): the user's tensor stays resizable
    nbytes = len(head) + (spans[-1][1] if spans else 0)
    storage_info = storage.write_parts(rel, parts)
    for key, rec, data, version in tensors:  # a tensor changed while written: its bytes may not match
        if crc32c(data) != rec["crc32c"] or data._version != version:
            raise ConsistencyError(f"{where}: tensor '{key}' was modified while it was being written; "
                                   "the save is abandoned (nothing is committed)")
    return {"bytes": nbytes, "storage": storage_info}
