"""The zstd frame table of a stored object, checked before use: the one validation of it.

A remote backend that compresses (:mod:`nebula_ckpt.storage.remote.frames`) writes each upload
part as one zstd frame and describes the object by its frame table ``[[raw_bytes, stored_bytes],
...]``, which the manifest keeps as the shard's storage info. That table comes from a file, so
:func:`frame_table` refuses anything a writer never writes before a byte is allocated: when a
manifest is parsed (:mod:`nebula_ckpt.format.storage_info`) and again when a remote object is
read against its real size.
"""

from __future__ import annotations

from typing import Any, Callable

from nebula_ckpt.errors import CorruptCheckpointError

#: no frame holds more raw bytes than any size a record may give (``format.checks.MAX_BYTES``)
MAX_RAW_BYTES = 1 << 62
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
        raw = _count(pair[0], f"frames[{i}].raw_bytes", where, MAX_RAW_BYTES, error)
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
