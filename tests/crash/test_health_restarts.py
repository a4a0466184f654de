"""Health marks under real crashes: a job that goes NaN is restarted (real processes, SIGKILL)
and never loops; records written while the writer is SIGKILLed are whole or absent, never torn,
and never make a restore fail."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from typing import Optional

import pytest
import torch

import nebula_ckpt as nc
import warm_python
from nebula_ckpt.format.health import HEALTH_DIR, parse_record
from nebula_ckpt.health.book import HealthView
from nebula_ckpt.storage.local import LocalStorage
from proc_lines import lines

HERE = os.path.dirname(os.path.abspath(__file__))


def _env(**extra: str) -> dict[str, str]:
    tests, repo = os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))
    path = os.pathsep.join([tests, repo, os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", **extra)


def _spawn(root: str, mode: str, **env: str) -> subprocess.Popen[str]:
    return warm_python.popen([sys.executable, "-u", os.path.join(HERE, "health_worker.py"), root, mode],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(**env))


def _job(root: str, kill_after: Optional[int] = None, **env: str) -> tuple[Optional[int], list[int], dict[int, float],
                                                                             str]:
    """One run of the job: the step it restored, the steps it skipped, its losses, how it ended
    (``"nan"``: it went NaN and died by SIGKILL; ``"killed"``: the test SIGKILLed it once it reported
    step ``kill_after``; ``"finished"``)."""
    proc = _spawn(root, "jobs", **env)
    restored, skipped, losses, end = None, [], {}, "?"
    out = []
    try:
        for line in lines(proc, time.monotonic() + 240):
            out.append(line)
            if line.startswith("RESTORED"):
                _, step, skip = line.split(" ", 2)
                restored, skipped = (None if step == "none" else int(step)), json.loads(skip)
            elif line.startswith("LOSS"):
                _, step, value = line.split()
                losses[int(step)] = float(value)
                if kill_after is not None and int(step) == kill_after:
                    proc.send_signal(signal.SIGKILL)
                    end = "killed"
                    break
            elif line.startswith("NAN"):
                end = "nan"
            elif line.startswith("FINISHED"):
                end = "finished"
    finally:
        if proc.poll() is None and end != "nan":
            proc.kill()
        proc.wait(60)
        assert proc.stdout is not None
        proc.stdout.close()
    if end == "nan":
        assert proc.returncode == -signal.SIGKILL, proc.returncode
    assert end != "?", "\n".join(out[-40:])
    return restored, skipped, losses, end


@pytest.mark.crash
def test_a_job_that_goes_nan_after_step_s_resumes_the_step_before_it_and_never_loops(tmp_path) -> None:  # noqa: ANN001
    root = str(tmp_path / "ckpt")
    # run 1: the state goes bad at step 18 (a bad node); saved at 20 with the fault in it; NaN at 21
    restored, _, first, end = _job(root, HEALTH_FAULT_AT="18")
    assert (restored, end, max(first)) == (None, "nan", 21)
    # restart 1: the newest step (20, never confirmed: the crash came first) gets its one try: NaN again
    restored, skipped, _, end = _job(root)
    assert (restored, skipped, end) == (20, [], "nan")
    # restart 2: 20 is suspect now; the step before it is restored, and trains on, same losses as the first run
    restored, skipped, third, end = _job(root, kill_after=27)
    assert (restored, skipped, end) == (15, [20], "killed")
    assert all(third[s] == first[s] for s in range(16, 21)), (third, first)  # bit-exact: the real step 15
    assert all(v == v and abs(v) != float("inf") for v in third.values())
    # restart 3: the newest step of the run that went on (25) -- never back to the bad 20, no loop
    restored, skipped, fourth, end = _job(root)
    assert (restored, end) == (25, "finished") and 20 not in skipped
    assert min(fourth) == 26 and max(fourth) == 29


def _check_records(root: str, wrote: list[str]) -> None:
    """Every record on disk is whole; every record the writer saw durable is there; the mark is
    the newest record's; a restore does not fail."""
    folder = os.path.join(root, HEALTH_DIR, "step-5")
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    records = {}
    for n in names:
        if n.startswith("."):
            continue  # a temporary file the kill left: not a record by its name
        with open(os.path.join(folder, n), "rb") as f:
            rec = parse_record(f.read(), n, 5)  # raises on a torn record
        assert rec is not None
        records[n] = rec
    assert set(wrote) <= set(records), set(wrote) - set(records)
    mark = HealthView(LocalStorage(root)).mark(1, 5)
    if records:
        newest = max(records.values(), key=lambda r: r.time_ns)
        assert (mark.state, mark.reason) == (newest.state, newest.reason)
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as r:
        got = r.load_latest(into={"w": torch.zeros(4)})
        assert got == (0 if mark.state == "suspect" else 5)
        assert r.last_restore is not None and r.last_restore["skipped"] == ([] if got == 5 else [
            {"step": 5, "generation": 1, "reason": mark.reason}])


@pytest.mark.crash
def test_health_records_survive_sigkill_at_any_point_of_a_write(tmp_path) -> None:  # noqa: ANN001
    root = str(tmp_path / "ckpt")
    with nc.Checkpointer(root, memory_tier=False) as ck:
        for step in (0, 5):
            ck.save(step, {"w": torch.full((4,), float(step))})
    rng = random.Random(20261128)
    wrote: list[str] = []
    proc = warm_python.popen([sys.executable, "-u", os.path.join(HERE, "health_worker.py"), root, "records"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=_env())
    assert proc.stdin is not None
    kills = 0
    try:
        out = lines(proc, time.monotonic() + 240)
        for cycle in range(10):
            staged = cycle % 3 == 2  # every 3rd: killed inside the write, between the fsync'd temp file and its name
            proc.stdin.write("link\n" if staged else "plain\n")
            proc.stdin.flush()
            child = next(int(x.split()[1]) for x in out if x.startswith("CHILD"))
            skip, delay = rng.randint(0, 20), rng.uniform(0, 0.004)
            for line in out:
                if line.startswith("WROTE"):
                    wrote.append(line.split()[2])
                elif line.startswith("WRITING") and not staged and skip > 0:
                    skip -= 1
                elif line.startswith("WRITING") and not staged and skip == 0:
                    time.sleep(delay)
                    os.kill(child, signal.SIGKILL)
                    skip = -1  # killed: the lines still in the pipe are read, nothing more is killed
                elif line == f"REAPED {child}":
                    break
            kills += 1
            _check_records(root, wrote)
    finally:
        proc.stdin.close()
        proc.wait(60)
        assert proc.stdout is not None
        proc.stdout.close()
    assert kills == 10 and len(wrote) >= 4
    leftovers = [n for n in os.listdir(os.path.join(root, HEALTH_DIR, "step-5")) if n.startswith(".")]
    assert leftovers, "no kill landed inside a write (the staged kills always do)"
