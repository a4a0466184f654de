"""A save's retention reads no step it knows: its cost does not grow with the steps a tier keeps.

Retention ranks a tier's committed steps by write and keeps what the kept ones refer to. A writer
reads each step's marker and references once (when it commits the step, or at its first pass
after open) and again only when the step's marker changed: a step committed again by another
write of this process is read again, and a restarted job reads what the job before it left.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import pytest
import torch

import nebula_ckpt as nc
from counting import CountingReads, reads_per_save
from nebula_ckpt.format.commit import CommitProgress, commit_manifest, read_committed_manifest
from nebula_ckpt.format.names import new_variant
from nebula_ckpt.storage.local import LocalStorage


class CountingStorage(CountingReads, LocalStorage):
    """A local tier's storage that records every read it serves (a look-up counts as a read)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.reads = []


class CountingTier(nc.LocalTier):
    """A local tier whose storage counts its reads (``storage``, once the tier is opened)."""

    def __init__(self, path: str, **kw: Any) -> None:
        super().__init__(path, **kw)
        self.storage: "CountingStorage | None" = None

    def make_storage(self) -> LocalStorage:
        self.storage = CountingStorage(self.path)
        return self.storage


def _other_steps(reads: list[str], step: int) -> list[str]:
    """The reads of files of step folders other than ``step``'s."""
    return [r for r in reads if r.startswith("step-") and not r.startswith(f"step-{step}/")]


@pytest.mark.parametrize("keep", [dict(keep_last=10**6), dict(keep_last=2, keep_every=3)],
                         ids=["every step kept", "keep_every"])
def test_a_saves_reads_do_not_grow_with_the_steps_kept(tmp_path: Any, keep: dict[str, int]) -> None:
    root = str(tmp_path / "ck")
    tier = CountingTier(root, **keep)
    with nc.Checkpointer(root, tiers=[tier]) as ck:
        reads = reads_per_save(ck, tier, range(1, 41))
        kept = ck.list()
    assert len(kept) >= 14, kept  # a history that grows: every step, or every third one
    assert len(reads[40]) <= len(reads[10]), (reads[10], reads[40])
    for s in range(10, 41):  # no marker nor manifest of a step it committed or read before
        assert not _other_steps(reads[s], s), (s, reads[s])


def test_the_first_save_after_a_restart_reads_each_step_once(tmp_path: Any) -> None:
    root = str(tmp_path / "ck")
    opts: dict[str, Any] = dict(keep_last=2, incremental=False)  # full saves: no step kept as a base
    with nc.Checkpointer(root, tiers=[nc.LocalTier(root, keep_every=2)], **opts) as ck:
        state = {"w": torch.zeros(64)}
        for s in range(1, 21):
            ck.save(s, state)
    tier = CountingTier(root, keep_every=2)
    with nc.Checkpointer(root, tiers=[tier], **opts) as ck:
        first, second = reads_per_save(ck, tier, range(21, 23)).values()
        assert ck.list() == [2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 21, 22]
    # the first save's retention reads each step the job before left once (then knows it): its
    # manifest once; the markers are read at the open too (the writer generation)
    manifests = [r for r in _other_steps(first, 21) if "manifest" in r]
    assert len(manifests) == len(set(manifests)) == 11, manifests
    assert not _other_steps(second, 22), second


class EarlierWriter:
    """The fence of a write of an earlier writer generation committed in this process (as the
    drain puts an earlier writer's step on a tier, under its own generation)."""

    def __init__(self, generation: int) -> None:
        self.generation = generation

    def check(self, what: str) -> None:
        pass

    def committing(self, what: str) -> "contextlib.AbstractContextManager[None]":
        return contextlib.nullcontext()


def _committed(root: str) -> list[int]:
    return sorted(int(n.split("-")[1]) for n in os.listdir(root)
                  if n.startswith("step-") and os.path.exists(os.path.join(root, n, "COMMIT")))


def test_a_step_committed_again_by_another_write_is_read_again(tmp_path: Any) -> None:
    """A step this writer knows is committed again, in this process, by an earlier writer's write:
    retention ranks it as that write (of the earlier generation: it goes first), not as it was."""
    root = str(tmp_path / "ck")
    state = {"w": torch.zeros(64)}
    with nc.Checkpointer(root, memory_tier=False, keep_last=3, incremental=False) as ck:
        ck.save(0, state)  # writer generation 1
    with nc.Checkpointer(root, memory_tier=False, keep_last=3, incremental=False) as ck:  # generation 2
        for s in range(1, 6):
            ck.save(s, state)
            ck.wait()
        assert _committed(root) == [3, 4, 5]  # step 0, of generation 1, went first
        st = LocalStorage(root)
        old, mbytes = read_committed_manifest(st, 4, "step 4")
        assert old.generation == 2
        commit_manifest(st, EarlierWriter(1), 4, mbytes, CommitProgress(), "test", None, old, new_variant())
        ck.save(6, state)
        ck.wait()
        # ranked by (generation, step): 4 (generation 1), then 3, 5, 6: the newest three stay
        assert _committed(root) == [3, 5, 6]


@contextlib.contextmanager
def _job(root: str) -> Iterator[nc.Checkpointer]:
    with nc.Checkpointer(root, memory_tier=False, keep_last=3) as ck:
        yield ck


def test_a_restarted_job_that_saves_steps_again_keeps_the_right_ones(tmp_path: Any) -> None:
    """A restarted job rolls back and saves steps again (incremental saves, whose references
    change with the timeline): what stays is its newest three, each one whole."""
    root = str(tmp_path / "ck")
    big = {"frozen": torch.arange(4096, dtype=torch.float32), "w": torch.zeros(16)}
    with _job(root) as ck:
        for s in range(1, 9):
            big["w"].fill_(float(s))
            ck.save(s, big)
    for rollback in (6, 7):
        with _job(root) as ck:
            into = {"frozen": torch.zeros(4096), "w": torch.zeros(16)}
            assert ck.load(rollback, into) == rollback
            for s in range(rollback + 1, rollback + 4):
                big["w"].fill_(100.0 * rollback + s)
                ck.save(s, big)
                ck.wait()
    with _job(root) as ck:
        kept = ck.list()
        assert kept[-3:] == [8, 9, 10], kept  # and the full save they build on
        for s in kept[-3:]:
            into = {"frozen": torch.zeros(4096), "w": torch.zeros(16)}
            assert ck.load(s, into) == s
            assert torch.equal(into["w"], torch.full((16,), 700.0 + s)), (s, into["w"])
            assert torch.equal(into["frozen"], big["frozen"])
