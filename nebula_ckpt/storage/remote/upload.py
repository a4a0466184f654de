"""Upload streams, part sizing and the parallel multi-part upload pipeline.

A backend says *how* one object goes up through a :class:`Sink` (one request, or parts then a
commit); :class:`PartUpload` runs the pipeline the same way for every backend: cut the caller's
buffer into parts (zero-copy slices), optionally compress them in parallel, coalesce parts
below the backend's minimum, keep at most ``concurrency`` parts in flight, retry each part on
its own, stop the siblings when one fails, and abort the upload on any failure.
"""

from __future__ import annotations

import io
import math
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, TypeVar, Union

from nebula_ckpt.storage.remote.errors import RemoteStorageError
from nebula_ckpt.storage.remote.retry import Attempt
from nebula_ckpt.workers import Workers

T = TypeVar("T")
_MiB = 1 << 20


class ViewReader(io.RawIOBase):
    """Read-only, seekable file object over a buffer, without copying it.

    botocore accepts ``bytes``/``bytearray``/file objects as a request body but not a
    ``memoryview``; this reader lets an upload part stream straight from a slice of the
    caller's staging buffer (aiohttp reads it in small chunks).
    """

    def __init__(self, data: Union[bytes, bytearray, memoryview]) -> None:
        super().__init__()
        self._mv = memoryview(data).cast("B") if not isinstance(data, memoryview) else data
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos}.get(whence, len(self._mv))
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: Any) -> int:
        n = min(len(b), len(self._mv) - self._pos)
        if n <= 0:
            return 0
        b[:n] = self._mv[self._pos:self._pos + n]
        self._pos += n
        return n

    def read(self, size: Optional[int] = -1) -> bytes:
        end = len(self._mv) if size is None or size < 0 else min(len(self._mv), self._pos + size)
        out = bytes(self._mv[self._pos:end])
        self._pos = max(self._pos, end)
        return out

    def __len__(self) -> int:
        return len(self._mv)


def byte_view(data: Any) -> memoryview:
    """``data`` as a flat, contiguous, unsigned-byte memoryview (no copy).

    Raises:
        ValueError: ``data`` is not contiguous.
    """
    mv = data if isinstance(data, memoryview) else memoryview(data)
    if not mv.contiguous:
        raise ValueError("write_buffer needs a contiguous buffer")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


@dataclass(frozen=True)
class PartLimits:
    """A service's limits on multi-part uploads (0: no limit)."""

    min_part: int = 0
    max_parts: int = 0
    max_part: int = 0

    def part_size(self, n: int, part_bytes: int, concurrency: int) -> int:
        """Part size for an ``n``-byte object: split mid-sized objects across every upload
        slot, never into tiny parts, within the service's limits."""
        part = max(1, min(part_bytes, max(8 * _MiB, math.ceil(n / max(1, concurrency)))))
        if self.max_parts:
            part = max(part, math.ceil(n / self.max_parts))
        part = max(part, self.min_part)
        return min(part, self.max_part) if self.max_part else part


def in_order(pool: Workers, fn: Callable[[Any], T], items: Iterable[Any],
             window: int, stop: threading.Event) -> Iterator[T]:
    """``map(fn, items)`` on ``pool`` with at most ``window`` results pending, yielded in order."""
    pending: list[Future] = []
    try:
        for item in items:
            if stop.is_set():
                break
            pending.append(pool.submit(fn, item))
            if len(pending) >= window:
                yield pending.pop(0).result()
        while pending and not stop.is_set():
            yield pending.pop(0).result()
    finally:
        for f in pending:
            f.cancel()


def coalesce(chunks: Iterable[Any], min_size: int) -> Iterator[Any]:
    """Concatenate consecutive chunks until each output is >= ``min_size`` (but the last).

    Chunks already large enough pass through without a copy.
    """
    if min_size <= 0:
        yield from chunks
        return
    buf: Optional[bytearray] = None
    for c in chunks:
        if buf is None and len(c) >= min_size:
            yield c
            continue
        if buf is None:
            buf = bytearray()
        buf += c
        if len(buf) >= min_size:
            yield buf
            buf = None
    if buf is not None:
        yield buf


class Sink:
    """How one object is uploaded: whole in one request, or as parts then a commit.

    One sink per object and upload. ``put_part`` may be called from several threads at once
    when ``parallel``; the other methods from the uploading thread only.
    """

    #: every part but the last must be at least this long
    min_part = 0
    #: parts can be uploaded concurrently, and each retried on its own
    parallel = True

    def put_single(self, body: Any, attempt: Attempt) -> None:
        """Upload the whole object in one request."""
        raise NotImplementedError

    def begin(self, attempt: Attempt) -> None:
        """Start a multi-part upload."""

    def put_part(self, index: int, body: Any, attempt: Attempt) -> Any:
        """Upload part ``index`` (0-based); returns a token for :meth:`complete`."""
        raise NotImplementedError

    def complete(self, tokens: list[Any], stored_bytes: int, attempt: Attempt) -> None:
        """Publish the object from the uploaded parts."""
        raise NotImplementedError

    def abort(self) -> None:
        """Best-effort cleanup of an unfinished upload."""


#: ``retry(op, fn, abort)``: run ``fn(attempt)`` under the tier's retry policy
Retry = Callable[[str, Callable[[Attempt], Any], Optional[threading.Event]], Any]


class PartUpload:
    """The multi-part upload of one object (see the module docstring).

    Memory bound: at most ``concurrency`` compressed frames pending plus ``concurrency`` parts
    in flight (uncompressed parts are slices of the caller's buffer: no copy at all).

    Args:
        sink: the backend's way of uploading this object.
        mv: the object's bytes.
        part: part size (before compression).
        concurrency: parts in flight.
        compress: compresses one part into one frame, or None.
        retry: the tier's retry runner.
        abandoned: builds the error of a part given up because a sibling failed.
        on_part: called as ``on_part(index)`` after each accepted part.
    """

    def __init__(self, sink: Sink, mv: memoryview, part: int, concurrency: int,
                 compress: Optional[Callable[[memoryview], bytes]], retry: Retry,
                 abandoned: Callable[[], RemoteStorageError],
                 on_part: Callable[[int], None]) -> None:
        self.sink, self.mv, self.conc = sink, mv, concurrency
        self.ranges = [(off, min(part, len(mv) - off)) for off in range(0, len(mv), part)]
        self.compress, self.retry = compress, retry
        self.abandoned, self.on_part = abandoned, on_part
        self.failed = threading.Event()
        #: ``[raw_len, stored_len]`` per frame when compressed
        self.frames: list[list[int]] = []
        self.stored = 0

    def _chunks(self, pool: Workers) -> Iterator[Any]:
        """The stored bodies in order: slices of ``mv``, or compressed frames."""
        if self.compress is None:
            for off, ln in self.ranges:
                yield self.mv[off:off + ln]
            return
        compress = self.compress
        views = [self.mv[off:off + ln] for off, ln in self.ranges]
        for (_, ln), blob in zip(self.ranges, in_order(pool, compress, views, self.conc, self.failed), strict=False):
            self.frames.append([ln, len(blob)])
            yield blob

    def _upload_one(self, index: int, body: Any) -> Any:
        if self.failed.is_set():
            raise self.abandoned()
        try:
            token = self.retry(f"upload part {index + 1}",
                               lambda attempt: self.sink.put_part(index, body, attempt), self.failed)
        except BaseException:
            self.failed.set()
            raise
        self.on_part(index)
        return token

    def _submit_all(self, pool: Workers) -> list[Any]:
        """Feed the parts to the pool (``conc`` in flight); the tokens in part order."""
        slots = threading.BoundedSemaphore(self.conc)
        futures: list[Future] = []
        try:
            for index, body in enumerate(coalesce(self._chunks(pool), self.sink.min_part)):
                self.stored += len(body)
                while not slots.acquire(timeout=0.5):
                    if self.failed.is_set():
                        break
                if self.failed.is_set():
                    break
                fut = pool.submit(self._upload_one, index, body)
                fut.add_done_callback(lambda f: slots.release())
                futures.append(fut)
                del body
            return [f.result() for f in futures]
        except BaseException:
            self.failed.set()
            pool.shutdown(wait=True, cancel_futures=True)
            # report the first real part failure rather than a follow-on abandonment
            for f in futures:
                exc = f.exception() if f.done() and not f.cancelled() else None
                if exc is not None and not getattr(exc, "abandoned", False):
                    raise exc from exc.__cause__  # our scrubbed error; keeps its __cause__
            raise

    def run(self) -> int:
        """Upload every part in parallel and publish the object.

        Returns:
            The number of parts uploaded.

        Raises:
            RemoteStorageError (or a subclass): a part, the start or the completion failed
                (after its retries); the upload was aborted.
        """
        sink = self.sink
        begun = False
        try:
            self.retry("start multipart upload", sink.begin, None)
            begun = True
            with Workers(max_workers=self.conc, thread_name_prefix="nebula-remote-up") as pool:
                tokens = self._submit_all(pool)
            if self.failed.is_set():  # pragma: no cover - defensive
                raise self.abandoned()
            self.retry("complete multipart upload",
                       lambda attempt: sink.complete(tokens, self.stored, attempt), None)
        except BaseException:
            if begun:
                sink.abort()
            raise
        return len(tokens)

    def run_sequential(self) -> int:
        """Write the parts in order to one stream (backends without parallel parts).

        Compression still runs in parallel. Exceptions are the backend's own (the caller
        classifies and scrubs them); the stream is aborted on failure.
        """
        sink = self.sink
        attempt = Attempt(1, float("inf"))
        sink.begin(attempt)
        n = 0
        try:
            with Workers(max_workers=self.conc, thread_name_prefix="nebula-remote-z") as pool:
                for index, body in enumerate(self._chunks(pool)):
                    self.stored += len(body)
                    sink.put_part(index, body, attempt)
                    n += 1
            sink.complete([], self.stored, attempt)
        except BaseException:
            self.failed.set()
            sink.abort()
            raise
        return max(1, n)
