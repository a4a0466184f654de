"""The restore's agreement on a step: a step agreed on already (the replicas' recover round)
is opened without exchanging candidates, and one that fails to open falls back to the exchange."""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Optional, Sequence

import torch

import nebula_ckpt as nc
from nebula_ckpt.ranks.coordinator import LocalCoordinator
from nebula_ckpt.restore.select import list_candidates, open_agreed


class CountingCoordinator(LocalCoordinator):
    """One process's coordinator that records every exchange of candidates."""

    def __init__(self) -> None:
        self.asked: list[list[tuple[int, int, int]]] = []

    def agree_step(self, candidates: Sequence[tuple[int, int, int]]) -> Optional[tuple[int, int, int]]:
        self.asked.append(list(candidates))
        return super().agree_step(candidates)


def _root(tmp_path: Path) -> tuple[nc.Checkpointer, list]:
    ck = nc.Checkpointer(str(tmp_path / "root"), tiers=[nc.LocalTier(str(tmp_path / "root"))])
    for s in (1, 2):
        ck.save(s, {"w": torch.full((1024,), float(s))})
    return ck, ck._restores.tier_pairs()


def test_an_agreed_step_is_opened_without_an_exchange(tmp_path: Path) -> None:
    ck, pairs = _root(tmp_path)
    try:
        write = next(c.order for c in list_candidates(pairs) if c.step == 1)
        co = CountingCoordinator()
        got = open_agreed(pairs, co, "root", None, "raise", agreed=write)
        assert got is not None and got.step == 1  # the agreed step, not the newest one
        assert torch.equal(got.view("w"), torch.full((1024,), 1.0))
        assert co.asked == []
        assert open_agreed(pairs, co, "root", None, "raise").step == 2 and len(co.asked) == 1
    finally:
        ck.close()


def test_an_agreed_step_that_fails_to_open_falls_back_to_the_exchange(tmp_path: Path) -> None:
    ck, pairs = _root(tmp_path)
    try:
        write = next(c.order for c in list_candidates(pairs) if c.step == 2)
        shard = glob.glob(str(tmp_path / "root" / "step-2" / "shard-*"))[0]
        os.truncate(shard, os.path.getsize(shard) - 1)  # a torn copy: it cannot be opened
        co = CountingCoordinator()
        got = open_agreed(pairs, co, "root", None, "raise", agreed=write)
        assert got is not None and got.step == 1
        assert co.asked and all(write not in c for c in co.asked)  # the failed step is offered no more
    finally:
        ck.close()
