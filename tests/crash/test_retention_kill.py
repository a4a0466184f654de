"""Real SIGKILLs between the deletions of retention: every committed step stays restorable.

Retention of incremental checkpoints deletes several steps in one pass, some of them the bases
that others of the pass refer to. A process killed between any two deletions (or between a
step's commit marker and its files) must leave only steps that ``list()`` shows *and* that load
and verify: never a step whose base is gone. Each tier is tried: local disk, the memory tier,
and blob stores (Azurite, moto S3: tests/blob/test_retention_kill_remote.py). The kill point is
chosen by a log record of a deletion stage (the worker waits there), the kill itself is a real
SIGKILL of a real process; the worker is a zygote that forks one process per kill
(tests/crash/retention_worker.py), so each kill costs a fork, not an interpreter start.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import pytest

from crash.retention_kills import MAX_POINTS, Zygote, kill_everywhere, zygote_process
from nebula_ckpt import knobs
from nebula_ckpt.cli import main as cli


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    yield from zygote_process()

@pytest.mark.crash
@pytest.mark.parametrize("tier", ["local", "memory"])
def test_sigkill_between_retention_deletions_leaves_every_step_restorable(zygote: Zygote, tmp_path: Any,
                                                                          tier: str) -> None:
    kill_everywhere(zygote, str(tmp_path), tier)


@pytest.mark.crash
def test_sigkill_during_gc_of_a_memory_tier_lists_no_half_deleted_step(zygote: Zygote, tmp_path: Any) -> None:
    """``nebula-ckpt gc --force`` removes a memory tier: killed between its deletions, the tier
    lists no step it cannot restore (markers go first), and the disk still has every step."""
    for n in range(1, MAX_POINTS):
        shm = str(tmp_path / f"shm-{n}")
        os.makedirs(shm)
        root = str(tmp_path / f"run-{n}")
        sc = {"root": root, "opts": None, "tier": "memory", "shm": shm, "steps": 6}
        assert zygote.run({**sc, "phase": "fill"})[0] == "done"
        how, what = zygote.run({**sc, "phase": "gc", "kill_at": n})
        with knobs.override(shm_dir=shm):
            assert cli(["verify", root]) == 0
        if how == "done":
            assert n > 2, f"gc went through {what} deletion point(s) only"
            return
    raise AssertionError("more deletion points than expected")
