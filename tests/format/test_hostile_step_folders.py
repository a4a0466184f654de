"""A folder named for a step no save takes is no checkpoint: never listed, counted, read or removed.

A step is an int in ``[0, 2**63-1]`` (what a save accepts, :func:`~nebula_ckpt.format.names.check_step`).
A folder ``step-9223372036854775808`` (one past it) or ``step-99999999999999999999`` in a root is
no checkpoint of ours, as ``step-042`` is not: it used to be listed as a step (``list()`` gave a
step that ``load(step=...)`` refuses), shown DAMAGED by ``ls`` / ``verify`` (exit code 1), and it
took ``keep_last`` slots from real checkpoints, which retention then deleted.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

import nebula_ckpt as nc
from nebula_ckpt.cli import main
from nebula_ckpt.format.checks import MAX_STEP

BEYOND = [f"step-{MAX_STEP + 1}", "step-99999999999999999999"]


def test_a_step_folder_beyond_the_largest_step_is_no_checkpoint(tmp_path: Any, shm_dir: str) -> None:
    root = str(tmp_path / "root")
    with nc.Checkpointer(root, memory_tier=False, keep_last=2) as ck:
        for s in (1, 2, 3):
            ck.save(s, {"model": torch.nn.Linear(4, 2), "x": torch.full((64,), float(s))})
    for name in BEYOND:  # a copy of a real step: its marker, manifest and shard
        shutil.copytree(os.path.join(root, "step-3"), os.path.join(root, name))
    with nc.Checkpointer(root, read_only=True) as ck:
        assert ck.list() == [2, 3]
        assert ck.load_latest(into={"model": torch.nn.Linear(4, 2), "x": torch.zeros(64)}) == 3
    assert [main([cmd, root]) for cmd in ("ls", "verify", "inspect")] == [0, 0, 0]
    with nc.Checkpointer(root, memory_tier=False, keep_last=2) as ck:
        ck.save(4, {"model": torch.nn.Linear(4, 2), "x": torch.full((64,), 4.0)})
        assert ck.list() == [3, 4]  # retention counted the real steps only
    x = torch.zeros(64)
    with nc.Checkpointer(root, read_only=True) as ck:
        assert ck.load_latest(into={"model": torch.nn.Linear(4, 2), "x": x}) == 4
    assert torch.equal(x, torch.full((64,), 4.0))
    assert set(BEYOND) <= set(os.listdir(root))  # not ours: left as they are
