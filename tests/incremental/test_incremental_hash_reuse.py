"""The disk tier takes the memory tier's byte compare instead of hashing an unchanged tensor.

When the memory tier's base and the disk tier's base were committed from the same snapshot, the
SHA-256 of a tensor the memory tier found equal byte for byte is the one the disk base recorded:
it is not hashed again. A tensor changed through ``.data`` or with an unchanged CRC32C differs
from the memory base's bytes, so it is hashed and written as before. Real files on the tmpfs
and a local disk tier; the keys hashed are observed by wrapping the hash function.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest
import torch

import nebula_ckpt as nc
from incremental.test_incremental import _forge_same_crc
from nebula_ckpt.save import tier_image as compare


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[set[str]]:
    """The keys each save hashed (the real hash function runs)."""
    calls: list[set[str]] = []
    real = compare.hash_staged

    def spy(view: memoryview, index: dict[str, dict[str, Any]], keys: Any) -> dict[str, str]:
        keys = set(keys)
        calls.append(keys)
        return real(view, index, keys)

    monkeypatch.setattr(compare, "hash_staged", spy)
    return calls


def _man(root: str, step: int) -> dict[str, Any]:
    with open(os.path.join(root, f"step-{step}", "manifest.json")) as f:
        return json.load(f)


def _disk(h: Any) -> int:
    return next(n for t, n in h.metrics.written_bytes.items() if t.startswith("local:"))


def _read_disk(root: str, step: int) -> dict[str, Any]:
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
        got, state = ck.read(step)
    assert got == step
    return state


@pytest.mark.parametrize("how", ["data", "numpy"])
def test_a_change_behind_autograd_is_hashed_and_written(tmp_path, shm_dir, hashed, how) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    model = torch.nn.Linear(512, 512)
    model.weight.requires_grad_(False)
    with nc.Checkpointer(root, keep_last=5) as ck:
        ck.save(0, {"model": model})
        model.bias.data += 1.0
        h = ck.save(1, {"model": model})
        assert _disk(h) < model.weight.nbytes  # the frozen weight is referred to...
        assert "model/weight" not in hashed[-1]  # ...and was not hashed: the memory tier compared it
        m0, m1 = _man(root, 0), _man(root, 1)
        assert m1["sha256"]["model/weight"] == m0["sha256"]["model/weight"]  # recorded all the same
        if how == "data":
            model.weight.data[3, 7] += 1.0
        else:
            model.weight.detach().numpy()[3, 7] += 1.0
        h = ck.save(2, {"model": model})
        assert "model/weight" not in hashed[-1]  # its CRC32C differs: a change, no hash needed
        assert _disk(h) > model.weight.nbytes
    got = _read_disk(root, 2)
    assert torch.equal(got["model"]["weight"], model.weight) and torch.equal(got["model"]["bias"], model.bias)


def test_a_change_with_an_unchanged_crc32c_is_hashed_and_written(tmp_path, shm_dir, hashed) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    frozen = torch.randint(0, 256, (256 << 10,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    train = torch.zeros(8)
    with nc.Checkpointer(root, keep_last=5) as ck:
        ck.save(0, {"frozen": frozen, "train": train})
        train += 1
        h = ck.save(1, {"frozen": frozen, "train": train})
        assert _disk(h) < frozen.nbytes and "frozen" not in hashed[-1]
        forged = _forge_same_crc(frozen.numpy().tobytes(), 1000, 2000)
        frozen.numpy()[:] = np.frombuffer(forged, dtype=np.uint8)
        train += 1
        h = ck.save(2, {"frozen": frozen, "train": train})
        assert "frozen" in hashed[-1]  # the memory tier found its bytes changed: hashed as before
        assert _disk(h) >= frozen.nbytes
    m1, m2 = _man(root, 1), _man(root, 2)
    assert m1["tensors"]["frozen"]["crc32c"] == m2["tensors"]["frozen"]["crc32c"]
    assert m1["sha256"]["frozen"] != m2["sha256"]["frozen"]
    assert torch.equal(_read_disk(root, 2)["frozen"], frozen)


def test_bases_of_different_snapshots_hash_as_before(tmp_path, shm_dir, hashed) -> None:  # noqa: ANN001
    """The disk tier takes every other save: its base is never the memory tier's (a step later)."""
    root = str(tmp_path / "ck")
    frozen, train = torch.randn(256, 256), torch.zeros(8)
    with nc.Checkpointer(root, tiers=[nc.MemoryTier(keep_last=5), nc.LocalTier(root, every=2, keep_last=5)]) as ck:
        for step in range(5):
            train += 1
            ck.save(step, {"frozen": frozen, "train": train})
            if step in (2, 4):  # the disk tier's incremental saves: frozen hashed (CRC equal to its base's)
                assert "frozen" in hashed[-1], (step, hashed)
    assert _man(root, 4)["sha256"]["frozen"] == _man(root, 0)["sha256"]["frozen"]
    assert torch.equal(_read_disk(root, 4)["frozen"], frozen)
