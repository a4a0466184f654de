"""The README's torchrun example runs as written: a 2-rank job saves, a second launch resumes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import warm_python

from .launch import free_port

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchrun_ddp.py"


def _torchrun(root: str, steps: int, shm_dir: str) -> "subprocess.CompletedProcess[str]":
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(EXAMPLE), "--root", root, "--steps", str(steps), "--every", "10"]
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir, OMP_NUM_THREADS="1", NEBULA_LOG_LEVEL="INFO")
    p = warm_python.run(cmd, env=env, text=True, capture_output=True, timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


@pytest.mark.timeout(240)
def test_torchrun_example_saves_and_resumes(root: str, shm_dir: str) -> None:
    first = _torchrun(root, 30, shm_dir)
    assert "fresh start" in first.stdout
    # A tier still busy with an older save drops a queued one for the newer save (a slow tier never
    # holds training up): on a busy machine the disk may skip step 20. Each save's summary line
    # names the tiers that dropped it; retention keeps the newest 3 of the rest.
    dropped = {int(s) for s in re.findall(r"step (\d+): [^\n]*dropped by local:", first.stderr)}
    assert 29 not in dropped, first.stderr[-6000:]  # leaving the block waits for the last save
    kept = [s for s in (0, 10, 20, 29) if s not in dropped][-3:]
    steps = sorted((n for n in os.listdir(root) if n.startswith("step-")), key=lambda n: int(n[5:]))
    assert steps == [f"step-{s}" for s in kept], first.stderr[-6000:]  # its log says why a step stayed
    out = _torchrun(root, 45, shm_dir).stdout
    assert "resumed from step 29" in out and "done at step 44" in out
