"""Faults in the multi-rank commit, on real gloo ranks: a committed step keeps every shard, a
failed step leaves nothing behind, and every earlier committed step stays restorable.

Each test runs a job of 2 ranks of ``commit_worker.py`` (memory tier off: the disk tier alone)
that saves steps 1-3 on a shared root with a fault at a named stage of step 3's commit (a real
SIGKILL, a stall, or a full file system), then checks the root with ``nebula-ckpt verify`` and
restarts from it (``resume``: restore, then save step 4), comparing tensors bit-exactly.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

import warm_python
from memory_paths import memory_tier_path
from nebula_ckpt import knobs
from nebula_ckpt.cli import main as cli
from nebula_ckpt.format.names import COMMIT, MANIFEST, shard_name

from .launch import reports, run_ranks

pytestmark = [pytest.mark.timeout(300), pytest.mark.crash]

WORLD = 2


def _job(scenario: str, root: str, out: Path, shm_dir: str, dead: tuple[int, ...] = (),
         **env: str) -> list[dict[str, Any]]:
    """Run the job; ranks in ``dead`` must have died of SIGKILL, the others exited cleanly."""
    done = run_ranks(WORLD, "commit_worker.py", [scenario, root, str(out)], out, shm_dir, env_extra=env)
    for r, p in enumerate(done):
        assert p.returncode == (-9 if r in dead else 0), f"rank {r}:\n{p.stdout[-4000:]}"
    return [json.loads((out / f"{scenario}-r{r}.json").read_text()) if r not in dead else {}
            for r in range(WORLD)]


def _verify(root: str, capsys: pytest.CaptureFixture[str]) -> dict[int, bool]:
    """``nebula-ckpt verify ROOT --json``: committed step -> healthy (every checksum read)."""
    capsys.readouterr()
    cli(["verify", root, "--json"])
    rows = json.loads(capsys.readouterr().out)
    return {r["step"]: r["healthy"] for r in rows if r["tier"] == f"local:{root}"}


def _resume(root: str, out: Path, shm_dir: str, expect_step: int, digest: dict[str, Any],
            memory: bool = False) -> list[dict[str, Any]]:
    """A new job restores (from the disk tier alone, unless ``memory``): ``expect_step``, bit-exact,
    on every rank."""
    got = run_ranks(WORLD, "commit_worker.py", ["resume", root, str(out)], out, shm_dir,
                    env_extra={"TEST_MEMORY_TIER": "1" if memory else "0"})
    for r, p in enumerate(got):
        assert p.returncode == 0, f"rank {r}:\n{p.stdout[-4000:]}"
    loaded = reports(out, "resume", WORLD)
    for r in range(WORLD):
        assert loaded[r]["step"] == expect_step, loaded[r]
        assert memory or loaded[r]["restored_from"]["tier"] == f"local:{root}"
        assert loaded[r]["digest"] == digest, f"rank {r}: not bit-exact"        # DDP: the same on every rank
        assert loaded[r]["mine"] == [float(r)] * 3
    return loaded


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    return out


def test_rank0_killed_right_after_commit_keeps_every_shard(root: str, shm_dir: str, job_dir: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 0 dies of SIGKILL right after writing step 3's COMMIT: rank 1 cannot hear the verdict,
    but the step is committed; rank 1 must not delete its shard of it."""
    got = _job("after_commit", root, job_dir, shm_dir, dead=(0,))
    survivor = got[1]
    assert Path(root, "step-3", COMMIT).exists()
    assert Path(root, "step-3", shard_name(1, 1)).exists(), "rank 1 deleted its shard of a committed step"
    assert survivor["step3"] == "committed", survivor["step3"]    # it re-checked: the COMMIT is there
    assert _verify(root, capsys) == {1: True, 2: True, 3: True}
    loaded = _resume(root, job_dir, shm_dir, 3, survivor["digest3"])
    # keep_last=3, and step 1 stays too: step 3 is incremental (unchanged tensors of a rank's
    # share lie in its step-1 shard) and a step another committed step refers to is never deleted
    refs = json.loads(Path(root, "step-3", MANIFEST).read_text())["references"]
    assert refs == [1], refs
    assert loaded[0]["list"] == [1, 2, 3, 4]


def test_rank0_stalled_at_commit_while_rank1_times_out_keeps_every_shard(
        root: str, shm_dir: str, job_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 0 is slow to write step 3's COMMIT; rank 1's round times out first and its save
    reports failure. Rank 0 then commits: rank 1's shard must still be there."""
    got = _job("slow_commit", root, job_dir, shm_dir, NEBULA_COMMIT_TIMEOUT_S="20")
    assert Path(root, "step-3", COMMIT).exists()
    for r in range(WORLD):
        assert Path(root, "step-3", shard_name(1, r)).exists(), f"rank {r} deleted its shard of a committed step"
    assert _verify(root, capsys) == {1: True, 2: True, 3: True}
    assert got[0]["step3"] == "committed", got[0]["step3"]
    assert got[1]["step3"].startswith("PersistError") and "step 3" in got[1]["step3"], got[1]["step3"]
    assert "may have committed" in got[1]["step3"], got[1]["step3"]
    _resume(root, job_dir, shm_dir, 3, got[0]["digest3"])


def test_rank0_timing_out_on_a_slow_rank_commits_nothing_and_deletes_only_its_own(
        root: str, shm_dir: str, job_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 1 is slow to report its (durable) shard of step 3: rank 0's round times out, so rank 0
    knows it did not commit and removes its own shard; rank 1 reports later and, hearing no
    verdict, cannot know: it keeps its shard. Step 2 is restored; the restart sweeps step 3."""
    got = _job("slow_report", root, job_dir, shm_dir, NEBULA_COMMIT_TIMEOUT_S="20")
    assert got[0]["step3"].startswith("PersistError") and "may have committed" not in got[0]["step3"], got[0]
    assert "may have committed" in got[1]["step3"], got[1]["step3"]
    assert not Path(root, "step-3", COMMIT).exists() and not Path(root, "step-3", MANIFEST).exists()
    assert not Path(root, "step-3", shard_name(1, 0)).exists()
    assert got[0]["list"] == [1, 2]
    assert _verify(root, capsys) == {1: True, 2: True}
    loaded = _resume(root, job_dir, shm_dir, 2, got[0]["digest2"])
    assert loaded[0]["list"] == [1, 2, 4]
    assert not Path(root, "step-3").exists()


def test_rank0_killed_before_commit_leaves_step2_and_the_sweep_clears_step3(
        root: str, shm_dir: str, job_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 0 dies at the COMMIT write of step 3, before it: rank 1 cannot know whether step 3
    committed and keeps its shard; step 3 stays invisible, step 2 is restored, and the restarted
    job's first save sweeps step 3's leftovers."""
    got = _job("before_commit", root, job_dir, shm_dir, dead=(0,))
    assert got[1]["step3"].startswith("PersistError") and "may have committed" in got[1]["step3"], got[1]["step3"]
    assert not Path(root, "step-3", COMMIT).exists()
    assert Path(root, "step-3", shard_name(1, 1)).exists()       # kept: the commit was not known
    assert _verify(root, capsys) == {1: True, 2: True}
    loaded = _resume(root, job_dir, shm_dir, 2, got[1]["digest2"])
    assert loaded[0]["list"] == [1, 2, 4]
    assert not Path(root, "step-3").exists()                         # a newer generation swept it


def test_rank1_killed_after_its_shard_before_reporting_commits_nothing(
        root: str, shm_dir: str, job_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    got = _job("before_report", root, job_dir, shm_dir, dead=(1,))
    assert got[0]["step3"].startswith("PersistError") and "step 3" in got[0]["step3"], got[0]["step3"]
    assert "may have committed" not in got[0]["step3"]               # rank 0 commits: it knows it did not
    assert not Path(root, "step-3", COMMIT).exists() and not Path(root, "step-3", MANIFEST).exists()
    assert not Path(root, "step-3", shard_name(1, 0)).exists()    # rank 0 removed its own at once
    assert got[0]["list"] == [1, 2]
    assert _verify(root, capsys) == {1: True, 2: True}
    loaded = _resume(root, job_dir, shm_dir, 2, got[0]["digest2"])
    assert loaded[0]["list"] == [1, 2, 4]
    assert not Path(root, "step-3").exists()


def test_a_rank_killed_at_its_memory_commit_leaves_nothing_its_next_job_keeps(
        root: str, shm_dir: str, job_dir: Path) -> None:
    """The last rank dies at the COMMIT write of step 3 on its own memory tier (its manifest is
    written): the restarted job's first save sweeps that folder on that rank's memory tier too."""
    got = _job("mem_before_commit", root, job_dir, shm_dir, dead=(1,))
    assert got[0]["step3"].startswith("PersistError") and "step 3" in got[0]["step3"], got[0]["step3"]
    with knobs.override(shm_dir=shm_dir):
        mem1 = memory_tier_path(root, 1)
    assert sorted(os.listdir(Path(mem1, "step-3"))) == [MANIFEST, shard_name(1, 1)]
    loaded = _resume(root, job_dir, shm_dir, 2, got[0]["digest2"], memory=True)
    assert loaded[1]["memory"] is not None and "step-3" not in loaded[1]["memory"], loaded[1]["memory"]
    assert "step-4" in loaded[1]["memory"]


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """A real 2 MiB file system (tmpfs; needs root), or, where it cannot be mounted, a folder whose
    shard writes of step 2 fail with ENOSPC at the ``shard`` stage (the worker's fault hook)."""
    d = tmp_path / f"small-{uuid.uuid4().hex[:6]}"
    d.mkdir()
    mounted = warm_python.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0755", "tmpfs", str(d)],
                              capture_output=True).returncode == 0
    try:
        yield str(d / "ckpt"), ({} if mounted else {"TEST_INJECT_ENOSPC": "1"})
    finally:
        if mounted:
            warm_python.run(["umount", "-l", str(d)], check=False)


def test_disk_full_during_a_save_leaves_no_step_folder(small_fs: tuple[str, dict[str, str]], shm_dir: str,
                                                       job_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Step 2 (4 MiB per rank) does not fit on the 2 MiB file system: it fails on every rank,
    and its folder is gone (no empty folder, no partial shard); step 3 then fits and commits."""
    root, env = small_fs
    got = _job("disk_full", root, job_dir, shm_dir, **env)
    for r in range(WORLD):
        assert got[r]["step1"] == "committed" and got[r]["step3"] == "committed", got[r]
        assert got[r]["step2"].startswith("PersistError") and "step 2" in got[r]["step2"], got[r]["step2"]
    assert got[0]["step2_left"] is None, got[0]["step2_left"]             # right after the failure
    assert not Path(root, "step-2").exists()
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-1", "step-3"]
    assert got[0]["list"] == [1, 3]
    assert _verify(root, capsys) == {1: True, 3: True}
    _resume(root, job_dir, shm_dir, 3, got[0]["digest3"])
