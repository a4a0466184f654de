"""Smoke test of the replicas benchmark's training-loop part, both kinds of step.

``python -m benchmarks.replicas --parts loop`` with 2 real gloo ranks, the smallest state and the
fewest iterations, in a subprocess; checks the report's structure (both the CPU-bound and the
host-idle loop, replicas=0 and 1, bytes actually moved by the replicas=1 runs), never timings'
values: the machine is shared and noisy.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import warm_python

REPO = Path(__file__).resolve().parents[2]
# the benchmark's ranks forked warm, as the test's own processes are
WARM = {"NEBULA_BENCH_WARM_PYTHON": warm_python.__file__}


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


@pytest.mark.timeout(300)
def test_loop_both_kinds_of_step(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "benchmarks.replicas", "--parts", "loop", "--loop", "cpu", "host-idle",
           "--worlds", "2", "--mb", "12", "--repeats", "1", "--iters", "4", "--save-every", "2", "--out", str(out)]
    proc = warm_python.run(cmd, cwd=REPO, env={**os.environ, **WARM}, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    res = json.loads((out / "results.json").read_text())
    assert not res["recovery"]  # --parts loop
    for key in ("loop", "loop_host_idle"):
        med = res[key]["2"]["median"]
        for k in ("0", "1"):
            assert _positive(med[k]["loop_s"]) and _positive(med[k]["cpu_s"]), (key, k, med[k])
        assert med["0"]["moved_mb"] == 0 and med["0"]["rounds"] == 0, (key, med["0"])
        # each rank sent its step and received its partner's in each of the 2 save rounds
        assert med["1"]["rounds"] == 2 and _positive(med["1"]["moved_mb"]), (key, med["1"])
        assert isinstance(res[key]["2"]["overhead_pp"], float)
        # where the training thread's time and each kind of thread's CPU went
        for k in ("0", "1"):
            assert all(isinstance(med[k][w], float) for w in ("step_over_s", "save_call_s", "train_runq_s",
                                                               "other_wait_s")), (key, k, med[k])
            assert _positive(med[k]["save_call_s"]) and _positive(med[k]["cpu:training"]), (key, k, med[k])
        assert _positive(med["1"]["cpu:nebula-replicas"]) and "cpu:nebula-replicas" not in med["0"], (key, med)
    assert res["loop"]["2"]["median"]["1"]["compute_s"] == 0  # the CPU-bound step sleeps nothing
    assert _positive(res["loop_host_idle"]["2"]["median"]["1"]["compute_s"])

    md = (out / "results.md").read_text()
    for heading in ("## Training-loop cost (memory tier", "## Training-loop cost, host-idle step",
                    "## Side by side", "not a GPU measurement", "Where the time goes"):
        assert heading in md, heading
    assert "## Recovery" not in md
