"""What a save costs is reported where users look: the handle, ``stats()`` and one INFO line."""

from __future__ import annotations

import logging

import pytest
import torch

import nebula_ckpt as nc


def _state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    return {"model": model, "optim": opt, "step": 0}


def test_each_save_reports_blocking_snapshot_and_durable_per_tier(tmp_path, caplog) -> None:  # noqa: ANN001
    state = _state()
    caplog.set_level(logging.INFO, logger="nebula_ckpt")
    with nc.Checkpointer(str(tmp_path / "root"), tiers=[nc.MemoryTier(), nc.LocalTier(str(tmp_path / "disk"))]) as ck:
        handles = []
        for s in (1, 2, 3):  # each waited for: a busy tier would drop a save (tested elsewhere)
            handles.append(ck.save_async(s, state))
            handles[-1].result()
        tiers = ck.stats()["tiers"]
        for h in handles:
            m = h.metrics
            assert m.step == h.step and m.bytes > 256 * 256 * 4 * 3  # weights + two AdamW moments + header
            assert m.blocked_s is not None and m.blocked_s > 0
            assert m.snapshot_s is not None and 0 < m.snapshot_s <= m.blocked_s  # CPU default: sync copy
            assert set(m.durable_s) == set(tiers) == set(h.tiers_written)
            assert all(t >= m.snapshot_s for t in m.durable_s.values())
            assert all(m.throughput(t) == pytest.approx(m.bytes / m.durable_s[t]) for t in tiers)
            d = m.to_dict()
            assert d["step"] == h.step and set(d["throughput_bytes_per_s"]) == set(tiers)
        st = ck.stats()
        assert st["saves_finished"] == 3 and st["bytes_saved"] == sum(h.metrics.bytes for h in handles)
        assert st["blocked_s_total"] == pytest.approx(sum(h.metrics.blocked_s for h in handles))
        assert st["blocked_s_max"] == max(h.metrics.blocked_s for h in handles)
        assert st["last_save"]["step"] in (1, 2, 3) and set(st["durable_s_last"]) == set(tiers)
    lines = [r.getMessage() for r in caplog.records if "blocked" in r.getMessage()]
    assert len(lines) == 3, lines  # one INFO line per save
    for step, line in zip((1, 2, 3), sorted(lines), strict=True):
        assert line.startswith(f"nebula_ckpt: step {step}: ") and all(f"durable on {t}" in line for t in tiers)


def test_an_overlapped_save_counts_the_wait_of_the_next_step(tmp_path) -> None:  # noqa: ANN001
    state = _state()
    with nc.Checkpointer(str(tmp_path / "root"), memory_tier=False, snapshot="async") as ck:
        h = ck.save_async(1, state)
        call = h.metrics.blocked_s
        assert call is not None
        state["optim"].step()  # the step pre-hook waits for the copy: that wait is training time lost
        h.result()
        assert h.metrics.blocked_s is not None and h.metrics.blocked_s >= call
        assert h._stalled >= 0 and h.metrics.blocked_s == pytest.approx(call + h._stalled)


def test_a_skipped_save_reports_no_tier(tmp_path) -> None:  # noqa: ANN001
    with nc.Checkpointer(str(tmp_path / "root"), memory_tier=False,
                         tiers=[nc.LocalTier(str(tmp_path / "disk"), every=2)]) as ck:
        ck.save(0, {"x": torch.ones(3)})
        h = ck.save_async(1, {"x": torch.ones(3)})
        assert h.skipped and h.metrics.durable_s == {} and h.metrics.blocked_s is not None
        assert h.metrics.bytes == 0 and h.metrics.to_dict()["bytes"] == 0  # no snapshot was taken
        assert ck.stats()["saves_finished"] == 1
