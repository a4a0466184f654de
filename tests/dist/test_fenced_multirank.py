"""Two jobs of 2 ranks on one root: the stale one, fenced, never wins the restart (real gloo ranks).

The stale job keeps running beside its restart and holds each rank's memory-tier lock, so the
newer job saves to the shared root only. Once fenced, the stale job must commit nothing more on
any tier (its ranks' memory tiers included) and give those tiers back; after the newer job closes
and the stale one dies, a restart of 2 ranks agrees on the newer job's step on every rank, not on
the stale job's higher steps in memory.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from faults import renumber_step
from memory_paths import memory_tier_path
from nebula_ckpt import knobs

from .launch import reports, run_ranks

pytestmark = [pytest.mark.timeout(400), pytest.mark.skipif(not os.path.isdir("/dev/shm"),
                                                           reason="needs a tmpfs memory tier")]


def _await(path: Path, what: threading.Thread) -> None:
    t0 = time.time()
    while not path.exists():
        assert what.is_alive(), f"the stale job ended before {path.name}"
        assert time.time() - t0 < 240, f"{path.name} never came"
        time.sleep(0.05)


def test_a_fenced_two_rank_job_stops_on_every_tier_and_never_wins_the_restart(root: str, shm_dir: str,
                                                                                tmp_path: Path) -> None:
    out, gates = tmp_path / "out", tmp_path / "gates"
    out.mkdir()
    gates.mkdir()
    args = [root, str(out), str(gates)]
    stale_done: list[Any] = []
    stale = threading.Thread(target=lambda: stale_done.extend(
        run_ranks(2, "fence_worker.py", ["stale", *args], out, shm_dir, timeout=360)))
    stale.start()
    try:
        newer = run_ranks(2, "fence_worker.py", ["newer", *args], out, shm_dir)
        assert all(p.returncode == 0 for p in newer), [p.stdout[-3000:] for p in newer]
        assert all(r["resumed"] == 1 for r in reports(out, "newer", 2))
        for r in range(2):
            _await(gates / f"stale-done-r{r}", stale)
        got = reports(out, "stale", 2)
    finally:
        (gates / "die").touch()
        stale.join()
    assert all(p.returncode == -9 for p in stale_done), [p.stdout[-3000:] for p in stale_done]
    for r in got:
        assert r["10"] == r["11"] == r["12"] == "fenced", r
        assert 11 not in r["memory_steps"] and 12 not in r["memory_steps"], f"the fenced job went on committing: {r}"
        # its save of step 10 ended fenced: whatever it committed of it is taken back; step 1 stays
        assert r["memory_steps"] == [1], f"a save that ended fenced left its step, or took another: {r}"
        assert r["11-written"] == r["12-written"] == [], r
        assert r["memory_lock_free"], f"the fenced job still holds rank {r['rank']}'s memory tier: {r}"
    # What the stale job committed in memory in saves that completed (step 1) is of the older
    # generation; each rank's memory tier also gets a step 20 of it: a higher step never wins.
    with knobs.override(shm_dir=shm_dir):
        folders = [memory_tier_path(root, r) for r in range(2)]
    for folder in folders:
        renumber_step(folder, 1, 20)
    loaded = run_ranks(2, "fence_worker.py", ["load", *args], out, shm_dir)
    assert all(p.returncode == 0 for p in loaded), [p.stdout[-3000:] for p in loaded]
    for r in reports(out, "load", 2):
        assert r["step"] == 5 and r["who"] == "newer", r
        assert r["w"] == torch.full((16,), 5 + r["rank"] / 10).tolist(), r
