"""A shard's storage info: how its bytes are stored (plain, or zstd frames), checked before use.

A backend that encodes what it writes records how in the manifest, per shard (``storage``):
``stored_bytes`` and, with ``compression: "zstd"``, the frame table ``[[raw_bytes,
stored_bytes], ...]`` (one zstd frame per upload part). That table comes from a file, so
:func:`frame_table` (the one validation of it, used when a manifest is parsed and again when a
remote object is read against its real size) refuses anything a writer never writes before a
byte is allocated: non-integers, more frames than stored bytes, a frame of no stored byte, a
frame claiming more than zstd can expand to, stored sizes not summing to the object's.
"""

from __future__ import annotations

from typing import Any, Callable

from nebula_ckpt.errors import CorruptCheckpointError
from nebula_ckpt.format.checks import MAX_BYTES, as_int, as_list, as_obj, bad, short

#: zstd's densest block is an RLE block: a 3-byte header plus 1 byte for up to 128 KiB, so no
#: frame decompresses to more than 32768 times its stored size
ZSTD_MAX_RATIO = (128 << 10) // 4
#: at most this many frames per object (a table this long is ~20 MB of JSON)
MAX_FRAMES = 1_000_000


def _count(value: Any, what: str, where: str, limit: int, error: Callable[[str], Exception]) -> int:
    if type(value) is not int or not 0 <= value <= limit:
        raise error(f"{where}: storage info field {what}={value!r:.80} is not an integer in [0, {limit}]; "
                    "the manifest is damaged or was not written by nebula_ckpt")
    return value


def frame_table(frames: Any, stored_bytes: int, where: str,
                error: Callable[[str], Exception] = CorruptCheckpointError) -> list[tuple[int, int]]:
    """The validated ``(raw_bytes, stored_bytes)`` of each zstd frame of an object of
    ``stored_bytes`` bytes (the frames' stored sizes must sum to it).

    Args:
        frames: the ``frames`` of the storage info, as read.
        stored_bytes: the object's stored size (recorded, or the object's real size).
        where: names the file / object in errors.
        error: builds the exception from the message (default :class:`CorruptCheckpointError`).

    Raises:
        what ``error`` builds, naming ``where`` and the frame.
    """
    if type(frames) is not list:
        raise error(f"{where}: storage info 'frames' is {type(frames).__name__}, not a list of "
                    "[raw_bytes, stored_bytes]")
    # every frame holds at least one stored byte: an object of n bytes has at most n frames
    if len(frames) > min(MAX_FRAMES, max(1, stored_bytes)):
        raise error(f"{where}: storage info lists {len(frames)} zstd frames for an object of "
                    f"{stored_bytes} bytes; the manifest is damaged")
    out: list[tuple[int, int]] = []
    total = 0
    for i, pair in enumerate(frames):
        if type(pair) is not list or len(pair) != 2:
            raise error(f"{where}: zstd frame {i} is {pair!r:.80}, not [raw_bytes, stored_bytes]")
        raw = _count(pair[0], f"frames[{i}].raw_bytes", where, MAX_BYTES, error)
        stored = _count(pair[1], f"frames[{i}].stored_bytes", where, stored_bytes, error)
        if stored == 0 or raw > stored * ZSTD_MAX_RATIO:
            raise error(f"{where}: zstd frame {i}: {raw} raw bytes cannot come from {stored} stored "
                        "bytes (more than zstd can expand to); the manifest is damaged")
        out.append((raw, stored))
        total += stored
    if total != stored_bytes:
        raise error(f"{where}: zstd frames hold {total} stored bytes but the object has {stored_bytes}; "
                    "the object was replaced or truncated, or the manifest is damaged")
    return out


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
