"""``nebula-ckpt inspect`` and ``export`` of a multi-rank job's root read what a restart restores:
one rank's memory-tier copy (a multi-rank step holding fewer ranks than its world size) is never
the choice, and is named on stderr as such, never as damaged. Real ranks (2, gloo;
``inspect_ranks_worker.py``): rank 1 holds a key rank 0 lacks, then dies, and rank 0's memory tier
alone commits a newer step; a restart of the job restores the older step every rank holds."""

from __future__ import annotations

import json
from contextlib import redirect_stderr, redirect_stdout
from io import StringIO
from pathlib import Path

import pytest
import torch

from nebula_ckpt.cli import main
from tests.dist.launch import run_mode

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "inspect_ranks_worker.py")

pytestmark = [pytest.mark.timeout(400)]


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = StringIO(), StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(list(args))
    return rc, out.getvalue(), err.getvalue()


def test_inspect_and_export_read_the_step_a_restart_restores_not_one_ranks_memory_tier(tmp_path: Path,
                                                                                         shm_dir: str) -> None:
    root = str(tmp_path / "ck")
    run_mode(tmp_path, WORKER, "save", root, shm_dir)
    restored = run_mode(tmp_path, WORKER, "restore", root, shm_dir)
    steps = {json.loads((restored / f"r{r}.json").read_text())["step"] for r in range(2)}
    assert steps == {2}, steps  # rank 0's memory tier holds step 3; rank 1 never saved it

    rc, out, err = _cli("inspect", root, "--json")
    info = json.loads(out)
    assert rc == 0 and info["step"] == 2 and info["ranks"] == [0, 1], (info.get("step"), info.get("ranks"), err)
    inspected = {k.split("/")[0] for k in info["logical"]}
    assert "one rank's memory-tier copy" in err and "step 3" in err and "damaged" not in err, err

    rc, out, err = _cli("inspect", root)
    assert rc == 0 and out.startswith("step 2 ") and "stage1" in out, out

    exported = tmp_path / "export.pt"
    rc, out, err = _cli("export", root, "--to", str(exported))
    assert rc == 0 and "exported step 2" in out, (out, err)
    assert "one rank's memory-tier copy" in err and "damaged" not in err, err
    saved = torch.load(exported)
    assert saved["step"] == 2 and torch.equal(saved["stage1"], torch.full((8,), 2.0))
    assert inspected == {k for k, v in saved.items() if isinstance(v, (torch.Tensor, dict))} == {"model", "stage1"}


def test_a_step_only_one_ranks_memory_tier_holds_is_shown_as_such_or_refused(tmp_path: Path, shm_dir: str) -> None:
    root = str(tmp_path / "ck")
    run_mode(tmp_path, WORKER, "save", root, shm_dir)

    rc, out, err = _cli("inspect", root, "--step", "2", "--json")  # on both: the shared tier's whole step
    info = json.loads(out)
    assert rc == 0 and info["ranks"] == [0, 1] and "stage1" in info["logical"], (info.get("ranks"), err)
    assert "one rank's memory-tier copy" in err and "damaged" not in err, err

    rc, out, err = _cli("inspect", root, "--step", "3", "--json")
    info = json.loads(out)
    assert rc == 0 and info["step"] == 3 and info["ranks"] == [0] and info["world_size"] == 2, info
    assert "no healthy whole copy of step 3 here" in err and "one rank's memory-tier copy" in err, err

    rc, out, err = _cli("export", root, "--step", "3", "--to", str(tmp_path / "three.pt"))
    assert rc == 1 and out == "", out
    assert "Only one rank's memory-tier copy holds step 3" in err and "persist-memory" in err, err
    assert "damaged" not in err, err
    assert not (tmp_path / "three.pt").exists()
