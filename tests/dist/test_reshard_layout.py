"""DTensors restored at the same world size into another layout are resharded, never copied rank
by rank: real ranks (gloo on loopback, ``tests/dist/layout_worker.py``) save DTensors, an FSDP2
model and its AdamW, then restore them with ``load_latest``.

Each rank's saved local shard used to go into its DTensor after a check of the local shape
only: a (2, 2) mesh's dims used the other way round gave ranks each other's rows, and a tensor of
another global shape but the same local one was restored without a word. Each DTensor of
``into`` is compared with what was saved (global shape, placements, mesh shape, this rank's
offsets and shape); the ranks agree, and a layout that differs on any rank is resharded on every
rank; another global shape is refused. A resharding restore where one rank's ``into`` does not
match is refused on every rank before any enters DCP's collectives (the others waited there
until the protocol's timeout).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dist.launch import reports, run_ok

from .test_reshard import fsdp_jobs

pytestmark = pytest.mark.timeout(180)

WORLD = 2


def test_dtensors_of_another_layout_at_the_same_world_size_are_resharded(tmp_path: Path, shm_dir: str) -> None:
    run_ok(WORLD, "layout_worker.py", [str(tmp_path / "ck"), str(tmp_path)], tmp_path, shm_dir, timeout=150,
           env_extra={"NEBULA_COMMIT_TIMEOUT_S": "30"})
    got = reports(tmp_path, "layout", WORLD)
    for rank, r in enumerate(got):
        # another mesh (the model sharded HSDP): every byte where it belongs
        assert r["other_mesh"] == {"got": 1, "differ": [], "step": 1}, (rank, r["other_mesh"])
        # full plain tensors, a plain model and an AdamW without state: the whole tensors on every rank
        assert r["plain"] == {"got": 1, "differ": []}, (rank, r["plain"])
        # another global shape with the same local one: refused, naming the key, nothing restored
        sh = r["shape"]
        assert sh["got"].startswith("ValidationError") and "'b'" in sh["got"] and "(8, 2)" in sh["got"] \
            and "(4, 4)" in sh["got"], (rank, sh)
        assert sh["a_untouched"], (rank, sh)
        # one rank's `into` mismatches a resharding restore: every rank hears it, nothing restored
        one = r["one_rank"]
        assert one["got"].startswith("ValidationError") and "'b'" in one["got"] and "(9, 2)" in one["got"], \
            (rank, one)
        if rank != 1:
            assert "rank(s) [1]" in one["got"], (rank, one)
        assert one["a_untouched"], (rank, one)


def test_placements_used_the_other_way_round_are_resharded() -> None:
    """4 ranks (the save job of test_reshard.py): ``[Replicate(), Shard(0)]`` on a (2, 2) mesh
    restored as ``[Shard(0), Replicate()]``: the local shapes are the same, ranks 1 and 2 hold
    each other's rows."""
    rows = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    for rank, r in enumerate(reports(fsdp_jobs()["out"], "roles-swapped", 4)):
        assert r["got"] == 1 and r["equal"], (rank, r)
        assert r["local"] == (rows[:2] if rank < 2 else rows[2:]), (rank, r)
