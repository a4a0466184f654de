"""The safetensors header of a shard: what makes every shard file openable by any safetensors tool.

A shard is an 8-byte little-endian header length, the JSON header (padded with spaces so the
tensor data starts on an :data:`ALIGN` boundary), then the tensors back to back. The header's
``__metadata__`` names the writer and the format version; each tensor has its safetensors dtype
code, shape and ``data_offsets`` relative to the data start (dtypes safetensors lacks are
described as ``"U8"`` bytes).
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch

from nebula_ckpt.format.dtypes import SAFETENSORS_CODES
from nebula_ckpt.format.names import SINGLE_VERSION

#: tensor data starts on a multiple of this many bytes
ALIGN = 4096
#: tensor keys safetensors reserves for itself
RESERVED_KEYS = frozenset({"__metadata__"})


def safetensors_header(items: list[tuple[str, torch.dtype, tuple[int, ...], int]]
                       ) -> tuple[bytes, list[tuple[int, int]]]:
    """The header of a safetensors image holding ``items`` (key, dtype, shape, bytes) back to back,
    in this order: 8-byte length + JSON padded so the data starts on an :data:`ALIGN` boundary,
    and each item's ``[start, end)`` relative to the data start. Dtypes safetensors lacks are
    described as ``"U8"`` bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "writer": "nebula_ckpt",
                                               "nebula_format": str(SINGLE_VERSION)}}
    pos = 0
    spans = []
    for k, dtype, shape, n in items:
        st = SAFETENSORS_CODES.get(dtype)
        header[k] = {"dtype": st or "U8", "shape": list(shape) if st else [n], "data_offsets": [pos, pos + n]}
        spans.append((pos, pos + n))
        pos += n
    js = json.dumps(header, separators=(",", ":")).encode()
    data_start = -(-(8 + len(js)) // ALIGN) * ALIGN
    js += b" " * (data_start - 8 - len(js))
    return struct.pack("<Q", len(js)) + js, spans


def data_start(head: "bytes | memoryview") -> int:
    """Where tensor data starts in a shard whose first 8 bytes are ``head``: 8 + the header length
    they hold (unchecked: :meth:`~nebula_ckpt.format.manifest.Manifest.check_data_start` checks it)."""
    return 8 + int.from_bytes(bytes(head[:8]), "little")
