"""The README's torchrun example runs as written: a 2-rank job saves, a second launch resumes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .launch import free_port

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchrun_ddp.py"


def _torchrun(root: str, steps: int, shm_dir: str) -> "subprocess.CompletedProcess[str]":
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(EXAMPLE), "--root", root, "--steps", str(steps), "--every", "10"]
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


@pytest.mark.timeout(240)
def test_torchrun_example_saves_and_resumes(root: str, shm_dir: str) -> None:
    first = _torchrun(root, 30, shm_dir)
    assert "fresh start" in first.stdout
    steps = sorted(n for n in os.listdir(root) if n.startswith("step-"))
    assert steps == ["step-10", "step-20", "step-29"], first.stderr[-6000:]  # its log says why a step stayed
    out = _torchrun(root, 45, shm_dir).stdout
    assert "resumed from step 29" in out and "done at step 44" in out
