"""The dtype tables of the format: torch dtypes by name, the storable ones, safetensors codes.

The manifest stores a tensor's dtype by name (``"bfloat16"``), the typed tree stores ``dtype``
leaves the same way, and a shard's safetensors header describes each tensor by its safetensors
code (dtypes safetensors lacks are stored as ``"U8"`` bytes).
"""

from __future__ import annotations

import torch

#: Every torch dtype by name (``"bfloat16"`` -> ``torch.bfloat16``): ``dtype`` leaves of the tree.
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_QUANTIZED = {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}
#: Dtypes a stored tensor may have: a byte size, not quantized (saving those is refused).
TENSOR_DTYPES: dict[str, torch.dtype] = {
    n: d for n, d in DTYPES.items() if n not in _QUANTIZED and getattr(d, "itemsize", 0) > 0}
#: torch dtype -> safetensors dtype code. Dtypes safetensors lacks are stored as ``"U8"`` bytes.
SAFETENSORS_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.complex64: "C64",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
}


def dtype_name(d: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the name the manifest stores)."""
    return str(d).removeprefix("torch.")
