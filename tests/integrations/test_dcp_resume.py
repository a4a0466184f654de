"""``torch.distributed.checkpoint`` users: a run saving with ``NebulaStorageWriter``, killed with
SIGKILL, resumes with ``dcp.load`` + ``NebulaStorageReader`` to bit-identical losses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import warm_python

WORKER = Path(__file__).with_name("dcp_worker.py")


def _run(root: Path, losses: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    return warm_python.run([sys.executable, str(WORKER), str(root), str(losses), "12", *extra],
                           env=env, capture_output=True, text=True, timeout=240)


def _losses(path: Path) -> dict[int, str]:
    out: dict[int, str] = {}
    for line in path.read_text().splitlines():
        step, value = line.split()
        out[int(step)] = value  # a resumed run rewrites the steps after its checkpoint
    return out


@pytest.mark.slow
@pytest.mark.crash
@pytest.mark.timeout(300)
def test_dcp_run_killed_and_resumed_gives_bit_identical_losses(tmp_path: Path) -> None:
    ref = _run(tmp_path / "ref", tmp_path / "ref.txt")
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = _run(tmp_path / "run", tmp_path / "run.txt", "--kill-at", "6")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "run").glob("step-*")) == ["step-3", "step-6"]
    resumed = _run(tmp_path / "run", tmp_path / "run.txt", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want, got = _losses(tmp_path / "ref.txt"), _losses(tmp_path / "run.txt")
    assert sorted(got) == list(range(1, 13))
    assert got == want, "losses after the resume differ from the uninterrupted run"
