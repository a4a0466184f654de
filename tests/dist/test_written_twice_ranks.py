"""One step number saved twice by a job of two ranks on a shared root: the coordinator replaces
the committed step (marker first, then the folder) while the other rank must not look into that
folder, or it finds its own leftover of the first save unlisted and removes it, and its sync of
the folder fails once the folder is gone (found by the stateful test on two ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nebula_ckpt.cli import main as cli

from .launch import reports, run_ok

pytestmark = [pytest.mark.timeout(300)]


def test_the_other_rank_waits_for_the_coordinator_to_replace_a_step(root: str, shm_dir: str, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    run_ok(2, "twice_worker.py", [root, str(out)], out, shm_dir)
    got = reports(out, "twice", 2)
    for r, rep in enumerate(got):
        assert rep["first"] == "committed", rep
        assert rep["second"] == "committed", f"rank {r}: {rep['second']}"
        assert rep["step"] == 0 and rep["w"] == [2.0] and rep["mine"] == [10 + r] * 3, rep
    assert (out / "r0-unmarked").exists()  # the hooks did order the replacement
    capsys.readouterr()
    cli(["verify", root, "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert [(row["step"], row["healthy"]) for row in rows] == [(0, True)], rows
