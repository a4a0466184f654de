"""A memory tier on a real tmpfs that fills up (``mount -t tmpfs -o size=8m``, skipped where
mounting is not permitted): a save that does not fit fails on that tier only, cleanly, with a
message saying where, how much and what to do; every step saved before stays restorable
bit-exact, the disk tier still gets the save, nothing partial is visible, and a later save that
fits is on the memory tier again. Fault injection at named stages (faults.py, flaky_fs.py) stays
beside this: here the file system is really full.
"""

from __future__ import annotations

import errno
import json
import os
from typing import Any, Callable

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt import knobs
from nebula_ckpt.cli import main
from nebula_ckpt.errors import PersistError

MiB = 1 << 20
_FROZEN = torch.randn(MiB // 4, generator=torch.Generator().manual_seed(7))  # 1 MiB that never changes


def _state(step: int, mib: float) -> dict[str, Any]:
    """A state of about ``mib`` MiB of trained bytes (new every step) beside the frozen MiB."""
    g = torch.Generator().manual_seed(step)
    return {"frozen": _FROZEN.clone(), "w": torch.randn(int(mib * MiB) // 4, generator=g), "step": step}


def _tier_files(folder: str) -> dict[str, list[str]]:
    """Every entry of the memory tier's folder (step folders with their files)."""
    out: dict[str, list[str]] = {}
    for name in sorted(os.listdir(folder)):
        p = os.path.join(folder, name)
        out[name] = sorted(os.listdir(p)) if os.path.isdir(p) and name.startswith("step-") else []
    return out


@pytest.mark.parametrize("incremental", [True, False])
def test_a_save_the_full_tmpfs_cannot_hold_fails_there_only(
        tmp_path, small_tmpfs: Callable[[str], str], incremental: bool,  # noqa: ANN001
        capsys: pytest.CaptureFixture[str]) -> None:
    shm = small_tmpfs("8m")
    root = str(tmp_path / "ckpt")
    sizes = {1: 0.5, 2: 1.5, 3: 2.5, 4: 7.0, 5: 0.5}  # step 4 cannot fit beside step 3 (nor alone)
    saved: dict[int, dict[str, Any]] = {}
    written: dict[int, list[str]] = {}
    failed: dict[int, PersistError] = {}
    with knobs.override(shm_dir=shm):
        tiers = [nc.MemoryTier(), nc.LocalTier(root, keep_last=10)]
        with nc.Checkpointer(root, tiers=tiers, incremental=incremental) as ck:
            mem = ck.tiers[0]
            folder = mem.path
            assert folder is not None and folder.startswith(shm)
            for step, mib in sizes.items():
                saved[step] = _state(step, mib)
                h = ck.save_async(step, saved[step])
                try:
                    written[step] = h.result()
                except PersistError as e:
                    failed[step] = e
                    written[step] = list(h.tiers_written)
                if step == 4:  # the step the memory tier held before stays there, whole, and restores
                    assert "step-3" in _tier_files(folder)
                    into = _state(0, sizes[3])
                    assert ck.load(3, into=into) == 3 and ck.last_restore["tier"] == mem.name
                    assert torch.equal(into["w"], saved[3]["w"]) and torch.equal(into["frozen"], _FROZEN)
                # never anything partial in the memory tier: only committed, whole steps
                files = _tier_files(folder)
                for name, inside in files.items():
                    assert not name.startswith(".") or name == ".slots", files
                    if name.startswith("step-"):
                        assert "COMMIT" in inside and "manifest.json" in inside, files
                        assert all(f in ("COMMIT", "manifest.json") or f.endswith(".safetensors")
                                   for f in inside), files
            assert sorted(failed) == [4], {s: str(e) for s, e in failed.items()}
            mem_name = mem.name
            for step in (1, 2, 3, 5):
                assert sorted(written[step]) == sorted([mem_name, ck.tiers[1].name]), (step, written[step])
            assert written[4] == [ck.tiers[1].name]  # the disk tier still got it
            err = failed[4]
            assert list(err.failures) == [mem_name]
            cause = err.failures[mem_name]
            assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC, repr(cause)
            msg = str(err)
            assert mem_name in msg and "step-4" in msg and "No space left" in msg, msg
            assert "needs" in msg and "free" in msg and "NEBULA_SHM_DIR" in msg, msg
            assert "step-4" not in _tier_files(folder)
            assert "step-5" in _tier_files(folder)  # a save that fits is on the memory tier again
            # every step restores bit-exact (the memory tier holds step 5, the disk tier all)
            for step, want in saved.items():
                into = _state(0, sizes[step])
                into["step"] = -1
                assert ck.load(step, into=into) == step
                assert ck.last_restore["tier"] == (mem_name if step == 5 else ck.tiers[1].name)
                for k in ("frozen", "w"):
                    assert torch.equal(into[k], want[k]), (step, k)
                assert into["step"] == step
            capsys.readouterr()
            assert main(["verify", root, "--json"]) == 0  # while the memory tier holds step 5
            rows = json.loads(capsys.readouterr().out)
            assert all(r["healthy"] for r in rows), rows
            assert {(r["tier"], r["step"]) for r in rows} >= {(mem_name, 5), (ck.tiers[1].name, 4)}, rows
    capsys.readouterr()
    assert main(["gc", "--shm-dir", shm, "--json"]) == 0
    decisions = json.loads(capsys.readouterr().out)
    assert all(d.get("problem") is None for d in decisions), decisions
