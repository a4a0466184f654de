"""Jobs on simulated nodes whose memory-tier steps are restored after a node loss or drained to the
shared tier (real gloo ranks, real processes; see ``drain_worker.py``).

Nodes are simulated as in ``test_replicas.py``: each rank gets ``NEBULA_NODE_ID=n<i>`` and its
node's own ``NEBULA_SHM_DIR``; a node is lost by deleting its memory-tier folder after the job
ended like a crash. Every state comparison is bit-exact (a SHA-256 of every tensor's bytes).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import nebula_ckpt as nc
import warm_python
from dist.launch import run_ranks
from nebula_ckpt import knobs
from nebula_ckpt.tiers.memory.epilogue import persist_memory

HERE = Path(__file__).resolve().parent  # the workers beside this module, spawned by path
REPO = HERE.parents[3]

pytestmark = [pytest.mark.timeout(600)]


class Job:
    """Runs of ``drain_worker.py`` on simulated nodes, one shm folder per node."""

    def __init__(self, tmp: Path, nodes_of: str, k: int, disk_every: int, steps: int = 3) -> None:
        self.tmp, self.nodes_of, self.k = tmp, nodes_of, k
        self.world = len(nodes_of.split(","))
        self.root, self.shm = str(tmp / "root"), tmp / "shm"
        self.extra = [str(disk_every), str(steps)]
        self.runs = 0

    def run(self, scenario: str, nodes_of: str = "", killed: bool = False) -> list[dict[str, Any]]:
        self.runs += 1
        out = self.tmp / f"out{self.runs}"
        out.mkdir()
        done = run_ranks(self.world, str(HERE / "drain_worker.py"),
                         [scenario, self.root, str(out), str(self.shm), nodes_of or self.nodes_of, str(self.k),
                          *self.extra], out, str(self.shm), timeout=200)
        for r, p in enumerate(done):
            assert p.returncode == (-9 if killed else 0), f"rank {r} ended with {p.returncode}:\n{p.stdout[-4000:]}"
        return [json.loads((out / f"{scenario}-r{r}.json").read_text()) for r in range(self.world)]

    def lose(self, *nodes: int) -> None:
        """The nodes' RAM is gone (their memory-tier folders and everything in them)."""
        for n in nodes:
            shutil.rmtree(self.shm / f"n{n}")


@pytest.mark.parametrize("k", [0, 1])
def test_a_step_saved_twice_is_restored_from_one_write_on_every_rank(tmp_path: Path, k: int) -> None:
    """Step 5 is saved twice; the second write reaches every rank's memory tier but neither the
    disk tier (every 2nd save) nor, with replicas, any partner (the job dies before that round).
    Node 1 is lost. Rank 0 still holds the second write in memory, rank 1 can get only the first
    (the disk tier, or rank 0's replica of it): every rank restores the first write, never a mix
    of the two."""
    job = Job(tmp_path, "0,1", k=k, disk_every=2)
    saved = job.run("twice", killed=bool(k))
    assert all(s["first"] != s["second"] for s in saved)
    job.lose(1)
    got = job.run("restore")
    for r, (s, g) in enumerate(zip(saved, got, strict=True)):
        assert g["step"] == 5, g
        which = "the second" if g["digest"] == s["second"] else "no"
        assert g["digest"] == s["first"], f"rank {r} restored {which} write"


def _drain(job: Job, node: int, kill: str = "-", gate: str = "") -> subprocess.Popen[str]:
    """``nebula-ckpt persist-memory`` on simulated node ``node`` (its memory tiers), in a process of
    its own, started (``kill``, ``gate``: see ``drain_cli.py``)."""
    env = dict(os.environ, NEBULA_SHM_DIR=str(job.shm / f"n{node}"), PYTHONPATH=str(REPO))
    return warm_python.popen([sys.executable, str(HERE / "drain_cli.py"), job.root, kill, gate],
                             env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _at_once(job: Job, nodes: list[int]) -> list[dict[str, Any]]:
    """The drains of ``nodes``, released together once every process is up."""
    gate = job.tmp / f"gate{job.runs}"
    procs = [_drain(job, n, gate=str(gate)) for n in nodes]
    deadline = time.monotonic() + 200
    while len(list(gate.parent.glob(f"{gate.name}.ready-*"))) < len(procs) and time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), "a drain ended before the gate opened"
        time.sleep(0.05)
    gate.touch()
    return [_done(p) for p in procs]


def _done(p: subprocess.Popen[str], code: int = 0) -> dict[str, Any]:
    out, _ = p.communicate(timeout=200)
    assert p.returncode == code, f"persist-memory ended with {p.returncode}:\n{out[-4000:]}"
    return json.loads(out.strip().splitlines()[-1]) if code == 0 else {}


def _committed(root: str) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in Path(root).glob("step-*/COMMIT"))


def _files(root: str, step: int) -> dict[str, Any]:
    """Every file of the step folder, by name (the commit marker without the time it was written)."""
    out: dict[str, Any] = {p.name: p.read_bytes() for p in sorted(Path(root, f"step-{step}").iterdir())}
    out["COMMIT"] = {k: v for k, v in json.loads(out["COMMIT"]).items() if k != "time"}
    return out


def _put_back(job: Job, kept: Path) -> None:
    """The root and every node's memory tiers as they were when ``kept`` was taken."""
    for name, dst in (("root", Path(job.root)), ("shm", job.shm)):
        shutil.rmtree(dst)
        shutil.copytree(kept / name, dst, symlinks=True)


def test_a_lost_nodes_memory_step_reaches_the_shared_tier_and_a_moved_job_resumes_it(tmp_path: Path) -> None:
    """4 ranks on 2 nodes with replicas; steps 2 and 3 only in RAM (the disk tier has step 1); the
    memory tiers' own copies of them are incremental (a frozen tensor), the replicas whole.

    * A newer job committed on the root: the drain writes nothing and says why.
    * Both nodes' drains at once: one commit.
    * Node 1 lost: node 0's drain (its ranks' own copies, its replicas of node 1's ranks), killed
      after two parts, then right before its ``COMMIT``, leaves nothing visible; run again it
      completes the step: the very files both nodes' drains made (node 1's own copies and node
      0's replicas of them give the same bytes); once more, it does nothing. The job moved to two
      fresh nodes with no memory tier resumes step 3 on every rank, bit-exact.
    """
    job = Job(tmp_path, "0,0,1,1", k=1, disk_every=1000)
    saved = job.run("save")
    assert _committed(job.root) == [1]
    own = [m for m in (job.shm / "n0").glob("nebula_ckpt-*/*/step-3/manifest.json") if "replicas" not in m.parts]
    assert len(own) == 2 and all(len(json.loads(m.read_text())["shards"]) == 2 for m in own)  # incremental
    kept = tmp_path / "kept"
    shutil.copytree(job.root, kept / "root")
    shutil.copytree(job.shm, kept / "shm", symlinks=True)

    with nc.Checkpointer(job.root, tiers=[nc.LocalTier(job.root, keep_last=100)]) as newer:
        newer.save(2, {"w": torch.ones(4)}).result()  # a newer job (generation 2) committed step 2
    writers = sorted(os.listdir(Path(job.root, "_nebula", "writers")))
    with knobs.override(shm_dir=str(job.shm / "n0")):
        got = persist_memory(job.root)
    assert not got["copied"] and "newer" in got["why"] and "generation 2" in got["why"], got
    assert _committed(job.root) == [1, 2] and sorted(os.listdir(Path(job.root, "_nebula", "writers"))) == writers

    _put_back(job, kept)
    results = _at_once(job, [0, 1])  # one commits, the other finds it committed (during or before its run)
    assert all(r["step"] == 3 and (r["copied"] or "already" in r["why"]) for r in results), results
    assert _committed(job.root) == [1, 3]
    both = _files(job.root, 3)

    _put_back(job, kept)
    job.lose(1)
    for kill in ("part:2", "commit"):
        _done(_drain(job, 0, kill), -9)
        assert _committed(job.root) == [1]  # nothing visible
    with knobs.override(shm_dir=str(job.shm / "n0")):
        got = persist_memory(job.root)
        assert got["copied"] and got["step"] == 3, got
        assert _committed(job.root) == [1, 3] and _files(job.root, 3) == both
        again = persist_memory(job.root)
        assert not again["copied"] and "already" in again["why"], again
    moved = job.run("restore_fresh", nodes_of="2,2,3,3")
    for r, (s, g) in enumerate(zip(saved, moved, strict=True)):
        assert g["step"] == 3 and g["digest"] == s["digests"]["3"], f"rank {r}: {g}"
        assert g["last_restore"]["tier"].startswith("local:"), g["last_restore"]
