"""The metadata scale simulation runs end to end on a small size (its figures are for the report)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import scale_sim


def test_scale_simulation_reports_every_cost_and_its_growth(tmp_path: Path) -> None:
    assert scale_sim.main(["--ranks", "4,8", "--tensors", "16", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    for kind in ("fsdp", "ddp"):
        samples = doc["kinds"][kind]["samples"]
        assert [s["ranks"] for s in samples] == [4, 8]
        names = set(samples[0]["values"])
        assert {"rank 0: build manifest (s)", "rank: restore plan: manifest + its records (s)",
                "dcp rank 0: create_global_plan (s)", "rank 0 writes (B)", "rank reads at restore (B)",
                "whole metadata path: every step above (s)"} <= names, names
        if kind == "fsdp":
            assert "rank reads to reshard (B)" in names
        # what a rank sends in the durable round does not grow with its tensors, nor with the ranks
        assert samples[1]["values"]["rank: sends in durable round (B)"] < 1000
        # what rank 0 receives in the digest round is one fixed-size payload per rank: exactly linear
        assert abs(doc["kinds"][kind]["fits"]["rank 0 receives: digest round (B)"]["k"] - 1.0) < 0.05
    assert "| rank: restore plan: manifest + its records (s) |" in (tmp_path / "results.md").read_text()
