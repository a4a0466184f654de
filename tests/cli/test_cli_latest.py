"""``inspect`` / ``export`` without ``--step`` (or ``--step latest``) read the step a restart restores.

The same order as ``load_latest`` (the newest writer generation first, then the newest step), the
steps marked suspect skipped, a damaged copy passed over; ``--step N`` reads ``N`` whatever its
mark, and says when it is suspect. And a ROOT no command can take (a malformed URL, a file) is a
usage error (exit 2) that names it and the fix.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import nebula_ckpt as nc
import warm_python
from nebula_ckpt.cli import main


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), value)}


def _exported(root: str, out: str, *which: str) -> float:
    """Export ``root`` (``which``: ``--step N`` ...) to ``out``; the value of ``w`` written."""
    assert main(["export", root, *which, "--to", out]) == 0
    return float(torch.load(out, weights_only=True)["w"][0])


@pytest.fixture
def suspect3(root: str, capsys: pytest.CaptureFixture[str]) -> str:
    """Steps 1, 2, 3, step 3 marked suspect by a person."""
    with nc.Checkpointer(root, memory_tier=False) as ck:
        for step in (1, 2, 3):
            ck.save(step, _state(float(step)))
    assert main(["mark", root, "--suspect", "3", "--reason", "loss went NaN"]) == 0
    capsys.readouterr()
    return root


def _inspect_step(root: str, capsys: pytest.CaptureFixture[str], *which: str) -> tuple[int, str]:
    """The step ``inspect --json`` reads, and what it said on stderr."""
    assert main(["inspect", root, *which, "--json"]) == 0
    got = capsys.readouterr()
    return int(json.loads(got.out)["step"]), got.err


def test_latest_skips_a_step_marked_suspect_as_load_latest_does(suspect3: str, tmp_path,  # noqa: ANN001
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    with nc.Checkpointer(suspect3, read_only=True) as ck:
        assert ck.read()[0] == 2  # what a restart restores
    for which in ([], ["--step", "latest"]):
        step, err = _inspect_step(suspect3, capsys, *which)
        assert step == 2, err
        assert "skipped step 3" in err and "loss went NaN" in err and "--step 3" in err, err
        assert _exported(suspect3, str(tmp_path / "out.pt"), *which) == 2.0
        assert "skipped step 3" in capsys.readouterr().err
    assert main(["ls", suspect3, "--json"]) == 0  # ls shows the mark
    assert [r["health"] for r in json.loads(capsys.readouterr().out)] == ["unknown", "unknown", "suspect"]


def test_a_suspect_step_on_the_memory_tier_is_skipped_too(root: str, tmp_path,  # noqa: ANN001
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """While the job runs, its memory tier (the fastest) holds step 3 too: skipped there as well."""
    with nc.Checkpointer(root) as ck:
        for step in (1, 2, 3):
            ck.save(step, _state(float(step)))
        ck.wait()
        assert main(["mark", root, "--suspect", "3"]) == 0
        capsys.readouterr()
        assert main(["ls", root, "--json"]) == 0
        tiers = {r["tier"].split(":")[0] for r in json.loads(capsys.readouterr().out) if r["step"] == 3}
        assert tiers == {"memory", "local"}, tiers
        assert _inspect_step(root, capsys)[0] == 2
        assert _exported(root, str(tmp_path / "out.pt")) == 2.0
        capsys.readouterr()
        assert _inspect_step(root, capsys, "--step", "3")[0] == 3


def test_an_explicit_step_reads_a_suspect_step_and_says_so(suspect3: str, tmp_path,  # noqa: ANN001
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    step, err = _inspect_step(suspect3, capsys, "--step", "3")
    assert step == 3
    assert "step 3 is marked suspect" in err and "loss went NaN" in err and "--healthy 3" in err, err
    assert _exported(suspect3, str(tmp_path / "out.pt"), "--step", "3") == 3.0
    assert "step 3 is marked suspect" in capsys.readouterr().err
    assert main(["mark", suspect3, "--healthy", "3"]) == 0  # cleared: latest is step 3 again
    capsys.readouterr()
    assert _inspect_step(suspect3, capsys) == (3, "")


def test_latest_passes_a_damaged_step_and_a_suspect_one(suspect3: str, tmp_path,  # noqa: ANN001
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Step 3 suspect, step 2 damaged: step 1, with both named on stderr."""
    d = os.path.join(suspect3, "step-2")
    shard = next(f for f in os.listdir(d) if f.endswith(".safetensors"))
    with open(os.path.join(d, shard), "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))
    assert _exported(suspect3, str(tmp_path / "out.pt")) == 1.0
    err = capsys.readouterr().err
    assert "skipped step 3" in err and "skipped (damaged)" in err and "step 2" in err, err


def test_every_step_suspect_is_an_error_that_names_them_and_the_fix(suspect3: str, tmp_path,  # noqa: ANN001
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    for step in ("1", "2"):
        assert main(["mark", suspect3, "--suspect", step]) == 0
    capsys.readouterr()
    assert main(["export", suspect3, "--to", str(tmp_path / "out.pt")]) == 1
    err = capsys.readouterr().err
    assert "marked suspect" in err and "3, 2, 1" in err and "--step N" in err and "--healthy" in err, err
    assert not os.path.exists(tmp_path / "out.pt")


def _nebula_ckpt() -> list[str]:
    return [sys.executable, "-m", "nebula_ckpt.cli"]


def test_latest_after_a_rollback_is_the_new_runs_step(root: str, shm_dir: str, tmp_path) -> None:  # noqa: ANN001
    """A job restored step 2 of a run that had reached 5, then saved step 3 again: a restart
    restores the new step 3 (a newer writer generation), and so do inspect and export, run as the
    command a user types."""
    with nc.Checkpointer(root, keep_last=10, memory_tier=False) as ck:
        for step in (1, 2, 3, 4, 5):
            ck.save(step, _state(float(step)))
    with nc.Checkpointer(root, keep_last=10, memory_tier=False) as ck:
        ck.load(2, into=_state(0.0))
        ck.save(3, _state(30.0))
    with nc.Checkpointer(root, read_only=True) as ck:
        assert ck.read()[0] == 3
    env = {**os.environ, "NEBULA_SHM_DIR": shm_dir}
    for which in ([], ["--step", "latest"]):
        r = warm_python.run([*_nebula_ckpt(), "inspect", root, *which, "--json"], capture_output=True, text=True,
                            env=env)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["step"] == 3
        out = str(tmp_path / "out.pt")
        r = warm_python.run([*_nebula_ckpt(), "export", root, *which, "--to", out], capture_output=True, text=True,
                            env=env)
        assert r.returncode == 0, r.stderr
        assert float(torch.load(out, weights_only=True)["w"][0]) == 30.0
    # the abandoned run's steps are still there, and still readable by number
    assert _exported(root, str(tmp_path / "five.pt"), "--step", "5") == 5.0
