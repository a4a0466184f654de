"""``LoopState`` in a multi-rank job (2 real ranks, gloo on loopback): each rank saves its own
random streams and position in its own share of the data, and each gets its own back: the
restored ranks see the batches and draw the numbers they did after the save, rank by rank."""

from __future__ import annotations

import json
from pathlib import Path

from dist.launch import run_ranks


def test_each_rank_resumes_its_own_streams_and_data(tmp_path: Path, shm_dir: str) -> None:
    done = run_ranks(2, "loop_worker.py", [str(tmp_path / "ck"), str(tmp_path)], tmp_path, shm_dir)
    assert all(p.returncode == 0 for p in done), [p.stdout[-3000:] for p in done]
    got = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(2)]
    for r in got:
        first, second = r["first"], r["second"]
        assert second["restored"] == 5 and second["position"] == [1, 1, 5], second
        assert [s[0] for s in first["seen"]] == [6, 7, 8]
        assert second["seen"] == first["seen"], f"rank {r['rank']} resumed elsewhere than where it was"
    assert got[0]["first"]["seen"] != got[1]["first"]["seen"]  # two shares of the data, two sets of streams
