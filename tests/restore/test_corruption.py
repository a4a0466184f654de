"""Damaged checkpoints are detected, reported by key and tier, and skipped on restore."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

import nebula_ckpt as nc


def _save_two(root: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    states = {s: {"w": torch.randn(128, 128), "b": torch.randn(7)} for s in (1, 2)}
    with nc.Checkpointer(root, memory_tier=False, keep_last=5) as ck:
        for s, st in states.items():
            ck.save(s, st)
    return states[1]


def _shard(root: str, step: int) -> str:
    d = os.path.join(root, f"step-{step}")
    return os.path.join(d, next(f for f in os.listdir(d) if f.endswith(".safetensors")))


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def _man(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step}", "manifest.json")


def flip_shard_byte(root: str) -> str:
    man = json.load(open(_man(root, 2)))
    start, end = man["tensors"]["w"]["offsets"]
    _flip(_shard(root, 2), start + (end - start) // 2)
    return "checksum mismatch in tensor 'w'"


def truncate_shard(root: str) -> str:
    p = _shard(root, 2)
    os.truncate(p, os.path.getsize(p) - 100)
    return "truncated"


def delete_manifest(root: str) -> str:
    os.unlink(_man(root, 2))
    return "missing"


def garble_manifest(root: str) -> str:
    _flip(_man(root, 2), 40)
    return "does not match its commit marker"


def marker_without_shards(root: str) -> str:
    os.unlink(_shard(root, 2))
    return "is missing"


def garble_commit(root: str) -> str:
    with open(os.path.join(root, "step-2", "COMMIT"), "wb") as f:
        f.write(b"{not json")
    return "commit marker is unreadable"


def _replace(path: str, how: str) -> None:
    """Put something else than the file nebula_ckpt wrote at ``path``: a sparse file of a terabyte
    (no disk blocks; read whole, it is a MemoryError) or a folder."""
    os.unlink(path)
    if how == "folder":
        os.mkdir(path)
    else:
        with open(path, "wb") as f:
            f.truncate(1 << 40)


def sparse_commit(root: str) -> str:
    _replace(os.path.join(root, "step-2", "COMMIT"), "sparse")
    return "is 1099511627776 bytes, more than the 65536"


def folder_commit(root: str) -> str:
    _replace(os.path.join(root, "step-2", "COMMIT"), "folder")
    return "COMMIT' is a folder, not a regular file"


def sparse_manifest(root: str) -> str:
    _replace(_man(root, 2), "sparse")
    return "manifest.json' is 1099511627776 bytes"


def folder_manifest(root: str) -> str:
    _replace(_man(root, 2), "folder")
    return "manifest.json' is a folder, not a regular file"


DAMAGE = [flip_shard_byte, truncate_shard, delete_manifest, garble_manifest, marker_without_shards, garble_commit,
          sparse_commit, folder_commit, sparse_manifest, folder_manifest]


@pytest.mark.parametrize("damage", DAMAGE, ids=[d.__name__ for d in DAMAGE])
def test_damage_detected_reported_and_skipped(tmp_path, shm_dir, caplog, damage) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    s1 = _save_two(root)
    expect = damage(root)
    caplog.set_level(logging.WARNING, logger="nebula_ckpt")
    w, b = torch.zeros(128, 128), torch.zeros(7)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        assert ck.load_latest(into={"w": w, "b": b}) == 1
    assert torch.equal(w, s1["w"]) and torch.equal(b, s1["b"])
    text = caplog.text
    assert "skipping tier local:" in text and "step 2" in text and expect in text, text

    from nebula_ckpt.cli import main
    assert main(["verify", root]) == 1
    assert main(["verify", root, "--step", "1"]) == 0


def test_falls_back_to_slower_tier_with_same_step(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    w = torch.randn(64, 64)
    with nc.Checkpointer(root) as ck:
        h = ck.save(5, {"w": w})
        assert len(h.tiers_written) == 2
        mem = ck.tiers[0]
        assert mem.kind == "memory"
        # A crash would leave the memory tier; simulate by copying it aside before close removes it.
        import shutil
        shutil.copytree(mem.display_url, str(tmp_path / "memcopy"))
    shutil.copytree(str(tmp_path / "memcopy"), mem.display_url, dirs_exist_ok=True)
    d = os.path.join(mem.display_url, "step-5")
    shard = os.path.join(d, next(f for f in os.listdir(d) if f.endswith(".safetensors")))
    _flip(shard, os.path.getsize(shard) - 10)
    out = torch.zeros(64, 64)
    with nc.Checkpointer(root) as ck:
        assert ck.load_latest(into={"w": out}) == 5
        assert ck.last_restore["tier"].startswith("local:")
    assert torch.equal(out, w)


def test_every_candidate_damaged_raises_with_the_list(tmp_path, shm_dir) -> None:  # noqa: ANN001
    """Committed checkpoints exist but none is healthy: say so (every candidate, and what to do)."""
    root = str(tmp_path / "ck")
    _save_two(root)
    flip_shard_byte(root)
    man = json.load(open(_man(root, 1)))
    start, end = man["tensors"]["w"]["offsets"]
    _flip(_shard(root, 1), start + 1)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        with pytest.raises(nc.CorruptCheckpointError) as ei:
            ck.load_latest(into={"w": torch.zeros(128, 128), "b": torch.zeros(7)})
    msg = str(ei.value)
    assert "step 1" in msg and "step 2" in msg and "checksum mismatch" in msg
    assert "nebula-ckpt verify" in msg
