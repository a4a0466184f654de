"""Hardware limits, measured in the same run as the systems (shared machines drift by 3x).

* sequential write + fsync to the target: ``N`` bytes in 16 MiB ``write`` calls, one fsync of
  the file and its directory at the end;
* host memory copy: ``torch.Tensor.copy_`` into a buffer allocated and touched beforehand;
* on CUDA, device-to-host copy into pinned memory.

Each figure is the best of a few repetitions (the target most favourable to the hardware, so
the "% of limit" the report computes is conservative), with every sample kept in the results.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

CHUNK = 16 << 20


def seq_write_fsync(directory: Path, nbytes: int, reps: int = 2) -> dict[str, Any]:
    """Write ``nbytes`` sequentially in 16 MiB chunks, then fsync file and directory.

    Args:
        directory: where to write (the benchmark target); the file is removed afterwards.
        nbytes: bytes per repetition (rounded up to whole chunks).
        reps: repetitions; the best is reported.

    Returns:
        ``{"gbps": best GB/s, "samples_gbps": [...], "bytes": n, "chunk_bytes": 16 MiB}``.
    """
    directory.mkdir(parents=True, exist_ok=True)
    # incompressible data, in case the virtual disk compresses or deduplicates
    chunk = os.urandom(CHUNK)
    chunks = max(1, -(-nbytes // CHUNK))
    samples = []
    for r in range(reps):
        path = directory / f"seq_write_{r}.bin"
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for _ in range(chunks):
                os.write(fd, chunk)
            os.fsync(fd)
        finally:
            os.close(fd)
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(dfd)
        os.close(dfd)
        dt = time.perf_counter() - t0
        samples.append(chunks * CHUNK / dt / 1e9)
        path.unlink()
    return {"gbps": max(samples), "samples_gbps": samples, "bytes": chunks * CHUNK,
            "chunk_bytes": CHUNK}


def memcpy(nbytes: int, reps: int = 5) -> dict[str, Any]:
    """``dst.copy_(src)`` of ``nbytes`` into a pre-touched CPU buffer; best of ``reps``."""
    n = max(1, nbytes // 4)
    src = torch.randn(n)
    dst = torch.empty(n)
    dst.zero_()  # fault every page in before timing
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        dt = time.perf_counter() - t0
        samples.append(n * 4 / dt / 1e9)
    return {"gbps": max(samples), "samples_gbps": samples, "bytes": n * 4,
            "threads": torch.get_num_threads()}


def d2h_pinned(nbytes: int, reps: int = 5) -> dict[str, Any]:
    """CUDA device-to-host copy into pinned memory; best of ``reps``. ``{}`` without CUDA."""
    if not torch.cuda.is_available():
        return {}
    n = max(1, nbytes // 4)
    src = torch.randn(n, device="cuda")
    dst = torch.empty(n, pin_memory=True)
    dst.copy_(src)
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        samples.append(n * 4 / (time.perf_counter() - t0) / 1e9)
    return {"gbps": max(samples), "samples_gbps": samples, "bytes": n * 4}


def measure(directory: Path, write_bytes: int, copy_bytes: int) -> dict[str, Any]:
    """All limits; a limit that fails is recorded with its error rather than stopping the run."""
    out: dict[str, Any] = {}
    for name, fn in (("seq_write_fsync", lambda: seq_write_fsync(directory, write_bytes)),
                     ("memcpy", lambda: memcpy(copy_bytes)),
                     ("d2h_pinned", lambda: d2h_pinned(copy_bytes))):
        try:
            out[name] = fn()
        except Exception as e:  # recorded; the targets that need it become n/a
            log.warning("limit %s failed: %s", name, e)
            out[name] = {"error": f"{type(e).__name__}: {e}"}
        if out[name].get("gbps") is not None:
            log.info("limit %s: %.2f GB/s", name, out[name]["gbps"])
    return out
