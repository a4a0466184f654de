"""A job whose ranks hold different state (pipeline stages) reshards with ``Checkpointer``.

4 real gloo ranks (2 stages x 2 data-parallel ranks) save through ``Checkpointer``; 2 ranks (one
per stage) restore with ``load_latest`` into their own stage's fresh model and optimizer: each
gets its stage's tensors bit for bit and the keys every rank saved, and is never asked for the
other stage's keys (:mod:`stages_worker`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .launch import reports, run_ranks, shm_folder

pytestmark = [pytest.mark.timeout(300)]


def test_each_stage_restores_its_own_state_at_another_world_size(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with shm_folder(tmp_path) as shm:
        for scenario, world in (("save", 4), ("load", 2)):
            done = run_ranks(world, "stages_worker.py", [scenario, str(tmp_path / "root"), str(out)], out, shm,
                             timeout=200)
            for r, p in enumerate(done):
                assert p.returncode == 0, f"{scenario} rank {r}:\n{p.stdout[-4000:]}"
    for r, rep in enumerate(reports(out, "load", 2)):
        assert rep["stage"] == r and rep["step"] == 3 and rep["value"] == 3, rep
        assert rep["tensors"] >= 9 and len(rep["same"]) == rep["tensors"], rep   # model, AdamW state, common
