"""``nebula-ckpt gc`` frees a memory tier only when the root's copy of its newest step restores:
a committed marker over a missing or truncated shard (a partial upload, a lost object) is no
copy, and the tier holding the only good one is kept."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

import nebula_ckpt as nc
import warm_python
from nebula_ckpt.cli import main

REPO = Path(__file__).resolve().parents[2]
FROZEN = torch.arange(4096, dtype=torch.float32)


def _state(step: int) -> dict[str, object]:
    return {"frozen": FROZEN, "w": torch.full((1024,), float(step))}


def _save_two(root: str, shm_dir: str) -> None:
    """Steps 1 and 2 on both tiers, then the process dies (a clean close frees its memory tier);
    step 2 is incremental: its ``frozen`` bytes lie in step 1's shard."""
    code = (f"import os, sys; sys.path.insert(0, {str(REPO / 'tests')!r})\n"
            "import nebula_ckpt as nc\n"
            "from cli.test_cli_gc import _state\n"
            f"ck = nc.Checkpointer({root!r})\n"
            "for s in (1, 2):\n"
            "    ck.save(s, _state(s)).result()\n"
            "os._exit(0)\n")
    warm_python.run([sys.executable, "-c", code], env=dict(os.environ, NEBULA_SHM_DIR=shm_dir, PYTHONPATH=str(REPO)),
                    check=True, timeout=120)


def _damage(root: str, how: str) -> None:
    step = 1 if how == "truncate-referenced" else 2
    d = os.path.join(root, f"step-{step}")
    shard = os.path.join(d, next(f for f in sorted(os.listdir(d)) if f.startswith("shard-")))
    if how == "delete":
        os.remove(shard)
    elif how != "none":
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) - 8)


def _gc(root: str, shm_dir: str, capsys: pytest.CaptureFixture[str]) -> list[dict[str, object]]:
    capsys.readouterr()
    assert main(["gc", root, "--shm-dir", shm_dir, "--json"]) == 0
    out: list[dict[str, object]] = json.loads(capsys.readouterr().out)
    assert len(out) == 1, out
    return out


@pytest.mark.parametrize("how", ["truncate", "delete", "truncate-referenced"])
def test_gc_keeps_the_memory_tier_when_the_roots_newest_step_has_a_broken_shard(
        how: str, root: str, shm_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    _save_two(root, shm_dir)
    with open(os.path.join(root, "step-2", "manifest.json"), "rb") as f:
        assert [s.get("step") for s in json.load(f)["shards"]] == [None, 1]  # step 2 refers to step 1's shard
    _damage(root, how)
    [d] = _gc(root, shm_dir, capsys)
    assert not d["remove"] and not d.get("removed"), d
    assert "holds step 2 but cannot restore it" in str(d["reason"]), d
    assert ("missing" if how == "delete" else "truncated") in str(d["reason"]), d
    into = {"frozen": torch.zeros(4096), "w": torch.zeros(1024)}
    with nc.Checkpointer(root, read_only=True) as ck:
        assert ck.load_latest(into=into, on_damaged="warn") == 2  # from the memory tier gc kept
    assert torch.equal(into["w"], torch.full((1024,), 2.0)) and torch.equal(into["frozen"], FROZEN)


def test_gc_frees_the_memory_tier_when_the_roots_newest_step_is_whole(
        root: str, shm_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    _save_two(root, shm_dir)
    [d] = _gc(root, shm_dir, capsys)
    assert d["remove"] and d["removed"], d
    assert not os.path.exists(str(d["folder"]))
