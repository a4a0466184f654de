"""Fault a fresh staging buffer's pages in the background while a save's copy fills it.

A save that finds no staging buffer of its size (the first save of a process, as a rule) copies
into fresh anonymous memory, and every 4 KiB page of it is faulted in by the copy threads as
they write: on the machines measured, faulting costs 5-10x the copy itself, so the first save
blocks several times longer than the later ones. :class:`FaultAhead` gives that work to threads
of cores the copy does not use (:data:`FAULT_AHEAD_THREADS`): each one populates its part of
the buffer from the buffer's end towards its start with ``madvise(MADV_POPULATE_WRITE)`` (Linux
5.14+), one call per chunk instead of a trap per page, while the copy goes front to back; they
meet in between, and the copy finds faulted pages in the part already done.

Populating a page never changes its bytes (a fresh anonymous page reads as zeros either way and
a page the copy already wrote is left alone), so the snapshot is the same whichever of the two
reaches a page first. Where the call is not available (another OS, an older kernel, a buffer
without a data pointer), nothing is started and the copy faults the pages as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import threading
from typing import Any, Optional

import torch

from nebula_ckpt import knobs

#: threads that fault in a fresh staging buffer's pages from its end while the first save's copy
#: fills it from the start; None: the cores of this rank the copy threads leave idle, at most 8
#: (0: the copy faults them)
FAULT_AHEAD_THREADS: Optional[int] = None

log = logging.getLogger(__name__)

#: madvise advice that faults pages in for writing (Linux >= 5.14)
MADV_POPULATE_WRITE = 23
#: bytes per madvise call: small enough that the threads and the copy meet close to the middle
CHUNK_BYTES = 8 << 20

_libc: Optional[Any] = None
_libc_lock = threading.Lock()
_unsupported = False


def _madvise() -> Optional[Any]:
    """libc's ``madvise``, or None where there is none."""
    global _libc
    with _libc_lock:
        if _libc is None:
            try:
                lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
                lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                lib.madvise.restype = ctypes.c_int
                _libc = lib
            except (OSError, AttributeError):
                return None
        return _libc.madvise


def advise(m: Any, start: int, length: int, advice: int) -> bool:
    """``madvise(advice)`` the pages of the mapping ``m`` (an :class:`mmap.mmap`) covering
    ``[start, start + length)``, in one call made without the GIL (``mmap.madvise`` holds it: a
    48 MB populate stalled the training thread ~17 ms). Whether it was done (False: no libc, an
    old kernel without the advice, an empty range)."""
    madvise = _madvise()
    if m.closed:
        return False
    lo = start - start % mmap.PAGESIZE
    end = min(start + length, len(m))
    if madvise is None or end <= lo:
        return False
    try:
        anchor = ctypes.c_char.from_buffer(m)  # its address (the export ends with this name)
    except (TypeError, ValueError):  # a read-only mapping: mmap's own call, GIL held
        try:
            m.madvise(advice, lo, end - lo)
            return True
        except (OSError, ValueError):
            return False
    address = ctypes.addressof(anchor)
    del anchor
    return bool(madvise(address + lo, end - lo, advice) == 0)


def populate_mapping(m: Any) -> bool:
    """Fault in every page of the writable mapping ``m`` for writing (:func:`advise`); False
    where it cannot be done (each page then faults on its first write)."""
    return advise(m, 0, len(m), MADV_POPULATE_WRITE)


def fault_ahead_threads() -> int:
    """:data:`FAULT_AHEAD_THREADS`, or by default the cores of this rank the copy threads leave idle
    (at most 8)."""
    if FAULT_AHEAD_THREADS is not None:
        return max(0, int(FAULT_AHEAD_THREADS))
    return max(0, min(8, knobs.cores_per_rank() - int(knobs.get("copy_threads"))))


def threads_for(nbytes: int) -> int:
    """How many fault-ahead threads a fresh buffer of ``nbytes`` gets (0: none)."""
    if _unsupported or nbytes < 2 * CHUNK_BYTES:
        return 0
    return fault_ahead_threads()


class FaultAhead:
    """Background threads populating ``buf``'s pages from its end (see the module docstring).

    Args:
        buf: a 1-D uint8 CPU tensor whose pages are not faulted in yet; each thread holds a
            reference to it while it runs (so the memory outlives it if the pool frees the slot
            meanwhile) and drops it when done (so a buffer the pool freed is not kept alive).
        threads: number of threads (each takes an equal part, the last part first).
    """

    def __init__(self, buf: torch.Tensor, threads: int) -> None:
        self._stop = threading.Event()
        self.faulted_bytes = 0
        self._lock = threading.Lock()
        n = buf.numel()
        parts = [(n * k // threads, n * (k + 1) // threads) for k in range(threads)]
        self._threads = [threading.Thread(target=self._run, args=(buf, lo, hi), name=f"nebula-fault-ahead-{k}",
                                          daemon=True) for k, (lo, hi) in enumerate(reversed(parts))]
        for t in self._threads:
            t.start()

    def _run(self, buf: torch.Tensor, lo: int, hi: int) -> None:
        global _unsupported
        madvise = _madvise()
        if madvise is None:
            return
        page = 4096
        base = buf.data_ptr()
        end = hi
        while end > lo and not self._stop.is_set():
            start = max(lo, end - CHUNK_BYTES)
            a = (base + start) // page * page  # madvise wants a page-aligned start
            if madvise(a, base + end - a, MADV_POPULATE_WRITE) != 0:
                err = ctypes.get_errno()
                if not _unsupported:
                    log.debug("nebula_ckpt: no fault-ahead of staging pages (madvise errno %d)", err)
                _unsupported = True
                return
            with self._lock:
                self.faulted_bytes += end - start
            end = start

    def running(self) -> bool:
        """Whether a thread is still faulting."""
        return any(t.is_alive() for t in self._threads)

    def stop(self) -> None:
        """Stop after the current chunk (the copy faults what is left) and wait for the threads."""
        self._stop.set()
        self.join()

    def join(self) -> None:
        """Wait until every thread is done."""
        for t in self._threads:
            t.join()


#: madvise advice that frees a private anonymous mapping's pages (they read as zeros after)
MADV_DONTNEED = 4


def free_pages(t: torch.Tensor, start: int, end: int) -> bool:
    """Give back the whole pages of the bytes ``[start, end)`` of ``t`` (a CPU tensor over a private
    anonymous mapping that nothing reads there any more): ``madvise(MADV_DONTNEED)``, the pages
    then read as zeros. Whether it was done (False: no libc, nothing page-aligned inside)."""
    madvise = _madvise()
    base = t.data_ptr()
    lo = -(-(base + start) // mmap.PAGESIZE) * mmap.PAGESIZE
    hi = (base + min(end, t.numel() * t.element_size())) // mmap.PAGESIZE * mmap.PAGESIZE
    if madvise is None or hi <= lo:
        return False
    return bool(madvise(lo, hi - lo, MADV_DONTNEED) == 0)
