"""Tests of the native extension nebula_ckpt._C against plain torch and the crc32c package."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time

import pytest
import torch

_C = pytest.importorskip("nebula_ckpt._C")
crc32c_pkg = pytest.importorskip("crc32c")

MiB = 1 << 20


def byte_image(t: torch.Tensor) -> torch.Tensor:
    """The bytes the copy engine must produce for `t` (row-major, conj/neg resolved)."""
    t = t.resolve_conj().resolve_neg()
    if t.dim() == 0:
        t = t.reshape(1)
    return t.contiguous().view(-1).view(torch.uint8)


def snapshot(srcs, threads=2, pad=0):
    """Copy srcs back to back (with `pad` bytes between) and return (dst, offsets, job)."""
    offsets, pos = [], 0
    for s in srcs:
        pos += pad
        offsets.append(pos)
        pos += s.numel() * s.element_size()
    dst = torch.full((pos + pad,), 0xAB, dtype=torch.uint8)
    eng = _C.CopyEngine(threads)
    job = eng.enqueue(list(srcs), dst, offsets)
    job.wait()
    return dst, offsets, job


def assert_images(srcs, dst, offsets, job=None):
    """Each source's bytes are in dst; with ``job``, its checksums are those of the bytes."""
    sums = job.checksums() if job is not None else None
    if sums is not None:
        assert len(sums) == len(srcs)
    for i, (s, off) in enumerate(zip(srcs, offsets, strict=False)):
        img = byte_image(s)
        got = dst[off : off + img.numel()]
        assert torch.equal(got, img), f"srcs[{i}] ({s.dtype}, {tuple(s.shape)}) differs"
        if sums is not None:
            assert sums[i] == crc32c_pkg.crc32c(img.numpy().tobytes()), f"srcs[{i}] checksum"


# --------------------------------------------------------------------------- build_info


def test_build_info():
    info = _C.build_info()
    from nebula_ckpt import __version__

    assert info["version"] == __version__  # one version: nebula_ckpt/_version.py, compiled in by setup.py
    assert info["cuda"] in (True, False)
    assert isinstance(info["crc32c_hw"], bool)
    assert isinstance(info["o_direct"], bool)
    if not torch.cuda.is_available():
        # a CUDA build still imports on a CPU-only machine, but this venv has CPU torch
        assert info["cuda"] is False or torch.version.cuda is not None


# --------------------------------------------------------------------------- copy engine

ALL_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
]
for _name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        ALL_DTYPES.append(getattr(torch, _name))


def make(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if str(dtype) in ("torch.uint16", "torch.uint32", "torch.uint64"):
        return torch.randint(0, 2**15, shape, generator=g, dtype=torch.int64).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(2**31)), min(info.max, 2**31 - 1)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_copy_every_dtype(dtype):
    base = make((37, 23), dtype)
    srcs = [
        base,  # contiguous
        base.t(),  # transposed
        base[::3, 1::2],  # sliced with steps
        base[5],  # 1-D view with storage offset
        base[2, 3],  # 0-dim view
        base[:0],  # empty
        make((), dtype, seed=1),  # 0-dim
    ]
    dst, offsets, job = snapshot(srcs, threads=2, pad=3)
    assert_images(srcs, dst, offsets, job)
    assert job.done()
    assert job.modified() == []
    assert job.seconds() >= 0.0


@pytest.mark.parametrize("pad", [0, 3, 4096])
def test_copy_checksums_of_large_unaligned_sources(pad):
    """Checksums taken while copying (streaming stores, pieces combined) equal the bytes' CRC32C."""
    g = torch.Generator().manual_seed(pad)
    srcs = [torch.randn(3 * MiB + 5, generator=g),          # ~12 MiB: several pieces per source
            torch.randint(0, 255, (300_001,), generator=g, dtype=torch.uint8),  # > 256 KiB, odd length
            torch.randn(64, 1024, generator=g).t(),         # strided: hashed after copy_
            torch.randn(7, generator=g),                    # tiny
            torch.empty(0)]
    dst, offsets, job = snapshot(srcs, threads=3, pad=pad)
    assert_images(srcs, dst, offsets, job)
    assert job.checksums()[-1] == 0  # CRC32C of no bytes


def test_copy_leaves_padding_untouched():
    srcs = [torch.arange(10, dtype=torch.int32), torch.ones(3, 4).t()]
    dst, offsets, _ = snapshot(srcs, pad=5)
    mask = torch.ones(dst.numel(), dtype=torch.bool)
    for s, off in zip(srcs, offsets, strict=False):
        mask[off : off + s.numel() * s.element_size()] = False
    assert bool((dst[mask] == 0xAB).all())


def test_copy_conj_neg_channels_last_expand_and_grad():
    z = torch.randn(4, 5, dtype=torch.complex64)
    x = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    p = torch.nn.Parameter(torch.randn(7, 3))
    e = torch.randn(1, 5).expand(4, 5)  # stride 0
    srcs = [z.conj(), torch._neg_view(torch.randn(6)), x, p, p.t(), e, torch.randn(3)[:, None]]
    dst, offsets, _ = snapshot(srcs)
    assert_images([s.detach() for s in srcs], dst, offsets)


def test_copy_inference_tensor():
    with torch.inference_mode():
        t = torch.randn(100)
    dst, offsets, job = snapshot([t, t[::2]])
    assert_images([t, t[::2]], dst, offsets)
    assert job.modified() == []


@pytest.mark.parametrize("src_off", [0, 1, 8])
@pytest.mark.parametrize("dst_off", [0, 5, 16])
def test_copy_lengths_around_block_and_lane_edges(src_off, dst_off):
    """The fused copy+CRC (3 lanes of 8 KiB / 256 B, 16-byte aligned stores, byte tails) at edges."""
    raw = torch.randint(0, 256, (3 * 64 * 1024 + 64,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    lengths = [1, 15, 16, 17, 767, 768, 769, 3 * 8192 - 1, 3 * 8192, 3 * 8192 + 785,
               64 * 1024, 64 * 1024 + 1, 2 * 64 * 1024 + 123, 256 * 1024 - 8]
    srcs = [raw[src_off:src_off + n] for n in lengths]
    offsets, pos = [], dst_off
    for n in lengths:
        offsets.append(pos)
        pos += n + 3  # keep most destinations unaligned
    dst = torch.full((pos,), 0xCD, dtype=torch.uint8)
    job = _C.CopyEngine(2).enqueue(srcs, dst, offsets)
    job.wait()
    assert_images(srcs, dst, offsets, job)
    assert job.modified() == []


def test_engine_close_is_idempotent_and_refuses_new_work():
    eng = _C.CopyEngine(2)
    src = torch.randn(4 * MiB)
    dst = torch.empty(16 * MiB, dtype=torch.uint8)
    job = eng.enqueue([src], dst, [0])
    eng.close()  # finishes the queued copy first
    assert job.done()
    assert torch.equal(dst, byte_image(src))
    eng.close()
    assert eng.num_threads == 0
    with pytest.raises(RuntimeError, match="closed"):
        eng.enqueue([src], dst, [0])


def test_many_small_tensors():
    srcs = [make((i % 13 + 1,), ALL_DTYPES[i % len(ALL_DTYPES)], seed=i) for i in range(2000)]
    srcs[7] = srcs[7][::2]
    dst, offsets, job = snapshot(srcs, threads=3, pad=1)
    assert_images(srcs, dst, offsets)
    assert job.modified() == []


def test_big_tensor_split_across_threads():
    src = torch.randn(16 * MiB)  # 64 MiB of fp32
    for threads in (1, 2, 4):
        dst, offsets, job = snapshot([src], threads=threads)
        assert torch.equal(dst[: src.numel() * 4], byte_image(src))
        assert job.done()


def test_engine_is_reusable_and_jobs_overlap():
    eng = _C.CopyEngine(2)
    assert eng.num_threads == 2
    a, b = torch.randn(3 * MiB), torch.randn(MiB).view(1024, 1024).t()
    da = torch.empty(a.numel() * 4, dtype=torch.uint8)
    db = torch.empty(b.numel() * 4, dtype=torch.uint8)
    ja = eng.enqueue([a], da, [0])
    jb = eng.enqueue([b], db, [0])
    jb.wait()
    ja.wait()
    assert torch.equal(da, byte_image(a))
    assert torch.equal(db, byte_image(b))
    for _ in range(3):  # the same engine serves many jobs
        j = eng.enqueue([a], da, [0])
        j.wait()
        j.wait()  # idempotent


def test_a_waiting_thread_copies_its_job_itself_instead_of_queueing_behind_others():
    """A job waited for is copied by the waiting thread too: it never waits behind work another
    job queued on the engine's threads (the checksums of a large copy, say)."""
    eng = _C.CopyEngine(1)
    big = torch.randn(64 * MiB)  # 256 MiB, checksummed: the one pool thread is busy with it for long
    dbig = torch.empty(big.numel() * 4, dtype=torch.uint8)
    small = [torch.randn(256 * 1024) for _ in range(4)]  # 4 MiB in several tasks
    dsmall = torch.empty(4 * MiB, dtype=torch.uint8)
    jbig = eng.enqueue([big], dbig, [0])
    jsmall = eng.enqueue(small, dsmall, [i * MiB for i in range(4)])
    jsmall.wait()
    assert not jbig.done()  # its tasks were queued first, and are still running
    assert_images(small, dsmall, [i * MiB for i in range(4)], jsmall)
    jbig.wait()
    assert torch.equal(dbig, byte_image(big))


def test_job_outlives_dropped_python_refs():
    eng = _C.CopyEngine(1)
    dst = torch.empty(32 * MiB, dtype=torch.uint8)
    src = torch.randn(8 * MiB)
    expected = byte_image(src).clone()
    job = eng.enqueue([src], dst, [0])
    del src  # the job keeps the source alive
    job.wait()
    assert torch.equal(dst, expected)
    # dropping an unfinished job (and then the engine) must not crash
    job2 = eng.enqueue([torch.randn(8 * MiB)], torch.empty(32 * MiB, dtype=torch.uint8), [0])
    del job2
    del eng


@pytest.mark.parametrize("path", ["native", "fallback"])
def test_copies_without_checksums_are_the_same_bytes(path):
    """checksum=False (what synchronous saves use: the stager hashes the staged bytes later, off
    the training thread) copies every layout exactly, returns no checksums, and still reports a
    source whose version counter moved during the copy."""
    from nebula_ckpt.native import fallback_ops, get_ops

    ops = get_ops() if path == "native" else fallback_ops()
    srcs = [make((i % 7 + 1, 33), ALL_DTYPES[i % len(ALL_DTYPES)], seed=i) for i in range(40)]
    srcs += [torch.randn(3 * MiB), torch.randn(64, 64).t(), torch.tensor(5.0)]
    offsets, pos = [], 0
    for t in srcs:
        offsets.append(pos)
        pos += t.numel() * t.element_size() + 3
    dst = torch.full((pos,), 0xAB, dtype=torch.uint8)
    job = ops.enqueue_copy(srcs, dst, offsets, checksum=False)
    job.wait()
    assert job.checksums() == []
    assert_images(srcs, dst, offsets)
    assert job.modified() == []
    with_sums = ops.enqueue_copy(srcs, torch.empty_like(dst), offsets)
    assert len(with_sums.checksums()) == len(srcs)  # the default still checksums while copying


@pytest.mark.parametrize("path", ["native", "fallback"])
def test_a_finished_copy_keeps_no_buffer_alive(path):
    """Once a copy finished and its caller dropped the job and the buffers, nothing of the copy path
    holds them (an idle copy thread must not keep its last job, and that job's staging buffer)."""
    import gc
    import weakref

    from nebula_ckpt.native import fallback_ops, get_ops

    ops = get_ops() if path == "native" else fallback_ops()
    src, dst = torch.randn(MiB), torch.empty(4 * MiB, dtype=torch.uint8)
    refs = [weakref.ref(src), weakref.ref(dst)]
    job = ops.enqueue_copy([src], dst, [0])
    job.wait()
    del job, src, dst
    gc.collect()
    assert [r() is None for r in refs] == [True, True]


def test_modified_reports_in_place_update():
    # One thread, FIFO: the big tensor is copied first, so `small` is copied
    # (and its version re-read) well after the add_ below. We only assert when
    # the job demonstrably had not finished before the mutation. `big` is cut
    # into pieces (its verdict waits for its last one), `small` is copied as one
    # piece (its verdict right after it): both name their in-place update.
    for size in (64 * MiB, 256 * MiB):
        big = torch.empty(size // 4, dtype=torch.float32)
        small = torch.zeros(16)
        dst = torch.empty(size + 64, dtype=torch.uint8)
        eng = _C.CopyEngine(1)
        job = eng.enqueue([big, small], dst, [0, size])
        finished_early = job.done()
        small.add_(1)
        big.add_(1)
        job.wait()
        if not finished_early:
            assert job.modified() == [0, 1]
            return
    pytest.skip("copy finished before the mutation could happen (machine too fast)")


def test_modified_empty_when_untouched_and_after_enqueue_mutation_of_other():
    a, b = torch.randn(1000), torch.randn(1000)
    a.add_(1)  # mutations before enqueue do not count
    dst, _, job = snapshot([a, b])
    assert job.modified() == []


def test_enqueue_validation_errors():
    eng = _C.CopyEngine(2)
    dst = torch.empty(100, dtype=torch.uint8)
    good = torch.zeros(4)
    with pytest.raises(RuntimeError, match=r"srcs\[1\] is on meta"):
        eng.enqueue([good, torch.empty(3, device="meta")], dst, [0, 16])
    with pytest.raises(RuntimeError, match=r"srcs\[2\].*dst has 100 bytes"):
        eng.enqueue([good, good, good], dst, [0, 16, 90])
    with pytest.raises(RuntimeError, match=r"srcs\[0\]"):
        eng.enqueue([good], dst, [-1])
    with pytest.raises(RuntimeError, match=r"2 srcs but 1 offsets"):
        eng.enqueue([good, good], dst, [0])
    with pytest.raises(RuntimeError, match=r"srcs\[0\] has layout"):
        eng.enqueue([torch.eye(3).to_sparse()], dst, [0])
    with pytest.raises(RuntimeError, match="dst must be uint8"):
        eng.enqueue([good], torch.empty(100), [0])
    with pytest.raises(RuntimeError, match="dst must be a 1-D contiguous"):
        eng.enqueue([good], torch.empty(10, 10, dtype=torch.uint8), [0])
    with pytest.raises(RuntimeError, match="dst must be a 1-D contiguous"):
        eng.enqueue([good], torch.empty(200, dtype=torch.uint8)[::2], [0])
    with pytest.raises(RuntimeError, match="num_threads"):
        _C.CopyEngine(0)
    # nothing was copied by the failed calls
    assert eng.enqueue([], dst, []).modified() == []


_CUDA_OK = torch.cuda.is_available() and _C.build_info()["cuda"]


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA_OK, reason="needs the CUDA build of _C and a GPU")
def test_cuda_sources_into_pinned_buffer():
    dev = torch.device("cuda")
    srcs = [
        torch.randn(1000, device=dev),
        torch.randn(64, 48, device=dev).t(),
        torch.randn(10, dtype=torch.complex64, device=dev).conj(),
        torch.tensor(3.0, device=dev).to(torch.bfloat16),
        torch.empty(0, device=dev),
        torch.randn(5),  # CPU source in the same job
        torch.randn(4 * MiB, device=dev)[::2],
    ]
    offsets, pos = [], 0
    for s in srcs:
        offsets.append(pos)
        pos += s.numel() * s.element_size()
    dst = _C.alloc_host_buffer(pos, pinned=True)
    assert dst.is_pinned()
    eng = _C.CopyEngine(2)
    job = eng.enqueue(srcs, dst, offsets)
    job.wait()
    assert job.done()
    assert job.modified() == []
    assert_images([s.cpu() for s in srcs], dst, offsets)


# --------------------------------------------------------------------------- crc32c


def _rand_bytes(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@pytest.fixture(scope="module")
def big_buf():
    return _rand_bytes(50 * MiB + 4099, seed=3)


def test_crc32c_ranges_match_package(big_buf):
    raw = big_buf.numpy().tobytes()
    sizes = [0, 1, 7, 8, 9, 4095, 4096, 4097, 3 * MiB, 3 * MiB + 5, 50 * MiB + 3]
    offsets, lengths = [], []
    for k, n in enumerate(sizes):
        off = (k * 131 + 1) % 4093  # odd offsets, unaligned
        offsets.append(off)
        lengths.append(n)
    for threads in (1, 2, 4):
        got = _C.crc32c(big_buf, offsets, lengths, threads)
        want = [crc32c_pkg.crc32c(raw[o : o + n]) for o, n in zip(offsets, lengths, strict=False)]
        assert got == want, f"threads={threads}"


def test_crc32c_many_small_ranges():
    buf = _rand_bytes(300_000, seed=5)
    raw = buf.numpy().tobytes()
    offsets = list(range(0, 290_000, 97))
    lengths = [(i * 7) % 300 for i in range(len(offsets))]
    got = _C.crc32c(buf, offsets, lengths, 2)
    assert got == [crc32c_pkg.crc32c(raw[o : o + n]) for o, n in zip(offsets, lengths, strict=False)]


def test_crc32c_errors():
    buf = _rand_bytes(100)
    with pytest.raises(RuntimeError, match="range 1"):
        _C.crc32c(buf, [0, 90], [10, 11], 1)
    with pytest.raises(RuntimeError, match="lengths"):
        _C.crc32c(buf, [0, 1], [1], 1)
    with pytest.raises(RuntimeError, match="uint8"):
        _C.crc32c(torch.zeros(10), [0], [4], 1)


def test_crc32c_bytes():
    data = _rand_bytes(1 * MiB + 13, seed=9).numpy().tobytes()
    assert _C.crc32c_bytes(b"") == 0
    assert _C.crc32c_bytes(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert _C.crc32c_bytes(data) == crc32c_pkg.crc32c(data)
    assert _C.crc32c_bytes(bytearray(data)) == crc32c_pkg.crc32c(data)
    assert _C.crc32c_bytes(memoryview(data)[3:]) == crc32c_pkg.crc32c(data[3:])
    # continuing a running checksum
    part = _C.crc32c_bytes(data[:1000])
    assert _C.crc32c_bytes(data[1000:], part) == crc32c_pkg.crc32c(data)
    assert _C.crc32c_bytes(data[1000:], value=part) == crc32c_pkg.crc32c(data[1000:], part)
    with pytest.raises(TypeError):
        _C.crc32c_bytes("not bytes")


def test_crc32c_software_fallback_in_subprocess():
    code = (
        "import torch, crc32c, nebula_ckpt._C as C\n"
        "assert C.build_info()['crc32c_hw'] is False\n"
        "b = torch.randint(0, 256, (5_000_000,), dtype=torch.uint8)\n"
        "raw = b.numpy().tobytes()\n"
        "offs = [0, 1, 3, 7, 12345]; lens = [0, 1, 4096, 4_000_000, 17]\n"
        "assert C.crc32c(b, offs, lens, 2) == [crc32c.crc32c(raw[o:o+n]) for o, n in zip(offs, lens)]\n"
        "assert C.crc32c_bytes(raw[5:]) == crc32c.crc32c(raw[5:])\n"
        "src = torch.randn(300_001)\n"  # the engine's copy + checksum, software path
        "dst = torch.zeros(src.numel() * 4 + 3, dtype=torch.uint8)\n"
        "job = C.CopyEngine(2).enqueue([src], dst, [3]); job.wait()\n"
        "assert job.checksums() == [crc32c.crc32c(src.numpy().tobytes())] and job.modified() == []\n"
        "assert dst[3:].numpy().tobytes() == src.numpy().tobytes()\n"
    )
    env = dict(os.environ, NEBULA_CRC32C_FORCE_SW="1")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)


# --------------------------------------------------------------------------- host buffers


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 10_000, 2 * MiB, 5 * MiB + 3])
def test_alloc_host_buffer(nbytes):
    t = _C.alloc_host_buffer(nbytes, prefault_threads=2)
    assert t.dtype == torch.uint8 and t.device.type == "cpu" and t.dim() == 1
    assert t.numel() == nbytes
    assert t.data_ptr() % 4096 == 0
    if nbytes >= 2 * MiB:
        assert t.data_ptr() % (2 * MiB) == 0
    assert int(t.count_nonzero()) == 0
    t.fill_(7)  # writable over the whole length
    assert int(t.sum()) == 7 * nbytes


@pytest.mark.parametrize("nbytes", [0, 4096, 3 * MiB + 1, 80 * MiB])
def test_alloc_host_buffer_without_prefault_still_reads_zero(nbytes):
    """prefault_threads=0 (a buffer a parallel copy fills at once) skips the zeroing pass, but a
    recycled heap block of a freed dirty buffer must never show through."""
    for _ in range(3):
        dirty = _C.alloc_host_buffer(nbytes, prefault_threads=1)
        dirty.fill_(0xEE)
        del dirty
        t = _C.alloc_host_buffer(nbytes, prefault_threads=0)
        assert t.numel() == nbytes and t.data_ptr() % 4096 == 0
        assert int(t.count_nonzero()) == 0


def test_alloc_host_buffer_defaults_and_errors():
    t = _C.alloc_host_buffer(8192)
    assert t.numel() == 8192
    with pytest.raises(RuntimeError):
        _C.alloc_host_buffer(-1)


@pytest.mark.skipif(
    "_C.build_info()['cuda']", reason="CPU-only build behaviour"
)
def test_pinned_needs_cuda_build():
    with pytest.raises(RuntimeError, match="pinned host buffers need the CUDA build"):
        _C.alloc_host_buffer(4096, pinned=True)


# --------------------------------------------------------------------------- file I/O


def _fs_type(path) -> str:
    try:
        best, fstype = "", ""
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mnt = parts[1]
                if str(path).startswith(mnt) and len(mnt) > len(best):
                    best, fstype = mnt, parts[2]
        return fstype
    except OSError:
        return ""


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize(
    "nbytes,chunk",
    [(0, 4096), (1, 4096), (4095, 4096), (4096, 4096), (1 * MiB + 123, 64 * 1024), (5 * MiB, MiB)],
)
def test_write_file_roundtrip(tmp_path, direct, nbytes, chunk):
    buf = _C.alloc_host_buffer(nbytes + 8192)
    buf.copy_(_rand_bytes(buf.numel(), seed=nbytes))
    path = tmp_path / f"f_{nbytes}_{int(direct)}.bin"
    used_direct = _C.write_file(str(path), buf, 0, nbytes, direct, 3, chunk, True)
    assert path.read_bytes() == buf[:nbytes].numpy().tobytes()
    assert oct(path.stat().st_mode & 0o777) in (oct(0o644 & ~_umask()), oct(0o644))
    if not direct or nbytes < 4096:
        assert used_direct is False
    elif _C.build_info()["o_direct"] and _fs_type(tmp_path) in ("ext4", "xfs", "btrfs"):
        assert used_direct is True
    # read it back into a fresh buffer, at an offset
    back = torch.zeros(nbytes + 10, dtype=torch.uint8)
    _C.read_file(str(path), back, 10, nbytes, 2)
    assert torch.equal(back[10:], buf[:nbytes])
    assert int(back[:10].count_nonzero()) == 0


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def test_write_file_unaligned_source_falls_back(tmp_path):
    buf = _C.alloc_host_buffer(3 * MiB)
    buf.copy_(_rand_bytes(buf.numel(), seed=11))
    path = tmp_path / "odd.bin"
    used = _C.write_file(str(path), buf, 1, 2 * MiB + 5, True, 2, MiB, False)
    assert used is False  # source address not 4096-aligned
    assert path.read_bytes() == buf[1 : 1 + 2 * MiB + 5].numpy().tobytes()


def test_write_file_truncates_existing(tmp_path):
    path = tmp_path / "t.bin"
    path.write_bytes(b"x" * 100_000)
    buf = _rand_bytes(5000)
    _C.write_file(str(path), buf, 0, 5000, False, 2, 4096, False)
    assert path.read_bytes() == buf.numpy().tobytes()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (tmpfs)")
def test_write_file_direct_on_tmpfs_falls_back():
    buf = _C.alloc_host_buffer(MiB + 4096 + 7)
    buf.copy_(_rand_bytes(buf.numel(), seed=12))
    path = f"/dev/shm/nebula_test_{os.getpid()}.bin"
    try:
        _C.write_file(path, buf, 0, buf.numel(), True, 2, 256 * 1024, True)
        with open(path, "rb") as f:
            assert f.read() == buf.numpy().tobytes()
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_write_file_missing_directory(tmp_path):
    path = tmp_path / "no" / "such" / "dir" / "x.bin"
    buf = _rand_bytes(10)
    with pytest.raises(FileNotFoundError) as ei:
        _C.write_file(str(path), buf, 0, 10, False, 1, 4096, False)
    assert ei.value.errno == errno.ENOENT
    assert ei.value.filename == str(path)
    assert str(path) in str(ei.value)
    assert "No such file or directory" in str(ei.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root bypasses file permissions")
def test_write_file_permission_denied(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        with pytest.raises(PermissionError) as ei:
            _C.write_file(str(d / "x.bin"), _rand_bytes(10), 0, 10, False, 1, 4096, False)
        assert ei.value.errno == errno.EACCES
    finally:
        d.chmod(0o700)


def test_write_file_into_directory_is_oserror(tmp_path):
    # EISDIR: an errno root does not bypass
    with pytest.raises(IsADirectoryError) as ei:
        _C.write_file(str(tmp_path), _rand_bytes(10), 0, 10, False, 1, 4096, False)
    assert ei.value.errno == errno.EISDIR
    assert ei.value.filename == str(tmp_path)


def test_write_file_bad_range(tmp_path):
    buf = _rand_bytes(10)
    with pytest.raises(RuntimeError, match="outside buf"):
        _C.write_file(str(tmp_path / "x"), buf, 5, 6, False, 1, 4096, False)


def test_read_file_errors(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"abc")
    buf = torch.zeros(10, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="short.bin.*3 bytes"):
        _C.read_file(str(path), buf, 0, 10, 1)
    with pytest.raises(FileNotFoundError, match="missing.bin"):
        _C.read_file(str(tmp_path / "missing.bin"), buf, 0, 1, 1)
    _C.read_file(str(path), buf, 0, 2, 1)  # prefix of a longer file is fine
    assert bytes(buf[:2].tolist()) == b"ab"


# ENOSPC on a real (tiny tmpfs) file system, for both paths: tests/native/test_io_errors.py


# --------------------------------------------------------------------------- GIL


def test_blocking_calls_release_the_gil():
    # While a native call runs on this thread, a Python thread must progress.
    import threading

    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    th = threading.Thread(target=ticker)
    th.start()
    try:
        buf = _rand_bytes(64 * MiB)
        t0 = time.perf_counter()
        for _ in range(8):
            _C.crc32c(buf, [0], [buf.numel()], 1)
        t1 = time.perf_counter()
    finally:
        stop.set()
        th.join()
    during = [t for t in ticks if t0 <= t <= t1]
    assert len(during) >= 2, "ticker thread starved: GIL not released?"


# --------------------------------------------------------------------------- copy_into (restore)


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_copy_into_fills_each_destination_with_its_bytes(threads):
    # every dtype's byte image, sizes around the piece and task edges, a large one split over threads
    src = _rand_bytes(24 * MiB + 4099)
    dsts = [torch.zeros(3, dtype=torch.bfloat16), torch.zeros(0), torch.zeros((), dtype=torch.int64),
            torch.zeros(MiB - 1, dtype=torch.uint8), torch.zeros(5 * MiB // 4 + 3), torch.zeros(7, dtype=torch.bool),
            torch.zeros(2, 3, dtype=torch.complex64), torch.zeros(4 * MiB + 1, dtype=torch.uint8)]
    offsets, at = [], 1
    for d in dsts:
        offsets.append(at)
        at += d.numel() * d.element_size() + 13
    versions = [d._version for d in dsts]
    _C.copy_into(src, offsets, dsts, threads)
    for i, (d, off) in enumerate(zip(dsts, offsets, strict=True)):
        n = d.numel() * d.element_size()
        assert torch.equal(d.reshape(-1).view(torch.uint8), src[off:off + n]), f"dsts[{i}] ({d.dtype})"
        assert d._version > versions[i] or not d.numel(), f"dsts[{i}]: version counter not bumped"


def test_copy_into_checks_every_argument_before_writing_anything():
    src = _rand_bytes(1024)
    good = torch.zeros(8)
    cases = [([0, 1000], [good, torch.zeros(8)], r"range 1 \[1000, 1000 \+ 32\) is outside src of 1024"),
             ([0, 64], [good, torch.zeros(8, 2).t()], "destination 1 must be a contiguous CPU tensor"),
             ([0, 64], [good, torch.empty(3, device="meta")], "destination 1 must be a contiguous CPU"),
             ([0, -1], [good, torch.zeros(2)], "range 1"),
             ([0], [good, good], "1 offsets for 2 destinations")]
    for offsets, dsts, match in cases:
        with pytest.raises(RuntimeError, match=match):
            _C.copy_into(src, offsets, dsts, 2)
        assert not good.any(), f"destination 0 was written before {match!r} was refused"
    with pytest.raises(RuntimeError, match="overlaps its source"):
        _C.copy_into(src, [0], [src[8:40]], 2)
    shrunk = torch.zeros(64)
    shrunk.untyped_storage().resize_(0)  # what FSDP does to a sharded parameter's storage
    with pytest.raises(RuntimeError, match="storage does not hold its bytes"):
        _C.copy_into(src, [0], [shrunk], 2)
    with pytest.raises(RuntimeError, match="src must be a 1-D contiguous uint8"):
        _C.copy_into(torch.zeros(256), [0], [good], 2)
