"""Smoke test of the benchmark suite: ``python -m benchmarks.run --quick`` end to end.

Checks the outputs and their shape, never timings (this machine is shared and noisy). Runs in
a subprocess so the benchmark's logging setup and threads stay out of the test process; the
workload is shrunk further than ``--quick`` so it finishes in well under a minute.
"""

from __future__ import annotations

import json
import os
import sys
from numbers import Number
from pathlib import Path

import pytest

import warm_python

REPO = Path(__file__).resolve().parents[2]
SYSTEMS = ["torch_save", "torch_save_thread", "nebula", "nebula_local"]
NUMERIC = ["persist_gbps", "restore_after_save_s", "restore_warm_s", "restore_cold_s", "peak_rss_bytes",
           "ckpt_bytes"]
SUMMARIES = ["blocking_s", "call_s", "stall_s", "durable_s"]


@pytest.mark.slow
def test_quick_run_writes_reports(tmp_path: Path) -> None:
    out = tmp_path / "out"
    shm = tmp_path / "shm"
    shm.mkdir()
    # keep the memory tier out of /dev/shm; one compute thread: on 2 shared cores a second one spins in
    # OpenMP barriers and triples the CPU time the training steps cost
    env = {**os.environ, "NEBULA_SHM_DIR": str(shm), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "benchmarks.run", "--quick", "--quiet", "--out", str(out),
           "--target", str(tmp_path / "target"), "--systems", ",".join(SYSTEMS),
           "--reps", "1", "--interval", "2", "--steps", "2", "--flat-saves", "12", "--restore-reps", "1"]
    proc = warm_python.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]

    for name in ("results.json", "results.md", "results.png", "machine.json"):
        assert (out / name).is_file(), f"{name} missing; stderr: {proc.stderr[-2000:]}"
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    results = json.loads((out / "results.json").read_text())
    (workload,) = results["workloads"]
    assert workload["name"] == "tiny" and workload["status"] == "ok"
    floor = workload["snapshot_floor"]  # the bare-copy reference measured in the same run
    assert isinstance(floor["overhead"], Number) and len(floor["rounds"]) >= 1, floor
    ran = {s["name"]: s for s in workload["systems"]}
    assert sorted(ran) == sorted(SYSTEMS)
    for name, s in ran.items():
        assert s["status"] == "ok", f"{name}: {s.get('reason')}"
        for key in NUMERIC:
            assert isinstance(s[key], Number), f"{name}.{key} = {s[key]!r}"
        for key in SUMMARIES:
            assert isinstance(s[key]["median"], Number) and isinstance(s[key]["p95"], Number), (name, key)
        assert isinstance(s["throughput"]["overhead"], Number), name
        assert s["restore_ok"] is True, f"{name}: restored state differs from the saved one"

    ids = {t["id"] for t in results["targets"]}
    assert {"blocking", "persist_bw", "throughput", "restore", "staging", "flat"} <= ids
    assert all(t["met"] in (True, False, None) for t in results["targets"])

    md = (out / "results.md").read_text()
    assert "## Targets" in md
    for name in SYSTEMS:
        assert f"| {name} |" in md
    machine = json.loads((out / "machine.json").read_text())
    assert machine["torch"] and machine["target_fs"] and machine["logical_cores"]
    assert not (shm / f"nebula_ckpt-{os.getuid()}").exists() or not any(
        (shm / f"nebula_ckpt-{os.getuid()}").iterdir()), "memory tier left behind after close()"
