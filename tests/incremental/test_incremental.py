"""Incremental checkpoints: a save writes only the tensors that changed, and every step restores.

Real files on a real local tier (and the memory tier beside it); the blob tiers are in
tests/blob/test_incremental_remote.py and the crashes in tests/crash/.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt import knobs
from nebula_ckpt.errors import CorruptCheckpointError


def _state(frozen: torch.Tensor, train: torch.Tensor, step: int) -> dict[str, object]:
    return {"frozen": frozen, "train": train, "step": step}


def _man(root: str, step: int) -> dict:
    with open(os.path.join(root, f"step-{step}", "manifest.json")) as f:
        return json.load(f)


def _restore(root: str, step: int) -> dict[str, torch.Tensor]:
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
        got, state = ck.read(step)
        assert got == step
        return state


def _frozen() -> torch.Tensor:
    return torch.randn(512, 512, generator=torch.Generator().manual_seed(1))


def test_chain_of_incremental_saves_restores_every_step_bit_exact(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    frozen, train = _frozen(), torch.zeros(256)
    want = {}
    with knobs.override(incremental_full_every=4), nc.Checkpointer(root, keep_last=20) as ck:
        for step in range(9):
            train += step + 0.5
            h = ck.save(step, _state(frozen, train, step))
            want[step] = train.clone()
            disk = next(t for t in h.metrics.written_bytes if t.startswith("local:"))
            full = step % 4 == 0
            n = h.metrics.written_bytes[disk]
            assert (n == h.metrics.bytes) if full else (n < 4096 + 2 * train.nbytes), (step, n)
            mem = [t for t in h.metrics.written_bytes if t.startswith("memory")]
            assert mem and all((h.metrics.written_bytes[t] == h.metrics.bytes) == full for t in mem)  # memory tier too
    for step in range(9):
        man = _man(root, step)
        refs = [s.get("step") for s in man["shards"][1:]]
        assert refs == ([] if step % 4 == 0 else [step - step % 4]), (step, man["shards"])
        got = _restore(root, step)
        assert torch.equal(got["frozen"], frozen) and torch.equal(got["train"], want[step])
        assert got["step"] == step
    with nc.Checkpointer(root, memory_tier=False) as ck:  # load_latest into live tensors
        into = _state(torch.zeros(512, 512), torch.zeros(256), -1)
        assert ck.load_latest(into=into) == 8
        assert torch.equal(into["frozen"], frozen) and torch.equal(into["train"], want[8])


def test_incremental_false_writes_everything(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    frozen, train = _frozen(), torch.zeros(16)
    with nc.Checkpointer(root, memory_tier=False, incremental=False) as ck:
        for step in range(3):
            train += 1
            h = ck.save(step, _state(frozen, train, step))
            assert list(h.metrics.written_bytes.values()) == [h.metrics.bytes]
    assert all(len(_man(root, s)["shards"]) == 1 for s in range(3))
    with pytest.raises(nc.ValidationError, match="incremental"):
        nc.Checkpointer(root, incremental="yes")  # type: ignore[arg-type]


def _forge_same_crc(data: bytes, changed_at: int, fix_at: int) -> bytes:
    """``data`` with byte ``changed_at`` flipped and the 4 bytes at ``fix_at`` chosen so that the
    CRC32C is unchanged (CRC is affine over GF(2): solve 32 linear equations)."""
    import crc32c

    zero = crc32c.crc32c(bytes(len(data)))

    def lin(delta: bytes) -> int:
        return crc32c.crc32c(delta) ^ zero

    target = bytearray(len(data))
    target[changed_at] = 0xFF
    goal = lin(bytes(target))  # the fix must cancel this
    cols = []
    for bit in range(32):
        d = bytearray(len(data))
        d[fix_at + bit // 8] = 1 << (bit % 8)
        cols.append(lin(bytes(d)))
    # Gaussian elimination: find x (32 bits) with XOR of cols[i] for x_i = 1 equal to goal
    rows = [(cols[i], 1 << i) for i in range(32)]
    basis: dict[int, tuple[int, int]] = {}
    for v, combo in rows:
        for b in range(31, -1, -1):
            if not v >> b & 1:
                continue
            if b in basis:
                v ^= basis[b][0]
                combo ^= basis[b][1]
            else:
                basis[b] = (v, combo)
                break
    x, g = 0, goal
    for b in range(31, -1, -1):
        if g >> b & 1:
            assert b in basis, "the 4 fix bytes do not span the CRC space"
            g ^= basis[b][0]
            x ^= basis[b][1]
    out = bytearray(data)
    out[changed_at] ^= 0xFF
    for bit in range(32):
        if x >> bit & 1:
            out[fix_at + bit // 8] ^= 1 << (bit % 8)
    assert crc32c.crc32c(bytes(out)) == crc32c.crc32c(data) and bytes(out) != data
    return bytes(out)


def test_a_change_with_an_unchanged_crc32c_is_written(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    frozen = torch.randint(0, 256, (64 << 10,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    train = torch.zeros(8)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(0, _state(frozen, train, 0))
        forged = _forge_same_crc(frozen.numpy().tobytes(), 1000, 2000)
        frozen.numpy()[:] = np.frombuffer(forged, dtype=np.uint8)  # changed through NumPy
        h = ck.save(1, _state(frozen, train, 1))
        assert list(h.metrics.written_bytes.values())[0] >= frozen.nbytes  # the forged tensor was written
    m0, m1 = _man(root, 0), _man(root, 1)
    assert m0["tensors"]["frozen"]["crc32c"] == m1["tensors"]["frozen"]["crc32c"]
    assert m0["sha256"]["frozen"] != m1["sha256"]["frozen"]
    assert torch.equal(_restore(root, 1)["frozen"], frozen)


@pytest.mark.parametrize("how", ["data", "numpy"])
def test_a_frozen_tensor_changed_behind_autograd_is_written(tmp_path, shm_dir, how) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    model = torch.nn.Linear(256, 256)
    model.weight.requires_grad_(False)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(0, {"model": model})
        h = ck.save(1, {"model": model})
        assert list(h.metrics.written_bytes.values())[0] < model.weight.nbytes  # unchanged: referred to
        if how == "data":
            model.weight.data[3, 7] += 1.0
        else:
            model.weight.detach().numpy()[3, 7] += 1.0
        h = ck.save(2, {"model": model})
        assert list(h.metrics.written_bytes.values())[0] > model.weight.nbytes
    fresh = torch.nn.Linear(256, 256)
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
        ck.load(2, into={"model": fresh})
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    assert not any(s.get("step") == 1 for s in _man(root, 2)["shards"])


def test_retention_and_remove_keep_referenced_steps(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    frozen, train = _frozen(), torch.zeros(64)
    with knobs.override(incremental_full_every=3), nc.Checkpointer(root, memory_tier=False, keep_last=1) as ck:
        for step in range(3):
            train += 1
            ck.save(step, _state(frozen, train, step))
            # keep_last=1, but the full step 0 holds the frozen bytes steps 1 and 2 refer to
            assert sorted(ck.list()) == sorted({0, step}), ck.list()
        assert ck.remove(step=0) == [0]  # referred to by step 2: kept until nothing refers to it
        assert 0 in ck.list()
        assert torch.equal(_restore(root, 2)["frozen"], frozen)
        train += 1
        ck.save(3, _state(frozen, train, 3))  # full (every 3rd): nothing refers to 0, 1, 2 now
        assert ck.list() == [3]
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-3"]


def test_remove_of_an_unreferenced_base_makes_the_next_save_full(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    frozen, train = _frozen(), torch.zeros(64)
    with nc.Checkpointer(root, memory_tier=False, keep_last=5) as ck:
        ck.save(0, _state(frozen, train, 0))
        assert ck.remove(step=0) == [0] and ck.list() == []
        h = ck.save(1, _state(frozen, train, 1))
        assert list(h.metrics.written_bytes.values()) == [h.metrics.bytes]
    assert torch.equal(_restore(root, 1)["frozen"], frozen)


def _chain(root: str) -> None:
    frozen, train = _frozen(), torch.zeros(64)
    with nc.Checkpointer(root, memory_tier=False, keep_last=5) as ck:
        for step in range(2):
            train += 1
            ck.save(step, _state(frozen, train, step))


def test_a_missing_referenced_step_is_corrupt_and_the_newest_healthy_one_loads(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    _chain(root)
    os.remove(os.path.join(root, "step-0", "COMMIT"))
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
        with pytest.raises(CorruptCheckpointError, match="refers to step 0"):
            ck.read(1)


def test_a_referenced_shard_of_another_size_is_corrupt(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    _chain(root)
    with open(os.path.join(root, "step-0", "shard-g1-r0.safetensors"), "ab") as f:
        f.write(b"x")
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
        with pytest.raises(CorruptCheckpointError, match="shard-g1-r0.safetensors"):
            ck.read(1)


def test_an_incremental_shard_opens_with_safe_open(tmp_path, shm_dir) -> None:  # noqa: ANN001
    from safetensors import safe_open

    root = str(tmp_path / "ck")
    _chain(root)
    with safe_open(os.path.join(root, "step-1", "shard-g1-r0.safetensors"), "pt") as f:
        assert list(f.keys()) == ["train"]
        assert torch.equal(f.get_tensor("train"), torch.full((64,), 2.0))


def test_close_puts_an_incremental_newest_step_whole_on_a_tier_that_skipped_it(tmp_path, shm_dir) -> None:  # noqa: ANN001
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    frozen, train = _frozen(), torch.zeros(64)
    with nc.Checkpointer(a, tiers=[nc.LocalTier(a), nc.LocalTier(b, every=3)], keep_last=10) as ck:
        for step in range(5):
            train += 1
            ck.save(step, _state(frozen, train, step))
    assert len(_man(a, 4)["shards"]) == 2  # incremental on the tier that took every save
    assert len(_man(b, 4)["shards"]) == 1  # copied at close(): whole
    with nc.Checkpointer(b, tiers=[nc.LocalTier(b)], read_only=True) as ck:
        got, state = ck.read(4)
    assert got == 4 and torch.equal(state["frozen"], frozen) and torch.equal(state["train"], train)


def test_a_stale_fenced_writer_cannot_drop_a_referenced_base(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    frozen, train = _frozen(), torch.zeros(64)
    stale = nc.Checkpointer(root, memory_tier=False, keep_last=1, on_persist_error="log")
    try:
        stale.save(0, _state(frozen, train, 0))
        train += 1
        stale.save(1, _state(frozen, train, 1))  # refers to step 0
        want = train.clone()
        with nc.Checkpointer(root, memory_tier=False, keep_last=5) as newer:  # a restart beside it
            newer.save(2, _state(frozen, train + 1, 2))  # a new generation: full
            assert len(_man(root, 2)["shards"]) == 1
        with pytest.raises(nc.FencedError):
            stale.remove(step=0)
        h = stale.save_async(3, _state(frozen, train, 3))
        assert h.wait(60) and isinstance(h.error(), nc.FencedError) and not h.tiers_written
    finally:
        stale.close()
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-0", "step-1", "step-2"]
    got = _restore(root, 1)
    assert torch.equal(got["frozen"], frozen) and torch.equal(got["train"], want)


def test_saving_a_referenced_step_again_drops_the_steps_that_refer_to_it(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    frozen, train = _frozen(), torch.zeros(64)
    with nc.Checkpointer(root, memory_tier=False, keep_last=10) as ck:
        for step in range(3):
            train += 1
            ck.save(step, _state(frozen, train, step))  # 1 and 2 refer to 0
    other = frozen + 1  # a run resumed from before step 0 saves step 0 again, with other bytes
    with nc.Checkpointer(root, memory_tier=False, keep_last=10) as ck:
        ck.save(0, _state(other, train, 0))
        assert ck.list() == [0]  # 1 and 2 referred to the old step 0's bytes: gone with it
    got = _restore(root, 0)
    assert torch.equal(got["frozen"], other)


def test_saving_the_same_step_again_in_one_run_is_full_and_restores(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    frozen, train = _frozen(), torch.zeros(64)
    with nc.Checkpointer(root, memory_tier=False, keep_last=10) as ck:
        ck.save(0, _state(frozen, train, 0))
        ck.save(1, _state(frozen, train, 1))
        train += 1
        h = ck.save(1, _state(frozen, train, 1))  # its base would be itself: written whole
        assert list(h.metrics.written_bytes.values()) == [h.metrics.bytes]
    got = _restore(root, 1)
    assert torch.equal(got["frozen"], frozen) and torch.equal(got["train"], train)


def test_a_flipped_byte_in_a_referenced_shard_is_caught(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    _chain(root)
    path = os.path.join(root, "step-0", "shard-g1-r0.safetensors")
    with open(path, "r+b") as f:
        f.seek(_man(root, 0)["tensors"]["frozen"]["offsets"][0] + 100)  # step 1 takes "frozen" from step 0
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 1]))
    with nc.Checkpointer(root, tiers=[nc.LocalTier(root, verify="full")], read_only=True) as ck:
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch in tensor 'frozen'"):
            ck.read(1)


def test_a_missing_referenced_folder_is_corrupt(tmp_path, shm_dir) -> None:  # noqa: ANN001
    import shutil

    root = str(tmp_path / "ck")
    _chain(root)
    shutil.rmtree(os.path.join(root, "step-0"))
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
        with pytest.raises(CorruptCheckpointError, match="refers to step 0"):
            ck.read(1)


def test_only_a_first_save_hashes_every_tensor_and_a_full_save_keeps_the_chain(tmp_path, shm_dir) -> None:  # noqa: ANN001
    """A tensor whose CRC32C differs from the base's is certainly changed: it is never hashed, so
    dense training pays no SHA-256; the frozen tensor's hash is recorded in every save (the
    cadence-full ones included), so the save after a full one still refers to it."""
    root = str(tmp_path / "ck")
    frozen, train = _frozen(), torch.zeros(256)
    with knobs.override(incremental_full_every=3), nc.Checkpointer(root, memory_tier=False, keep_last=20) as ck:
        for step in range(7):
            train += 1.0
            ck.save(step, _state(frozen, train, step))
    hashed = {step: set(_man(root, step).get("sha256", {})) for step in range(7)}
    assert hashed[0] == {"frozen", "train"}, hashed[0]  # no base: everything
    for step in range(1, 7):
        assert hashed[step] == {"frozen"}, (step, hashed[step])
    refs = {step: [s.get("step") for s in _man(root, step)["shards"][1:]] for step in range(7)}
    assert refs == {0: [], 1: [0], 2: [0], 3: [], 4: [3], 5: [3], 6: []}, refs
    for step in range(7):
        got = _restore(root, step)
        assert torch.equal(got["frozen"], frozen) and float(got["train"][0]) == step + 1.0


def test_the_hash_threads_yield_to_training(tmp_path, shm_dir, monkeypatch) -> None:  # noqa: ANN001
    """The SHA-256 threads run niced (HASH_NICE), so they never compete with training for a core."""
    import threading

    from nebula_ckpt.save import incremental

    seen: list[int] = []
    real = incremental.yield_to_training

    def spy() -> None:
        real()
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    base = os.getpriority(os.PRIO_PROCESS, 0)
    data = bytes(range(256)) * 64
    index = {"a": {"offsets": [0, 8192]}, "b": {"offsets": [8192, 16384]}}
    try:
        incremental.yield_to_training = spy
        monkeypatch.setattr(incremental, "HASH_NICE", 7)
        with knobs.override(io_threads=2):
            got = incremental.hash_staged(memoryview(data), index, ["a", "b"])
    finally:
        incremental.yield_to_training = real
    assert seen and all(p == min(19, base + 7) for p in seen), (base, seen)
    assert got["a"] == got["b"] == __import__("hashlib").sha256(data[:8192]).hexdigest()
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the calling (training) thread is untouched
