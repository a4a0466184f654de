"""``persist_memory`` / ``nebula-ckpt persist-memory``: the memory tier's newest step onto the
persistent root when the job will not be restarted (a real process that ends without closing)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt.errors import CorruptCheckpointError, ValidationError
from nebula_ckpt.save.epilogue import persist_memory
from nebula_ckpt.tiers.memory.tier import memory_tier_path

REPO = Path(__file__).resolve().parents[1]


def _job_that_dies(root: str, shm_dir: str, steps: int = 3) -> None:
    """Saves steps 1..steps (the disk tier only every 10th save: step 1), then ends unclosed."""
    code = textwrap.dedent(f"""
        import os, torch, nebula_ckpt as nc
        ck = nc.Checkpointer({root!r}, tiers=[nc.MemoryTier(), nc.LocalTier({root!r}, every=10)])
        for s in range(1, {steps} + 1):
            ck.save(s, {{"w": torch.arange(1000, dtype=torch.float32) * s, "step": s}}).result()
        os._exit(0)
    """)
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir, PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


def test_the_newest_memory_step_reaches_the_root(root: str, shm_dir: str) -> None:
    _job_that_dies(root, shm_dir)
    assert sorted(p.name for p in Path(root).glob("step-*")) == ["step-1"]
    got = persist_memory(root)
    assert got["copied"] and got["step"] == 3
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
        state = {"w": torch.zeros(1000), "step": 0}
        assert ck.load_latest(state) == 3
        assert torch.equal(state["w"], torch.arange(1000, dtype=torch.float32) * 3) and state["step"] == 3
    again = persist_memory(root)  # idempotent
    assert not again["copied"] and "already" in again["why"]


def test_a_damaged_memory_step_is_not_copied(root: str, shm_dir: str) -> None:
    _job_that_dies(root, shm_dir)
    shard = next(Path(memory_tier_path(root)).glob("step-3/shard-*"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError):
        persist_memory(root)
    assert not Path(root, "step-3").exists()


def test_a_live_writer_is_left_alone(root: str, shm_dir: str) -> None:
    with nc.Checkpointer(root, tiers=[nc.MemoryTier(), nc.LocalTier(root, every=10)]) as ck:
        ck.save(1, {"w": torch.ones(4)}).result()
        ck.save(2, {"w": torch.ones(4) * 2}).result()
        with pytest.raises(ValidationError, match="live process"):
            persist_memory(root)
        assert not Path(root, "step-2").exists()


def test_nothing_to_do(tmp_path: Path, shm_dir: str) -> None:
    assert persist_memory(str(tmp_path / "never"))["step"] is None


def test_the_command(root: str, shm_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    from nebula_ckpt.cli import main

    _job_that_dies(root, shm_dir)
    assert main(["persist-memory", root, "--json"]) == 0
    assert '"copied": true' in capsys.readouterr().out
    assert Path(root, "step-3", "COMMIT").exists()
    assert main(["persist-memory", root]) == 0
    assert "nothing to copy" in capsys.readouterr().out
    with nc.Checkpointer(root, tiers=[nc.MemoryTier(), nc.LocalTier(root, every=10)]) as ck:
        ck.save(4, {"w": torch.ones(4)}).result()   # on both tiers
        ck.save(5, {"w": torch.ones(4)}).result()   # in memory only
        assert main(["persist-memory", root]) == 2    # a live writer holds the memory tier
        assert "live process" in capsys.readouterr().err
