"""A restarted multi-rank job's first save builds on the step its ranks restored.

Two real ranks (gloo on 127.0.0.1) save on their memory tiers and the shared disk tier and are
SIGKILLed; a new two-rank job restores and saves once more (and is SIGKILLed too): restored from
the disk tier, its save there writes only what changed on every rank (each rank built on its own
share of the step it restored), and so does each rank's memory tier (on its own newest step,
compared byte for byte); restored from the memory tiers, those build on the restored step. A
third job restores the new step bit-exact. A job of another world size (a resharding restore)
starts full. A job restarted after every save writes every ``full_every``-th save full, no sooner
and no later (rank 0's manifest carries the count across restarts).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

import nebula_ckpt as nc
from memory_paths import memory_tier_path
from nebula_ckpt import knobs

from .launch import reports, run_ranks
from .seed_worker import digest, state

pytestmark = [pytest.mark.timeout(300)]

#: a save that wrote only the trained tensor (and headers, records), per rank and tier
SMALL = 16 << 10


def _life(root: str, out: Path, shm_dir: str, scenario: str, steps: str,
          env: Optional[dict[str, str]] = None) -> list[dict[str, Any]]:
    done = run_ranks(2, "seed_worker.py", [scenario, root, str(out), steps], out, shm_dir, env_extra=env)
    assert all(p.returncode == -9 for p in done), [p.stdout[-3000:] for p in done]
    return reports(out, scenario, 2)


def _tier(written: dict[str, int], kind: str) -> int:
    return next(n for t, n in written.items() if t.startswith(kind))


def _drop_memory_step(root: str, shm_dir: str, step: int) -> None:
    with knobs.override(shm_dir=shm_dir):
        for r in range(2):
            os.remove(os.path.join(memory_tier_path(root, r), f"step-{step}", "COMMIT"))


def test_restored_from_the_shared_tier_every_rank_saves_incrementally(root: str, shm_dir: str,
                                                                      tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    _life(root, out, shm_dir, "first", "1,2")
    _drop_memory_step(root, shm_dir, 2)  # the restore reads the shared disk tier
    got = _life(root, out, shm_dir, "second", "3")
    for r in got:
        assert r["restored"] == 2 and r["tier"].startswith("local"), r
        written = r["saves"][0]["written"]
        assert _tier(written, "local") < SMALL and _tier(written, "memory") < SMALL, r
    with open(os.path.join(root, "step-3", "manifest.json")) as f:
        assert json.load(f)["references"] == [1]  # both frozen tensors lie in step 1
    again = _life(root, out, shm_dir, "third", "")
    for r, before in zip(again, got, strict=True):
        assert r["restored"] == 3 and r["digest"] == before["digest"], r


def test_restored_from_the_memory_tiers_each_rank_builds_on_its_restored_step(root: str, shm_dir: str,
                                                                            tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    _life(root, out, shm_dir, "first", "1,2")
    got = _life(root, out, shm_dir, "second", "3,4")
    for r in got:
        assert r["restored"] == 2 and r["tier"].startswith("memory"), r
        assert all(_tier(s["written"], "memory") < SMALL for s in r["saves"]), r
        # the disk tier's step 2 was not read by the restore: its first save is full, the next builds on it
        assert _tier(r["saves"][0]["written"], "local") > 256 * 1024 * 4, r
        assert _tier(r["saves"][1]["written"], "local") < SMALL, r
    again = _life(root, out, shm_dir, "third", "")
    for r, before in zip(again, got, strict=True):
        assert r["restored"] == 4 and r["tier"].startswith("memory") and r["digest"] == before["digest"], r


def test_a_job_of_another_world_size_starts_full(root: str, shm_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    _life(root, out, shm_dir, "first", "1,2")
    s = state()
    with nc.Checkpointer(root, memory_tier=False, keep_last=5) as ck:
        assert ck.load_latest(s) == 2  # resharded: saved by 2 ranks, restored by 1
        s["train"] += 3
        h = ck.save(3, s)
        assert sum(h.metrics.written_bytes.values()) == h.metrics.bytes  # full: no share of its own to build on
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
        step, back = ck.read(3)
    assert step == 3 and digest(back) == digest(s)
    assert torch.equal(back["train"], s["train"])


def test_a_base_deleted_by_hand_makes_every_rank_save_its_share_whole(root: str, shm_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    got = _life(root, out, shm_dir, "rmbase", "1,2,3")  # 2 refers to 1; 1 is deleted before 3 is saved
    for r in got:
        assert _tier(r["saves"][1]["written"], "local") < SMALL, r  # step 2 built on step 1
        assert _tier(r["saves"][2]["written"], "local") > 256 * 1024 * 4, r  # never on the deleted step
    with open(os.path.join(root, "step-3", "manifest.json")) as f:
        assert 1 not in json.load(f).get("references", [])
    _drop_memory_step(root, shm_dir, 3)  # the next job restores step 3 from the shared disk tier
    again = _life(root, out, shm_dir, "again", "")
    for r, before in zip(again, got, strict=True):
        assert r["restored"] == 3 and r["tier"].startswith("local") and r["digest"] == before["digest"], r



def test_a_job_restarted_after_every_save_keeps_the_cadence_of_full_saves(root: str, shm_dir: str,
                                                                          tmp_path: Path) -> None:
    """Every third save full (``NEBULA_INCREMENTAL_FULL_EVERY=3``), steps 10 apart, a new two-rank
    job for each save: the count of saves since the last full one comes from rank 0's manifest,
    not from the distance in steps (which would make step 30 full already, and every save after)."""
    out = tmp_path / "out"
    out.mkdir()
    env = {"NEBULA_INCREMENTAL_FULL_EVERY": "3"}
    lives = []
    for step in (10, 20, 30, 40, 50, 60):
        got = _life(root, out, shm_dir, "cadence", str(step), env)
        if lives:
            for r, before in zip(got, lives[-1], strict=True):  # each restart restores the step before, bit-exact
                assert r["restored"] == step - 10 and r["restored_digest"] == before["digest"], r
        lives.append(got)
    for step, got in zip((10, 20, 30, 40, 50, 60), lives, strict=True):
        full = step in (10, 40)
        for r in got:  # every rank's share: whole at the cadence, only the trained tensor otherwise
            written = _tier(r["saves"][0]["written"], "local")
            assert (written > 256 * 1024 * 4) if full else (written < SMALL), (step, r)
    counts = []
    for step in (10, 20, 30, 40, 50, 60):
        with open(os.path.join(root, f"step-{step}", "manifest.json")) as f:
            counts.append(json.load(f)["stats"].get("saves_since_full"))
    assert counts == [0, 1, 2, 0, 1, 2], counts
    again = _life(root, out, shm_dir, "cadence", "", env)
    for r, before in zip(again, lives[-1], strict=True):
        assert r["restored"] == 60 and r["restored_digest"] == before["digest"], r
