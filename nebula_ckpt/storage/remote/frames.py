"""zstd framing of remote objects, and the checks that make storage info safe to act on.

With ``compression="zstd"`` each upload part is compressed on its own (one zstd frame), so
parts stay parallel both ways. The frame table ``[[raw_len, stored_len], ...]`` goes into the
manifest as the object's storage info; restore reads each frame with a ranged read and
decompresses it straight into its raw offset.

The storage info comes from a file, so :func:`plan_read` validates it against the object's
real size *before* a byte is allocated: every number a non-negative int within bounds, the
frame table as :func:`~nebula_ckpt.storage.frame_table.frame_table` checks it (frame count
bounded by the object size, stored lengths summing to it, no frame claiming more than zstd can
possibly expand to), raw lengths summing to the recorded / expected raw size. A 181-byte object
cannot make a restore allocate 1.5 GiB.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

from nebula_ckpt.storage.frame_table import frame_table
from nebula_ckpt.storage.remote.errors import StorageInfoError
from nebula_ckpt.workers import Workers

_MiB = 1 << 20
#: no object (raw or stored) is larger than this (1 PiB): a sanity bound on every number
MAX_OBJECT_BYTES = 1 << 50


def zstd_module() -> Any:
    """The ``zstandard`` module.

    Raises:
        ImportError: not installed (the message says how to install it).
    """
    try:
        import zstandard
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("compression='zstd' needs the 'zstandard' package: pip install zstandard "
                          "(or pip install 'nebula_ckpt[zstd]')") from e
    return zstandard


def compressor(level: int) -> Callable[[memoryview], bytes]:
    """A function compressing one part into one zstd frame (thread-safe: one context per call)."""
    zstd = zstd_module()

    def compress(view: memoryview) -> bytes:
        return zstd.ZstdCompressor(level=level).compress(view)

    return compress


class _ViewWriter:
    """Minimal writable file object that fills a fixed memoryview (decompression target)."""

    def __init__(self, target: memoryview) -> None:
        self._mv = target
        self.pos = 0

    def write(self, b: Any) -> int:
        n = len(b)
        if self.pos + n > len(self._mv):
            raise ValueError("decompressed data is larger than the frame table says")
        self._mv[self.pos:self.pos + n] = b
        self.pos += n
        return n

    def flush(self) -> None:
        pass


def decompress_into(frame: bytes, target: memoryview) -> Optional[str]:
    """Decompress one zstd frame into ``target`` (exactly its raw length, as the frame table says).

    The frame is input: the raw size its header declares must be ``len(target)`` (a frame
    declaring more, a bomb of zeros spliced in, is refused before a byte is decompressed), and
    what it decompresses to is bounded by ``target`` all the same (a frame that declares no size,
    or holds more frames after it, is refused at the first byte past ``target``, never buffered).

    Returns:
        ``None`` on success, else what is wrong (for the caller's error message).
    """
    zstd = zstd_module()
    w = _ViewWriter(target)
    try:
        declared = zstd.frame_content_size(frame)  # -1: not declared
        if declared not in (-1, len(target)):
            return f"declares {declared} raw bytes, the frame table {len(target)}; not a frame of this object"
        with zstd.ZstdDecompressor().stream_writer(w, write_size=_MiB, closefd=False) as d:
            d.write(frame)
    except (zstd.ZstdError, ValueError) as e:
        return f"is corrupt ({e})"
    if w.pos != len(target):
        return f"gave {w.pos} bytes, expected {len(target)}"
    return None


@dataclass(frozen=True)
class ReadTask:
    """One ranged read: ``stored_len`` bytes at ``stored_off`` fill ``raw_len`` at ``raw_off``."""

    stored_off: int
    stored_len: int
    raw_off: int
    raw_len: int


@dataclass(frozen=True)
class ReadPlan:
    """How to read one object: its raw size and the ranged reads that fill it.

    Attributes:
        raw_bytes: size of the buffer to allocate (validated).
        compressed: whether each task's bytes are one zstd frame.
        tasks: the ranged reads, in object order.
    """

    raw_bytes: int
    compressed: bool
    tasks: list[ReadTask]


def _count(value: Any, what: str, where: str, limit: int = MAX_OBJECT_BYTES) -> int:
    """``value`` if it is an int in ``[0, limit]`` (bools and floats are refused)."""
    if type(value) is not int or not 0 <= value <= limit:
        raise StorageInfoError(f"{where}: storage info field {what}={value!r:.80} is not an "
                               f"integer in [0, {limit}]; the manifest is damaged or was not "
                               f"written by nebula_ckpt (restore an older step)")
    return value


def _zstd_tasks(frames: Any, object_size: int, where: str) -> list[ReadTask]:
    """Read tasks of a zstd frame table, validated against the object's real size
    (:func:`~nebula_ckpt.storage.frame_table.frame_table`, the one check of frame tables)."""
    tasks: list[ReadTask] = []
    soff = roff = 0
    for raw, stored in frame_table(frames, object_size, where, StorageInfoError):
        tasks.append(ReadTask(soff, stored, roff, raw))
        soff += stored
        roff += raw
    return tasks


def plan_read(info: Optional[dict[str, Any]], object_size: int, where: str, *,
              part_bytes: int, concurrency: int, expected_bytes: Optional[int] = None) -> ReadPlan:
    """Validate ``info`` against the object and plan its ranged reads (nothing allocated yet).

    Args:
        info: storage info from the manifest (what ``write_buffer`` returned), or None.
        object_size: the object's real size (from the store).
        where: tier URL and object, for messages.
        part_bytes: largest ranged read of an uncompressed object.
        concurrency: ranges in flight; mid-sized objects are split so every slot works.
        expected_bytes: the raw size the caller expects (e.g. the manifest's shard size).

    Returns:
        The validated :class:`ReadPlan`.

    Raises:
        StorageInfoError: ``info`` is malformed or contradicts the object / ``expected_bytes``.
    """
    info = info if info is not None else {}
    if not isinstance(info, dict):
        raise StorageInfoError(f"{where}: storage info is {type(info).__name__}, not an object")
    comp = info.get("compression")
    if comp not in (None, "zstd"):
        raise StorageInfoError(f"{where}: unknown compression {comp!r:.40} in storage info "
                               f"(this version reads None or 'zstd')")
    if "stored_bytes" in info and _count(info["stored_bytes"], "stored_bytes", where) != object_size:
        raise StorageInfoError(f"{where}: the object has {object_size} bytes but its storage info "
                               f"says stored_bytes={info['stored_bytes']}; the object was replaced "
                               f"or truncated, or the manifest is damaged")
    if comp == "zstd":
        tasks = _zstd_tasks(info.get("frames"), object_size, where)
        raw_total = sum(t.raw_len for t in tasks)
    else:
        raw_total = object_size
        part = max(1, min(part_bytes, max(16 * _MiB, math.ceil(object_size / max(1, concurrency)))))
        tasks = [ReadTask(off, min(part, object_size - off), off, min(part, object_size - off))
                 for off in range(0, object_size, part)]
    for what, want in (("raw_bytes", info.get("raw_bytes")), ("expected size", expected_bytes)):
        if want is not None and _count(want, what, where) != raw_total:
            raise StorageInfoError(f"{where}: storage info decodes to {raw_total} bytes, but the "
                                   f"{what} is {want}; the manifest is damaged")
    if raw_total > MAX_OBJECT_BYTES:
        raise StorageInfoError(f"{where}: storage info decodes to {raw_total} bytes, more than "
                               f"{MAX_OBJECT_BYTES}; the manifest is damaged")
    return ReadPlan(raw_total, comp == "zstd", tasks)


def download(plan: ReadPlan, fetch: Callable[[ReadTask], bytes], concurrency: int,
             corrupt: Callable[[str, str], BaseException]) -> memoryview:
    """Allocate the planned buffer and fill it with parallel ranged reads.

    Args:
        plan: the validated plan (:func:`plan_read`).
        fetch: one ranged read (with its retries): the stored bytes of a task.
        concurrency: ranges in flight.
        corrupt: builds the error for ``(message, op)`` when bytes do not match the plan.

    Returns:
        A writable memoryview over a ``bytearray`` holding the raw bytes.
    """
    out = memoryview(bytearray(plan.raw_bytes))

    def one(t: ReadTask) -> None:
        blob = fetch(t)
        if len(blob) != t.stored_len:
            raise corrupt(f"short read at offset {t.stored_off} ({len(blob)} of {t.stored_len} "
                          f"bytes); the object is smaller than its manifest says", "read")
        target = out[t.raw_off:t.raw_off + t.raw_len]
        if not plan.compressed:
            target[:] = blob
            return
        problem = decompress_into(blob, target)
        if problem is not None:
            raise corrupt(f"zstd frame at raw offset {t.raw_off} {problem}", "decompress")

    if len(plan.tasks) <= 1:
        for task in plan.tasks:
            one(task)
        return out
    with Workers(max_workers=min(concurrency, len(plan.tasks)),
                            thread_name_prefix="nebula-remote-down") as pool:
        futures = [pool.submit(one, t) for t in plan.tasks]
        try:
            for f in futures:
                f.result()
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return out
