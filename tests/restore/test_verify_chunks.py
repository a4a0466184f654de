"""The checksum pass of a restore from disk, a chunk at a time with the next chunk read ahead on a
thread of its own: every chunk is checked (damage in the first, a middle or the last chunk is
found and named, the live tensors untouched), a clean restore is bit-exact, and no read-ahead
thread outlives the restore, however it ended."""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import pytest
import torch

import nebula_ckpt as nc
import nebula_ckpt.restore.open as open_mod
from nebula_ckpt.storage.prefault import MADV_POPULATE_READ

MiB = 1 << 20
N = 12  # tensors of 4 MiB: a restore checks them in chunks of 4 MiB (chunks() takes a sixteenth, at least 4 MiB)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i:02d}": torch.randn(MiB, generator=g) for i in range(N)}


def _read_ahead_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("nebula-read-ahead")]


@pytest.fixture
def populates(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The ranges mapped ahead (``MADV_POPULATE_READ``) during the restore; the advice still runs."""
    seen: list[tuple[int, int]] = []
    real = open_mod.advise

    def recording(m: Any, start: int, length: int, advice: int) -> bool:
        if advice == MADV_POPULATE_READ:
            seen.append((start, length))
        return real(m, start, length, advice)
    monkeypatch.setattr(open_mod, "advise", recording)
    return seen


def _save(root: str) -> dict[str, torch.Tensor]:
    saved = _state(1)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, saved)
    return saved


def test_a_restore_from_disk_checks_every_chunk_reading_the_next_ahead(tmp_path: Any, shm_dir: Any,
                                                                       populates: list[tuple[int, int]]) -> None:
    root = str(tmp_path / "ck")
    saved = _save(root)
    live = _state(2)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        assert ck.load_latest(into=live) == 1
    for k, t in saved.items():
        assert torch.equal(live[k], t), k
    # every chunk was mapped once, each while the one before was checked (the first before it)
    assert len(populates) == N, populates
    assert len({s for s, _ in populates}) == N
    assert sum(n for _, n in populates) >= N * 4 * MiB
    assert _read_ahead_threads() == []


@pytest.mark.parametrize("which", [0, N // 2, N - 1], ids=["first-chunk", "middle-chunk", "last-chunk"])
def test_damage_in_any_chunk_is_named_and_nothing_is_restored(tmp_path: Any, shm_dir: Any, which: int,
                                                              populates: list[tuple[int, int]]) -> None:
    root = str(tmp_path / "ck")
    _save(root)
    step = os.path.join(root, "step-1")
    man = json.load(open(os.path.join(step, "manifest.json")))
    key = f"t{which:02d}"
    start, end = man["tensors"][key]["offsets"]
    shard = os.path.join(step, next(f for f in os.listdir(step) if f.endswith(".safetensors")))
    with open(shard, "r+b") as f:  # one bit of one byte, in the last page of the tensor
        f.seek(end - 3)
        b = f.read(1)
        f.seek(end - 3)
        f.write(bytes([b[0] ^ 0x01]))
    live = _state(2)
    before = {k: t.clone() for k, t in live.items()}
    with nc.Checkpointer(root, memory_tier=False) as ck:
        with pytest.raises(nc.CorruptCheckpointError, match=f"checksum mismatch in tensor '{key}'"):
            ck.load_latest(into=live)
    for k, t in before.items():
        assert torch.equal(live[k], t), f"{k} was written although the checkpoint is damaged"
    assert _read_ahead_threads() == []
    assert len(populates) == min(which + 2, N)  # up to the chunk after the damaged one, read while it was checked
