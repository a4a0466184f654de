"""``LoopState`` in a multi-rank job (2 real ranks, gloo on loopback): each rank saves its own
random streams and position in its own share of the data, and each gets its own back: the
restored ranks see the batches and draw the numbers they did after the save, rank by rank. Restored
by one process (another world size: resharded, the lowest rank's streams and position), the loop
resumes as rank 0 did."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

import nebula_ckpt as nc
from dist.launch import run_ranks
from dist.loop_worker import SAVE_AT, Draws


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
    # one process: the 2 ranks' checkpoint is resharded; a fresh LoopState (no epoch started yet:
    # `epoch_start` None where the checkpoint holds streams) takes rank 0's streams and position
    assert _resumed_alone(tmp_path / "ck") == got[0]["first"]["seen"]


def _resumed_alone(root: Path) -> list[Any]:
    """What rank 0's second loop of loop_worker.py sees, run in this process (no process group)."""
    torch.manual_seed(100)
    np.random.seed(100)
    random.seed(100)
    ds = Draws()
    sampler = torch.utils.data.DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True, seed=7)
    loop = nc.LoopState(torch.utils.data.DataLoader(ds, batch_size=2, sampler=sampler))
    with nc.Checkpointer(str(root), memory_tier=False, read_only=True) as ck:
        assert ck.load_latest(into={"loop": loop}) == SAVE_AT
    assert [loop.epoch, loop.batch, loop.step] == [1, 1, SAVE_AT]
    seen: list[Any] = []
    for _ in loop.epochs(2):
        for batch in loop:
            seen.append([loop.step, batch.tolist(), float(torch.rand(())), float(np.random.normal()),
                         random.random()])
    return seen
