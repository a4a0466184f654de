"""Memory-tier replicas tried with cases an unlucky operator meets and the other replica tests do not.

Real ranks (gloo on 127.0.0.1, spawned processes, ``attack2_worker.py``) on simulated nodes, each
with its own memory tier; a node is lost by deleting its memory-tier folder after the job ended
like a crash. Every state comparison is bit-exact (a SHA-256 of every tensor's bytes, model and
optimizer). Each test is one scenario whose jobs check several promises in turn:

* uneven, interleaved nodes with odd ids: partners never on the rank's node, the epilogue command
  on either node (and on one with only replicas left), tampered replicas and links planted in the
  replica store, one holder serving three pulls at once, a restart with the ranks on other nodes;
* a replaced node that comes back with a stale memory tier (the same step number, saved by an
  earlier writer generation with other bytes), then a restart with more ranks;
* saves every iteration (rounds queued behind them), ``close()`` with rounds in flight, and a
  partner that dies between two saves;
* the copy a lost rank pulls into memory at a restore: kept by its memory tier after the first
  steps (the job then crashes), or not at all when the job saved first; then the other node lost.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import pytest

from dist.launch import run_ranks
from nebula_ckpt import knobs
from nebula_ckpt.ranks.partners import choose_partners, pack_node_id, unpack_node_id
from nebula_ckpt.tiers.memory import replicas
from nebula_ckpt.tiers.memory.epilogue import persist_memory
from nebula_ckpt.tiers.memory.replica_save import check_copy
from nebula_ckpt.tiers.memory.replica_store import ReplicaStore, committed

HERE = Path(__file__).resolve().parent  # the workers beside this module, spawned by path

pytestmark = [pytest.mark.timeout(600)]

#: a node id longer than the exchange's 256 bytes (it goes as its SHA-256), with a slash, a
#: space and non-ASCII letters; and one with a tab
ODD_A = "rack-1/nöde a " + "x" * 300
ODD_B = "node\tB"
#: bytes of each rank's frozen tensor (attack2_worker.py)
FROZEN = 256 * 1024 * 4


class Job:
    """Jobs of ``attack2_worker.py`` on one root; node ``i`` (by first appearance in ``nodes``)
    keeps its memory tier in ``shm/n<i>``."""

    def __init__(self, tmp: Path, **spec: Any) -> None:
        self.tmp, self.runs = tmp, 0
        self.shm = tmp / "shm"
        self.spec = dict(root=str(tmp / "root"), shm=str(self.shm), **spec)

    def run(self, expect_killed: tuple[int, ...] = (), env: Optional[dict[str, str]] = None,
            **spec: Any) -> list[dict[str, Any]]:
        self.runs += 1
        out = self.tmp / f"out{self.runs}"
        out.mkdir()
        full = {**self.spec, **spec}
        world = len(full["nodes"])
        done = run_ranks(world, str(HERE / "attack2_worker.py"), [json.dumps(full), str(out)], out, str(self.shm),
                         timeout=200, env_extra=env)
        for r, p in enumerate(done):
            want = -9 if r in expect_killed else 0
            assert p.returncode == want, f"rank {r} ended with {p.returncode}:\n{p.stdout[-4000:]}"
        return [json.loads((out / f"r{r}.json").read_text()) if r not in expect_killed else {}
                for r in range(world)]

    def node(self, i: int) -> Path:
        return self.shm / f"n{i}"

    def lose(self, i: int) -> None:
        shutil.rmtree(self.node(i))

    def held(self, i: int, src: int) -> Path:
        """The replica store folder of rank ``src``'s copies on node ``i`` (exactly one)."""
        got = list(self.node(i).glob(f"nebula_ckpt-*/*/replicas/r{src}"))
        assert len(got) == 1, got
        return got[0]


def _restored(got: dict[str, Any], saved: dict[str, Any], step: int) -> None:
    assert "restore_error" not in got, got["restore_error"]
    assert got["step"] == step, f"rank {got['rank']} restored step {got['step']}, expected {step}"
    assert got["digest"] == saved["digests"][str(step)], f"rank {got['rank']}: not its state of step {step}"


def _drain_and_undo(job: Job, shm: Path, missing: list[int]) -> None:
    """The epilogue command on the node whose memory tiers are in ``shm`` writes the parts of the
    ranks whose step 3 it holds (own copies and replicas) to the root; with every rank's part
    (``missing`` empty) step 3 is committed there, once (run again, it does nothing); otherwise
    nothing is committed and the ranks whose parts it lacks are named. The root is then put back
    as it was (the rest of the test restores from the memory tiers)."""
    root = Path(job.spec["root"])
    kept = root.parent / "root-before-drain"
    shutil.copytree(root, kept)
    with knobs.override(shm_dir=str(shm)):
        got = persist_memory(str(root))
        assert got["step"] == 3 and got["copied"] == (not missing), got
        assert (root / "step-3" / "COMMIT").exists() == (not missing)
        if missing:
            assert got["missing"] == missing and f"rank(s) {missing}" in got["why"], got
        else:
            again = persist_memory(str(root))
            assert not again["copied"] and "already" in again["why"], again
    shutil.rmtree(root)
    kept.rename(root)


def _tamper_checks(job: Job, snap: Path) -> None:
    """On a copy of node B's replica store (rank 1 holds ranks 0, 2 and 3's copies of steps 2 and
    3): what a receiver runs on a pulled copy refuses each tampered copy, and links planted in
    the store are never listed, written nor deleted through."""
    base = next(snap.glob("nebula_ckpt-*/*/replicas"))
    r2, r3 = base / "r2", base / "r3"
    gen = max(committed(str(r2)))[0]
    check_copy(str(r2), 3, 2, 4, gen)  # healthy as saved
    cases = {
        "marker of step 2": lambda d: shutil.copy(r2 / "step-2" / "COMMIT", d / "step-3" / "COMMIT"),
        "rank 3's manifest": lambda d: shutil.copy(r3 / "step-3" / "manifest.json", d / "step-3" / "manifest.json"),
        "shard renamed as rank 3's": lambda d: [p.rename(p.with_name(p.name.replace("-r2.", "-r3.")))
                                                for p in (d / "step-3").glob("shard-*")],
        "step 2's shard": lambda d: [shutil.copy(p, d / "step-3" / p.name) for p in (r2 / "step-2").glob("shard-*")],
    }
    for name, tamper in cases.items():
        d = snap.parent / f"tampered-{len(name)}"
        shutil.copytree(r2, d)
        tamper(d)
        try:
            check_copy(str(d), 3, 2, 4, gen)
        except Exception as e:  # any refusal is right (it names what is wrong); acceptance is the bug
            assert str(e), name
        else:
            pytest.fail(f"a copy with {name} was accepted as rank 2's step 3")
        shutil.rmtree(d)
    # links planted in the store: an ``.incoming-*`` one and a source folder pointing elsewhere
    victim = snap.parent / "victim"
    shutil.copytree(r3, victim)
    (base / ".incoming-planted").symlink_to(victim, target_is_directory=True)
    shutil.rmtree(r2)
    r2.symlink_to(victim, target_is_directory=True)
    shutil.copytree(r3, base / "r02")  # not a name the store gives rank 2's copies
    store = ReplicaStore(str(base.parent))
    store.sweep()
    assert not os.path.lexists(base / ".incoming-planted")  # the link is gone, not what it pointed to
    assert sorted(store.held()) == [0, 3]  # neither is listed as rank 2's copies
    store.prune(2, 0)
    assert sorted(p.name for p in victim.iterdir()) == ["step-2", "step-3"]  # nothing deleted through it
    assert (victim / "step-3" / "COMMIT").is_file()


def test_uneven_interleaved_nodes_with_odd_ids(tmp_path: Path) -> None:
    """Ranks 0, 2, 3 on node A, rank 1 alone on node B (both odd ids): every copy on the other
    node; the epilogue on either node puts step 3 on the root (node B without its own copies: all
    but rank 1's part, named); node A lost, its three
    ranks pull their step from rank 1 in one round, each its own state, and once their memory tiers
    kept it every rank's part goes to the shared tier, where a restart on renumbered nodes finds it."""
    job = Job(tmp_path, nodes=[ODD_A, ODD_B, ODD_A, ODD_A], k=1, keep=2)
    saved = job.run(save=[1, 2, 3])
    for r, s in enumerate(saved):
        rep = s["stats"]["replicas"]
        assert not any("error" in o for o in s["outcome"].values()), s["outcome"]
        assert rep["node"] == (ODD_B if r == 1 else ODD_A)  # the ids as given, whatever they hold
        assert rep["partners"] == ([0] if r == 1 else [1]), rep  # never on the rank's own node
        assert rep["holding_for"] == ([0, 2, 3] if r == 1 else [1] if r == 0 else []), rep
        assert all(len(steps) <= 2 for steps in rep["held_steps"].values()), rep  # keep_last=2
    assert sorted(os.listdir(job.spec["root"])) == ["_nebula", "step-1"]
    # steps 2 and 3 are only in RAM: either node holds every rank's part of step 3 (own or replica)
    _drain_and_undo(job, job.node(0), missing=[])
    _drain_and_undo(job, job.node(1), missing=[])
    snap = tmp_path / "snap-b"
    shutil.copytree(job.node(1), snap, symlinks=True)
    only = tmp_path / "only-replicas-b"  # node B's rank lost its own steps: only the replicas it holds
    shutil.copytree(job.node(1), only, symlinks=True)
    for d in only.glob("nebula_ckpt-*/*/step-*"):
        shutil.rmtree(d)
    _drain_and_undo(job, only, missing=[1])
    _tamper_checks(job, snap)
    job.lose(0)
    crashed = job.run(load="latest")  # and the job dies at once: before its memory tiers keep the copies
    got = job.run(load="latest", end="close")  # the holder still has them: pulled again, then kept
    for s, c, g in zip(saved, crashed, got, strict=True):
        for x in (c, g):
            _restored(x, s, 3)
            assert x["last_restore"]["sources"] == ["replica from rank 1", "memory", "replica from rank 1",
                                                     "replica from rank 1"], x["last_restore"]
    assert len(list(job.node(0).glob("nebula_ckpt-*/*/step-3/COMMIT"))) == 3  # the pulled copies stay
    # the restart that pulled and kept step 3 put every rank's part of it on the shared tier, once
    # kept there (a node was lost: it lived only in RAM); a restart that places the ranks on other
    # nodes (a launcher renumbering its nodes) finds no memory tier nor replica (found by rank on a
    # node) and restores it from the shared tier
    assert (Path(job.spec["root"]) / "step-3" / "COMMIT").is_file()
    moved = job.run(nodes=[ODD_B, ODD_A, ODD_B, ODD_B], shm_of={ODD_A: "n0", ODD_B: "n1"}, load="latest")
    for s, g in zip(saved, moved, strict=True):
        _restored(g, s, 3)
        assert g["last_restore"]["sources"] == ["shared tier"] * 4, g["last_restore"]


def test_a_stale_node_comes_back_then_the_job_grows(tmp_path: Path) -> None:
    """Writer generation 1 saves steps 1..5 (incremental: a large frozen tensor); node B's memory
    tier is kept aside. The job restarts from step 3 (generation 2) and saves steps 4 (also on
    disk: the first save after a restart) and 5 with other bytes. Node B is replaced by a node
    whose memory tier is the kept one: its step 5 is generation 1's. The restore takes generation
    2's step 5 on both ranks (node B's pulled from its replica at node A), never the stale one;
    the job saves on (6, also on disk, then 7, built on the pulled copy), node A is lost, and
    step 7 comes back (restored by the tag every step carries). Then a job of 3 ranks (more nodes) takes the
    documented path: the shared
    tier's newest step, resharded, bit-exact. The node ids are not UTF-8 (bytes from the
    environment), and differ only there."""
    job = Job(tmp_path, nodes=["n\udcff", "n\udcfe"], k=1, keep=3, same=True, frozen=True, tag="every")
    gen1 = job.run(save=[1, 2, 3, 4, 5])
    stale = tmp_path / "stale-b"
    shutil.copytree(job.node(1), stale, symlinks=True)
    gen2 = job.run(load=3, save=[4, 5], seed=1)
    for g1, g2 in zip(gen1, gen2, strict=True):
        assert g2["step"] == 3 and g2["last_restore"]["sources"] == ["memory", "memory"]
        assert g2["digests"]["5"] != g1["digests"]["5"]  # the same step number, other bytes
        assert "replicas" in g2["outcome"]["5"]["written"], g2["outcome"]
    assert sorted(os.listdir(job.spec["root"])) == ["_nebula", "step-1", "step-4"]
    job.lose(1)
    shutil.copytree(stale, job.node(1), symlinks=True)
    got = job.run(load="latest", save=[6, 7])
    for g2, g in zip(gen2, got, strict=True):
        _restored(g, g2, 5)
        assert g["last_restore"]["sources"] == ["memory", "replica from rank 0"], g["last_restore"]
        assert "replicas" in g["outcome"]["7"]["written"], g["outcome"]
    # the job saved on at once, so node B's memory tier did not keep the pulled step 5: its own saves
    # of 6 and 7 (replicated) are what the next failure needs; its stale step 5 is never restored
    assert all(g["stats"]["replicas"]["keep_failed"] == 0 for g in got), [g["stats"]["replicas"] for g in got]
    assert sorted(os.listdir(job.spec["root"]))[-1] == "step-6"
    job.lose(0)
    # by tag: node A's rank sees the tag on the disk's steps only, node B's on its memory tier's
    # too; every rank plans from the same steps (they chose different ones and waited on each other)
    again = job.run(load="every", env={"NEBULA_REPLICA_TIMEOUT_S": "60", "NEBULA_COMMIT_TIMEOUT_S": "60"})
    for g6, g in zip(got, again, strict=True):
        _restored(g, g6, 7)
        assert g["last_restore"]["sources"] == ["replica from rank 1", "memory"], g["last_restore"]
    grown = job.run(nodes=["a", "b", "c"], load="latest")
    for g in grown:  # memory tiers and replicas hold 2-rank steps: the shared tier's step 6, resharded
        _restored(g, got[0], 6)
        assert g["last_restore"]["tier"].startswith("local:"), g["last_restore"]


def test_saves_every_iteration_close_in_flight_and_a_partner_that_dies(tmp_path: Path) -> None:
    """Two nodes save steps 1..14 without waiting (rounds queue behind the saves; an incremental
    step each time: a large frozen tensor). Rank 1 waits for its saves of 1..12 and is SIGKILLed
    before step 13; rank 0 saves on and closes with rounds in flight. Every handle of rank 0 says
    what happened to its replicas (kept, skipped for a newer save, or failed naming rank 0, its
    node and its partner); ``close()`` returns well before the channel's timeout; the counters add
    up; the memory held for replicas stays within its bound."""
    job = Job(tmp_path, nodes=["a", "b"], k=1, keep=1, frozen=True)
    env = {"NEBULA_REPLICA_TIMEOUT_S": "60", "NEBULA_COMMIT_TIMEOUT_S": "60"}
    a, _ = job.run(save=list(range(1, 15)), wait=False, die=[1, 13], end="close", env=env, expect_killed=(1,))
    rep, outcome = a["stats"]["replicas"], a["outcome"]
    assert sorted(outcome, key=int) == [str(s) for s in range(1, 15)]
    kept = [int(s) for s, o in outcome.items() if "replicas" in o["written"]]
    skipped = [int(s) for s, o in outcome.items() if "replicas" in o["dropped"]]
    failed = [int(s) for s, o in outcome.items() if "error" in o]
    assert sorted(kept + skipped + failed) == list(range(1, 15)), outcome  # each said one thing
    assert failed and min(failed) >= 13, outcome  # rank 1 took part in every round before it died
    why = outcome[str(min(failed))]["error"]["message"]
    assert "replicas" in why and "rank 0 on node 'a'" in why and "rank 1 on node 'b'" in why, why
    assert a["close_s"] < 30, a["close_s"]
    assert rep["rounds"] == 14 and rep["failed"] == len(failed), rep
    assert rep["held_steps"] and all(len(v) <= 1 for v in rep["held_steps"].values()), rep
    # rank 1's newest step, whole, and the spares the next copy lands in: (keep + 1) steps at most
    assert FROZEN < rep["held_bytes"] <= 2 * (FROZEN + (1 << 16)), rep
    held = {k: v for k, v in a["held"].items() if not os.path.basename(k).startswith(".")}
    assert [v for v in held.values()] == [["step-12"]], a["held"]  # rank 1's newest step, nothing partial


@pytest.mark.parametrize("a,b", [("n\udcff", "n\udcfe"), ("\udcff" * 300, "\udcfe" * 300), ("\ud800", "\ud801")])
def test_node_ids_that_are_not_utf8_stay_two_nodes(a: str, b: str) -> None:
    """An id from the environment that is not UTF-8 (its bytes as surrogates) is exchanged as
    those bytes: it raised UnicodeEncodeError on that rank alone (the others waited in the
    exchange), and two such ids could read back as one node."""
    ids = [unpack_node_id(pack_node_id(n)) for n in (a, b)]
    assert ids[0] != ids[1], ids
    assert choose_partners(ids, 1) == [[1], [0]]


def _own_steps(job: Job, node: int) -> list[str]:
    """The committed steps of the memory tier(s) on ``node`` (not the replicas it holds)."""
    return sorted(p.parent.name for p in job.node(node).glob("nebula_ckpt-*/*/step-*/COMMIT"))


def test_the_pulled_copy_is_kept_after_the_first_steps_or_not_when_a_save_came_first(tmp_path: Path) -> None:
    """Node B lost; its rank restores step 3 from the copy it pulled into memory (its memory tier
    is empty at that point). Training on for longer than the keep delay, then crashing: B's memory
    tier holds step 3 (kept by the timer, before the crash), and a restart with A's copy of it gone
    restores it from there, bit-exact. Saving step 4 at once instead: B's memory tier never gets
    the pulled step 3 (that save owns what comes next), holds step 4, and losing node A then
    restores step 4 on both ranks, bit-exact."""
    job = Job(tmp_path, nodes=["a", "b"], k=1, keep=2)
    saved = job.run(save=[1, 2, 3])
    snap = tmp_path / "snap"
    shutil.copytree(job.shm, snap, symlinks=True)
    job.lose(1)
    slow = job.run(load="latest", sleep=3 * float(replicas.KEEP_AFTER_S))
    for s, g in zip(saved, slow, strict=True):
        _restored(g, s, 3)
    assert slow[1]["last_restore"]["source"] == "replica from rank 0"
    assert slow[1]["stats"]["replicas"]["last_keep_s"] is not None and slow[1]["stats"]["replicas"]["keep_failed"] == 0
    assert _own_steps(job, 1) == ["step-3"]  # kept before the job crashed
    for d in job.node(0).glob("nebula_ckpt-*/*/replicas/r1"):
        shutil.rmtree(d)  # and A's copy of it gone: B's kept copy is rank 1's only one in RAM
    again = job.run(load="latest")
    for s, g in zip(saved, again, strict=True):
        _restored(g, s, 3)
    assert [g["last_restore"]["source"] for g in again] == ["memory", "memory"]

    shutil.rmtree(job.shm)
    shutil.copytree(snap, job.shm, symlinks=True)
    job.lose(1)
    fast = job.run(load="latest", save=[4], seed=3)
    for s, g in zip(saved, fast, strict=True):
        _restored(g, s, 3)
        assert "replicas" in g["outcome"]["4"]["written"], g["outcome"]
    assert _own_steps(job, 1) == ["step-4"], _own_steps(job, 1)  # the pulled step 3 never published
    assert fast[1]["stats"]["replicas"]["keep_failed"] == 0
    job.lose(0)
    last = job.run(load="latest")
    for f, g in zip(fast, last, strict=True):
        _restored(g, f, 4)
    assert [g["last_restore"]["source"] for g in last] == ["replica from rank 1", "memory"]
