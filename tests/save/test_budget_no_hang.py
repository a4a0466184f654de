"""A save that waits for the host-memory budget (``on_full="wait"``) never waits for ever: once no
save is in flight and nothing can be freed, it raises ``ValidationError`` naming the budget and
what holds the memory, and nothing of it is written. Each situation in which nothing can be freed,
with a budget under two states: the memory tier's newest step marked suspect (never copied to a
persistent tier), the copy to the disk tier failing, ``MemoryTier(keep_last=2)`` keeping an older
step no persistent tier has, and a multi-rank job (2 gloo ranks), whose memory-tier steps are never
copied to the shared tier to make room. Real processes (``budget_hang_child.py``,
``budget_ranks_worker.py``), each under a timeout that fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from proc_lines import json_child
from tests.dist.launch import run_ranks

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

pytestmark = [pytest.mark.timeout(300)]

WHY = {"suspect": "step 2 is marked suspect", "copy_fails": "the copy of step 2 to",
       "keep_last": "MemoryTier(keep_last=2) keeps the others"}


def _child(scenario: str, root: str, shm_dir: str) -> dict[str, Any]:
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir, PYTHONPATH=os.pathsep.join([str(REPO),
                                                                               os.environ.get("PYTHONPATH", "")]))
    return json_child([sys.executable, str(HERE / "budget_hang_child.py"), scenario, root], env,
                      f"{scenario}: a save that waits")


@pytest.mark.parametrize("scenario", sorted(WHY))
def test_a_waiting_save_that_nothing_can_free_room_for_raises(tmp_path: Path, shm_dir: str, scenario: str) -> None:
    root = str(tmp_path / "ck")
    out = _child(scenario, root, shm_dir)
    last = "4" if scenario == "keep_last" else "3"
    saves = out["saves"]
    assert all(saves[str(s)] == "ok" for s in range(1, int(last))), saves
    err = saves[last]
    assert err.startswith("ValidationError: ") and f"step {last} cannot go ahead (on_full='wait')" in err, err
    assert "host_memory_budget" in err and "nothing in flight can free" in err and WHY[scenario] in err, err
    assert "holds step(s) [2] that no persistent tier holds" in err, err  # what holds it
    assert out["held"] <= (int(8.5 * (1 << 20)) if scenario == "keep_last" else 6 << 20), out
    assert err.split(": ", 1)[1] in out["log"]  # the one line naming it, for a job's log
    listed = out["listed"]
    assert all(int(last) not in steps for steps in listed.values()), listed  # nothing of it written
    assert any(k.startswith("memory") and steps == [2] for k, steps in listed.items()), listed  # step 2 kept


def test_a_state_within_the_budget_saves_without_a_memory_tier(tmp_path: Path, shm_dir: str) -> None:
    """4 MiB states under a 5 MiB budget, disk tier only: each staging buffer fits (the anonymous
    buffer is rounded up to 6 MiB only where the budget holds the rounding), so no save waits."""
    out = _child("disk_only", str(tmp_path / "ck"), shm_dir)
    assert out["saves"] == {str(s): "ok" for s in range(1, 5)}, out["saves"]
    assert out["held"] <= 5 << 20, out


def test_a_multi_rank_waiting_save_raises_on_every_rank(tmp_path: Path, shm_dir: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    done = run_ranks(2, str(HERE / "budget_ranks_worker.py"), [str(tmp_path / "ck"), str(out)], out, shm_dir,
                     timeout=150)
    for r, p in enumerate(done):
        assert p.returncode == 0, f"rank {r} ended with {p.returncode}:\n{p.stdout[-4000:]}"
    for r in range(2):
        got = json.loads((out / f"r{r}.json").read_text())
        saves = got["saves"]
        assert saves["1"] == "ok" and saves["2"] == "ok", saves
        err = saves["3"]
        assert err.startswith("ValidationError: ") and "step 3 cannot go ahead (on_full='wait')" in err, err
        assert "host_memory_budget 6.0 MiB" in err and "a multi-rank job's step reaches the shared tier" in err, err
        assert all(3 not in steps for steps in got["listed"].values()), got
