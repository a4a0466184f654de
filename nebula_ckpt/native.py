"""Internal: one facade over the hot primitives: the C++ extension when it loads, pure PyTorch otherwise.

The rest of the library reaches them through :func:`get_ops`, which returns a
:class:`NativeOps` (the extension ``nebula_ckpt._C`` loaded) or the :class:`FallbackOps` (it did
not, or the ``disable_native`` knob is set); :func:`fallback_ops` returns the latter always and
:func:`describe` says which path runs and why. Both produce the same bytes and the same checksums
(CRC32C); ``tests/native/test_paths.py`` compares them. Which path runs is logged once, at first use.

Hot primitives (methods of both classes):

* ``alloc(nbytes, pinned=False, prefault=True)`` — a zero-filled, page-aligned host buffer (uint8
  tensor), its pages faulted in now unless ``prefault=False`` (for a buffer a parallel copy fills
  at once: its threads take the faults); ``pinned`` needs the CUDA build.
* ``enqueue_copy(srcs, dst, offsets, checksum=True)`` — copy every source's bytes into ``dst`` at
  its offset, returning a :class:`CopyJob` at once; the copy runs on native threads (GIL released).
  ``source_set(tensors, offsets)`` / ``enqueue_sources(sources, dst, checksum=True)`` — the same for
  a :class:`SourceSet` (a save's tensors with their offsets and version counters, held natively on
  the native path, where the plan cache's check also makes them: no per-tensor Python).
* ``copy_into(src, offsets, dsts)`` — the other direction, for a restore: ``src``'s bytes at each
  offset into the memory of each contiguous CPU tensor of ``dsts`` (its byte image; version
  counters bumped), on the copy threads (GIL released), without an intra-op (OpenMP) region.
* ``crc32c(buf, offsets, lengths)`` / ``crc32c_bytes(data)`` — checksums of byte ranges (in
  parallel) / of one bytes-like object.
* ``write_file(path, buf, offset, nbytes, fsync=True)`` — parallel ``pwrite`` (+ ``O_DIRECT``) and
  fsync; ``read_file(path, buf, offset, nbytes)`` — parallel ``pread``. Failures raise
  :class:`OSError` with the real ``errno`` and the path on both paths.

Checksums of a copy are always those of the *staged* bytes, and a source written while it is
being copied (even through ``.data`` or a numpy view, which bypass the version counter) is
reported by ``modified()`` wherever its bytes were seen to change: the native engine hashes each
64 KiB block before copying it and compares with the hash of what it copied; the fallback
compares the staged bytes' CRC32C with the source's after the copy.

Interpreter exit: the native copy threads are joined by an ``atexit`` handler (after pending
copies finished), and a daemon thread still inside a native call when Python finalizes is parked
there instead of being torn down (see ``csrc/bindings.cpp``). The pure-PyTorch path copies on one
daemon worker thread that the same handler waits for, so no copy is cut half way either; a Ctrl-C
anywhere in ``enqueue_copy`` or a job's ``wait`` leaves nothing locked
(:class:`~nebula_ckpt.copy_worker.CopyWorker`).
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import logging
import os
import threading
import time
from typing import Any, Optional, Protocol, Sequence

import torch

from nebula_ckpt import knobs
from nebula_ckpt.copy_worker import CopyWorker
from nebula_ckpt.errors import ValidationError
from nebula_ckpt.latch import Latch
from nebula_ckpt.source_set import PySourceSet, SourceSet, version_of

WRITE_CHUNK_BYTES = 16 << 20  #: bytes per pwrite call on local tiers
log = logging.getLogger(__name__)


class CopyJob(Protocol):
    """A copy enqueued by ``enqueue_copy``."""

    def wait(self) -> None:
        """Block until every byte is copied; raise the first copy error."""

    def done(self) -> bool:
        """Whether the copy has finished (successfully or not)."""

    def modified(self) -> list[int]:
        """Indices of sources written during their copy: version counter or bytes (after ``wait``)."""

    def checksums(self) -> list[int]:
        """CRC32C of each source's staged bytes (waits); empty: not computed, hash the buffer."""


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The contiguous byte image of ``t``'s values as a 1-D uint8 tensor (may copy if
    non-contiguous, or a conj/neg view)."""
    # A conj/neg view's memory holds the unconjugated values (the bit is applied lazily), and
    # torch refuses to reinterpret it: its values are materialised into a copy.
    t = t.detach().resolve_conj().resolve_neg()
    if t.dim() == 0:
        t = t.reshape(1)
    if t.element_size() == 1:
        # torch has no copy kernel for the sub-byte shell dtypes (int1..7, uint1..7): a 1-byte
        # tensor is made contiguous as bytes (a same-size view, whatever its strides)
        t = t.view(torch.uint8)
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def host_bytes(t: torch.Tensor) -> memoryview:
    """A read-write memoryview (format ``"B"``) of the bytes of ``t``, a contiguous CPU tensor,
    that leaves its storage as it was: ``Tensor.numpy()`` would make the storage of a user's
    tensor non-resizable for good (a later ``resize_`` or growing ``out=`` fails). The view keeps
    ``t`` alive."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValidationError(f"host_bytes: needs a contiguous CPU tensor, got {t.device} with strides "
                              f"{t.stride()}; pass byte_view(t.cpu())")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"").cast("B")
    arr = (ctypes.c_char * n).from_address(t.data_ptr())
    arr.owner = t  # type: ignore[attr-defined]  # the memory lives as long as the view
    return memoryview(arr).cast("B")


class _FallbackJob:
    """Copy job of the pure-PyTorch path, run tensor by tensor by the copy worker
    (:class:`~nebula_ckpt.copy_worker.CopyWorker`).

    ``copy_`` and ``crc32c`` release the GIL, so the training thread keeps running. Its completion
    is a :class:`~nebula_ckpt.latch.Latch`: a Ctrl-C inside :meth:`wait` leaves no lock held.
    """

    def __init__(self, srcs: Sequence[torch.Tensor], dst: torch.Tensor, offsets: Sequence[int],
                 checksum: bool = True) -> None:
        self._checksum = checksum
        self._srcs = list(srcs)
        self._dst: Optional[torch.Tensor] = dst
        self._offsets = list(offsets)
        self._versions = [version_of(s) for s in self._srcs]  # -1: an inference tensor, no counter
        self._modified: list[int] = []
        self._checksums: list[int] = []
        self._error: Optional[BaseException] = None
        self._done = Latch()

    def run(self) -> None:
        """Copy (on the worker thread); every error is kept for :meth:`wait`, the latch always set.

        The buffers are let go before the latch is set: a caller that drops them once ``wait()``
        returned frees them at once."""
        try:
            self._copy()
        except BaseException as e:  # re-raised from wait()
            self._error = e
        finally:
            self._srcs, self._dst = [], None
            self._done.set()

    def _copy(self) -> None:
        import crc32c as _crc

        dst = self._dst
        assert dst is not None, "a copy job runs once"
        with torch.no_grad():
            for i, (src, off) in enumerate(zip(self._srcs, self._offsets, strict=True)):
                n = src.numel() * src.element_size()
                crc, torn = 0, False
                if n and not self._checksum:
                    dst[off:off + n].copy_(byte_view(src))
                elif n:
                    staged = dst[off:off + n]
                    staged.copy_(byte_view(src))
                    # The checksum is that of the staged bytes; a source whose bytes differ
                    # from them after the copy was written meanwhile (a device source is
                    # left to its version counter: re-reading it would cost a transfer).
                    crc = _crc.crc32c(host_bytes(staged))
                    if src.device.type == "cpu":
                        torn = _crc.crc32c(host_bytes(byte_view(src))) != crc
                self._checksums.append(int(crc))
                v = self._versions[i]
                if torn or (v >= 0 and src._version != v):
                    self._modified.append(i)

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise RuntimeError(f"snapshot copy failed: {self._error}") from self._error

    def done(self) -> bool:
        return self._done.is_set()

    def modified(self) -> list[int]:
        return list(self._modified)

    def checksums(self) -> list[int]:
        self.wait()
        return list(self._checksums) if self._checksum else []


_copies = CopyWorker()


class FallbackOps:
    """Pure-PyTorch implementation of the hot primitives (no compiler needed)."""

    name = "pure-pytorch"

    def alloc(self, nbytes: int, pinned: bool = False, prefault: bool = True) -> torch.Tensor:
        """A zero-filled uint8 host buffer of ``nbytes``, pre-faulted unless ``prefault=False``
        (a buffer a parallel copy fills right away: its threads take the page faults)."""
        if not prefault and not pinned:
            return torch.zeros(nbytes, dtype=torch.uint8)  # calloc: fresh pages are not touched
        buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)
        buf.zero_()  # touch every page now, not on the first snapshot
        return buf[:nbytes]

    def enqueue_copy(self, srcs: Sequence[torch.Tensor], dst: torch.Tensor,
                     offsets: Sequence[int], checksum: bool = True) -> CopyJob:
        """Start copying ``srcs`` into ``dst`` at ``offsets`` on a background thread.

        ``checksum=False``: plain copies; ``checksums()`` is empty (hash the buffer afterwards).
        """
        job = _FallbackJob(srcs, dst, offsets, checksum)
        _copies.submit(job)
        return job

    def source_set(self, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> SourceSet:
        """The :class:`SourceSet` of ``tensors`` whose bytes go to ``offsets`` (versions recorded now)."""
        return PySourceSet(tensors, offsets)

    def enqueue_sources(self, sources: SourceSet, dst: torch.Tensor, checksum: bool = True) -> CopyJob:
        """:meth:`enqueue_copy` of a :class:`SourceSet` (each tensor at its offset)."""
        return self.enqueue_copy(sources.tensors(), dst, sources.offsets(), checksum)

    def warm_up_cuda(self, devices: Sequence[int]) -> None:
        """Set up the device-to-host copy path of these CUDA devices now rather than in the first
        save (the native CUDA build's side stream, events, host function; no-op on this path)."""

    def plan_guard(self, *args: Any) -> Any:
        """The plan cache's native check (``nebula_ckpt._C.PlanGuard(*args)``,
        :mod:`nebula_ckpt.save.plan_cache`), or None on this path (plans are made at every save)."""
        return None

    def copy_into(self, src: torch.Tensor, offsets: Sequence[int], dsts: Sequence[torch.Tensor]) -> None:
        """Copy ``src[offsets[i]:offsets[i] + nbytes]`` (``src`` a 1-D uint8 CPU tensor) into the
        memory of each contiguous CPU tensor ``dsts[i]``, byte for byte whatever its dtype; every
        destination checked before any is written."""
        n = src.numel()
        for i, (o, d) in enumerate(zip(offsets, dsts, strict=True)):
            if d.device.type != "cpu" or not d.is_contiguous() or not 0 <= o <= n - d.numel() * d.element_size():
                raise RuntimeError(f"copy_into: destination {i} is no contiguous CPU tensor within src")
        with torch.no_grad():
            for o, d in zip(offsets, dsts, strict=True):
                d.reshape(-1).view(torch.uint8).copy_(src[o:o + d.numel() * d.element_size()])

    def crc32c(self, buf: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> list[int]:
        """CRC32C of each ``buf[offset:offset+length]``."""
        import crc32c as _crc

        mv = host_bytes(buf)  # buf may be a byte view of a user's tensor (DCP)
        return [_crc.crc32c(mv[o:o + n]) for o, n in zip(offsets, lengths, strict=True)]

    def crc32c_bytes(self, data: bytes | bytearray | memoryview) -> int:
        """CRC32C of a bytes-like object."""
        import crc32c as _crc

        return int(_crc.crc32c(data))

    def write_file(self, path: str, buf: torch.Tensor, offset: int, nbytes: int,
                   fsync: bool = True) -> bool:
        """Write ``buf[offset:offset+nbytes]`` to a new file at ``path``; fsync it.

        A write that fails after the file was opened removes the file (its old contents were
        truncated anyway).

        Returns:
            Whether ``O_DIRECT`` was used (never, on this path).

        Raises:
            OSError: with the failing call's ``errno`` (``ENOSPC``, ``EACCES``, ...) and
                ``filename == path``, like the native path.
        """
        mv = buf.numpy().data[offset:offset + nbytes]
        chunk, op = WRITE_CHUNK_BYTES, "open"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                op, pos = "pwrite", 0
                while pos < nbytes:
                    n = os.pwrite(fd, mv[pos:pos + chunk], pos)
                    if n == 0:
                        raise OSError(errno.EIO, "pwrite wrote 0 bytes")
                    pos += n
                if fsync:
                    op = "fsync"
                    os.fsync(fd)
            except BaseException:
                os.close(fd)
                raise
            op = "close"
            os.close(fd)  # on NFS-like file systems, write errors may only surface here
        except OSError as e:
            if op != "open":
                # The old contents are gone (O_TRUNC) and a torn file would only hold space
                # (on a full disk, all of it): remove it, like the native path.
                try:
                    os.unlink(path)
                except OSError:
                    pass
            # os.pwrite/os.fsync errors carry no file name: say which file and which call.
            code = e.errno or errno.EIO
            raise OSError(code, f"{os.strerror(code)} ({op} while writing)", path) from e
        return False

    def read_file(self, path: str, buf: torch.Tensor, offset: int, nbytes: int) -> None:
        """Read the first ``nbytes`` of ``path`` into ``buf[offset:offset+nbytes]``."""
        mv = buf.numpy().data[offset:offset + nbytes]
        with open(path, "rb", buffering=0) as f:
            got = 0
            while got < nbytes:
                n = f.readinto(mv[got:])
                if not n:
                    raise OSError(f"nebula_ckpt: '{path}' is shorter than {nbytes} bytes")
                got += n


class NativeOps(FallbackOps):
    """The C++ extension ``nebula_ckpt._C``: native threads, hardware CRC32C, pwrite/O_DIRECT."""

    name = "native"

    def __init__(self, C: Any) -> None:
        self._C = C
        self._engine_lock = threading.Lock()
        self._engine: Optional[Any] = C.CopyEngine(int(knobs.get("copy_threads")))
        self.info = dict(C.build_info())
        os.register_at_fork(after_in_child=self._after_fork_in_child)

    def _after_fork_in_child(self) -> None:
        """A fork's child has the engine's memory but none of its threads: closing or destroying it
        there would join threads that do not exist (a crash at the child's exit), so it is kept,
        unused, for the child's life; the child's first copy starts an engine of its own."""
        _forked_engines.append(self._engine)
        self._engine, self._engine_lock = None, threading.Lock()  # the lock may have been held at fork

    def close(self) -> None:
        """Finish the queued copies and join the copy threads (called at interpreter exit).

        A later ``enqueue_copy`` starts a new engine, so code running after the ``atexit``
        handlers (a late save) still works.
        """
        with self._engine_lock:
            engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()

    def _get_engine(self) -> Any:
        with self._engine_lock:
            if self._engine is None:
                self._engine = self._C.CopyEngine(int(knobs.get("copy_threads")))
            return self._engine

    def alloc(self, nbytes: int, pinned: bool = False, prefault: bool = True) -> torch.Tensor:
        threads = int(knobs.get("copy_threads")) if prefault or pinned else 0
        return self._C.alloc_host_buffer(nbytes, pinned, threads, bool(knobs.get("huge_pages")))

    def enqueue_copy(self, srcs: Sequence[torch.Tensor], dst: torch.Tensor,
                     offsets: Sequence[int], checksum: bool = True) -> CopyJob:
        return self._get_engine().enqueue(list(srcs), dst, list(offsets), checksum)

    def source_set(self, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> SourceSet:
        return self._C.SourceSet(list(tensors), list(offsets))

    def plan_guard(self, *args: Any) -> Any:
        return self._C.PlanGuard(*args)

    def warm_up_cuda(self, devices: Sequence[int]) -> None:
        if self.info.get("cuda"):
            for d in devices:
                self._C.cuda_warm_up(int(d))

    def enqueue_sources(self, sources: SourceSet, dst: torch.Tensor, checksum: bool = True) -> CopyJob:
        if not isinstance(sources, self._C.SourceSet):  # made by the other path (tests compare both)
            return self.enqueue_copy(sources.tensors(), dst, sources.offsets(), checksum)
        return self._get_engine().enqueue_set(sources, dst, checksum)

    def copy_into(self, src: torch.Tensor, offsets: Sequence[int], dsts: Sequence[torch.Tensor]) -> None:
        self._C.copy_into(src, list(offsets), list(dsts), int(knobs.get("copy_threads")))

    def crc32c(self, buf: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> list[int]:
        return list(self._C.crc32c(buf, list(offsets), list(lengths), int(knobs.get("io_threads"))))

    def crc32c_bytes(self, data: bytes | bytearray | memoryview) -> int:
        return int(self._C.crc32c_bytes(data, 0))

    def write_file(self, path: str, buf: torch.Tensor, offset: int, nbytes: int,
                   fsync: bool = True) -> bool:
        return bool(self._C.write_file(path, buf, offset, nbytes, bool(knobs.get("o_direct")),
                                       int(knobs.get("io_threads")), WRITE_CHUNK_BYTES, fsync))

    def read_file(self, path: str, buf: torch.Tensor, offset: int, nbytes: int) -> None:
        self._C.read_file(path, buf, offset, nbytes, int(knobs.get("io_threads")))


_lock = threading.Lock()
_native: Optional[FallbackOps] = None
_native_error: Optional[str] = None
_fallback = FallbackOps()
_forked_engines: list[Any] = []  # the parent's engines in a fork's child: never closed nor freed there


def _load_native() -> FallbackOps:
    global _native_error
    try:
        from nebula_ckpt import _C

        ops = NativeOps(_C)
        log.info("nebula_ckpt: running the native path (C++ extension %s)", ops.info)
        return ops
    except Exception as e:  # ImportError, or an ABI mismatch surfacing as another error
        _native_error = f"{type(e).__name__}: {e}"
        if isinstance(e, ModuleNotFoundError) and e.name == "nebula_ckpt._C":
            # not built: installed with NEBULA_NO_EXTENSION=1 (a build that fails stops the install)
            log.info("nebula_ckpt: running the pure-PyTorch path (installed without the C++ extension, "
                     "NEBULA_NO_EXTENSION=1): the same checkpoints; each save blocks for a one-thread copy and "
                     "its checksum, about as long as torch.save (the native path: milliseconds). To build the "
                     "extension: pip install --no-build-isolation -e . with a C++ compiler")
        else:
            log.warning("nebula_ckpt: the C++ extension is installed but does not load (%s): running the "
                        "pure-PyTorch path, whose saves block about as long as torch.save. Rebuild it against "
                        "this torch: pip install --no-build-isolation -e . (nebula-ckpt doctor says more)",
                        _native_error)
        return _fallback


def _close_native() -> None:
    """``atexit``: finish the queued copies (both paths) and join the native copy threads before
    the interpreter finalizes.

    Registered when this module is imported, i.e. before ``nebula_ckpt.close_all``, so it runs
    after it (``atexit`` is last-in, first-out): saves being closed still have their engine.
    """
    _copies.drain()  # the pure-PyTorch path's copies (tests compare both paths in one process)
    with _lock:
        ops = _native
    if isinstance(ops, NativeOps):
        ops.close()


atexit.register(_close_native)


def get_ops() -> FallbackOps:
    """The primitives in use: native if the extension loads, unless ``disable_native`` is set."""
    global _native
    if knobs.get_once("disable_native"):  # the environment read once: get_ops() runs at every save
        return _fallback
    with _lock:
        if _native is None:
            _native = _load_native()
        return _native


def fallback_ops() -> FallbackOps:
    """The pure-PyTorch primitives (for tests that compare both paths)."""
    return _fallback


def native_available() -> bool:
    """Whether the C++ extension imports."""
    try:
        from nebula_ckpt import _C  # noqa: F401
    except Exception:
        return False
    return True


def describe() -> dict[str, Any]:
    """Which path runs and why (for logs, the CLI and bug reports)."""
    ops = get_ops()
    out: dict[str, Any] = {"path": ops.name}
    if isinstance(ops, NativeOps):
        out.update(ops.info)
    elif knobs.get_once("disable_native"):
        out["reason"] = "disabled by NEBULA_DISABLE_NATIVE"
    elif _native_error:
        out["reason"] = _native_error
    return out


def monotonic() -> float:
    """Clock used for every duration the library reports."""
    return time.perf_counter()
