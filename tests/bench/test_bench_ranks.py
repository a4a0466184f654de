"""Smoke test of the benchmark's multi-rank cases: ``nebula-ckpt bench --quick --ranks 2``.

Runs the real thing (spawned gloo ranks, DDP + AdamW) with the smallest model and the fewest
reps, in a subprocess, and checks the report's structure: one row per system at 2 ranks plus the
single-process reference, positive numbers, the protocol timing, the targets. Never timings'
values: the machine is shared and noisy.
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
SYSTEMS = ["nebula", "dcp_save", "dcp_async_save"]
# the benchmark's ranks forked warm, as the test's own processes are
WARM = {"NEBULA_BENCH_WARM_PYTHON": warm_python.__file__}


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


@pytest.mark.timeout(180)
def test_quick_two_ranks_report(tmp_path: Path) -> None:
    out = tmp_path / "out"
    shm = tmp_path / "shm"
    shm.mkdir()
    env = {**os.environ, "NEBULA_SHM_DIR": str(shm), **WARM}  # keep the memory tier out of /dev/shm
    cmd = [sys.executable, "-m", "benchmarks.run", "--quick", "--quiet", "--ranks", "2", "--ranks-only",
           "--ranks-model", "micro", "--reps", "1", "--interval", "2", "--steps", "2", "--out", str(out),
           "--target", str(tmp_path / "target"), "--no-plot"]
    proc = warm_python.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-4000:]

    results = json.loads((out / "results.json").read_text())
    sec = results["ranks"]
    assert sec["ranks"] == [2] and sec["protocol_ranks"] == [2] and sec["model"] == "micro"
    assert not results["workloads"]  # --ranks-only

    single = sec["single"]
    assert single["status"] == "ok", single.get("reason")
    rows = {r["system"]: r for r in sec["rows"]}
    assert sorted(rows) == sorted(SYSTEMS)
    assert all(r["world"] == 2 for r in rows.values())
    for name, r in [*rows.items(), ("single", single)]:
        if name == "nebula" and r["status"] != "ok":
            # the row says why; the rest of the report must still be there
            assert r["reason"], r
            continue
        assert r["status"] == "ok", f"{name}: {r.get('reason')}"
        for key in ("blocking_s", "call_s", "commit_s", "commit_idle_s"):
            assert _positive(r[key]["median"]) and _positive(r[key]["p95"]), (name, key, r[key])
        assert isinstance(r["overhead"], Number), name
        per = r["bytes_per_rank"]
        assert len(per) == r["ranks"] and all(_positive(b) for b in per), (name, per)
        assert r["ckpt_bytes"] == sum(per) and _positive(r["state_bytes"])

    # replicated state is written once in all, not once per rank (nebula: this micro model's
    # replicas are mostly under 64 KiB, so rank 0 writes most of them; DCP spreads them)
    r = rows["nebula"]
    if r["status"] == "ok":
        assert sum(r["bytes_per_rank"]) < 1.1 * r["state_bytes"], (r["bytes_per_rank"], r["state_bytes"])
    r = rows["dcp_save"]
    if r["status"] == "ok":
        assert max(r["bytes_per_rank"]) < r["state_bytes"], (r["bytes_per_rank"], r["state_bytes"])

    (prot,) = sec["protocol"]
    assert prot["world"] == 2
    if prot["status"] == "ok":
        assert prot["saves"] >= 1
        for key in ("protocol_s", "protocol_ack_s", "commit_s"):
            assert _positive(prot[key]["median"]), (key, prot[key])
    else:
        assert prot["reason"]

    ids = [t["id"] for t in results["targets"]]
    assert {"ranks_blocking", "ranks_persist", "ranks_vs_dcp_async"} <= set(ids)
    assert all(t["met"] in (True, False, None) for t in results["targets"])

    md = (out / "results.md").read_text()
    assert "## Multi-rank" in md and "commit protocol time" in md and "## Targets" in md
    for name in SYSTEMS:
        assert f"| 2 | {name} |" in md
    assert "| 1 (one process) | nebula |" in md
