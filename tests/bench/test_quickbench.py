"""``nebula-ckpt bench`` for an installed package (:mod:`nebula_ckpt.quickbench`): real saves of a
real state on the local disk and the (redirected) memory tier; nothing left behind."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

import warm_python
from nebula_ckpt import quickbench

REPO = Path(__file__).resolve().parents[2]


def _positive(x: object) -> bool:
    return isinstance(x, float) and x > 0


def _left(*folders: str) -> list[str]:
    return [os.path.join(d, n) for f in folders for d, dirs, files in os.walk(f) for n in dirs + files]


def test_a_synthetic_state_is_measured_and_nothing_is_left(tmp_path: Path, shm_dir: str) -> None:
    res = quickbench.run(quickbench.Options(size_gb=0.01, saves=3, torch_reps=1, root=str(tmp_path)))
    assert 0.0099e9 <= res["state_bytes"] <= 0.0101e9 and res["tensors"] == 1
    neb = res["nebula"]
    assert [t.split(":")[0] for t in neb["tiers"]] == ["memory", "local"]
    assert len(neb["blocking_s"]) == len(neb["durable_s"]) == 3
    assert all(_positive(x) for x in neb["blocking_s"] + neb["durable_s"])
    assert all(d >= b for b, d in zip(neb["blocking_s"], neb["durable_s"], strict=True))
    assert neb["first_blocking_s"] == neb["blocking_s"][0]
    assert neb["later_blocking_s"] == sorted(neb["blocking_s"][1:])[0] + (sorted(neb["blocking_s"][1:])[1]
                                                                          - sorted(neb["blocking_s"][1:])[0]) / 2
    assert _positive(res["torch_save"]["durable_s"])
    assert res["ratios"]["durable_vs_torch_save"] == neb["later_durable_s"] / res["torch_save"]["durable_s"]
    assert _left(str(tmp_path), shm_dir) == []  # the checkpoints, the torch.save file, the memory tier
    assert _positive(neb["restore_s"]["fastest_tier"]) and _positive(neb["restore_s"]["disk"])
    assert neb["restored_from"].startswith("memory:") and _positive(res["torch_save"]["load_s"])
    lo, hi = neb["later_blocking_spread_s"]
    assert lo == min(neb["blocking_s"][1:]) and hi == max(neb["blocking_s"][1:])
    assert res["peak_rss_bytes"] > res["state_bytes"] and neb["shm"]["tier_bytes"] >= res["state_bytes"]
    table = quickbench.render(res)
    for row in ("save_async blocking, first save", "save_async blocking, later saves",
                "time to durable, later saves", "torch.save + fsync", "restore: load_latest from the memory tier",
                "restore: load_latest from disk", "torch.load + copy into the state", "host memory for the saves",
                f"{shm_dir}: the memory tier held"):
        assert row in table, table
    rows = {ln[:44].strip(): ln[44:].split() for ln in table.splitlines()[2:9]}
    assert rows["save_async blocking, later saves"][1] == f"{lo:.3f}-{hi:.3f}"  # the spread beside the median


@pytest.mark.parametrize("load, busy", [(0.0, False), (64.0, True)])
def test_a_busy_machine_is_said(load: float, busy: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The load average at the start (at least half the cores busy) makes the report say the times
    include waiting for a CPU."""
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    m = quickbench.machine_load()
    assert m == {"load_1min": load, "cores": 8, "busy": busy}
    res = {"nebula": {"tiers": ["memory:/x", "local:/y"], "first_blocking_s": 0.1, "later_blocking_s": 0.1,
                      "later_blocking_spread_s": [0.1, 0.1], "later_durable_s": 0.2, "later_durable_spread_s": None,
                      "restore_s": {"fastest_tier": 0.1, "disk": 0.2},
                      "restore_spread_s": {"fastest_tier": None, "disk": None}, "restored_from": "memory:/x",
                      "staging_bytes": 0, "slot_bytes": 0, "shm": None},
           "torch_save": {"durable_s": 1.0, "spread_s": None, "load_s": 1.0, "load_spread_s": None},
           "state_bytes": 1, "tensors": 1, "source": "synthetic", "peak_rss_bytes": 1, "machine": m}
    said = quickbench.render(res)
    assert ("machine was busy (load average 64.0 on 8 cores" in said) == busy, said


def test_a_state_file_is_loaded_weights_only_and_saved_whole(tmp_path: Path, shm_dir: str) -> None:
    f = tmp_path / "sd.pt"
    torch.save({"model": {"w": torch.randn(256, 256), "b": torch.zeros(256)}, "optim": {"m": torch.ones(1000)},
                "step": 7}, f)
    work = tmp_path / "work"
    work.mkdir()
    res = quickbench.run(quickbench.Options(state=str(f), saves=2, torch_reps=1, root=str(work), keep=True))
    assert res["tensors"] == 3 and res["state_bytes"] == (256 * 256 + 256 + 1000) * 4
    assert res["source"] == f"file: {f}"
    kept = Path(res["folder"])
    assert kept.parent == work and (kept / "nebula").is_dir()  # --keep: the local tier's checkpoints stay


def test_a_file_that_needs_pickle_is_refused_before_anything_is_written(tmp_path: Path, shm_dir: str) -> None:
    f = tmp_path / "obj.pt"
    torch.save({"w": torch.ones(4), "cfg": quickbench.Options()}, f)  # an object weights_only refuses
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(quickbench.ValidationError, match="weights_only=True") as e:
        quickbench.run(quickbench.Options(state=str(f), root=str(work)))
    assert str(f) in str(e.value)
    assert _left(str(work), shm_dir) == []


@pytest.mark.parametrize("argv, message", [
    (["--size-gb", "0"], "--size-gb must be > 0"),
    (["--state", "/nonexistent/x.pt"], "no such file"),
    (["--size-gb", "0.001", "--saves", "1"], "--saves must be >= 2"),
])
def test_bad_options_exit_2_with_the_reason(argv: list[str], message: str, tmp_path: Path, shm_dir: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert quickbench.main([*argv, "--root", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert _left(str(tmp_path), shm_dir) == []


def test_the_command_prints_json_and_no_progress_without_a_terminal(tmp_path: Path, shm_dir: str) -> None:
    env = {**os.environ, "NEBULA_SHM_DIR": shm_dir, "PYTHONPATH": str(REPO)}
    proc = warm_python.run([sys.executable, "-m", "nebula_ckpt.quickbench", "--size-gb", "0.005", "--saves", "2",
                           "--torch-reps", "1", "--root", str(tmp_path), "--json"],
                           env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert res["options"]["saves"] == 2 and len(res["nebula"]["blocking_s"]) == 2
    assert "nebula save" not in proc.stderr  # progress lines only on a terminal
    assert _left(str(tmp_path), shm_dir) == []
