"""A writer fenced by a newer one stops on every tier, and restore never resumes its run.

A stale writer (its job was restarted beside it) holds the memory tier's lock, so the newer
writer never writes, or fences, that tier. Once the stale writer is fenced on the root it must
commit nothing more on any tier and give the memory tier back; whatever it committed there
before it knew is an older generation's, which restore never prefers to the newer writer's
checkpoints, whatever their step numbers. Real processes: the stale writer is a subprocess that
saves at pinned points and is SIGKILLed at the end; the newer writer and the restart run here.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import nebula_ckpt as nc
from faults import renumber_step
from nebula_ckpt.format.commit import committed_steps
from nebula_ckpt.format.names import step_dir
from nebula_ckpt.storage.local import LocalStorage
from nebula_ckpt.tiers.memory.shm import try_lock
from nebula_ckpt.tiers.memory.tier import memory_tier_path

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs a tmpfs memory tier")

# The stale writer: saves step 1, signals `saved-1`, waits for `newer-saved`, then saves steps
# 10, 11, 12 (each waited for, its outcome reported), signals `stale-done` and waits to be killed.
_STALE = r"""
import json, os, sys, time, torch, nebula_ckpt as nc
root, gates = sys.argv[1], sys.argv[2]

def gate(name):
    t0 = time.time()
    while not os.path.exists(os.path.join(gates, name)):
        if time.time() - t0 > 120:
            raise SystemExit(f"stale writer: gate {name} never opened")
        time.sleep(0.01)

ck = nc.Checkpointer(root)
ck.save(1, {"w": torch.full((64,), 1.0), "who": "stale"})
open(os.path.join(gates, "saved-1"), "w").close()
gate("newer-saved")
out = {}
for step in (10, 11, 12):
    h = ck.save_async(step, {"w": torch.full((64,), float(step)), "who": "stale"})
    try:
        h.result(timeout=120)
        out[step] = "committed"
    except nc.FencedError as e:
        out[step] = "fenced"
    out[f"{step}-written"] = h.tiers_written
with open(os.path.join(gates, "stale.json"), "w") as f:
    json.dump(out, f)
open(os.path.join(gates, "stale-done"), "w").close()
time.sleep(600)
"""


def _await(path: str, proc: subprocess.Popen) -> None:
    t0 = time.time()
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise AssertionError(f"the stale writer exited early: {proc.stderr.read()[-3000:]}")
        assert time.time() - t0 < 180, f"{path} never came"
        time.sleep(0.02)


def test_a_fenced_writer_stops_on_every_tier_and_never_wins_the_restart(root: str, shm_dir: str, tmp_path) -> None:  # noqa: ANN001
    gates = str(tmp_path / "gates")
    os.makedirs(gates)
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir)
    stale = subprocess.Popen([sys.executable, "-c", _STALE, root, gates], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    folder = memory_tier_path(root)
    try:
        _await(os.path.join(gates, "saved-1"), stale)
        # the newer writer: its restart beside the stale one (which keeps the memory tier's lock)
        with nc.Checkpointer(root) as newer:
            state = {"w": torch.zeros(64), "who": ""}
            assert newer.load_latest(into=state) == 1
            newer.save(5, {"w": torch.full((64,), 5.0), "who": "newer"})
        open(os.path.join(gates, "newer-saved"), "w").close()
        _await(os.path.join(gates, "stale-done"), stale)
        with open(os.path.join(gates, "stale.json")) as f:
            got = json.load(f)
        assert got["10"] == got["11"] == got["12"] == "fenced", got
        # once fenced (step 10 on the root at the latest), nothing more is committed on any tier ...
        mem_steps = committed_steps(LocalStorage(folder))
        assert 11 not in mem_steps and 12 not in mem_steps, f"the fenced writer went on committing: {mem_steps}"
        assert got["11-written"] == got["12-written"] == [], got
        # ... and the memory tier's lock is given back while the stale process still runs
        fd = try_lock(folder)
        assert fd is not None, "the fenced writer still holds the memory tier's lock"
        os.close(fd)
    finally:
        stale.send_signal(signal.SIGKILL)
        stale.wait()
    # the restart resumes the newer writer's step 5, never the stale writer's later steps
    with nc.Checkpointer(root) as again:
        state = {"w": torch.zeros(64), "who": ""}
        assert again.load_latest(into=state) == 5, again.last_restore
        assert state["who"] == "newer" and torch.equal(state["w"], torch.full((64,), 5.0))


def test_an_older_generation_never_wins_even_with_a_higher_step_on_the_fastest_tier(root: str, shm_dir: str,
                                                                                       tmp_path) -> None:  # noqa: ANN001
    """Selection alone: a memory tier holding a higher step of an older writer generation (what a
    stale writer committed before it learnt it was fenced) loses to a newer generation's lower
    step on the slower tier; the older step stays reachable by number."""
    gates = str(tmp_path / "gates")
    os.makedirs(gates)
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir)
    stale = subprocess.Popen([sys.executable, "-c", _STALE, root, gates], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        _await(os.path.join(gates, "saved-1"), stale)
    finally:
        stale.send_signal(signal.SIGKILL)
        stale.wait()
    # the memory tier's step 1 of generation 1 becomes "step 9" of generation 1
    folder = memory_tier_path(root)
    renumber_step(folder, 1, 9)
    shutil.rmtree(os.path.join(folder, step_dir(1)))
    with nc.Checkpointer(root, memory_tier=False) as newer:  # generation 2, root only
        newer.save(5, {"w": torch.full((64,), 5.0), "who": "newer"})
    with nc.Checkpointer(root) as again:
        assert sorted(again.list()) == [1, 5, 9]
        state = {"w": torch.zeros(64), "who": ""}
        assert again.load_latest(into=state) == 5, again.last_restore
        assert state["who"] == "newer"
        assert again.load(9, into=state) == 9 and state["who"] == "stale"  # by number, still there
