"""The GPU campaign's script (``benchmarks/gpu/run.sh``) on a machine without a GPU: it must stop
at once and say why, and with ``--allow-cpu`` run its CPU parts and write its results folder.
What it measures on a GPU is checked on a GPU (the ``gpu`` tests it runs there)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import warm_python

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu" / "run.sh"

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the script where no GPU is")


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # one compute thread: on 2 shared cores a second one spins in OpenMP barriers (the CPU bench's tiny model)
    env = {**os.environ, "OUT": str(tmp_path), "BUDGET": "240", "NEBULA_SHM_DIR": str(tmp_path / "shm"),
           "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    (tmp_path / "shm").mkdir(exist_ok=True)
    return warm_python.run(["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=300)


def test_without_a_gpu_the_campaign_stops_and_says_why(tmp_path: Path) -> None:
    res = _run(tmp_path)
    assert res.returncode == 3, res.stdout + res.stderr
    assert "no CUDA GPU" in res.stdout
    summary = (tmp_path / "gpu-results" / "summary.md").read_text()
    assert "FAILED: no CUDA GPU" in summary and "nothing was run" in summary


@pytest.mark.slow
def test_with_allow_cpu_the_campaign_runs_its_cpu_parts(tmp_path: Path) -> None:
    res = _run(tmp_path, "--allow-cpu", "--steps=facts,bench")
    assert res.returncode == 0, res.stdout + res.stderr
    out = tmp_path / "gpu-results"
    assert sorted(p.name for p in out.iterdir()) == ["bench.log", "facts.txt", "gpu_bench.json", "gpu_bench.md",
                                                     "summary.md"]
    table = (out / "gpu_bench.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| tiny "))
    assert "error" not in row and row.count("|") == 14, row
    assert "bench rc=0" in (out / "summary.md").read_text()
