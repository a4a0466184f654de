"""Memory-tier replicas when the newest step is suspect, a rank dies at restore, or the host-memory
budget is tight (real ranks, gloo on 127.0.0.1; two simulated nodes, one rank each: see
replica_fault_worker.py).

- a node loss never costs an older healthy step the replicas hold: the recover round leaves the
  writes the restore leaves out (rank 0's suspect marks) out of its plan, and pulls the step the
  restore then opens;
- a rank that dies at restore gives the others a PersistError naming the rank, its node and its
  partners, not gloo's raw RuntimeError;
- a replica of a write a shared tier holds committed protects nothing against a node loss: the
  host-memory budget gives it up before it refuses a partner's newer copy or a save.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "dist"))
from launch import reports, run_ok, run_ranks  # noqa: E402

pytestmark = [pytest.mark.timeout(180)]
WORKER = str(Path(__file__).resolve().parent / "replica_fault_worker.py")
MiB = 1 << 20


def _run(tmp: Path, scenario: str, *extra: str, ok: bool = True, **kw: Any) -> list[dict[str, Any]]:
    out = tmp / f"out-{scenario}"
    out.mkdir()
    args = [scenario, str(tmp / "root"), str(out), str(tmp / "shm"), *extra]
    (run_ok if ok else run_ranks)(2, WORKER, args, out, str(tmp / "shm"), timeout=120, **kw)
    return reports(out, scenario, 2) if ok else [reports(out, scenario, 1)[0]]


def test_a_suspect_newest_step_lets_a_node_loss_restore_the_older_step_the_replicas_hold(tmp_path: Path) -> None:
    saved = _run(tmp_path, "save")
    assert not any(r["errors"] for r in saved), saved
    shutil.rmtree(tmp_path / "shm" / "n1")  # node n1 lost: rank 1's own steps and its copy of rank 0's
    a, b = _run(tmp_path, "recover")
    # rank 0 leaves step 3 out: every rank gets step 2, rank 1 from rank 0's copy (not the disk's step 1)
    assert a["suspect"] == b["suspect"], (a, b)
    assert a["suspect"]["step"] == 2 and a["suspect"]["sources"] == ["memory", "replica from rank 0"], a
    assert a["plain"]["step"] == 3 and a["plain"]["sources"] == ["memory", "replica from rank 0"], a  # the control


def test_load_latest_after_a_node_loss_skips_the_suspect_newest_step_for_the_older_one_the_replicas_hold(
        tmp_path: Path) -> None:
    """The same through the public calls: a restart marks step 3 suspect (a NaN loss), node n1 is
    lost, and the next restart's load_latest gives step 2 on every rank, bit-exact (not the disk's
    step 1)."""
    saved = _run(tmp_path, "save")
    assert not any(r["errors"] for r in saved), saved
    assert [r["step"] for r in _run(tmp_path, "nan")] == [3, 3]
    shutil.rmtree(tmp_path / "shm" / "n1")
    got = _run(tmp_path, "latest")
    for r, (s, g) in enumerate(zip(saved, got, strict=True)):
        assert g["step"] == 2 and g["digest"] == s["digests"]["2"], (r, g)


def test_a_rank_dead_at_restore_gives_the_others_a_persist_error_naming_it(tmp_path: Path) -> None:
    (r0,) = _run(tmp_path, "die", ok=False)
    assert r0["raised"] == "PersistError" and r0["cause"] == "RuntimeError", r0
    msg = r0["message"]
    assert "rank 0" in msg and "recover round" in msg and "node 'n0'" in msg and "rank 1 on node 'n1'" in msg, msg
    assert "died or stalled" in msg, msg


def test_the_budget_gives_up_replicas_of_writes_the_shared_tier_holds(tmp_path: Path) -> None:
    # every step is on the disk too: a partner's copy of an older one only pins the budget, which
    # holds this rank's newest step, its partner's newest step and one save's staging
    ranks = _run(tmp_path, "budget", str(3 * MiB + MiB // 4))
    for r, rep in enumerate(ranks):
        assert not rep["errors"], rep["errors"]
        assert all("replicas" in w for w in rep["written"].values()), rep["written"]
        assert rep["held"] and all(h.endswith(f"replicas/r{1 - r}/step-4") for h in rep["held"]), rep["held"]
        # the next save short of the budget (on the training thread) gives the copy of step 4 up too
        assert rep["gave_up"] and not rep["held_after"], rep
