"""A restarted job's first memory-tier save builds on a step still in the tmpfs.

A real process saves a frozen base and a small trainable tensor on the memory and disk tiers and
is SIGKILLed. A second real process restores, trains the small tensor, saves once and is SIGKILLed
too: its memory-tier step holds only the changed bytes (it refers to the killed job's step, whose
bytes it compared byte for byte). A third process restores that step from the memory tier
bit-exact. Restored from the disk tier instead, the memory tier builds on its own newest committed
step (no newer than the one restored): it compares bytes, so it needs no trust in the restore.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import textwrap
from pathlib import Path
from typing import Any

import torch

import warm_python
from nebula_ckpt import knobs
from nebula_ckpt.tiers.memory.tier import memory_tier_path

REPO = str(Path(__file__).resolve().parents[3])

#: one life of the job: restore (if anything is there), train, save the steps of argv[3], report, SIGKILL
JOB = textwrap.dedent("""
    import hashlib, json, os, signal, sys
    import torch
    import nebula_ckpt as nc
    root, out, steps = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3].split(",") if s]
    state = {"frozen": torch.randn(512, 512, generator=torch.Generator().manual_seed(1)),
             "train": torch.zeros(256), "step": -1}
    if len(sys.argv) > 4:  # restore into nothing: the restore creates the tensors (and adopts the tier's pages)
        state = {"frozen": None, "train": None, "step": -1}
    ck = nc.Checkpointer(root, keep_last=5)
    report = {"restored": ck.load_latest(state), "tier": (ck.last_restore or {}).get("tier"), "saves": [],
              "adopted": (ck.last_restore or {}).get("adopted_bytes", 0)}
    for step in steps:
        state["train"] += step
        state["step"] = step
        h = ck.save(step, state)
        h.result()
        report["saves"].append({"written": h.metrics.written_bytes, "bytes": h.metrics.bytes})
    report["digest"] = {k: hashlib.sha256(v.numpy().tobytes()).hexdigest()
                        for k, v in state.items() if torch.is_tensor(v)}
    with open(out, "w") as f:
        json.dump(report, f)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def _life(root: str, shm_dir: str, out: str, steps: list[int], adopt: bool = False) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), NEBULA_SHM_DIR=shm_dir)
    args = [root, out, ",".join(map(str, steps)), *(["adopt"] if adopt else [])]
    p = warm_python.run([sys.executable, "-c", JOB, *args], env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == -signal.SIGKILL, p.stdout + p.stderr
    with open(out) as f:
        return json.load(f)


def _tier(written: dict[str, int], kind: str) -> int:
    return next(n for t, n in written.items() if t.startswith(kind))


def _mem_man(root: str, shm_dir: str, step: int) -> dict[str, Any]:
    with knobs.override(shm_dir=shm_dir):
        folder = memory_tier_path(root)
    with open(os.path.join(folder, f"step-{step}", "manifest.json")) as f:
        return json.load(f)


def _digest(state: dict[str, Any]) -> dict[str, str]:
    return {k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in state.items() if torch.is_tensor(v)}


def test_the_first_memory_tier_save_after_a_restart_holds_only_the_changes(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    _life(root, shm_dir, str(tmp_path / "a.json"), [1, 2])
    got = _life(root, shm_dir, str(tmp_path / "b.json"), [3])
    assert got["restored"] == 2 and got["tier"].startswith("memory"), got
    save = got["saves"][0]
    small = 4096 + 2 * 256 * 4
    assert _tier(save["written"], "memory") < small, save  # only "train" (and a header)
    man = _mem_man(root, shm_dir, 3)
    assert [s.get("step") for s in man["shards"][1:]] == [1], man["shards"]  # the frozen bytes lie in step 1
    again = _life(root, shm_dir, str(tmp_path / "c.json"), [])
    assert again["restored"] == 3 and again["tier"].startswith("memory"), again
    assert again["digest"] == got["digest"]  # bit-exact after another restart


def test_restored_from_disk_the_memory_tier_builds_on_its_own_newest_step(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    _life(root, shm_dir, str(tmp_path / "a.json"), [1, 2])
    with knobs.override(shm_dir=shm_dir):
        folder = memory_tier_path(root)
    os.remove(os.path.join(folder, "step-2", "COMMIT"))  # the memory tier's step 2 is no checkpoint now
    got = _life(root, shm_dir, str(tmp_path / "b.json"), [3, 4])
    assert got["restored"] == 2 and got["tier"].startswith("local"), got
    small = 4096 + 2 * 256 * 4
    for save in got["saves"]:
        assert _tier(save["written"], "memory") < small, got["saves"]
        assert _tier(save["written"], "local") < small, got["saves"]
    assert [s.get("step") for s in _mem_man(root, shm_dir, 4)["shards"][1:]] == [1]
    again = _life(root, shm_dir, str(tmp_path / "c.json"), [])
    assert again["restored"] == 4 and again["tier"].startswith("memory"), again
    assert again["digest"] == got["digest"]


def test_after_an_adopting_restore_the_memory_tier_builds_on_the_base_it_keeps(tmp_path, shm_dir) -> None:  # noqa: ANN001
    """The restore takes the memory tier's step 2 over (its own shard's pages handed to the new
    process, the step gone from the tier); step 1, the base step 2 referred to, stays there, and
    the first save compares with it."""
    root = str(tmp_path / "ck")
    _life(root, shm_dir, str(tmp_path / "a.json"), [1, 2])
    got = _life(root, shm_dir, str(tmp_path / "b.json"), [3], adopt=True)
    assert got["restored"] == 2 and got["tier"].startswith("memory") and got["adopted"] > 0, got
    assert _tier(got["saves"][0]["written"], "memory") < 4096 + 2 * 256 * 4, got["saves"]
    assert [s.get("step") for s in _mem_man(root, shm_dir, 3)["shards"][1:]] == [1]
    again = _life(root, shm_dir, str(tmp_path / "c.json"), [])
    assert again["restored"] == 3 and again["digest"] == got["digest"], again
