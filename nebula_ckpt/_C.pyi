"""Type stub of the native extension ``nebula_ckpt._C`` (built from ``csrc/``)."""

from typing import TypedDict

import torch
from typing_extensions import Buffer

class _BuildInfo(TypedDict):
    version: str
    cuda: bool
    crc32c_hw: bool
    o_direct: bool

def build_info() -> _BuildInfo:
    """Version and capabilities: CUDA build, hardware CRC32C in use, O_DIRECT known."""

def alloc_host_buffer(nbytes: int, pinned: bool = False, prefault_threads: int = 1,
                      huge_pages: bool = False) -> torch.Tensor:
    """Zero-filled, pre-faulted 1-D uint8 CPU tensor over 4 KiB (>= 2 MiB: 2 MiB) aligned memory.

    ``huge_pages``: advise transparent huge pages (MADV_HUGEPAGE) for a buffer of 2 MiB or more.

    ``prefault_threads=0``: not pre-faulted (zero-filled all the same): for a buffer a parallel copy
    fills right away, whose threads then take the page faults. ``pinned`` needs the CUDA build."""

class CopyJob:
    """Handle of one asynchronous ``CopyEngine.enqueue``; keeps its sources and destination alive.

    Dropping it waits (without the GIL) for its copies still running, then releases the tensors.
    """

    def wait(self) -> None:
        """Block (without the GIL) until every copy finished; re-raise the first copy error as RuntimeError."""
    def done(self) -> bool:
        """True when every copy has finished (non-blocking)."""
    def modified(self) -> list[int]:
        """Sorted indices of sources written during their copy (complete after wait()).

        A source is reported when its ``_version`` changed before its copy finished, or when a block of
        a contiguous CPU source hashed before its copy differs from the bytes copied (writes through
        ``.data`` or numpy, which bypass the version counter).
        """
    def checksums(self) -> list[int]:
        """CRC32C of the bytes staged for each source, taken during the copy (waits).

        Empty when CUDA sources were copied."""
    def seconds(self) -> float:
        """Seconds from enqueue to the last copy finished (elapsed so far while running)."""

class CopyEngine:
    """Persistent native thread pool that snapshots tensors into host staging buffers."""

    def __init__(self, num_threads: int) -> None:
        """Start ``num_threads`` (>= 1) worker threads once."""
    @property
    def num_threads(self) -> int:
        """Number of worker threads (0 once closed)."""
    def close(self) -> None:
        """Finish the queued copies and join the threads now (idempotent).

        ``enqueue`` raises RuntimeError afterwards."""
    def enqueue(self, srcs: list[torch.Tensor], dst: torch.Tensor, offsets: list[int],
                checksum: bool = True) -> CopyJob:
        """Validate, then asynchronously copy each srcs[i]'s contiguous bytes into dst at offsets[i].

        ``dst``: a 1-D uint8 CPU tensor. ``checksum=False``: plain copies at memcpy speed, no CRC32C
        and no check of a block's bytes against a hash taken before its copy (version counters are
        still compared); ``checksums()`` is then empty."""

def crc32c(buf: torch.Tensor, offsets: list[int], lengths: list[int], num_threads: int) -> list[int]:
    """CRC32C of each byte range [offsets[i], offsets[i] + lengths[i]) of a 1-D contiguous uint8 CPU tensor."""

def copy_into(src: torch.Tensor, offsets: list[int], dsts: list[torch.Tensor], num_threads: int) -> None:
    """Copy src[offsets[i]:...] into the memory of each contiguous CPU tensor dsts[i] on native threads
    (its version counter bumped); every argument checked before any byte is written."""

def crc32c_bytes(data: Buffer, value: int = 0) -> int:
    """CRC32C of a contiguous bytes-like object, continuing from ``value`` (like ``crc32c.crc32c``)."""

def write_file(
    path: str,
    buf: torch.Tensor,
    offset: int,
    nbytes: int,
    direct: bool,
    num_threads: int,
    chunk_bytes: int,
    do_fsync: bool,
) -> bool:
    """Write buf[offset:offset+nbytes] to a new/truncated file with parallel pwrite; True if O_DIRECT was used.

    Raises OSError(errno, reason, path) (``filename == path``; the subclass follows errno, e.g. ENOSPC,
    PermissionError) when a system call fails, after removing the file; RuntimeError for bad arguments.
    """

def read_file(path: str, buf: torch.Tensor, offset: int, nbytes: int, num_threads: int) -> None:
    """Read the first nbytes of ``path`` into buf[offset:offset+nbytes] with parallel pread.

    Raises OSError(errno, reason, path) when a system call fails; RuntimeError when the file is shorter.
    """
