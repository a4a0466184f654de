"""Slips of a first multi-rank script: each is told what happened and how to fix it, and every
step committed before stays (gloo ranks on 127.0.0.1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nebula_ckpt.format.names import COMMIT, step_dir

from .launch import reports, run_ok

pytestmark = [pytest.mark.timeout(240)]


def test_destroying_the_group_before_close_names_the_fix(root: str, shm_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    run_ok(2, "slips_worker.py", ["destroyed", root, str(out)], out, shm_dir)
    for r, got in enumerate(reports(out, "destroyed", 2)):
        # the save in flight fails on the shared root, and the message says why and what to do
        for what in (got["step3"], got["close"]):
            assert "destroy_process_group()" in what and "Close the Checkpointer first" in what, (r, what)
            assert "died" not in what, (r, what)  # no rank died: the message must not send anyone looking
        assert got["listed"] == [1, 2], (r, got["listed"])
    assert Path(root, step_dir(1), COMMIT).exists() and Path(root, step_dir(2), COMMIT).exists()
    assert not Path(root, step_dir(3), COMMIT).exists()


def test_load_latest_on_rank_0_alone_says_every_rank_must_call_it(root: str, shm_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    run_ok(2, "slips_worker.py", ["load_on_rank0", root, str(out)], out, shm_dir,
           env_extra={"NEBULA_COMMIT_TIMEOUT_S": "5"})
    got = reports(out, "load_on_rank0", 2)[0]["load"]
    assert got.startswith("PersistError: ") and "not on rank 0 alone" in got, got
    assert "NEBULA_COMMIT_TIMEOUT_S" in got, got  # the wait it took, and where it is set
    assert Path(root, step_dir(1), COMMIT).exists()


def test_a_save_refused_on_one_rank_leaves_the_ranks_in_step(root: str, shm_dir: str, tmp_path: Path) -> None:
    """One rank's save refused before anything was written (its state) used no save number on that
    rank while the others' went on: every later save paired step N with N+1 and failed ("the ranks
    saved different steps"), and a restart went back to before the refusal. The refused save now
    takes its number on that rank too: that save alone is dropped, the later ones commit."""
    out = tmp_path / "out"
    out.mkdir()
    run_ok(2, "slips_worker.py", ["one_rank_refused", root, str(out)], out, shm_dir,
           env_extra={"NEBULA_COMMIT_TIMEOUT_S": "60"})
    got = reports(out, "one_rank_refused", 2)
    assert got[1]["saves"][2].startswith("ValidationError: ") and "bad" in got[1]["saves"][2], got[1]
    for r in (0, 1):
        later = got[r]["saves"][3:]
        assert later == ["ok"] * 3, (r, got[r]["saves"])
        assert got[r]["restored"] == 5 and got[r]["x"] == 50.0 + r, got[r]
    assert Path(root, step_dir(5), COMMIT).exists()


def test_hugging_faces_get_last_checkpoint_on_rank_0_alone_waits_for_no_rank(root: str, shm_dir: str,
                                                                            tmp_path: Path) -> None:
    """A read of the root (``get_last_checkpoint``, ``export_pretrained``) on rank 0 alone opened a
    Checkpointer whose constructor is a collective of the job: it waited the whole commit timeout
    for rank 1, then raised a bare ``DistStoreError``. It is one rank's read now."""
    out = tmp_path / "out"
    out.mkdir()
    run_ok(2, "slips_worker.py", ["hf_last_on_rank0", root, str(out)], out, shm_dir,
           env_extra={"NEBULA_COMMIT_TIMEOUT_S": "10"})
    got = reports(out, "hf_last_on_rank0", 2)[0]
    assert got["last"] == "ok" and got["path"] == "/nonexistent-out/checkpoint-8", got


def test_a_shared_tier_every_seconds_persists_in_step_on_every_rank(root: str, shm_dir: str, tmp_path: Path) -> None:
    """Each rank applied ``every_seconds`` on its own clock from the save it last took: one late save
    on one rank put the ranks one save apart for good, and every later disk save was dropped (the
    disk ended at step 0, silently). The ranks now take a shared tier's saves by windows of the
    same wall clock: they take the same save, and a save dropped at a window's edge is the only one."""
    out = tmp_path / "out"
    out.mkdir()
    run_ok(2, "slips_worker.py", ["every_seconds", root, str(out)], out, shm_dir)
    got = reports(out, "every_seconds", 2)
    committed = sorted(int(d.name[5:]) for d in Path(root).glob("step-*") if (d / COMMIT).exists())
    assert got[0]["written"] == got[1]["written"] == committed, (got, committed)
    assert len(committed) >= 4 and committed[0] == 0, committed  # ~10 windows of 0.5 s in ~5 s of saves
    assert len(got[0]["dropped"]) <= 3, got  # only where a window's edge fell between the ranks' calls
