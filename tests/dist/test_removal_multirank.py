"""A multi-rank job's ``remove()`` of a base on the shared tier is durable (gloo ranks on 127.0.0.1).

Rank 0 removes the shared tier's steps. ``remove(1)`` of a step that later steps refer to keeps it
and records the request on the shared tier (``step-1/REMOVED``); the job is SIGKILLed right after,
and a new job that removes steps 2 and 3 deletes step 1 too: nothing is listed or restored.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .launch import reports, run_ok, run_ranks

pytestmark = [pytest.mark.timeout(240)]


def test_a_removed_base_on_the_shared_tier_goes_when_a_later_job_removes_its_referrers(
        root: str, shm_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    done = run_ranks(2, "removal_worker.py", ["remove", root, str(out)], out, shm_dir)
    assert all(p.returncode == -9 for p in done), [p.stdout[-3000:] for p in done]
    got = reports(out, "remove", 2)
    assert got[0]["written"][1] < got[0]["written"][0] / 4, got[0]["written"]  # step 2 refers to step 1
    assert got[0]["removed"] == [1] and got[1]["removed"] == []  # the shared copy is rank 0's to remove
    assert all(g["listed"] == [1, 2, 3] for g in got), got  # kept while 2 and 3 refer to it
    assert os.path.isfile(os.path.join(root, "step-1", "REMOVED"))
    run_ok(2, "removal_worker.py", ["rest", root, str(out)], out, shm_dir)
    got = reports(out, "rest", 2)
    for g in got:
        assert g["listed_before"] == [1, 2, 3] and g["listed"] == [] and g["latest"] is None, g
    assert got[0]["removed"] == [[2], [3]]
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == []
