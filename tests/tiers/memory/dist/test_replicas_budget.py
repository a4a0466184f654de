"""A partner's copy counts against the receiving rank's host-memory budget: a rank whose budget
cannot hold it refuses it before a byte is sent (the sender's handle reports the replica failed,
naming the partner and the budget), and that rank's own saves and the other direction's copies
go on (real ranks, gloo on 127.0.0.1; two simulated nodes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dist.launch import reports, run_ok

HERE = Path(__file__).resolve().parent  # the workers beside this module, spawned by path

pytestmark = [pytest.mark.timeout(300)]
MiB = 1 << 20


def test_a_partner_beyond_its_host_memory_budget_refuses_the_replica(tmp_path: Path) -> None:
    out, shm = tmp_path / "out", tmp_path / "shm"
    out.mkdir()
    run_ok(2, str(HERE / "budget_replica_worker.py"), [str(tmp_path / "root"), str(out), str(shm)], out, str(shm))
    a, b = reports(out, "budget", 2)
    for step in ("1", "2"):  # A's copy is refused by B's budget, every time, before it is sent
        why = a["errors"][step]
        assert why.startswith("['replicas']"), why
        assert "partner rank 1" in why and "host-memory budget" in why and "host_memory_budget 2.0 MiB" in why, why
        assert any(t.startswith("memory:") for t in a["written"][step]), a["written"]
    assert not b["errors"], b["errors"]  # B's own saves, and their copies at A, are unaffected
    assert all("replicas" in w for w in b["written"].values()), b["written"]
    assert not any("/r0/" in h for h in b["held"]), b["held"]  # nothing of A's is held at B
    assert any("/r1/" in h for h in a["held"]), a["held"]  # B's copy is held at A
    assert sum(b["used"].values()) <= 2 * MiB, b["used"]  # B stayed within its budget
