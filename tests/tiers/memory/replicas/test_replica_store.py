"""The replica store drops what an earlier job's partners left (real files, a real saved step)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt import knobs
from nebula_ckpt.storage.holds import MappedHold
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


def _shard_of(folder: str, step: int) -> str:
    (name,) = [n for n in os.listdir(os.path.join(folder, f"step-{step}")) if n.startswith("shard-")]
    return os.path.join(folder, f"step-{step}", name)


@pytest.mark.parametrize("held", [True, False])
def test_a_step_file_mapped_to_send_keeps_its_bytes_while_later_saves_stage(tmp_path, held):
    """A replica round sends a memory-tier step's shard from a mapping of its file; retention may
    drop the step meanwhile, and the staging pool then reuses idle slot files. A file counted by
    :class:`MappedHold` is never staged into: the bytes being sent stay step 1's. (Without the
    count the next saves stage into it: the case checks that the scenario reaches the reuse.)"""
    shm = str(tmp_path / "shm")
    os.makedirs(shm)
    root = str(tmp_path / "ck")
    with knobs.override(shm_dir=shm), \
            nc.Checkpointer(root, tiers=[nc.MemoryTier(keep_last=1)], incremental=False) as ck:
        ck.save(1, {"w": torch.full((1 << 18,), 1.0)})
        folder = ck.tiers[0].path
        assert folder is not None
        path = _shard_of(folder, 1)
        hold = MappedHold(path) if held else None
        t = torch.from_file(path, shared=False, size=os.path.getsize(path), dtype=torch.uint8)
        if hold is not None:
            hold.tie(t)
        before = t.clone()
        for step in (2, 3, 4):  # step 1 dropped at once (keep_last=1): its slot file idle
            ck.save(step, {"w": torch.full((1 << 18,), float(step))})
        assert not os.path.exists(os.path.join(folder, "step-1"))
        assert torch.equal(t, before) == held
        del t
