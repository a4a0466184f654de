"""``Checkpointer.latest()``: the checkpoint ``load_latest`` tries first, named without reading its
tensors, in the restore's order (the newest writer generation first, steps marked suspect passed
over, a damaged copy passed to the next) -- what scripts and integrations name as "the last
checkpoint"."""

from __future__ import annotations

import os

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt.cli import main


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), value)}


def _latest(root: str) -> "tuple[int, str | None] | None":
    with nc.Checkpointer(root, read_only=True) as ck:
        got = ck.latest()
        restored = ck.read()[0] if got is not None else None
    assert got is None or got[0] == restored, (got, restored)  # always what a restart restores
    return got


def test_nothing_committed_is_none(root: str) -> None:
    assert _latest(root) is None
    with nc.Checkpointer(root, memory_tier=False) as ck:
        assert ck.latest() is None


def test_the_newest_step_with_its_tag(root: str) -> None:
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, _state(1.0), tag="epoch=0")
        ck.save(2, _state(2.0))
        assert ck.latest() == (2, None)
        ck.save(3, _state(3.0), tag="epoch=1")
        assert ck.latest() == (3, "epoch=1")
    assert _latest(root) == (3, "epoch=1")


def test_a_step_marked_suspect_is_passed_over(root: str, capsys: pytest.CaptureFixture[str]) -> None:
    with nc.Checkpointer(root, memory_tier=False) as ck:
        for step in (1, 2, 3):
            ck.save(step, _state(float(step)), tag=f"s{step}")
    assert main(["mark", root, "--suspect", "3"]) == 0
    capsys.readouterr()
    assert _latest(root) == (2, "s2")


def test_after_a_rollback_the_new_runs_step_not_the_abandoned_higher_one(root: str) -> None:
    with nc.Checkpointer(root, keep_last=10, memory_tier=False) as ck:
        for step in (1, 2, 3, 4, 5):
            ck.save(step, _state(float(step)), tag=f"old-{step}")
    with nc.Checkpointer(root, keep_last=10, memory_tier=False) as ck:
        ck.load(2, into=_state(0.0))
        ck.save(3, _state(30.0), tag="new-3")
        assert ck.latest() == (3, "new-3")
    assert _latest(root) == (3, "new-3")


def test_a_step_whose_shard_lost_bytes_is_passed_over(root: str) -> None:
    with nc.Checkpointer(root, memory_tier=False, incremental=False) as ck:
        ck.save(1, _state(1.0))
        ck.save(2, _state(2.0))
    shard = next(os.path.join(root, "step-2", f) for f in os.listdir(os.path.join(root, "step-2"))
                 if f.endswith(".safetensors"))
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 4)
    assert _latest(root) == (1, None)
