"""The metadata scale simulation runs end to end on a small size (its figures are for the report)."""

from __future__ import annotations

import gc
import json
from pathlib import Path

from benchmarks import scale_sim


def test_scale_simulation_reports_every_cost_and_its_growth(tmp_path: Path) -> None:
    # the simulation collects garbage before each timed step: frozen, the test process's own objects
    # (torch, pytest) are not walked again each time
    gc.freeze()
    try:
        assert scale_sim.main(["--ranks", "4,8", "--tensors", "16", "--out", str(tmp_path)]) == 0
    finally:
        gc.unfreeze()
    doc = json.loads((tmp_path / "results.json").read_text())
    for kind in ("fsdp", "ddp", "ddp-spread"):
        samples = doc["kinds"][kind]["samples"]
        assert [s["ranks"] for s in samples] == [4, 8]
        names = set(samples[0]["values"])
        assert {"rank 0: build manifest + ranks.json (s)", "rank: restore plan: manifest + its records (s)",
                "rank 0 writes: manifest.json (B)", "rank 0 writes: ranks.json (B)", "rank reads at restore (B)",
                "rank reads at restore: records files (n)", "busiest rank writes: its shard (B)",
                "whole metadata path: every step above (s)"} <= names, names
        assert ("dcp rank 0: create_global_plan (s)" in names) == (kind != "ddp-spread")
        if kind == "fsdp":
            assert "rank reads to reshard (B)" in names
        # what a rank sends in the durable round does not grow with its tensors, nor with the ranks
        assert samples[1]["values"]["rank: sends in durable round (B)"] < 1000
        # what rank 0 receives in the digest round is one fixed-size payload per rank: exactly linear
        assert abs(doc["kinds"][kind]["fits"]["rank 0 receives: digest round (B)"]["k"] - 1.0) < 0.05
    # the manifest a restoring rank reads does not grow with the ranks (ranks.json does, and it is not read)
    for kind in ("fsdp", "ddp"):
        values = [s["values"] for s in doc["kinds"][kind]["samples"]]
        assert values[1]["rank 0 writes: manifest.json (B)"] <= values[0]["rank 0 writes: manifest.json (B)"] + 16
        assert values[1]["rank 0 writes: ranks.json (B)"] > 1.5 * values[0]["rank 0 writes: ranks.json (B)"]
    assert "| rank: restore plan: manifest + its records (s) |" in (tmp_path / "results.md").read_text()
