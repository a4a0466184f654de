"""Fault-ahead of a fresh staging buffer (:mod:`nebula_ckpt.storage.prefault`): background threads
populate its pages while the first save's copy fills it; the snapshot stays exact."""

from __future__ import annotations

import os

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt.native import get_ops
from nebula_ckpt.save import buffers
from nebula_ckpt.storage import prefault

MB = 1 << 20


def _random_tensors(total: int, parts: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-2**31, 2**31 - 1, (total // parts // 4,), dtype=torch.int32, generator=g)
            for _ in range(parts)]


def test_pages_faulted_ahead_while_the_copy_runs_hold_exactly_the_copied_bytes() -> None:
    srcs = _random_tensors(96 * MB, 6, seed=1)
    offsets = [i * srcs[0].numel() * 4 for i in range(len(srcs))]
    buf = get_ops().alloc(96 * MB, False, prefault=False)
    ahead = prefault.FaultAhead(buf, 2)
    get_ops().enqueue_copy(srcs, buf, offsets, checksum=False).wait()
    ahead.join()
    if ahead.faulted_bytes == 0:
        pytest.skip("madvise(MADV_POPULATE_WRITE) is not available here (Linux >= 5.14)")
    assert torch.equal(buf.view(torch.int32), torch.cat(srcs))


def test_faulting_ahead_never_changes_bytes_already_written() -> None:
    buf = get_ops().alloc(40 * MB, False, prefault=False)
    half = 20 * MB
    buf[:half].copy_(torch.arange(half, dtype=torch.int64).to(torch.uint8))  # the copy got here first
    ahead = prefault.FaultAhead(buf, 3)
    ahead.join()
    assert torch.equal(buf[:half], torch.arange(half, dtype=torch.int64).to(torch.uint8))
    assert int(buf[half:].count_nonzero()) == 0  # fresh pages read as zeros, faulted or not


def test_the_first_save_of_the_default_path_is_exact_with_its_pages_faulted_ahead(
        root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[prefault.FaultAhead] = []

    class Spy(prefault.FaultAhead):
        def __init__(self, buf: torch.Tensor, threads: int) -> None:
            super().__init__(buf, threads)
            started.append(self)

    monkeypatch.setattr(buffers, "FaultAhead", Spy)
    state = {f"w{i}": t for i, t in enumerate(_random_tensors(64 * MB, 4, seed=2))}
    want = {k: v.clone() for k, v in state.items()}
    monkeypatch.setattr(prefault, "FAULT_AHEAD_THREADS", 2)
    ck = nc.Checkpointer(root)
    try:
        ck.save_async(1, state).result()
        for t in state.values():  # the training goes on: the checkpoint must not follow
            t.add_(1)
        ck.save_async(2, state).result()
    finally:
        ck.close()
    assert len(started) == 1, "only the first save stages in fresh memory"  # the second finds a buffer
    for s in started:
        s.join()
    with nc.Checkpointer(root) as ck:
        for step, delta in ((1, 0), (2, 1)):
            got_step, got = ck.read(step)
            assert got_step == step
            assert set(got) == set(want)
            for k, v in want.items():
                assert torch.equal(got[k], v + delta), (step, k)


def test_no_thread_is_started_when_fault_ahead_threads_is_zero(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[object] = []
    monkeypatch.setattr(buffers, "FaultAhead", lambda *a: started.append(a))
    monkeypatch.setattr(prefault, "FAULT_AHEAD_THREADS", 0)
    with nc.Checkpointer(root) as ck:
        ck.save_async(1, {"w": torch.ones(16 * MB)}).result()
    assert started == []


def test_a_finished_fault_ahead_keeps_no_buffer_alive() -> None:
    import gc
    import weakref

    buf = get_ops().alloc(32 * MB, False, prefault=False)
    ahead = prefault.FaultAhead(buf, 2)
    ahead.join()
    ref = weakref.ref(buf)
    del buf
    gc.collect()
    assert ref() is None, "a buffer the pool freed would stay mapped as long as its faulter object lives"
    assert not ahead.running()


def test_populate_mapping_allocates_every_page_of_a_hole(shm_dir: str) -> None:
    """The receive mappings of replicas are populated through libc (no GIL held): every page of a
    sparse tmpfs file exists afterwards; a read-only mapping falls back to mmap's own call, and a
    closed one is a no-op."""
    import mmap as _mmap

    from nebula_ckpt.storage.prefault import advise, populate_mapping
    path = os.path.join(shm_dir, "hole")
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 8 << 20)
        assert os.fstat(fd).st_blocks == 0
        m = _mmap.mmap(fd, 8 << 20)
        assert populate_mapping(m)
        assert os.fstat(fd).st_blocks * 512 >= 8 << 20
        m.close()
        assert not advise(m, 0, 4096, 4)
        ro = _mmap.mmap(fd, 8 << 20, prot=_mmap.PROT_READ)
        assert advise(ro, 4096, 8192, 4)  # MADV_DONTNEED through mmap.madvise
        ro.close()
    finally:
        os.close(fd)
