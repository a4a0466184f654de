"""Incremental memory-tier steps with replicas, on real ranks (4 gloo ranks as 2 simulated nodes).

Each rank's own memory tier stores only what changed (a large frozen tensor stays in the first
step's shard); its partner receives the small own files and makes the replica whole, from its
replica of the base step or, when it lacks that, from the referenced shards the owner then sends.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .test_replicas import Job, _check_exact

pytestmark = [pytest.mark.timeout(300)]

FROZEN = 256 * 1024 * 4  # bytes of each rank's frozen tensor (replica_worker.py)


def _whole_replicas(job: Job, step: int) -> list[Path]:
    """The shards of every replica of ``step`` held on any node, each checked whole."""
    held = [p for n in (0, 1) for d in job.replica_dirs(n) for p in d.glob(f"step-{step}/shard-*")]
    for p in held:
        assert p.stat().st_size > FROZEN, p  # the frozen tensor's bytes are in it
    return held


def test_incremental_steps_replicate_what_changed_and_restore_bit_exact(tmp_path: Path) -> None:
    job = Job(tmp_path, "0,0,1,1", k=1, steps=4)
    saved = job.run("save_frozen")
    for s in saved:
        assert not s["errors"] and all("replicas" in w for w in s["written"].values()), s["errors"]
        own, sent = s["own"], s["sent"]
        assert own["1"]["shards"] == 1 and own["1"]["bytes"] > FROZEN
        for step in ("2", "3", "4"):  # (a) incremental: a small own shard, the frozen tensor referred to
            assert own[step]["shards"] == 2 and own[step]["bytes"] < FROZEN // 8, own
        assert sent["1"] > FROZEN
        for step in (3, 4):  # (b) a later round sends what changed
            assert sent[str(step)] - sent[str(step - 1)] < FROZEN // 8, sent
    assert len(_whole_replicas(job, 4)) == 4
    snap = job.snapshot("after-save")
    for lost in (0, 1):  # (c) either node lost: every rank restores step 4 bit-exact
        job.restore_from(snap)
        job.lose(lost)
        got = job.run("restore_frozen")
        _check_exact(saved, got, 4)
        assert sum(g["last_restore"]["source"].startswith("replica from rank ") for g in got) == 2


def test_a_partner_lacking_the_base_is_sent_it(tmp_path: Path) -> None:
    """(d) every partner deleted its replica of step 2 before step 3 was saved: each owner sent
    the shards step 3 refers to, and each partner still holds a verified whole step 3."""
    job = Job(tmp_path, "0,0,1,1", k=1, steps=3)
    saved = job.run("save_frozen_drop")
    for s in saved:
        assert not s["errors"], s["errors"]
        assert s["own"]["3"]["shards"] == 2
        assert s["sent"]["3"] - s["sent"]["2"] > FROZEN, s["sent"]  # the base came along
    assert len(_whole_replicas(job, 3)) == 4
    job.lose(1)
    _check_exact(saved, job.run("restore_frozen"), 3)


def test_a_damaged_base_fails_the_replica_cleanly(tmp_path: Path) -> None:
    """A byte of each held replica of step 2 flipped before step 3 was saved: step 3's copies,
    made whole from those bases, fail their checksums; every save reports its partner's failure,
    and no partial step 3 is visible or left behind."""
    job = Job(tmp_path, "0,0,1,1", k=1, steps=3)
    saved = job.run("save_frozen_flip")
    for s in saved:
        assert list(s["errors"]) == ["3"] and "partner rank" in s["errors"]["3"], s["errors"]
        assert "CorruptCheckpointError" in s["errors"]["3"] or "checksum" in s["errors"]["3"], s["errors"]
    held = [d for n in (0, 1) for d in job.replica_dirs(n) if not d.name.startswith(".")]
    assert len(held) == 4 and all(sorted(p.name for p in d.iterdir()) == ["step-2"] for d in held), held
    assert not [p for n in (0, 1) for p in (job.shm / f"n{n}").glob("nebula_ckpt-*/*/replicas/.incoming-*")]
