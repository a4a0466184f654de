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
import warm_python
from faults import renumber_step
from memory_paths import memory_tier_path, try_lock
from nebula_ckpt.format.commit import Commit, committed_steps, read_commit, retract_step
from nebula_ckpt.format.names import step_dir
from nebula_ckpt.storage.local import LocalStorage

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
    stale = warm_python.popen([sys.executable, "-c", _STALE, root, gates], env=env, stdout=subprocess.PIPE,
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
    stale = warm_python.popen([sys.executable, "-c", _STALE, root, gates], env=env, stdout=subprocess.PIPE,
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


# The stale writer of a save that is fenced after its memory tier committed: its disk tier (the
# root) pauses at the named stage `shard` of step 6, after that tier's first fence check passed,
# until `go`; meanwhile the memory tier commits step 6. The newer writer takes over in between.
_FENCED_SAVE = r"""
import json, os, sys, threading, time, torch, nebula_ckpt as nc
root, gates, tests = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, tests)
from faults import FaultyTier

disk = FaultyTier(root, pause_at="shard")

def opener():
    while not os.path.exists(os.path.join(gates, "go")):
        time.sleep(0.01)
    disk.gate.set()
threading.Thread(target=opener, daemon=True).start()

ck = nc.Checkpointer(root, tiers=[nc.MemoryTier(), disk])
h = ck.save_async(6, {"w": torch.full((64,), 6.0), "who": "stale"})
disk.reached.wait(120)
open(os.path.join(gates, "paused"), "w").close()
try:
    h.result(timeout=120)
    out = "committed"
except nc.FencedError:
    out = "fenced"
with open(os.path.join(gates, "stale.json"), "w") as f:
    json.dump({"save": out, "listed": ck.list()}, f)
open(os.path.join(gates, "stale-done"), "w").close()
time.sleep(600)
"""


def test_a_save_that_ends_fenced_takes_back_what_it_committed_on_its_memory_tier(root: str, shm_dir: str,
                                                                                  tmp_path) -> None:  # noqa: ANN001
    """The stale writer's save(6) commits on its memory tier, then is fenced on the root: it ends
    in FencedError and leaves no step 6 behind, so neither ``list()`` nor ``load(6)`` ever gives
    the bytes of a writer that was told it was fenced; the newer writer's steps stay."""
    gates = str(tmp_path / "gates")
    os.makedirs(gates)
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir)
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    stale = warm_python.popen([sys.executable, "-c", _FENCED_SAVE, root, gates, tests], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    folder = memory_tier_path(root)
    try:
        _await(os.path.join(gates, "paused"), stale)
        _await(os.path.join(folder, step_dir(6), "COMMIT"), stale)  # the memory tier committed step 6
        with nc.Checkpointer(root, memory_tier=False) as newer:  # the takeover: a newer generation
            newer.save(3, {"w": torch.full((64,), 3.0), "who": "newer"})
        open(os.path.join(gates, "go"), "w").close()
        _await(os.path.join(gates, "stale-done"), stale)
        with open(os.path.join(gates, "stale.json")) as f:
            got = json.load(f)
        assert got["save"] == "fenced", got
        assert 6 not in committed_steps(LocalStorage(folder)), "the fenced save left its step on the memory tier"
        assert 6 not in got["listed"], got
    finally:
        stale.send_signal(signal.SIGKILL)
        stale.wait()
    with nc.Checkpointer(root) as again:
        assert again.list() == [3]
        state = {"w": torch.zeros(64), "who": ""}
        with pytest.raises(nc.NotFoundError):
            again.load(6, into=state)
        assert again.load_latest(into=state) == 3 and state["who"] == "newer"


def test_two_generations_of_one_step_load_and_list_the_newer_writers(root: str, shm_dir: str) -> None:  # noqa: ARG001
    """A step number both writers committed (the older one on its memory tier, the newer on the
    root): ``load(N)`` opens the newer generation's, ``list()`` shows the step once."""
    with nc.Checkpointer(root, tiers=[nc.MemoryTier()]) as old:  # generation 1, memory tier only
        old.save(6, {"w": torch.full((64,), 1.0), "who": "old"})
    with nc.Checkpointer(root, memory_tier=False) as newer:  # generation 2, the root only
        newer.save(6, {"w": torch.full((64,), 2.0), "who": "newer"})
    with nc.Checkpointer(root) as again:
        per = again.list(detailed=True)
        assert sorted(per.values()) == [[6], [6]], per  # both copies are there ...
        assert again.list() == [6]
        state = {"w": torch.zeros(64), "who": ""}
        assert again.load(6, into=state) == 6
        assert state["who"] == "newer" and torch.equal(state["w"], torch.full((64,), 2.0))  # ... the newer one wins


class _NewerWriterMeanwhile(LocalStorage):
    """A tier storage on which a newer writer (generation 2) replaces step 6's commit marker at
    the named stage between the take-back's read of the marker and its removal."""

    def local_path(self, rel: str):  # noqa: ANN201
        if rel.endswith("/COMMIT") and not getattr(self, "swapped", False):
            self.swapped = True
            with open(os.path.join(self.root, rel), "wb") as f:
                f.write(Commit(6, 2, 1, 0).to_bytes())
        return super().local_path(rel)


def test_a_take_back_never_removes_a_newer_writers_step_of_the_same_number(tmp_path) -> None:  # noqa: ANN001
    """``retract_step`` removes only its own generation's step: not a newer writer's committed
    step 6, and not one that replaced its own between its read and its removal."""
    with nc.Checkpointer(str(tmp_path / "a"), memory_tier=False) as ck:  # generation 1
        ck.save(6, {"w": torch.ones(4)})
    st = LocalStorage(str(tmp_path / "a"))
    assert not retract_step(st, 6, generation=7, tier="t")  # another generation's: kept
    assert committed_steps(st) == [6]
    racy = _NewerWriterMeanwhile(str(tmp_path / "a"))
    assert not retract_step(racy, 6, generation=1, tier="t")  # replaced by generation 2 meanwhile: kept
    assert racy.swapped and committed_steps(st) == [6]
    assert read_commit(st, 6, "step 6").generation == 2
    assert not [n for n in os.listdir(tmp_path / "a" / step_dir(6)) if ".taken-" in n]
    with nc.Checkpointer(str(tmp_path / "b"), memory_tier=False) as ck:
        ck.save(6, {"w": torch.ones(4)})
    st = LocalStorage(str(tmp_path / "b"))
    assert retract_step(st, 6, generation=1, tier="t")  # its own: taken back, folder and all
    assert committed_steps(st) == [] and not os.path.exists(tmp_path / "b" / step_dir(6))


def test_every_tier_keeps_a_bounded_number_of_writer_records_however_often_the_job_restarts(tmp_path) -> None:
    """Each job takes a writer generation and records it on every tier it writes: a tier beside the
    root keeps the newest ones only, as the root does (one record per restart would pile up, and
    every save's fence check lists them)."""
    root, extra = str(tmp_path / "root"), str(tmp_path / "extra")
    for step in range(24):
        with nc.Checkpointer(root, tiers=[nc.LocalTier(extra), nc.LocalTier(root)], keep_last=2) as ck:
            ck.save(step, {"w": torch.full((8,), float(step))})
    for where in (root, extra):
        records = os.listdir(os.path.join(where, "_nebula", "writers"))
        assert 0 < len(records) <= 17, (where, sorted(records))
    with nc.Checkpointer(root, tiers=[nc.LocalTier(extra), nc.LocalTier(root)], read_only=True) as ck:
        into = {"w": torch.zeros(8)}
        assert ck.load_latest(into=into) == 23 and float(into["w"][0]) == 23.0


# A stale writer whose shard write of step 4 lasts until the newer writer committed its own step 4.
_SLOW_STALE = r"""
import os, sys, time, torch, nebula_ckpt as nc
import nebula_ckpt.save.writer as W
root, gates = sys.argv[1], sys.argv[2]
real = W.write_image

def held(rt, rel, step):
    out = real(rt, rel, step)
    if rel.startswith("step-4/"):
        open(os.path.join(gates, "shard-written"), "w").close()
        while not os.path.exists(os.path.join(gates, "newer-saved")):
            time.sleep(0.01)
    return out

W.write_image = held
ck = nc.Checkpointer(root, memory_tier=False, keep_last=1)
ck.save(3, {"w": torch.full((64,), 3.0)})
h = ck.save_async(4, {"w": torch.full((64,), -4.0)})
try:
    h.result(timeout=120)
    print("committed")
except nc.FencedError:
    print("fenced")
"""


def test_a_stale_writers_manifest_never_lands_on_a_step_the_newer_writer_committed(root: str, shm_dir: str,
                                                                                   tmp_path) -> None:  # noqa: ANN001
    """A stale writer whose shard write outlasts the newer run's commit of the same step number is
    fenced before its manifest: the newer run's step stays whole (with ``keep_last=1`` it is the
    only step the root has)."""
    gates = str(tmp_path / "gates")
    os.makedirs(gates)
    stale = warm_python.popen([sys.executable, "-c", _SLOW_STALE, root, gates], text=True,
                              env=dict(os.environ, NEBULA_SHM_DIR=shm_dir), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    try:
        _await(os.path.join(gates, "shard-written"), stale)
        with nc.Checkpointer(root, memory_tier=False, keep_last=1) as newer:
            assert newer.load_latest(into={"w": torch.zeros(64)}) == 3
            newer.save(4, {"w": torch.full((64,), 4.0)})
        open(os.path.join(gates, "newer-saved"), "w").close()
        out, err = stale.communicate(timeout=120)
        assert out.strip() == "fenced", err[-3000:]
    finally:
        stale.kill()
        stale.wait()
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as again:
        state = {"w": torch.zeros(64)}
        assert again.load_latest(into=state) == 4, again.last_restore
        assert torch.equal(state["w"], torch.full((64,), 4.0))
