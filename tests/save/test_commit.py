"""Commit protocol: nothing is visible before its marker; failures never touch earlier checkpoints."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch

import nebula_ckpt as nc
from faults import STAGES, FaultyTier
from nebula_ckpt.cli import main as cli
from nebula_ckpt.format.names import COMMIT, MANIFEST
from nebula_ckpt.storage.local import LocalStorage


def _state(v: float) -> dict[str, object]:
    return {"w": torch.full((64, 64), float(v)), "step": int(v)}


@pytest.mark.parametrize("stage", STAGES)
def test_failure_at_each_stage_leaves_earlier_checkpoint(tmp_path, stage: str) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    tier = FaultyTier(root, fail_at=stage, fail_steps={2})
    ck = nc.Checkpointer(root, tiers=[tier])
    ck.save(1, _state(1))
    h = ck.save_async(2, _state(2))
    with pytest.raises(nc.PersistError, match=f"injected failure at stage '{stage}'") as ei:
        h.result()
    assert tier.name in ei.value.failures
    assert ck.list() == [1]
    assert not os.path.exists(os.path.join(root, "step-2", "COMMIT"))
    w = torch.zeros(64, 64)
    into = {"w": w, "step": 0}
    assert ck.load_latest(into=into) == 1 and torch.all(w == 1) and into["step"] == 1
    # The next save goes through, and cleans the failed step's leftovers.
    ck.save(3, _state(3))
    assert ck.list() == [1, 3]
    assert not os.path.exists(os.path.join(root, "step-2"))
    ck.close()


@pytest.mark.parametrize("stage", STAGES)
def test_nothing_visible_before_commit(tmp_path, stage: str) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    tier = FaultyTier(root, pause_at=stage)
    ck = nc.Checkpointer(root, tiers=[tier])
    h = ck.save_async(5, _state(5))
    assert tier.reached.wait(30)
    reader = nc.Checkpointer(root, memory_tier=False)
    assert reader.list() == []
    assert reader.load_latest() is None
    tier.gate.set()
    h.result()
    assert reader.list() == [5]
    ck.close()


def test_unseen_background_error_raised_from_next_calls(tmp_path) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    ck = nc.Checkpointer(root, tiers=[FaultyTier(root, fail_at="manifest", fail_steps={1})])
    ck.save_async(1, _state(1))
    with pytest.raises(nc.PersistError, match="step 1"):
        ck.wait()
    # seen now: the next save works
    ck.save_async(2, _state(2)).result()
    h3 = ck.save_async(3, _state(3))
    h3.result()
    ck.save_async(4, _state(4))
    ck.close()
    assert ck.list() == [2, 3, 4][-3:]

    ck = nc.Checkpointer(root, tiers=[FaultyTier(root, fail_at="commit", fail_steps={5})])
    ck.save_async(5, _state(5))
    ck._saves.handles[-1].wait(30)
    with pytest.raises(nc.PersistError, match="step 5"):
        ck.save_async(6, _state(6))
    with pytest.raises(nc.PersistError, match="step 7"):
        ck2 = nc.Checkpointer(root, tiers=[FaultyTier(root, fail_at="shard", fail_steps={7})])
        ck2.save_async(7, _state(7))
        ck2.close()
    ck.close()


def test_on_persist_error_log_keeps_training(tmp_path) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    ck = nc.Checkpointer(root, tiers=[FaultyTier(root, fail_at="shard", fail_steps={1})],
                         on_persist_error="log")
    h1 = ck.save_async(1, _state(1))
    h1._durable.wait(30)
    h2 = ck.save_async(2, _state(2))   # does not raise
    h2.result()
    assert isinstance(h1.error(), nc.PersistError)
    ck.close()
    assert ck.list() == [2]


def test_retention_keeps_last_and_milestones(tmp_path) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    with nc.Checkpointer(root, tiers=[nc.LocalTier(root, keep_last=2, keep_every=4)]) as ck:
        for s in range(1, 10):
            ck.save(s, _state(s))
        assert ck.list() == [4, 8, 9]


def test_retention_after_a_rollback_keeps_the_new_runs_steps(tmp_path) -> None:  # noqa: ANN001
    """A run that went back (restored step 10 of a run that reached 30, then saved 11, 12, 13) is
    newer in a restore's order (writer generation first): retention keeps its steps and lets the
    abandoned run's 20 and 30 go, so a damaged 13 falls back to 12, never to the abandoned 30."""
    root = str(tmp_path / "ck")
    with nc.Checkpointer(root, keep_last=3, memory_tier=False) as ck:
        for s in (10, 20, 30):
            ck.save(s, _state(s))
    with nc.Checkpointer(root, keep_last=3, memory_tier=False) as ck:
        assert ck.load(10, into=_state(0)) == 10
        for s in (11, 12, 13):
            ck.save(s, _state(s))
        assert ck.list() == [11, 12, 13]
    shard = next(n for n in os.listdir(os.path.join(root, "step-13")) if n.endswith(".safetensors"))
    with open(os.path.join(root, "step-13", shard), "r+b") as f:  # bit rot in step 13's last bytes
        f.seek(-8, 2)
        b = f.read(1)
        f.seek(-8, 2)
        f.write(bytes([b[0] ^ 0xFF]))
    into = _state(0)
    with nc.Checkpointer(root, keep_last=3, memory_tier=False) as ck:
        assert ck.load_latest(into=into) == 12 and into["step"] == 12


def test_cadence_every_nth_save(tmp_path) -> None:  # noqa: ANN001
    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    with nc.Checkpointer(slow, tiers=[nc.LocalTier(fast, keep_last=10),
                                      nc.LocalTier(slow, every=3, keep_last=10)]) as ck:
        for s in range(7):
            ck.save(s, _state(s))
        per = ck.list(detailed=True)
    assert per[f"local:{fast}"] == list(range(7))
    assert per[f"local:{slow}"] == [0, 3, 6]


class _LostCommit:
    """The ``commit`` stage of one step on an object store whose response is lost: the write
    reports an error, and the request lands only later (:meth:`land`)."""

    def __init__(self, step: int) -> None:
        self.step, self.pending = step, []
        self.real = LocalStorage.write_small

    def write_small(self, st: LocalStorage, rel: str, data: bytes, *, create_only: bool = False) -> None:
        if rel == f"step-{self.step}/{COMMIT}":
            self.pending.append((st, rel, data))
            raise OSError(errno.ETIMEDOUT, "injected at stage 'commit': the response was lost")
        self.real(st, rel, data, create_only=create_only)

    def install(self, mp: pytest.MonkeyPatch) -> None:
        lost = self
        mp.setattr(LocalStorage, "failed_create_is_final", False, raising=False)  # as on a blob store
        mp.setattr(LocalStorage, "write_small", lambda st, rel, data, *, create_only=False:
                   lost.write_small(st, rel, data, create_only=create_only))

    def land(self) -> None:
        for st, rel, data in self.pending:
            self.real(st, rel, data, create_only=True)


def test_a_commit_write_that_reports_an_error_deletes_nothing(tmp_path, capsys) -> None:  # noqa: ANN001
    """The COMMIT write fails, but its request lands afterwards: the step must still be whole."""
    root = str(tmp_path / "ck")
    lost = _LostCommit(2)
    with pytest.MonkeyPatch.context() as mp:
        lost.install(mp)
        ck = nc.Checkpointer(root, tiers=[nc.LocalTier(root, keep_last=5)], on_persist_error="log")
        ck.save(1, _state(1))
        h = ck.save_async(2, _state(2))
        with pytest.raises(nc.PersistError) as ei:
            h.result()
        assert os.path.exists(os.path.join(root, "step-2", MANIFEST))       # nothing of it deleted
        assert "may have committed" in str(ei.value)
        h = ck.save_async(2, _state(2))                                          # never written over
        with pytest.raises(nc.PersistError, match="not written again"):
            h.result()
        ck.save(3, _state(3))                                                    # no sweep of step 2 either
        lost.land()
        ck.close()
    capsys.readouterr()
    assert cli(["verify", root, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["step"]: r["healthy"] for r in rows} == {1: True, 2: True, 3: True}
    w = torch.zeros(64, 64)
    with nc.Checkpointer(root, tiers=[nc.LocalTier(root, keep_last=5)]) as ck:
        assert ck.load(2, into={"w": w, "step": 0}) == 2 and torch.all(w == 2)


def test_remove_empty_dir_removes_only_an_empty_folder(tmp_path) -> None:  # noqa: ANN001
    st = LocalStorage(str(tmp_path / "root"))
    st.write_small("step-1/a", b"x")
    st.write_small("step-1/b", b"y")
    st.remove_empty_dir("step-1")                  # not empty: stays, files and all
    assert sorted(st.list("step-1")) == ["a", "b"]
    st.remove("step-1/a")
    st.remove("step-1/b")
    assert st.list("") == ["step-1"]
    st.remove_empty_dir("step-1")
    st.remove_empty_dir("step-9")                  # missing: nothing to do
    assert st.list("") == []
