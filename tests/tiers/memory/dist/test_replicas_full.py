"""Memory-tier replicas when the partner's tmpfs is really full (a small tmpfs mounted for it,
skipped where mounting is not permitted), on real ranks (gloo on 127.0.0.1, spawned processes).

Two simulated nodes, one rank each (``full_worker.py``): B's memory tier is a 16 MiB tmpfs that
"another job" fills before step 2 so that B's own step fits but A's replica does not. A's handle
reports the replica failed for lack of room; nothing partial is visible in B's replica store; B's
own memory tier is intact; once the file is gone the next save is replicated again. Losing A
then restores the newest step every rank can get. Every comparison is bit-exact (SHA-256).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from dist.launch import run_ranks
from tmpfs_mount import mounted_tmpfs

HERE = Path(__file__).resolve().parent  # the workers beside this module, spawned by path

pytestmark = [pytest.mark.timeout(300)]


class Job:
    """Save / restore jobs of ``full_worker.py``; node B's memory tier is a small tmpfs."""

    def __init__(self, tmp: Path, shm_b: str) -> None:
        self.tmp = tmp
        self.root, self.shm = str(tmp / "root"), tmp / "shm"
        (self.shm / "n0").mkdir(parents=True)
        self.shm_b = shm_b
        self.runs = 0

    def run(self, scenario: str, *args: str, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
        self.runs += 1
        out = self.tmp / f"out{self.runs}"
        out.mkdir()
        done = run_ranks(2, str(HERE / "full_worker.py"), [scenario, self.root, str(out), str(self.shm), *args],
                         out, str(self.shm), timeout=200, env_extra=env)
        for r, p in enumerate(done):
            assert p.returncode == 0, f"rank {r} ended with {p.returncode}:\n{p.stdout[-4000:]}"
        return [json.loads((out / f"{scenario}-r{r}.json").read_text()) for r in range(2)]

    def lose_a(self) -> None:
        """Node A's RAM is gone (its memory-tier folders and everything in them)."""
        shutil.rmtree(self.shm / "n0")
        (self.shm / "n0").mkdir()

    def lose_b(self) -> None:
        """Node B's RAM is gone (everything on its tmpfs; the mount stays)."""
        for entry in os.listdir(self.shm_b):
            shutil.rmtree(os.path.join(self.shm_b, entry))


@pytest.fixture
def job(tmp_path: Path) -> Any:
    shm_b = tmp_path / "shm" / "n1"
    with mounted_tmpfs(str(shm_b), "16m"):
        yield Job(tmp_path, str(shm_b))


def _visible(holds: dict[str, Any]) -> dict[str, list[str]]:
    """B's replica store as listed: folder -> entries."""
    return holds["replicas"]


def _check_exact(saved: list[dict[str, Any]], restored: list[dict[str, Any]], step: int) -> None:
    for r, (s, got) in enumerate(zip(saved, restored, strict=True)):
        assert got["step"] == step, f"rank {r} restored step {got['step']}, expected {step}"
        assert got["digest"] == s["digests"][str(step)], f"rank {r}: restored state differs from step {step}"


@pytest.mark.parametrize("refused_by", ["floor", "fallocate"])
def test_a_partner_without_room_refuses_the_replica_and_takes_the_next(job: Job, refused_by: str) -> None:
    """``floor``: the partner's room check (NEBULA_SHM_MIN_FREE, default 10%) refuses the copy
    before the round sends it; ``fallocate``: the other job takes the room after that check, and
    allocating the copy's pages (before any byte lands) finds the tmpfs full."""
    saved = job.run("save", "3", "2", "receiving" if refused_by == "fallocate" else "before")
    a, b = saved
    assert b["filled"]["free_after"] < 2 * (1 << 20) < b["filled"]["free_before"], b["filled"]
    # A's handle of step 2 reports the replica failed, naming the partner and the lack of room
    assert list(a["errors"]) == ["2"] and a["failures"]["2"] == ["replicas"], a["errors"]
    why = a["errors"]["2"]
    assert "partner rank 1" in why, why
    if refused_by == "floor":
        assert "would keep less than 10% free" in why and "NEBULA_SHM_MIN_FREE" in why, why
    else:
        assert "No space left on device" in why and "needs" in why and "free" in why, why
    assert "replicas" not in a["written"]["2"] and any(w.startswith("memory:") for w in a["written"]["2"])
    assert a["stats"]["replicas"]["failed"] == 1
    # B: its own saves (and their replicas at A) are unaffected; its memory tier holds its step
    assert not b["errors"], b["errors"]
    assert all("replicas" in w and any(t.startswith("memory:") for t in w) for w in b["written"].values())
    for step in ("1", "2", "3"):
        assert b["holds"][step]["own"] == [f"step-{step}"], b["holds"][step]
        for folder, entries in _visible(b["holds"][step]).items():  # nothing partial is visible
            assert not any(e.startswith(".incoming") for e in entries), (step, folder, entries)
    assert _visible(b["holds"]["2"])["r0"] == ["step-1"]  # A's copy of step 1 is kept, whole
    assert sorted(_visible(b["holds"]["2"])["r0/step-1"])[:2] == ["COMMIT", "manifest.json"]
    # room again (the other job's file is gone): step 3 is replicated
    assert "replicas" in a["written"]["3"] and "3" not in a["errors"]
    assert _visible(b["holds"]["3"])["r0"] == ["step-3"]
    # node A lost: A's step 3 comes from its replica at B, B's from its own memory tier
    job.lose_a()
    got = job.run("restore")
    _check_exact(saved, got, 3)
    assert got[0]["last_restore"]["source"] == "replica from rank 1"
    assert got[1]["last_restore"]["source"] == "memory"


def test_node_a_lost_after_a_refused_replica_restores_the_newest_step_every_rank_has(job: Job) -> None:
    saved = job.run("save", "2", "2")
    assert saved[0]["failures"]["2"] == ["replicas"]
    assert _visible(saved[1]["holds"]["2"])["r0"] == ["step-1"]
    got = job.run("restore")  # nothing lost: step 2 on both, each from its own memory tier
    _check_exact(saved, got, 2)
    assert [g["last_restore"]["source"] for g in got] == ["memory", "memory"]
    # A's step 2 was only in A's RAM: every rank goes back to step 1 (A's replica at B, or the disk)
    job.lose_a()
    got = job.run("restore")
    _check_exact(saved, got, 1)


def test_a_pull_whose_memory_tier_copy_runs_out_of_room_part_way_still_restores_from_the_replica(job: Job) -> None:
    """Node B lost; restarted, its tmpfs fills (another job) so that its memory tier cannot take
    the copy it pulls from A (chunks of 128 KiB, 256 KiB free for a 512 KiB shard). The restore
    does not need the tmpfs: the copy lands in B's memory, checked, and B restores it bit-exact.
    Keeping it in B's memory tier (the keep round, at close() at the latest) runs out of room part
    way: the chunks after the refused one go to scratch memory (no byte lands in a tmpfs hole: no
    SIGBUS, the ranks stay in step), the copy is refused with the tmpfs's room named, counted, and
    nothing of it is left on B."""
    saved = job.run("save", "1", "5")  # B's tmpfs is not filled while saving
    assert not any(s["errors"] for s in saved), [s["errors"] for s in saved]
    job.lose_b()
    got = job.run("restore", "fill", str(256 << 10), str(128 << 10))
    _check_exact(saved, got, 1)
    a, b = got
    assert b["filled"]["free_after"] < (512 << 10) < b["filled"]["free_before"], b["filled"]
    assert a["last_restore"]["source"] == "memory" and b["last_restore"]["source"] == "replica from rank 0", got
    why = [w for w in b["warnings"] if "cannot receive its step from rank 0" in w]
    assert why and "No space left on device" in why[0] and "needs" in why[0] and "free" in why[0], b["warnings"]
    assert any("does not keep the copy of step 1" in w for w in b["warnings"]), b["warnings"]
    assert b["stats"]["replicas"].get("keep_failed") == 1, b["stats"]["replicas"]
    for folder, entries in b["holds"]["replicas"].items():  # nothing of the refused copy is left
        assert not any(e.startswith(".incoming") for e in entries), (folder, entries)
