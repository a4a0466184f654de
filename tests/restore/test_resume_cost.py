"""What a resume reads: ``load_latest`` / ``latest()`` read the commit markers lazily, newest
first, in the restore's order (:func:`~nebula_ckpt.restore.select.newest_first`), so a restart's
storage reads do not grow with the number of steps the root keeps; and that lazy order is exactly
the order of every marker read (:func:`~nebula_ckpt.restore.candidates.list_candidates`): the
newest writer generation first, then the step, the save, the fastest tier, an unreadable marker last."""

from __future__ import annotations

import collections
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt.restore.candidates import list_candidates
from nebula_ckpt.restore.select import newest_first
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.storage.local import LocalStorage
from nebula_ckpt.tiers.base import Tier

READS = ("read_small", "list", "exists", "size", "read_buffer")


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), value)}


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> "collections.Counter[str]":
    """Every read of a local storage, counted by kind (the reads themselves unchanged)."""
    counts: "collections.Counter[str]" = collections.Counter()
    for name in READS:
        def wrap(orig: Callable[..., Any], name: str) -> Callable[..., Any]:
            def counting(self: LocalStorage, *a: Any, **k: Any) -> Any:
                counts[name] += 1
                return orig(self, *a, **k)
            return counting
        monkeypatch.setattr(LocalStorage, name, wrap(getattr(LocalStorage, name), name))
    return counts


def _resume_reads(root: str, counts: "collections.Counter[str]", step: int) -> tuple[int, int]:
    """The reads of a restarted job's ``load_latest`` and of ``latest()`` (fresh Checkpointers)."""
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as rd:
        counts.clear()
        into = _state(0.0)
        assert rd.load_latest(into=into) == step and into["w"][0].item() == step
        load = sum(counts.values())
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as rd:
        counts.clear()
        assert rd.latest() == (step, None)
        return load, sum(counts.values())


def test_a_resume_reads_as_much_at_120_kept_steps_as_at_20(root: str, counted: "collections.Counter[str]") -> None:
    reads = {}
    with nc.Checkpointer(root, memory_tier=False, keep_last=1000) as ck:
        for i in range(1, 121):
            ck.save(i, _state(float(i)))
            if i in (20, 120):
                ck.wait()
                reads[i] = _resume_reads(root, counted, i)
    assert reads[120] == reads[20], reads  # it read every marker before: 46 -> 246 reads
    assert reads[120][0] < 20, reads


def test_after_a_rollback_the_resume_stops_at_the_new_runs_step(root: str,
                                                                counted: "collections.Counter[str]") -> None:
    with nc.Checkpointer(root, memory_tier=False, keep_last=1000) as ck:
        for i in range(1, 61):
            ck.save(i, _state(float(i)))
    with nc.Checkpointer(root, memory_tier=False, keep_last=1000) as ck:  # rolls back to step 10
        ck.load(10, into=_state(0.0))
        ck.save(11, _state(110.0))
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as rd:
        counted.clear()
        into = _state(0.0)
        assert rd.load_latest(into=into) == 11 and into["w"][0].item() == 110.0
        assert rd.latest() == (11, None)
    # each call passes the abandoned steps 60..12 on the way (their markers name the older generation)
    # and stops at step 11: the markers of steps 10..1 are never read
    assert counted["read_small"] < 2 * 60, dict(counted)


def _tiers(*roots: str) -> list[tuple[Tier, Storage]]:
    return [(nc.LocalTier(r), LocalStorage(r)) for r in roots]


def _same_order(tiers: list[tuple[Tier, Storage]]) -> list[tuple[int, int, int, int, bool]]:
    """The lazy order, checked against every marker read; as ``(tier index, generation, step, save, damaged)``."""
    problems: list[int] = []
    lazy = list(newest_first(tiers, on_problem=lambda c: problems.append(c.step)))
    eager = list_candidates(tiers)
    stores = [st for _, st in tiers]
    key = [(stores.index(c.storage), c.generation, c.step, c.save, c.problem is not None) for c in lazy]
    assert key == [(stores.index(c.storage), c.generation, c.step, c.save, c.problem is not None) for c in eager]
    assert sorted(problems) == sorted(c.step for c in eager if c.problem is not None)
    return key


def _commit(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step}", "COMMIT")


def test_the_lazy_order_is_the_order_of_every_marker(tmp_path: Path, shm_dir: str) -> None:
    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    for r in (fast, slow):
        with nc.Checkpointer(r, memory_tier=False, keep_last=1000) as ck:
            for i in range(1, 9):
                ck.save(i, _state(float(i)))
    with nc.Checkpointer(slow, memory_tier=False, keep_last=1000) as ck:  # a newer run of slow: steps 2, 3 again
        ck.save(2, _state(20.0))
        ck.save(3, _state(30.0))
    got = _same_order(_tiers(fast, slow))
    # the newer run's steps first, whatever their number; then one write on both tiers: the fastest first
    assert got[:4] == [(1, 2, 3, 1, False), (1, 2, 2, 0, False), (0, 1, 8, 7, False), (1, 1, 8, 7, False)], got
    with open(_commit(slow, 5), "wb") as f:
        f.write(b"{garbled")  # an unreadable marker: damage, sorted after every readable one
    assert _same_order(_tiers(fast, slow))[-1] == (1, -1, 5, -1, True)
    assert _same_order(_tiers(slow, fast))[:4] == [(0, 2, 3, 1, False), (0, 2, 2, 0, False), (0, 1, 8, 7, False),
                                                   (1, 1, 8, 7, False)]
    with nc.Checkpointer(fast, memory_tier=False, read_only=True) as rd:
        assert rd.latest() == (8, None)


def test_steps_copied_in_above_every_writer_record_are_read_whole(tmp_path: Path, shm_dir: str) -> None:
    """A step whose marker names a generation no writer record does (a step folder copied in from
    another root) still comes first, as it does when every marker is read; a root with no records
    at all has every marker read."""
    root, other = str(tmp_path / "root"), str(tmp_path / "other")
    with nc.Checkpointer(root, memory_tier=False, keep_last=1000) as ck:
        for i in range(1, 31):
            ck.save(i, _state(float(i)))
    for g in (1, 2, 3):  # another root, restarted twice: its step 40 names generation 3
        with nc.Checkpointer(other, memory_tier=False, keep_last=1000) as ck:
            ck.save(37 + g, _state(1000.0 + g))
    shutil.copytree(os.path.join(other, "step-40"), os.path.join(root, "step-40"))
    assert _same_order(_tiers(root))[0][1:3] == (3, 40)
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as rd:
        assert rd.latest() == (40, None)
    shutil.rmtree(os.path.join(root, "_nebula", "writers"))
    assert _same_order(_tiers(root))[0][1:3] == (3, 40)
    with open(_commit(root, 12)) as f:  # without records, a step far below names the newest generation
        marker = json.load(f)
    marker["generation"] = 7
    with open(_commit(root, 12), "w") as f:
        json.dump(marker, f)
    assert _same_order(_tiers(root))[0][1:3] == (7, 12)
