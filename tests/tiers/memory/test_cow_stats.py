"""``stats()["memory_tier_dropped_cow_bytes"]``: tmpfs bytes that copy-on-write views kept alive.

A restart restores an incremental memory-tier step (a real process saved it and was SIGKILLed):
its frozen tensor is a copy-on-write view of the base step's shard file (nebula_ckpt/tiers/memory/adopt.py).
A later full save lets retention delete that base: its name goes, but its tmpfs pages stay
allocated as long as the restored tensor maps them. ``stats()`` shows those bytes, and they go
(from the tmpfs and from the counter) once the tensors are freed.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt.tiers.memory.tier import memory_tier_path
from tiers.memory.test_adopt_incremental import _crash, _into, _shard, _tiers

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs a tmpfs memory tier")


def _deleted_maps() -> set[int]:
    """Inodes of deleted files this process still maps."""
    with open("/proc/self/maps") as f:
        return {int(p[4]) for p in (line.split() for line in f) if len(p) >= 7 and p[-1] == "(deleted)"}


def test_a_dropped_base_mapped_copy_on_write_is_counted_until_freed(root: str, shm_dir: str, tmp_path) -> None:  # noqa: ANN001
    want = _crash(root, shm_dir, str(tmp_path / "ref"))  # step 0 whole, step 1 refers to its frozen bytes
    folder = memory_tier_path(root)
    base = _shard(folder, 0)
    base_bytes, base_ino = os.path.getsize(base), os.stat(base).st_ino
    with nc.Checkpointer(root, tiers=_tiers(root, keep=1)) as ck:
        into = _into()
        assert ck.load_latest(into=into) == 1
        assert ck.last_restore["copy_on_write_bytes"] == into["frozen"].numel() * 4
        assert torch.equal(into["frozen"], want[1]["frozen"])
        assert ck.stats()["memory_tier_dropped_cow_bytes"] == 0  # the base is still the tier's
        # a new frozen tensor: the next save stores it whole, and retention (keep_last=1) drops step 0
        ck.save(2, {"frozen": torch.randn(1024, 1024), "train": torch.zeros(4096), "step": 2})
        ck.wait()
        assert not os.path.exists(os.path.join(folder, "step-0"))
        assert base_ino in _deleted_maps()
        assert ck.stats()["memory_tier_dropped_cow_bytes"] == base_bytes
        assert torch.equal(into["frozen"], want[1]["frozen"])  # the restored tensor still reads its bytes
        into.clear()
        gc.collect()
        assert base_ino not in _deleted_maps()
        assert ck.stats()["memory_tier_dropped_cow_bytes"] == 0
