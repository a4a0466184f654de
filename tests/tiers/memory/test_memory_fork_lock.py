"""A training process with forked children (DataLoader workers) killed with SIGKILL: the job
restarted at once finds its memory tier free, while the orphaned workers still live (they notice
their parent's death only a few seconds later), and resumes from it.

The memory tier's lock is an ``flock``, which belongs to the open file a fork shares; a forked
child lets go of its copy, so only the writing process holds the lock."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch

import nebula_ckpt as nc
import warm_python

# saves step 1, forks a child that lives on (a DataLoader worker), prints its pid, SIGKILLs itself
CHILD = """
import os, signal, sys, time, torch
import nebula_ckpt as nc
ck = nc.Checkpointer(sys.argv[1])
ck.save(1, {"w": torch.arange(8.0)})
pid = os.fork()
if pid == 0:  # off the parent's output pipes, so the test sees the parent's end at once
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    time.sleep(120)
    os._exit(0)
print(pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_restart_finds_the_memory_tier_while_the_killed_process_children_live(tmp_path: Path,
                                                                                 shm_dir: str) -> None:
    root = str(tmp_path / "ck")
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir)
    res = warm_python.run([sys.executable, "-c", CHILD, root], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == -signal.SIGKILL, res.stderr
    orphan = int(res.stdout.split()[0])
    try:
        assert _alive(orphan)  # still alive: it would hold the lock without the fix
        into = {"w": torch.zeros(8)}
        with nc.Checkpointer(root) as ck:
            assert ck.load_latest(into=into) == 1
            assert ck.last_restore["tier"].startswith("memory:"), ck.last_restore
            assert any(t.startswith("memory:") for t in ck.stats()["tiers"]), ck.stats()["tiers"]
            ck.save(2, into)
            assert ck.list(detailed=True)[ck.tiers[0].name] == [1, 2]  # the restart writes its memory tier
        assert torch.equal(into["w"], torch.arange(8.0))
    finally:
        os.kill(orphan, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _alive(orphan):
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie left for init to reap does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
