"""A shard's storage info: how its bytes are stored (plain, or zstd frames), checked before use.

A backend that encodes what it writes records how in the manifest, per shard (``storage``):
``stored_bytes`` and, with ``compression: "zstd"``, the frame table ``[[raw_bytes,
stored_bytes], ...]`` (one zstd frame per upload part). That table comes from a file, so
:func:`~nebula_ckpt.storage.frame_table.frame_table` (the one validation of it, kept beside the
storage that writes the frames; used when a manifest is parsed and again when a remote object is
read against its real size) refuses anything a writer never writes before a
byte is allocated: non-integers, more frames than stored bytes, a frame of no stored byte, a
frame claiming more than zstd can expand to, stored sizes not summing to the object's.
"""

from __future__ import annotations

from typing import Any

from nebula_ckpt.format.checks import as_int, as_list, as_obj, bad, short
from nebula_ckpt.storage.frame_table import frame_table


def check_storage_info(info: Any, raw: int, where: str) -> dict[str, Any]:
    """Check a shard's storage info against its ``raw`` size (other keys belong to the backend
    and pass through); return it as a new dict.

    Raises:
        CorruptCheckpointError: naming ``where`` and the field.
    """
    info = dict(as_obj(info, where, "storage"))
    stored = as_int(info.get("stored_bytes", raw), where, "stored_bytes")
    comp = info.get("compression")
    if comp is None:
        if "frames" in info:
            raise bad(where, "frames given without compression")
        if stored != raw:
            raise bad(where, f"stored_bytes = {stored} but the shard has {raw} bytes uncompressed")
        return info
    if comp != "zstd":
        raise bad(where, f"compression {short(comp)} is unknown (this nebula_ckpt reads 'zstd')")
    frames = frame_table(as_list(info.get("frames"), where, "frames"), stored, where)
    total_raw = sum(r for r, _ in frames)
    if total_raw != raw:
        raise bad(where, f"frame table sums to {total_raw} raw bytes; the shard has {raw} raw bytes")
    return info
