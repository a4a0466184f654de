"""Hardware limits, measured in the same run as the systems (shared machines drift by 3x).

* sequential write + fsync to the target: ``N`` bytes in 16 MiB ``write`` calls, one fsync of
  the file and its directory at the end;
* host memory copy: ``torch.Tensor.copy_`` into a buffer allocated and touched beforehand;
* on CUDA, device-to-host copy into pinned memory.

Also the probes of the machine (:func:`machine_info`) and of this process the runner uses:
peak RSS, block-device bytes written, page-cache residency and eviction of files.

Each figure is the best of a few repetitions (the target most favourable to the hardware, so
the "% of limit" the report computes is conservative), with every sample kept in the results.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import logging
import mmap
import os
import platform
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

log = logging.getLogger(__name__)

CHUNK = 16 << 20
#: a cold restore counts only if at most this fraction of the files stayed in the page cache
COLD_RESIDENT_MAX = 0.05


def seq_write_fsync(directory: Path, nbytes: int, reps: int = 3) -> dict[str, Any]:
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


def measure(directory: Optional[Path], write_bytes: int, copy_bytes: int) -> dict[str, Any]:
    """All limits; one that fails is recorded with its error rather than stopping the run.

    Args:
        directory: local target folder, or ``None`` for a URL target (no write limit then).
        write_bytes: bytes of the sequential write.
        copy_bytes: bytes of the memory copies.
    """
    out: dict[str, Any] = {}
    todo: list[tuple[str, Callable[[], dict[str, Any]]]] = []
    if directory is None:
        out["seq_write_fsync"] = {"error": "the target is a URL; no local write limit"}
    else:
        local = directory
        todo.append(("seq_write_fsync", lambda: seq_write_fsync(local, write_bytes)))
    todo += [("memcpy", lambda: memcpy(copy_bytes)), ("d2h_pinned", lambda: d2h_pinned(copy_bytes))]
    for name, fn in todo:
        try:
            out[name] = fn()
        except Exception as e:  # recorded; the targets that need it become n/a
            log.warning("limit %s failed: %s", name, e)
            out[name] = {"error": f"{type(e).__name__}: {e}"}
        if out[name].get("gbps") is not None:
            log.info("limit %s: %.2f GB/s", name, out[name]["gbps"])
    return out


# --------------------------------------------------------------------------- machine

def _mount_of(path: Path) -> tuple[str, str, str]:
    """(mount point, fs type, device) of the longest /proc/mounts entry containing ``path``."""
    best = ("/", "unknown", "unknown")
    try:
        real = os.path.realpath(path)
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                dev, mnt, fstype = parts[0], parts[1].replace("\\040", " "), parts[2]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                    best = (mnt, fstype, dev)
    except OSError:
        pass
    return best


def _rotational(dev: str) -> Optional[bool]:
    """Whether block device ``dev`` (e.g. /dev/vda1) is rotational, from sysfs."""
    name = os.path.basename(dev)
    for cand in (name, name.rstrip("0123456789"), re.sub(r"p\d+$", "", name)):
        p = f"/sys/block/{cand}/queue/rotational"
        if os.path.exists(p):
            with open(p) as f:
                return f.read().strip() == "1"
    return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info(directory: Optional[Path], target: str) -> dict[str, Any]:
    """CPU, memory, the target's file system and disk, library versions, kernel."""
    import psutil

    info: dict[str, Any] = {
        "cpu_model": _cpu_model(), "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "memory_bytes": psutil.virtual_memory().total,
        "memory_available_bytes": psutil.virtual_memory().available,
        "kernel": platform.release(), "os": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "target": target,
        "versions": {d: _version(d) for d in ("nebula_ckpt", "safetensors", "torchsnapshot", "numpy")},
    }
    try:
        from nebula_ckpt import native

        info["nebula_native"] = native.describe()
    except Exception as e:  # informative only
        info["nebula_native"] = {"error": str(e)}
    if directory is not None:
        mnt, fstype, dev = _mount_of(directory)
        usage = shutil.disk_usage(directory)
        info.update(target_mount=mnt, target_fs=fstype, target_device=dev,
                    target_is_tmpfs=fstype in ("tmpfs", "ramfs"),
                    target_rotational=_rotational(dev) if dev.startswith("/dev/") else None,
                    target_free_bytes=usage.free)
    else:
        info.update(target_fs="url", target_is_tmpfs=False)
    return info


# --------------------------------------------------------------------------- process and page-cache probes

def rss_bytes() -> int:
    """Current resident set size of this process."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def _status_kb(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class PeakRss:
    """Peak RSS over a block: resets the kernel's high-water mark (``clear_refs`` 5) if it can,
    else samples RSS every 10 ms on a thread."""

    def __init__(self) -> None:
        self.method = ""
        self._stop = threading.Event()
        self._peak = 0
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "PeakRss":
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method = "VmHWM after clear_refs"
        except OSError:
            self.method = "psutil sampling every 10 ms"
            self._thread = threading.Thread(target=self._sample, daemon=True, name="bench-rss")
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self._peak = max(self._peak, rss_bytes())

    def peak(self) -> int:
        """Peak so far."""
        if self._thread is None:
            return _status_kb("VmHWM") or rss_bytes()
        return max(self._peak, rss_bytes())

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def io_write_bytes() -> Optional[int]:
    """Bytes this process caused to be sent to block storage (``/proc/self/io``); tmpfs excluded."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("write_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def shm_used_bytes() -> Optional[int]:
    """Bytes used on the /dev/shm file system (the memory tier lives there)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def dir_bytes(path: Optional[str | Path]) -> int:
    """Total size of the files under ``path``, each file once however many names link it."""
    from nebula_ckpt.tiers.memory.shm import tree_bytes

    return tree_bytes(str(path)) if path and os.path.exists(path) else 0


# --------------------------------------------------------------------------- page cache

_libc = ctypes.CDLL(None, use_errno=True)


def resident_fraction(files: list[Path]) -> Optional[float]:
    """Fraction of the pages of ``files`` in the page cache (``mincore``), or None."""
    total = resident = 0
    page = mmap.PAGESIZE
    try:
        import numpy as np

        for p in files:
            size = os.path.getsize(p)
            if size == 0:
                continue
            with open(p, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mm:
                arr = np.frombuffer(mm, dtype=np.uint8)
                pages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * pages)()
                rc = _libc.mincore(ctypes.c_void_p(arr.ctypes.data), ctypes.c_size_t(size), vec)
                del arr
                if rc != 0:
                    return None
                resident += int((np.frombuffer(bytes(vec), dtype=np.uint8) & 1).sum())
                total += pages
    except (OSError, ValueError, ImportError):
        return None
    return resident / total if total else 0.0


def evict(files: list[Path], drop_caches: bool = False) -> tuple[str, Optional[float]]:
    """Drop ``files`` from the page cache; return (method, resident fraction afterwards).

    ``posix_fadvise(DONTNEED)`` after an fsync evicts the clean pages of just these files. Pages
    still mapped (a restore that keeps tensors backed by an mmap of the file) stay resident;
    the fraction tells, and the report shows such a cold figure as n/a. ``drop_caches`` empties
    the whole machine's page cache, so it is used only when asked (``--drop-caches``).
    """
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    frac = resident_fraction(files)
    if frac is not None and frac < COLD_RESIDENT_MAX:
        return "posix_fadvise(DONTNEED)", frac
    if drop_caches:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1")
            return "posix_fadvise(DONTNEED) + drop_caches", resident_fraction(files)
        except OSError as e:
            log.info("drop_caches not possible: %s", e)
    return "posix_fadvise(DONTNEED)", frac
