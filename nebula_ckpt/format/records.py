"""The typed records of a manifest: a shard file, a stored tensor, a DTensor's local shard.

Each record is parsed from the manifest's JSON by its ``parse``, which checks every field (types,
dtypes, shapes against byte ranges, ranges against their shard, shard file names, placements)
and raises :class:`~nebula_ckpt.errors.CorruptCheckpointError` naming the field; readers use only
these records, never the raw JSON. ``to_json`` gives back what the writer writes.
"""

from __future__ import annotations

import json
import math
import re
import types
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from nebula_ckpt.format.checks import (
    MAX_INT64,
    MAX_NDIM,
    as_int,
    as_list,
    as_obj,
    as_step,
    as_str,
    bad,
    only_fields,
    short,
)
from nebula_ckpt.format.dtypes import TENSOR_DTYPES
from nebula_ckpt.format.names import is_shard_name
from nebula_ckpt.format.storage_info import check_storage_info

_PLACEMENT_RE = re.compile(r"R|S\((0|[1-9][0-9]?)\)")
_DEVICE_RE = re.compile(r"(cpu|cuda)(:(0|[1-9][0-9]{0,3}))?")


def as_shape(v: Any, where: str, name: str = "shape") -> tuple[int, ...]:
    """``v`` as a tensor shape torch can build: at most :data:`MAX_NDIM` dimensions, each an
    int64, whose nonzero ones multiply to an int64. Torch multiplies a shape's sizes (the element
    count) and strides one by one and refuses an overflow on the way, even for a shape with a zero
    dimension, whose tensor is empty: ``[2**62, 2**62, 0]`` is no shape of any tensor."""
    shape = as_list(v, where, name)
    if len(shape) > MAX_NDIM:
        raise bad(where, f"{name} has {len(shape)} dimensions (at most {MAX_NDIM})")
    dims = tuple(as_int(x, where, f"{name}[{i}]", hi=MAX_INT64) for i, x in enumerate(shape))
    if math.prod(max(n, 1) for n in dims) > MAX_INT64:
        raise bad(where, f"{name} {short(list(dims))}: its nonzero dimensions multiply to more than 2**63-1, "
                  "which no torch tensor has (its element count or strides overflow int64)")
    return dims


@dataclass(frozen=True)
class ShardRecord:
    """One shard file of a checkpoint: its validated plain name, raw size and storage info.

    ``step``: None for a file of the checkpoint's own folder; in an incremental checkpoint, the
    earlier step whose folder (on the same tier) holds the file, always the step that physically
    holds it (:mod:`nebula_ckpt.format.commit`).
    """

    file: str
    bytes: int
    storage: Optional[Mapping[str, Any]] = None
    step: Optional[int] = None

    def folder_step(self, own: int) -> int:
        """The step whose folder holds this file, in a checkpoint of step ``own``."""
        return own if self.step is None else self.step

    @property
    def stored_bytes(self) -> int:
        """Bytes the file takes in storage (differs from ``bytes`` when compressed)."""
        return int((self.storage or {}).get("stored_bytes", self.bytes))

    def to_json(self) -> dict[str, Any]:
        """The manifest's JSON object for this shard."""
        out: dict[str, Any] = {"file": self.file, "bytes": self.bytes}
        if self.storage is not None:
            out["storage"] = json.loads(json.dumps(dict(self.storage)))
        if self.step is not None:
            out["step"] = self.step
        return out

    @staticmethod
    def parse(d: Any, where: str) -> "ShardRecord":
        """Validate one entry of ``shards``; raise :class:`CorruptCheckpointError` naming the field."""
        d = as_obj(d, where, "the shard entry")
        only_fields(d, ("file", "bytes", "storage", "step"), where, "the shard entry")
        name = as_str(d.get("file"), where, "file")
        if not is_shard_name(name):
            raise bad(where, f"file {short(name)} is not a shard name of this format "
                       "(shard-g<G>-r<R>.safetensors, a plain name inside the step folder)")
        n = as_int(d.get("bytes"), where, "bytes")
        if n < 8:
            raise bad(where, f"bytes = {n}: a shard holds at least its 8-byte header length")
        info = d.get("storage")
        if info is not None:
            info = types.MappingProxyType(check_storage_info(info, n, f"{where}.storage"))
        ref = None if "step" not in d else as_step(d["step"], where)
        return ShardRecord(name, n, info, ref)


@dataclass(frozen=True)
class DTensorInfo:
    """Where a DTensor's local shard lies in the global tensor (``dtensor`` of a tensor record)."""

    shape: tuple[int, ...]           # global shape
    offsets: tuple[int, ...]         # offsets of this shard in the global tensor
    placements: tuple[str, ...]      # "R" (replicate) or "S(d)" (shard on dim d), one per mesh dim
    mesh: tuple[int, ...]            # mesh shape

    def to_json(self) -> dict[str, Any]:
        """The manifest's JSON object."""
        return {"shape": list(self.shape), "offsets": list(self.offsets),
                "placements": list(self.placements), "mesh": list(self.mesh)}

    @staticmethod
    def parse(d: Any, local: tuple[int, ...], where: str) -> "DTensorInfo":
        """Validate against the local shard's shape ``local``."""
        d = as_obj(d, where, "dtensor")
        only_fields(d, ("shape", "offsets", "placements", "mesh"), where, "dtensor")
        shape = as_shape(d.get("shape"), where, "dtensor.shape")
        offs = tuple(as_int(x, where, "dtensor.offsets[]", hi=MAX_INT64)
                     for x in as_list(d.get("offsets"), where, "dtensor.offsets"))
        if len(shape) != len(local) or len(offs) != len(local):
            raise bad(where, f"dtensor shape {list(shape)} / offsets {list(offs)} do not match the local "
                       f"shard's {len(local)} dimensions")
        for i, (g, o, n) in enumerate(zip(shape, offs, local, strict=True)):
            if o + n > g:
                raise bad(where, f"dtensor dimension {i}: the shard [{o}, {o + n}) lies outside the global size {g}")
        pl = tuple(as_str(x, where, "dtensor.placements[]") for x in as_list(d.get("placements"), where,
                                                                             "dtensor.placements"))
        mesh = tuple(as_int(x, where, "dtensor.mesh[]", lo=1, hi=2**31) for x in as_list(d.get("mesh"), where,
                                                                                     "dtensor.mesh"))
        if len(pl) != len(mesh) or not mesh or len(mesh) > MAX_NDIM:
            raise bad(where, f"dtensor has {len(pl)} placements for a mesh of shape {list(mesh)}")
        for p in pl:
            if not _PLACEMENT_RE.fullmatch(p) or (p != "R" and int(p[2:-1]) >= len(local)):
                raise bad(where, f"dtensor placement {short(p)} is not 'R' or 'S(<dim>)' of this tensor")
        if all(p == "R" for p in pl) and (offs != (0,) * len(local) or shape != local):
            raise bad(where, f"dtensor is replicated (placements {list(pl)}), but its shard {list(local)} at "
                       f"{list(offs)} is not the whole global tensor {list(shape)}")
        return DTensorInfo(shape, offs, pl, mesh)


@dataclass(frozen=True)
class TensorRecord:
    """One stored tensor: dtype, shape and where its bytes lie (``[start, end)`` of shard ``shard``)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int
    crc32c: int
    device: str = "cpu"
    shard: int = 0
    dtensor: Optional[DTensorInfo] = None

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        return self.end - self.start

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype as a ``torch.dtype``."""
        return TENSOR_DTYPES[self.dtype]

    def to_json(self) -> dict[str, Any]:
        """The manifest's JSON object for this tensor (``shard`` only when not 0)."""
        out: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape),
                               "offsets": [self.start, self.end], "crc32c": self.crc32c,
                               "device": self.device}
        if self.shard:
            out["shard"] = self.shard
        if self.dtensor is not None:
            out["dtensor"] = self.dtensor.to_json()
        return out

    @staticmethod
    def parse(key: str, d: Any, shards: tuple[ShardRecord, ...], where: str) -> "TensorRecord":
        """Validate one tensor entry against its shard; raise naming the key and the field."""
        d = as_obj(d, where, "the tensor entry")
        only_fields(d, ("dtype", "shape", "offsets", "crc32c", "device", "shard", "dtensor"), where, "the tensor entry")
        if not shards:
            raise bad(where, "refers to a shard, but the manifest lists none")
        si = as_int(d.get("shard", 0), where, "shard", hi=len(shards) - 1)
        dtype = as_str(d.get("dtype"), where, "dtype")
        if dtype not in TENSOR_DTYPES:
            raise bad(where, f"dtype {short(dtype)} is not a storable torch dtype")
        dims = as_shape(d.get("shape"), where)
        offs = as_list(d.get("offsets"), where, "offsets")
        if len(offs) != 2:
            raise bad(where, "offsets must be [start, end]")
        size = shards[si].bytes
        start, end = as_int(offs[0], where, "offsets[0]", hi=size), as_int(offs[1], where, "offsets[1]", hi=size)
        want = math.prod(dims) * TENSOR_DTYPES[dtype].itemsize
        if end - start != want:
            raise bad(where, f"offsets [{start}, {end}) hold {end - start} bytes, but {dtype} "
                       f"{short(list(dims))} needs {want} (shard {shards[si].file} has {size} bytes)")
        if want and start % TENSOR_DTYPES[dtype].itemsize:
            raise bad(where, f"offset {start} is not aligned to the {dtype} element size")
        device = as_str(d.get("device", "cpu"), where, "device")
        if not _DEVICE_RE.fullmatch(device):
            raise bad(where, f"device {short(device)} is not 'cpu', 'cuda' or 'cuda:<n>'")
        crc = as_int(d.get("crc32c"), where, "crc32c", hi=2**32 - 1)
        dt = None if d.get("dtensor") is None else DTensorInfo.parse(d["dtensor"], dims, where)
        return TensorRecord(key, dtype, dims, start, end, crc, device, si, dt)
