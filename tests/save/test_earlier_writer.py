"""A restarted job's memory tier holds the newest step of the writer before it (a process killed
before its disk tier's cadence took that step): what the new Checkpointer copies of it to a
persistent tier (at ``close()``, or to make room under the host-memory budget: the same code,
``save.drain.flush_newest``) is the same write, under its own writer generation, so the marks on
it still apply (and the memory tier can give it up)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

import nebula_ckpt as nc
import warm_python

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
    warm_python.run([sys.executable, "-c", EARLIER, root], check=True, timeout=120,
                    env=dict(os.environ, NEBULA_SHM_DIR=shm_dir))
    assert sorted(p.name for p in Path(root).glob("step-*")) == ["step-0"]


def _commit(root: str, step: int) -> dict:
    return json.loads(Path(root, f"step-{step}", "COMMIT").read_text())


def test_close_copies_an_earlier_writers_step_as_the_same_write_and_its_suspect_mark_holds(
        tmp_path: Path, shm_dir: str) -> None:
    root = str(tmp_path / "ck")
    _earlier_writer(root, shm_dir)
    mark = warm_python.run([sys.executable, "-m", "nebula_ckpt.cli", "mark", root, "--suspect", "2", "--reason",
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



SAVED_AGAIN = """
import os, sys, torch, nebula_ckpt as nc
root = sys.argv[1]
ck = nc.Checkpointer(root, tiers=[nc.MemoryTier(), nc.LocalTier(root, every=2)], incremental=False)
ck.save(1, {"w": torch.full((%d,), 1.0)})  # save 0: the memory and disk tiers
ck.save(1, {"w": torch.full((%d,), 2.0)})  # save 1, the step saved again (a rollback): the memory tier only
os._exit(0)  # killed: the second write of step 1 lives only in the memory tier
""" % (N, N)


@pytest.mark.parametrize("how", ["close", "budget", "persist-memory"])
def test_an_earlier_writers_step_saved_again_replaces_its_first_write_on_disk(
        tmp_path: Path, shm_dir: str, how: str) -> None:
    root = str(tmp_path / "ck")
    warm_python.run([sys.executable, "-c", SAVED_AGAIN, root], check=True, timeout=120,
                    env=dict(os.environ, NEBULA_SHM_DIR=shm_dir))
    assert _commit(root, 1)["generation"] == 1 and _commit(root, 1)["save"] == 0  # the first write
    # 2.5 MiB: the memory tier's step 1 (1 MiB), the earlier process's spare slot file (1 MiB, too small for the
    # new state: not adopted) and step 2 (1.25 MiB) do not fit together: the save puts step 1 on disk first
    if how == "persist-memory":  # the job ended for good: its epilogue
        r = warm_python.run([sys.executable, "-m", "nebula_ckpt.cli", "persist-memory", root, "--json"],
                            capture_output=True, text=True, env=dict(os.environ, NEBULA_SHM_DIR=shm_dir), timeout=120)
        assert r.returncode == 0 and json.loads(r.stdout)["copied"], (r.stdout, r.stderr)
    budget = int(2.5 * 4 * N) if how == "budget" else None
    ck = nc.Checkpointer(root, tiers=[nc.MemoryTier(), nc.LocalTier(root, every=2)], incremental=False,
                         host_memory_budget=budget)
    if how == "budget":
        ck.save(2, {"w": torch.full((N + N // 4,), 3.0)})  # refused before the fix: its copy to disk failed
    else:
        state = {"w": torch.zeros(N)}
        assert ck.load_latest(into=state) == 1 and float(state["w"][0]) == 2.0  # the memory tier's second write
        ck.prepare(state)
    ck.close()  # puts the memory tier's newest step on the disk tier (close), or has put it there (budget)
    assert _commit(root, 1)["generation"] == 1 and _commit(root, 1)["save"] == 1  # the same write, replacing
    files = sorted(p.name for p in Path(root, "step-1").iterdir())  # the first write's files are gone
    assert files[:2] == ["COMMIT", "manifest.json"] and len(files) == 3 and files[2].startswith("shard-g1-r0"), files
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as fresh:
        into = {"w": torch.zeros(N)}
        assert fresh.load(1, into=into) == 1 and float(into["w"][0]) == 2.0
        assert fresh.list() == ([1, 2] if how == "budget" else [1])
