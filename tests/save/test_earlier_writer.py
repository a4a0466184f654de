"""A restarted job's memory tier holds the newest step of the writer before it (a process killed
before its disk tier's cadence took that step): what the new Checkpointer copies of it to a
persistent tier (at ``close()``, or to make room under the host-memory budget: the same code,
``save.drain.flush_newest``) is the same write, under its own writer generation, so the marks on
it still apply (and the memory tier can give it up)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import nebula_ckpt as nc

N = 1 << 18  # 1 MiB of float32

EARLIER = """
import os, sys, torch, nebula_ckpt as nc
root = sys.argv[1]
ck = nc.Checkpointer(root, tiers=[nc.MemoryTier(), nc.LocalTier(root, every=3)], incremental=False)
for s in range(3):
    ck.save(s, {"w": torch.full((%d,), float(s))})
os._exit(0)  # killed: step 2 lives only in the memory tier
""" % N


def _earlier_writer(root: str, shm_dir: str) -> None:
    subprocess.run([sys.executable, "-c", EARLIER, root], check=True, timeout=120,
                   env=dict(os.environ, NEBULA_SHM_DIR=shm_dir))
    assert sorted(p.name for p in Path(root).glob("step-*")) == ["step-0"]


def _commit(root: str, step: int) -> dict:
    return json.loads(Path(root, f"step-{step}", "COMMIT").read_text())


def test_close_copies_an_earlier_writers_step_as_the_same_write_and_its_suspect_mark_holds(
        tmp_path: Path, shm_dir: str) -> None:
    root = str(tmp_path / "ck")
    _earlier_writer(root, shm_dir)
    mark = subprocess.run([sys.executable, "-m", "nebula_ckpt.cli", "mark", root, "--suspect", "2", "--reason",
                           "loss went NaN"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, NEBULA_SHM_DIR=shm_dir))
    assert mark.returncode == 0, mark.stdout + mark.stderr
    state = {"w": torch.zeros(N)}
    ck = nc.Checkpointer(root, tiers=[nc.MemoryTier(), nc.LocalTier(root, every=3)], incremental=False)
    assert ck.load_latest(into=state) == 0  # step 2 is suspect
    ck.prepare(state)
    ck.close()  # puts the memory tier's newest step on the disk tier
    assert _commit(root, 2)["generation"] == 1 and _commit(root, 2)["save"] == 2  # the same write
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as fresh:
        into = {"w": torch.zeros(N)}
        assert fresh.load_latest(into=into) == 0  # its mark still applies: never restored
        assert float(into["w"][0]) == 0.0

