"""Staging memory is bounded and reused: 100 saves of the same state allocate once, RSS stays flat."""

from __future__ import annotations

import gc

import psutil
import pytest
import torch

import nebula_ckpt as nc


@pytest.mark.slow
def test_100_saves_no_host_memory_growth(tmp_path, shm_dir, ops_path: str) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])  # ~8.4 MB
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    state_bytes = sum(p.numel() * 4 for p in model.parameters()) * 2
    proc = psutil.Process()
    with nc.Checkpointer(str(tmp_path / "ck"), keep_last=2) as ck:
        rss = []
        for step in range(100):
            ck.save_async(step, {"model": model, "optim": opt, "step": step})
            model(torch.randn(2, 512)).sum().backward()
            opt.step()
            opt.zero_grad()
            if step in (19, 99):
                ck.wait()
                gc.collect()
                rss.append(proc.memory_info().rss)
                slots = ck.stats()
                # staging: at most two slots (one filling, one a slower tier still reads), each the
                # shard image; the memory tier's own checkpoint (keep_last=2) is apart from it
                assert slots["staging_bytes"] <= 2 * (state_bytes * 1.1 + (2 << 20)), slots
                assert slots["memory_tier_slot_bytes"] <= 2 * (state_bytes * 1.1 + (2 << 20)), slots
        per_tier = ck.list(detailed=True)
        # newest always committed; retention bounds what stays (a busy disk tier may drop saves)
        assert all(steps[-1] == 99 and len(steps) <= 2 for steps in per_tier.values()), per_tier
    growth = rss[1] - rss[0]
    assert growth < state_bytes // 2, f"RSS grew by {growth / 2**20:.1f} MiB over 80 saves"


def test_on_full_skip_drops_save_instead_of_growing(tmp_path) -> None:  # noqa: ANN001
    from faults import FaultyTier

    root = str(tmp_path / "ck")
    tier = FaultyTier(root, pause_at="commit")
    ck = nc.Checkpointer(root, tiers=[tier], on_full="skip")
    w = torch.ones(1000)
    h1 = ck.save_async(1, {"w": w})
    assert tier.reached.wait(30)
    h2 = ck.save_async(2, {"w": w})      # the only staging slot is still being persisted
    assert h2.skipped is not None and "staging" in h2.skipped
    assert h2.result() == []
    tier.gate.set()
    h1.result()
    assert ck.stats()["staging_allocations"] == 1
    ck.close()
    assert ck.list() == [1]
