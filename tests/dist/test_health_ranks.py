"""Health marks in a multi-rank job (2 gloo ranks on 127.0.0.1): one rank's NaN demotes the step
for the whole job, and every rank restores the same older step and says what it skipped."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nebula_ckpt.format.health import HEALTH_DIR

from .launch import reports, run_ok

pytestmark = [pytest.mark.timeout(300)]


def _phase(root: str, out: Path, shm_dir: str, phase: str) -> list[dict]:
    run_ok(2, "health_worker.py", [root, str(out), phase], out, shm_dir)
    return reports(out, phase, 2)


def test_one_ranks_nan_demotes_the_step_and_every_rank_restores_the_one_before(
        root: str, shm_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    _phase(root, out, shm_dir, "train")
    healthy = {s: sorted(os.listdir(Path(root, HEALTH_DIR, f"step-{s}"))) for s in (0, 5, 10)}
    assert all(len(v) == 1 and v[0].endswith("-r0.json") for v in healthy.values()), healthy  # rank 0 confirms
    got = _phase(root, out, shm_dir, "nan")
    assert [g["restored"] for g in got] == [10, 10]
    suspect = sorted(set(os.listdir(Path(root, HEALTH_DIR, "step-10"))) - set(healthy[10]))
    assert len(suspect) == 1 and suspect[0].endswith("-r1.json"), suspect          # rank 1 saw it, rank 1 said it
    for g in got:
        assert g["restarted"] == 5, g
        last = g["restart"]
        assert last["health"] == "healthy"
        assert [(x["step"], x["reason"]) for x in last["skipped"]] == [
            (10, "loss nan at step 11, 1 reported step after a restore from it")], last
