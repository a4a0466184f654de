"""Slot files: CPU saves stage straight into the memory tier's files, which it links (no second copy).

These tests pin the promises that make that safe: a slot a committed memory-tier checkpoint
links is never written again until retention drops that checkpoint; slot names of finished
processes are swept without losing the checkpoints they back; without room in the tmpfs the
memory tier falls back to copying.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import torch

import nebula_ckpt as nc
from nebula_ckpt import knobs
from nebula_ckpt.memtier import SLOT_DIR


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"a": torch.full((64, 1024), float(step)), "b": torch.arange(5000, dtype=torch.int64) + step}


def _slot_dir(ck: nc.Checkpointer) -> str:
    return os.path.join(ck.tiers[0].display_url, SLOT_DIR)


def _memory_shard(ck: nc.Checkpointer, step: int) -> str:
    d = os.path.join(ck.tiers[0].display_url, f"step-{step}")
    [shard] = [f for f in os.listdir(d) if f.endswith(".safetensors")]
    return os.path.join(d, shard)


def test_memory_tier_links_the_slot_file(root: str) -> None:
    with nc.Checkpointer(root) as ck:
        ck.save(1, _state(1))
        shard = _memory_shard(ck, 1)
        slots = [os.path.join(_slot_dir(ck), f) for f in os.listdir(_slot_dir(ck))]
        assert os.stat(shard).st_nlink == 2, "the memory tier copied instead of linking"
        assert os.stat(shard).st_ino in {os.stat(p).st_ino for p in slots}
        stats = ck.stats()
        assert stats["memory_tier_slot_bytes"] == os.path.getsize(shard)
        assert stats["staging_bytes"] == 0  # the only slot is the memory tier's checkpoint now
        out = {k: torch.zeros_like(v) for k, v in _state(0).items()}
        assert ck.load_latest(into=out) == 1
        assert ck.last_restore["tier"].startswith("memory:")
        assert all(torch.equal(out[k], v) for k, v in _state(1).items())
        # the disk tier got the same bytes
        disk = nc.Checkpointer(root, tiers=[nc.LocalTier(root)])
        assert disk.read(1)[1]["a"].equal(_state(1)["a"])
        disk.close()


def test_live_slot_is_never_reused(root: str, shm_dir: str) -> None:
    """Every memory-tier checkpoint still committed holds its own step's values after each save."""
    mem = nc.MemoryTier(keep_last=2)
    with nc.Checkpointer(root, tiers=[mem, nc.LocalTier(root)]) as ck:
        for step in range(1, 9):
            ck.save_async(step, _state(step))
            ck.wait()
            per = ck.list(detailed=True)
            mem_steps = per[ck.tiers[0].name]
            assert mem_steps[-1] == step and len(mem_steps) <= 2, per
            for s in mem_steps:
                got = ck.read(s)[1]  # newest-first, fastest tier first: the memory tier's copy
                assert ck.last_restore["tier"].startswith("memory:")
                assert torch.equal(got["a"], _state(s)["a"]) and torch.equal(got["b"], _state(s)["b"]), \
                    f"memory-tier checkpoint of step {s} was overwritten by a later save"
        stats = ck.stats()
        # two live checkpoints + at most two staging slots, reused: no growth over 8 saves
        assert stats["staging_allocations"] <= 4, stats
        assert len(os.listdir(_slot_dir(ck))) == stats["staging_allocations"]


def test_close_removes_own_slot_names_and_keeps_checkpoints(root: str, shm_dir: str) -> None:
    ck = nc.Checkpointer(root, tiers=[nc.MemoryTier()])  # memory only: kept on close
    ck.save(3, _state(3))
    slot_dir = _slot_dir(ck)
    ck.close()
    assert os.listdir(slot_dir) == []
    with nc.Checkpointer(root, tiers=[nc.MemoryTier()]) as again:
        assert torch.equal(again.read()[1]["a"], _state(3)["a"])


def test_slot_names_of_a_killed_process_are_swept(root: str, shm_dir: str) -> None:
    code = f"""
import os, torch, nebula_ckpt as nc
ck = nc.Checkpointer({root!r})
for s in (1, 2):
    ck.save(s, {{"a": torch.full((64, 1024), float(s)), "b": torch.arange(5000, dtype=torch.int64) + s}})
os._exit(0)   # no close(): as after a crash
"""
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=os.getcwd())
    ck = nc.Checkpointer(root)
    try:
        slot_dir = _slot_dir(ck)
        assert os.listdir(slot_dir) == [], "slot names of the dead writer were not swept"
        assert os.stat(_memory_shard(ck, 2)).st_nlink == 1  # the checkpoint holds its bytes alone
        step, got = ck.read()
        assert step == 2 and ck.last_restore["tier"].startswith("memory:")
        assert torch.equal(got["a"], _state(2)["a"])
        ck.save(3, _state(3))  # and the new writer goes on with slots of its own
        assert torch.equal(ck.read(3)[1]["b"], _state(3)["b"])
    finally:
        ck.close()


def test_no_room_in_shm_falls_back_to_copying(root: str, caplog) -> None:  # noqa: ANN001
    with knobs.override(shm_min_free_fraction=1.0), caplog.at_level(logging.WARNING, "nebula_ckpt"):
        with nc.Checkpointer(root) as ck:
            ck.save(1, _state(1))
            ck.save(2, _state(2))
            assert os.stat(_memory_shard(ck, 2)).st_nlink == 1  # copied, not linked
            assert not os.path.isdir(_slot_dir(ck)) or os.listdir(_slot_dir(ck)) == []
            assert torch.equal(ck.read(2)[1]["a"], _state(2)["a"])
            assert ck.stats()["memory_tier_slot_bytes"] == 0
    assert any("no slot file" in r.getMessage() for r in caplog.records)
