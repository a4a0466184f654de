"""Two Checkpointers on one root in one process: the newer one takes the root over, the older one's
committed checkpoints stay (a framework that builds a second engine, or re-creates its plugin,
while the first one's Checkpointer is still open and persisting).

The older writer's checkpoint is committed on the memory tier and still being written to disk
(a real local tier paused while it writes the shard, :mod:`faults`) when the newer one saves. The
newer one must find that checkpoint, on disk too, write the memory tier itself, and say nothing
about "another live process"; the older one, handed over, refuses to save again, naming why.
The same with two real ranks, where the newer Checkpointer takes its writer generation in its
constructor: ``tests/dist/test_two_writers_ranks.py``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import pytest
import torch

import nebula_ckpt as nc
from faults import FaultyTier
from nebula_ckpt.errors import FencedError

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs a tmpfs memory tier")


def _state(v: float) -> dict[str, Any]:
    return {"w": torch.full((256,), v), "note": f"v{v}"}


def _open_after(tier: FaultyTier, done: threading.Event, grace: float) -> threading.Thread:
    """Open ``tier``'s gate once ``done`` is set, or after ``grace`` seconds (the newer writer waits
    for the older one's persist: only the gate ends that wait)."""
    def run() -> None:
        done.wait(grace)
        tier.gate.set()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_second_checkpointer_saving_while_the_first_persists_loses_none_of_its_checkpoints(
        root: str, caplog: pytest.LogCaptureFixture) -> None:
    slow = FaultyTier(root, pause_at="shard")  # the older writer's disk write waits in its shard
    older = nc.Checkpointer(root, tiers=[nc.MemoryTier(), slow])
    try:
        h = older.save_async(1, _state(1.0), tag="t1")
        assert slow.reached.wait(60), "the older writer's disk write never started"
        mem = older.tiers[0].name
        deadline = time.monotonic() + 60
        while mem not in h.tiers_written and not h.done() and time.monotonic() < deadline:
            time.sleep(0.01)  # the memory tier commits beside the paused disk write
        assert h.tiers_written == [mem] and older.list(detailed=True)[mem] == [1]  # disk still writing
        saved = threading.Event()
        opener = _open_after(slow, saved, grace=3.0)
        with caplog.at_level(logging.INFO, logger="nebula_ckpt"), \
                nc.Checkpointer(root, tiers=[nc.MemoryTier(), nc.LocalTier(root)]) as newer:
            newer.save(2, _state(2.0), tag="t2")
            saved.set()
            opener.join()
            h.result()  # the older save ended well: it was finished before the hand-over
            step, got = newer.read(tag="t1")
            assert step == 1 and torch.equal(got["w"], torch.full((256,), 1.0)) and got["note"] == "v1.0"
            held = newer.list(detailed=True)
            assert held[newer.tiers[1].name] == [1, 2], "the older writer's checkpoint is not on disk"
            assert 2 in held[newer.tiers[0].name], "the newer writer could not write the memory tier"
        messages = [r.getMessage() for r in caplog.records]
        assert not [m for m in messages if "another live process" in m], messages
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], messages
        assert [m for m in messages if "took this root over" in m]
        with pytest.raises(FencedError, match="newer Checkpointer of this process"):
            older.save(3, _state(3.0))
    finally:
        slow.gate.set()
        older.close()
    with nc.Checkpointer(root) as again:  # a restart finds both on disk
        assert again.list() == [1, 2]
        assert again.read(tag="t1")[0] == 1


def test_a_second_checkpointer_that_only_reads_leaves_the_first_one_writing(root: str) -> None:
    """Reading takes nothing over: the first Checkpointer keeps the root and the memory tier."""
    with nc.Checkpointer(root) as first:
        first.save(1, _state(1.0), tag="a")
        with nc.Checkpointer(root) as reader:
            assert reader.read(tag="a")[0] == 1
        first.save(2, _state(2.0), tag="b")
        assert first.list(detailed=True)[first.tiers[0].name][-1] == 2
        assert first.read(tag="b")[0] == 2


def test_a_memory_tier_held_by_this_very_process_is_named_so(root: str, caplog: pytest.LogCaptureFixture) -> None:
    """The memory tier's lock held elsewhere in this very process (a claim that has not handed
    over): the Checkpointer saves without the tier, and its warning names this process, not
    "another live process"."""
    from nebula_ckpt.format.owner import read_owner
    from nebula_ckpt.tiers.memory.shm import Claim
    from nebula_ckpt.tiers.memory.tier import memory_tier_path

    with nc.Checkpointer(root) as ck:
        folder = memory_tier_path(root)
        owner = read_owner(folder)
        assert owner is not None
        other = Claim(folder, owner)
        assert other.lock()
        try:
            with caplog.at_level(logging.WARNING, logger="nebula_ckpt"):
                ck.save(1, _state(1.0))
            assert ck.list(detailed=True)[ck.tiers[0].name] == []  # saved without the memory tier
        finally:
            other.release()
    messages = [r.getMessage() for r in caplog.records]
    assert [m for m in messages if "another Checkpointer of this process" in m], messages
    assert not [m for m in messages if "another live process" in m], messages


def test_a_second_checkpointer_that_removes_a_step_takes_the_root_over_in_order(
        root: str, caplog: pytest.LogCaptureFixture) -> None:
    """Removing is writing: a second Checkpointer that removes a step (it never saved) takes the
    root over as a save does, and writes the memory tier after."""
    with nc.Checkpointer(root) as first:
        first.save(1, _state(1.0), tag="a")
        first.save(2, _state(2.0), tag="b")
        with caplog.at_level(logging.INFO, logger="nebula_ckpt"), nc.Checkpointer(root) as second:
            second.remove(1)
            assert second.list() == [2] and second.read(tag="b")[0] == 2
            second.save(3, _state(3.0))
            assert second.list(detailed=True)[second.tiers[0].name][-1] == 3
        messages = [r.getMessage() for r in caplog.records]
        assert [m for m in messages if "took this root over" in m], messages
        assert not [m for m in messages if "another live process" in m or "another Checkpointer" in m], messages
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], messages
        with pytest.raises(FencedError, match="newer Checkpointer of this process"):
            first.save(4, _state(4.0))
