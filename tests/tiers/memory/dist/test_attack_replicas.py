"""Memory-tier replicas attacked like an unlucky operator (or a hostile user of the tmpfs) would.

Real ranks (gloo on 127.0.0.1, spawned processes) on simulated nodes, as in test_replicas.py:
a 4-rank job on two nodes saves steps 1..3 (only step 1 on the disk tier), node 1 is lost, and
the replicas node 0 holds for node 1's ranks are tampered with before the restart. The promise:
every rank restores its own state bit-exact (a SHA-256 of every tensor), from a healthy source
or an older step every rank has, never another rank's or a damaged copy.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest

from .test_replicas import Job, _check_exact

pytestmark = [pytest.mark.timeout(600)]


def _held(job: Job, rank: int) -> Path:
    """The folder of step 3 of the replica of ``rank`` held on node 0."""
    held = [d / "step-3" for d in job.replica_dirs(0) if d.name == f"r{rank}"]
    assert len(held) == 1 and held[0].is_dir(), held
    return held[0]


def _shard(step_dir: Path) -> Path:
    shards = list(step_dir.glob("shard-*.safetensors"))
    assert len(shards) == 1, shards
    return shards[0]


def _other_ranks_copy(job: Job) -> None:
    """Rank 2's replica holds rank 3's step 3 (files, manifest and commit marker): a copy put in
    the wrong folder."""
    mine, theirs = _held(job, 2), _held(job, 3)
    shutil.rmtree(mine)
    shutil.copytree(theirs, mine)


def _symlink(job: Job, flip: bool) -> None:
    """Rank 2's replica shard is a symlink to a file outside the folder (its bytes, or one flipped)."""
    shard = _shard(_held(job, 2))
    outside = job.tmp / f"outside-{shard.name}"
    data = bytearray(shard.read_bytes())
    if flip:
        data[-5] ^= 0xFF
    outside.write_bytes(bytes(data))
    shard.unlink()
    os.symlink(outside, shard)


def _truncate(job: Job) -> None:
    shard = _shard(_held(job, 2))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1)


def _renamed_newer(job: Job) -> None:
    """Rank 2's replica of step 3 moved to a step-4 folder (its manifest still says step 3)."""
    src = _held(job, 2)
    src.rename(src.parent / "step-4")


def _commit_deleted(job: Job) -> None:
    (_held(job, 2) / "COMMIT").unlink()


_CASES: dict[str, Callable[[Job], None]] = {
    "another rank's copy": _other_ranks_copy,
    "symlink, same bytes": lambda job: _symlink(job, False),
    "symlink, other bytes": lambda job: _symlink(job, True),
    "shard truncated": _truncate,
    "moved to a newer step": _renamed_newer,
    "COMMIT deleted": _commit_deleted,
}


@pytest.fixture(scope="module")
def saved_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Job, list[dict[str, Any]], Path]:
    job = Job(tmp_path_factory.mktemp("replicas"), "0,0,1,1", k=1)
    saved = job.run("save")
    assert all(not s["errors"] for s in saved)
    return job, saved, job.snapshot("after-save")


@pytest.mark.parametrize("case", list(_CASES))
def test_a_tampered_replica_is_never_restored_and_every_rank_gets_its_own_state(
        saved_job: tuple[Job, list[dict[str, Any]], Path], case: str) -> None:
    job, saved, snap = saved_job
    job.restore_from(snap)
    job.lose(1)
    _CASES[case](job)
    got = job.run("restore")
    step = got[0]["step"]
    assert all(g["step"] == step for g in got), [g["step"] for g in got]
    _check_exact(saved, got, step)  # each rank's own state of that step, bit-exact
    if case != "symlink, same bytes":  # rank 2's only copy of step 3 is refused: every rank takes step 1
        assert step == 1 and all(g["last_restore"]["tier"].startswith("local:") for g in got), got
