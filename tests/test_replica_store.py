"""The replica store drops what an earlier job's partners left (real files, a real saved step)."""

from __future__ import annotations

import os
import shutil

import torch

import nebula_ckpt as nc
from nebula_ckpt.tiers.memory.replica_store import ReplicaStore, committed


def _a_step(tmp_path) -> str:
    """The folder of a real committed step 1 (a one-process save to a disk tier)."""
    root = str(tmp_path / "saved")
    with nc.Checkpointer(root, tiers=[nc.LocalTier(root)]) as ck:
        ck.save(1, {"w": torch.arange(8.0)})
    return os.path.join(root, "step-1")


def test_replicas_of_ranks_that_are_no_longer_sources_are_dropped(tmp_path):
    step = _a_step(tmp_path)
    store = ReplicaStore(str(tmp_path / "mem"))
    for r in (0, 3, 5):
        shutil.copytree(step, os.path.join(store.source_dir(r), "step-1"))
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(step, str(elsewhere / "step-1"))
    os.symlink(str(elsewhere), store.source_dir(7))  # planted: never listed, never deleted through
    assert sorted(store.held()) == [0, 3, 5]

    assert store.drop_others({0, 3}) == [5]
    assert sorted(store.held()) == [0, 3] and not os.path.lexists(store.source_dir(5))
    assert committed(store.source_dir(0)) and committed(store.source_dir(3))
    assert (elsewhere / "step-1" / "COMMIT").exists()  # the link's target is untouched
    assert store.drop_others({0, 3}) == []  # nothing left to drop
