"""Memory-tier replicas on partner nodes, on real ranks (gloo on 127.0.0.1, spawned processes).

Nodes are simulated: each rank gets ``NEBULA_NODE_ID=n<i>`` and its node's own ``NEBULA_SHM_DIR``
(see ``replica_worker.py``). A node is lost by deleting its memory-tier folder after the job
ended like a crash (nothing closed); the restarted job's ranks on it start empty. Every state
comparison is bit-exact (a SHA-256 of every tensor's bytes, model and optimizer).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from dist.launch import run_ranks
from nebula_ckpt.tiers.memory import replica_channel

HERE = Path(__file__).resolve().parent  # the workers beside this module, spawned by path

pytestmark = [pytest.mark.timeout(300)]


class Job:
    """Save / restore jobs of ``replica_worker.py`` on simulated nodes, one shm folder per node."""

    def __init__(self, tmp: Path, nodes_of: str, k: int, disk_every: int = 1000, steps: int = 3) -> None:
        self.tmp, self.nodes_of, self.k = tmp, nodes_of, k
        self.world = len(nodes_of.split(","))
        self.root, self.shm = str(tmp / "root"), tmp / "shm"
        self.extra = [str(disk_every), str(steps)]
        self.runs = 0

    def run(self, scenario: str, expect_killed: tuple[int, ...] = ()) -> list[dict[str, Any]]:
        self.runs += 1
        out = self.tmp / f"out{self.runs}"
        out.mkdir()
        done = run_ranks(self.world, str(HERE / "replica_worker.py"),
                         [scenario, self.root, str(out), str(self.shm), self.nodes_of, str(self.k), *self.extra],
                         out, str(self.shm), timeout=200)
        for r, p in enumerate(done):
            want = -9 if r in expect_killed else 0
            assert p.returncode == want, f"rank {r} ended with {p.returncode}:\n{p.stdout[-4000:]}"
        return [json.loads((out / f"{scenario}-r{r}.json").read_text())
                if r not in expect_killed else {} for r in range(self.world)]

    def lose(self, *nodes: int) -> None:
        """The nodes' RAM is gone (their memory-tier folders and everything in them)."""
        for n in nodes:
            shutil.rmtree(self.shm / f"n{n}")

    def snapshot(self, name: str) -> Path:
        """A copy of every node's memory tier and of the root, to lose different nodes from the same
        state (a restore after a node loss drains the step it pulled to the root)."""
        dst = self.tmp / name
        shutil.copytree(self.shm, dst / "shm", symlinks=True)
        shutil.copytree(self.root, dst / "root", symlinks=True)
        return dst

    def restore_from(self, snap: Path) -> None:
        for src, dst in ((snap / "shm", self.shm), (snap / "root", Path(self.root))):
            shutil.rmtree(dst)
            shutil.copytree(src, dst, symlinks=True)

    def replica_dirs(self, node: int) -> list[Path]:
        return sorted((self.shm / f"n{node}").glob("nebula_ckpt-*/*/replicas/*"))


def _check_exact(saved: list[dict[str, Any]], restored: list[dict[str, Any]], step: int) -> None:
    for r, (s, got) in enumerate(zip(saved, restored, strict=True)):
        assert got["step"] == step, f"rank {r} restored step {got['step']}, expected {step}"
        assert got["digest"] == s["digests"][str(step)], f"rank {r}: restored state differs from step {step}"


def test_a_step_only_in_memory_survives_the_loss_of_either_node(tmp_path: Path) -> None:
    job = Job(tmp_path, "0,0,1,1", k=1)
    saved = job.run("save")
    for s in saved:  # every save's replicas committed; only step 1 reached the disk tier
        assert not s["errors"] and all("replicas" in w for w in s["written"].values())
        assert s["stats"]["replicas"]["held_bytes"] > 0 and s["stats"]["replicas"]["sent_bytes"] > 0
    assert sorted(os.listdir(job.root)) == ["_nebula", "step-1"]
    for s in saved:  # step 3's copy is received into the files of step 1's, pruned (keep_last=1) as step 2's came
        assert s["inodes"]["3"] and s["inodes"]["3"] == s["inodes"]["1"] != s["inodes"]["2"], s["inodes"]
    for s in saved:  # the replicas' thread and its channel's TCP loop yield to training (replica_channel.REPLICA_NICE)
        base, threads = s["nice"]["training"], s["nice"]["threads"]
        niced = min(19, base + int(replica_channel.REPLICA_NICE))
        assert ["nebula-replicas", niced] in threads, threads
        loops = sorted(n for name, n in threads if name == "gloo_tcp_loop")
        assert loops[0] == base and niced in loops, threads  # the training group's loop is untouched
    snap = job.snapshot("after-save")
    for lost in (0, 1):
        job.restore_from(snap)
        job.lose(lost)
        got = job.run("restore")
        _check_exact(saved, got, 3)
        lost_ranks = [r for r, n in enumerate(job.nodes_of.split(",")) if int(n) == lost]
        for r, g in enumerate(got):
            src = g["last_restore"]["source"]
            if r in lost_ranks:
                assert src.startswith("replica from rank ") and int(src.split()[-1]) not in lost_ranks, src
                # pulled into this process's memory: the optimizer state it creates is those pages
                assert g["last_restore"]["adopted_bytes"] > 0, g["last_restore"]
            else:
                assert src == "memory" and g["last_restore"]["adopted_bytes"] == 0, g["last_restore"]
            assert g["last_restore"]["tier"].startswith("memory:")  # the pulled copy is read from its memory tier
        # the pulled copies stay in the restarted node's memory tier
        assert len(list((job.shm / f"n{lost}").glob("nebula_ckpt-*/*/step-3/COMMIT"))) == len(lost_ranks)


def test_a_removed_step_is_not_restored_from_the_partners_copies(tmp_path: Path) -> None:
    """remove(step) on every rank drops the copies the partners hold too: a job that crashes after
    it restarts from what is left (step 1 on the disk tier; the memory tiers kept only step 3),
    never from a copy of the step it removed (found by the stateful test's two-rank machine)."""
    job = Job(tmp_path, "0,1", k=1)
    saved = job.run("save_remove")
    for s in saved:
        assert not s["errors"] and s["digests"]["removed"] == [3] and s["digests"]["replicas_left"] == []
    _check_exact(saved, job.run("restore"), 1)


def test_sigkill_while_receiving_leaves_no_partial_replica_visible(tmp_path: Path) -> None:
    job = Job(tmp_path, "0,0,1,1", k=1)
    # rank 1 (node 0) holds rank 3's replicas; it is killed receiving step 3's copy
    saved = job.run("save_kill_receiving", expect_killed=(1,))
    assert any(str(3) in s.get("errors", {}) for s in saved if s), "the others saw the round fail"
    held = [d for d in job.replica_dirs(0) if d.name == "r3"]
    assert len(held) == 1
    assert sorted(p.name for p in held[0].iterdir()) == ["step-2"]       # step 3 never became visible
    leftovers = list(held[0].parent.glob(".incoming-*"))
    assert leftovers and any(leftovers[0].glob("step-3/shard-*"))        # it was being received
    # rank 3's node is lost too: its newest copy anywhere is step 2, rank 0 only keeps step 3 in
    # memory: the newest step every rank can get is step 1 on the disk tier
    job.lose(1)
    got = job.run("restore")
    assert all(g["step"] == 1 for g in got)
    assert all(g["last_restore"]["tier"].startswith("local:") for g in got)
    assert not list(held[0].parent.glob(".incoming-*"))                  # swept by the restart


def test_a_corrupted_replica_is_detected_and_the_next_source_used(tmp_path: Path) -> None:
    job = Job(tmp_path, "0,0,1,1", k=1, disk_every=1)
    saved = job.run("save")
    job.lose(1)
    # rank 2's copy (held by rank 0 on node 0): flip one byte of tensor data
    shard = next(p for d in job.replica_dirs(0) if d.name == "r2" for p in d.glob("step-3/shard-*"))
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    got = job.run("restore")
    _check_exact(saved, got, 3)
    sources = got[0]["last_restore"]["sources"]
    assert sources == ["memory", "memory", "shared tier", "replica from rank 1"], sources
    assert got[2]["last_restore"]["tier"].startswith("local:")


@pytest.mark.parametrize("k,cases", [(1, [((1,), 3), ((0, 1), 1)]), (2, [((0, 1), 3), ((0, 1, 2), None)])])
def test_three_nodes(tmp_path: Path, k: int, cases: list[tuple[tuple[int, ...], Any]]) -> None:
    """k=1: one node lost costs nothing; losing both holders of rank 0's copy (its node and its
    partner's) falls back to the newest step every rank still has (disk, step 1). k=2: two nodes
    lost cost nothing; all three lost: the disk's step 1."""
    job = Job(tmp_path, "0,1,2", k=k)
    saved = job.run("save")
    for r, s in enumerate(saved):
        partners = s["stats"]["replicas"]["partners"]
        assert len(set(partners)) == k and r not in partners
        assert s["stats"]["replicas"]["held_bytes"] > 0
    snap = job.snapshot("after-save")
    for lost, step in cases:
        job.restore_from(snap)
        job.lose(*lost)
        got = job.run("restore")
        _check_exact(saved, got, step or 1)


def test_too_few_nodes_for_k_is_refused_on_every_rank(tmp_path: Path) -> None:
    job = Job(tmp_path, "0,0,1,1", k=2)
    out = tmp_path / "out"
    out.mkdir()
    done = run_ranks(4, str(HERE / "replica_worker.py"), ["save", job.root, str(out), str(job.shm), job.nodes_of, "2"],
                     out, str(job.shm), timeout=200)
    for p in done:
        assert p.returncode != 0
        assert "ValidationError" in p.stdout and "replicas=2" in p.stdout and "2 node(s)" in p.stdout, p.stdout[-2000:]



def _flip(path: Path) -> bytes:
    """Flip one byte of tensor data in ``path`` (same size); its bytes before."""
    before = path.read_bytes()
    data = bytearray(before)
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    return before


@pytest.mark.parametrize("replica_damaged", [False, True])
def test_a_rank_whose_own_copy_is_corrupted_pulls_it_from_its_partner(tmp_path: Path, replica_damaged: bool) -> None:
    """Rank 2's own memory-tier copy of the newest step (in no shared tier) keeps its sizes but
    not its bytes: it pulls that step from its partner's replica, and no rank falls back to an
    older step. When that replica is damaged too, every rank falls back alike (disk, step 1)."""
    job = Job(tmp_path, "0,0,1,1", k=1)
    saved = job.run("save")
    assert sorted(os.listdir(job.root)) == ["_nebula", "step-1"]
    shard = next(p for p in (job.shm / "n1").glob("nebula_ckpt-*/*/step-3/shard-*-r2.safetensors")
                 if "replicas" not in p.parts)
    healthy = _flip(shard)
    if replica_damaged:
        held = [p for d in job.replica_dirs(0) if d.name == "r2" for p in d.glob("step-3/shard-*")]
        assert len(held) == 1
        _flip(held[0])
    got = job.run("restore")
    if replica_damaged:
        _check_exact(saved, got, 1)
        assert all(g["last_restore"]["tier"].startswith("local:") for g in got)
        return
    _check_exact(saved, got, 3)
    sources = got[0]["last_restore"]["sources"]
    assert all(g["last_restore"]["sources"] == sources for g in got)
    assert sources[2].startswith("replica from rank ") and int(sources[2].split()[-1]) in (0, 1), sources
    assert [s for r, s in enumerate(sources) if r != 2] == ["memory"] * 3, sources
    assert got[2]["last_restore"]["tier"].startswith("memory:")  # read from its memory tier
    assert shard.read_bytes() == healthy  # the damaged copy was replaced by the verified pulled one
