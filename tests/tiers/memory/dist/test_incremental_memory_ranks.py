"""Incremental memory tier in a multi-rank job: each rank's memory-tier step holds only what changed.

Two real ranks (gloo on 127.0.0.1) save a chain on their own memory tiers (a large frozen tensor
and a small trained one, each rank its own), are SIGKILLed after the last committed step, and a
new two-rank job restores the newest step from the memory tiers, bit-exact on every rank.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from dist.launch import reports, run_ranks
from nebula_ckpt import knobs
from nebula_ckpt.format.names import COMMIT
from nebula_ckpt.tiers.memory.tier import memory_tier_path

HERE = Path(__file__).resolve().parent  # the workers beside this module, spawned by path

pytestmark = [pytest.mark.timeout(180)]


def _step_bytes(folder: str, step: int) -> int:
    """Bytes of the shard files in the step's own folder (what the step holds in the tmpfs)."""
    d = os.path.join(folder, f"step-{step}")
    return sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d) if n.endswith(".safetensors"))


def test_each_rank_memory_tier_chain_is_incremental_and_restores_after_sigkill(root: str, shm_dir: str,
                                                                                tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    env = {"NEBULA_INCREMENTAL_FULL_EVERY": "3"}
    done = run_ranks(2, str(HERE / "memrank_worker.py"), ["save", root, str(out)], out, shm_dir, env_extra=env)
    assert all(p.returncode == -9 for p in done), [p.stdout[-3000:] for p in done]
    saved = reports(out, "save", 2)
    with knobs.override(shm_dir=shm_dir):
        folders = [memory_tier_path(root, r) for r in range(2)]
    for r, folder in enumerate(folders):
        # retention (keep_last=3) and remove(1) keep step 1: step 3 refers to it; step 2 is gone
        assert saved[r]["removed"] == [1]
        assert sorted(n for n in os.listdir(folder) if n.startswith("step-")) == [f"step-{s}" for s in (1, 3, 4, 5)]
        full = _step_bytes(folder, 1)
        assert full > 1 << 20, full
        for step, base in ((1, None), (3, 1), (4, None), (5, 4)):  # every 3rd save whole
            with open(os.path.join(folder, f"step-{step}", "manifest.json")) as f:
                man = json.load(f)
            refs = [s.get("step") for s in man["shards"][1:]]
            held = _step_bytes(folder, step)
            if base is None:
                assert refs == [] and held == full, (r, step, held)
            else:
                assert refs == [base] and held < 0.02 * full, (r, step, refs, held)
                assert man["tensors"][f"r{r}/frozen"]["shard"] == 1 and man["ranks"] == [r]
        written = saved[r]["written"]
        assert all(n < 0.02 * written[0] for n in (written[1], written[2], written[4])), written
    got = _load(root, out, shm_dir)
    for r in range(2):
        assert got[r]["step"] == 5 and got[r]["saved_step"] == 5, got[r]
        assert got[r]["restored_from"]["tier"].startswith("memory"), got[r]["restored_from"]
        assert got[r]["digest"] == saved[r]["digest5"], r
    # rank 1's step 4 is no committed checkpoint any more (its shard file stays): step 5, which
    # refers to it, does not open there, and both ranks agree on step 3 (built on step 1)
    os.remove(os.path.join(folders[1], "step-4", COMMIT))
    got = _load(root, out, shm_dir)
    for r in range(2):
        assert got[r]["step"] == 3 and got[r]["digest"] == saved[r]["digest3"], got[r]


def _load(root: str, out: Path, shm_dir: str) -> list[dict[str, Any]]:
    done = run_ranks(2, str(HERE / "memrank_worker.py"), ["load", root, str(out)], out, shm_dir)
    assert all(p.returncode == 0 for p in done), [p.stdout[-3000:] for p in done]
    return reports(out, "load", 2)
