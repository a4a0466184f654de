"""The restore floor: what any verified restore of the state into live tensors must cost.

A restore reads each byte once, checks it once and writes it once into the tensors of the model
and optimizer. The floor measures exactly that, on the same state, disk and page cache as the
systems' restores: the state's tensors are written back to back into one plain file (with the
CRC32C of each), then each run reads the file a chunk at a time, takes the CRC32C of every
tensor in the chunk (the library's native multi-threaded CRC32C, compared with the recorded one)
and copies the chunk's tensors into the live ones (the library's native multi-threaded copy,
:meth:`~nebula_ckpt.native.FallbackOps.copy_into`: no intra-op parallel region per tensor). Two
ways of reading, the better one is the floor:

* ``read``: ``readinto`` a reused buffer whose pages were touched before (the kernel copies the
  page cache into it);
* ``mmap``: the file mapped, each chunk's pages mapped in one ``MADV_POPULATE_READ`` call,
  checked and copied from there, then dropped from the process.

Warm: the file's pages cached (a run before); cold: evicted first with the same
:func:`~benchmarks.limits.evict` the systems' cold restores use. Each tier is held to the floor of
where its bytes lie: the disk's for the disk tiers, tmpfs's for the memory tier
(:func:`measure_tmpfs_floor`, in the memory tier's own ``shm_dir``; tmpfs keeps 4 KiB pages that
cost more page-table work than a disk file's page cache, and cannot be evicted). Nothing else is done: no
manifest, no tree, no Python object per tensor beyond the copy call, so it is a floor, not a
peer.
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import workloads as wl
from benchmarks.limits import evict, resident_fraction
from nebula_ckpt import knobs
from nebula_ckpt.native import get_ops

log = logging.getLogger(__name__)

CHUNK = 64 << 20
_MADV_POPULATE_READ = 22


def live_tensors(w: wl.Workload) -> list[torch.Tensor]:
    """The tensors a restore of ``w`` writes: the model's state dict and the optimizer's state
    (each storage once, as a checkpoint stores tied tensors once)."""
    out, seen = [], set()
    tensors = list(w.model.state_dict().values()) + [v for st in w.optimizer.state.values()
                                                       for v in st.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        if t.numel() and t.is_contiguous() and t.device.type == "cpu" and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            out.append(t)
    return out


def write_image(path: Path, tensors: list[torch.Tensor]) -> list[tuple[int, int, int]]:
    """Write ``tensors`` back to back into ``path`` (fsynced); their ``(offset, bytes, crc32c)``."""
    ops = get_ops()
    layout, at = [], 0
    with open(path, "wb") as f:
        for t in tensors:
            raw = t.detach().reshape(-1).view(torch.uint8)
            f.write(raw.numpy().data)
            layout.append((at, raw.numel(), ops.crc32c(raw, [0], [raw.numel()])[0]))
            at += raw.numel()
        f.flush()
        os.fsync(f.fileno())
    return layout


def _groups(layout: list[tuple[int, int, int]]) -> list[list[int]]:
    """Indices of ``layout`` in consecutive groups of at most CHUNK bytes (a larger tensor alone)."""
    out: list[list[int]] = []
    size = 0
    for i, (_, n, _) in enumerate(layout):
        if not out or size + n > CHUNK:
            out.append([])
            size = 0
        out[-1].append(i)
        size += n
    return out


def _check_and_copy(buf: torch.Tensor, base: int, idx: list[int], layout: list[tuple[int, int, int]],
                    tensors: list[torch.Tensor]) -> None:
    crcs = get_ops().crc32c(buf, [layout[i][0] - base for i in idx], [layout[i][1] for i in idx])
    for i, c in zip(idx, crcs, strict=True):
        if c != layout[i][2]:
            raise RuntimeError(f"restore floor: checksum mismatch in tensor {i}")
    get_ops().copy_into(buf, [layout[i][0] - base for i in idx], [tensors[i] for i in idx])


def run_read(path: Path, layout: list[tuple[int, int, int]], tensors: list[torch.Tensor],
             buf: torch.Tensor) -> float:
    """One floor restore by ``readinto`` a touched buffer; seconds."""
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        for idx in _groups(layout):
            base = layout[idx[0]][0]
            n = layout[idx[-1]][0] + layout[idx[-1]][1] - base
            view = buf.numpy().data.cast("B")[:n]
            got = 0
            while got < n:
                r = f.readinto(view[got:])
                if not r:
                    raise RuntimeError("restore floor: the file is shorter than its layout")
                got += r
            _check_and_copy(buf, base, idx, layout, tensors)
    return time.perf_counter() - t0


def run_mmap(path: Path, layout: list[tuple[int, int, int]], tensors: list[torch.Tensor]) -> float:
    """One floor restore from a mapping of the file, a chunk populated at a time; seconds."""
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    whole = torch.frombuffer(mm, dtype=torch.uint8)
    page = mmap.PAGESIZE
    for idx in _groups(layout):
        base = layout[idx[0]][0]
        end = layout[idx[-1]][0] + layout[idx[-1]][1]
        lo = base // page * page
        try:
            mm.madvise(_MADV_POPULATE_READ, lo, end - lo)
        except OSError:
            pass  # an old kernel: the pages fault in as they are read
        _check_and_copy(whole[base:end], base, idx, layout, tensors)
        mm.madvise(mmap.MADV_DONTNEED, lo, end - lo)
    del whole
    mm.close()
    return time.perf_counter() - t0


def measure_restore_floor(w: wl.Workload, folder: Path, reps: int = 3, drop_caches: bool = False) -> dict[str, Any]:
    """The floor of a restore of ``w``'s state into its live tensors, warm and cold (medians of
    ``reps`` per way of reading; the floor is the better way)."""
    tensors = live_tensors(w)
    path = folder / "restore-floor.bin"
    layout = write_image(path, tensors)
    largest = max(n for _, n, _ in layout)
    buf = get_ops().alloc(max(CHUNK, largest), prefault=True)
    res: dict[str, Any] = {"bytes": sum(n for _, n, _ in layout), "tensors": len(layout)}
    try:
        for how in ("read", "mmap"):
            cpu: dict[str, list[float]] = {"first": [], "warm": [], "cold": []}

            def once(mode: str, how: str = how, cpu: dict[str, list[float]] = cpu) -> float:
                c0 = time.process_time()
                took = run_read(path, layout, tensors, buf) if how == "read" else run_mmap(path, layout, tensors)
                cpu[mode].append(time.process_time() - c0)
                return took
            once("first")  # warms the page cache (and the code paths)
            res[f"{how}_warm_s"] = statistics.median(once("warm") for _ in range(reps))
            colds = []
            for _ in range(reps):
                method, frac = evict([path], drop_caches)
                res["cold_method"], res["cold_resident_fraction"] = method, frac
                colds.append(once("cold"))
            res[f"{how}_cold_s"] = statistics.median(colds)
            res[f"{how}_warm_cpu_s"], res[f"{how}_cold_cpu_s"] = (statistics.median(cpu[m]) for m in ("warm", "cold"))
        res["warm_s"] = min(res["read_warm_s"], res["mmap_warm_s"])
        res["cold_s"] = min(res["read_cold_s"], res["mmap_cold_s"])
        res["warm_cpu_s"] = min(res["read_warm_cpu_s"], res["mmap_warm_cpu_s"])
        res["cold_cpu_s"] = min(res["read_cold_cpu_s"], res["mmap_cold_cpu_s"])
        res["after_resident_fraction"] = resident_fraction([path])
    finally:
        path.unlink(missing_ok=True)
    return res


def measure_tmpfs_floor(w: wl.Workload, reps: int = 3) -> dict[str, Any]:
    """:func:`measure_restore_floor` with the file in the memory tier's tmpfs folder (``shm_dir``):
    the floor of the memory tier's restore (its "cold" is warm: tmpfs pages are never evicted)."""
    folder = Path(tempfile.mkdtemp(prefix="restore-floor-", dir=knobs.get("shm_dir")))
    try:
        return measure_restore_floor(w, folder, reps=reps)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
