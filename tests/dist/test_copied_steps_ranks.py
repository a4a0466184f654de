"""A two-rank job on a root holding step folders copied in without its ``_nebula/`` folder
(gloo ranks on 127.0.0.1).

The copied steps carry writer generation 3 and no writer record says so. Rank 0 takes the job's
generation above every committed step's as well as every record's, and every rank writes under
it: retention keeps the job's own newest steps and a restart restores them on every rank.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

import nebula_ckpt as nc

from .launch import reports, run_ok

pytestmark = [pytest.mark.timeout(240)]


def test_a_two_rank_job_outranks_steps_copied_in_without_their_writer_records(root: str, shm_dir: str,
                                                                               tmp_path: Path) -> None:
    other = str(tmp_path / "other")
    for s in (1, 2, 3):  # a run that restarted twice: its steps carry writer generations 1, 2, 3
        with nc.Checkpointer(other, memory_tier=False) as ck:
            ck.save(s, {"x": torch.full((4,), float(s))})
    os.makedirs(root, exist_ok=True)
    for s in (1, 2, 3):  # the step folders only
        shutil.copytree(os.path.join(other, f"step-{s}"), os.path.join(root, f"step-{s}"))
    out = tmp_path / "out"
    out.mkdir()
    run_ok(2, "copied_steps_worker.py", [root, str(out)], out, shm_dir)
    for r, got in enumerate(reports(out, "copied", 2)):
        assert got["listed"] == [5, 6] and got["latest"] == 6 and got["x"] == 60.0 + r, got
    assert sorted(os.listdir(os.path.join(root, "_nebula", "writers"))) == ["g-4.json", "g-5.json"]
    assert sorted(n for n in os.listdir(os.path.join(root, "step-6")) if n.startswith("shard-")) == \
        ["shard-g4-r0.safetensors", "shard-g4-r1.safetensors"]
