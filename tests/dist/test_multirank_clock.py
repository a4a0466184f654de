"""A wall clock that steps back in a multi-rank job (2 gloo ranks on 127.0.0.1): a shared tier's
``every_seconds`` windows keep taking saves, alike on every rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from nebula_ckpt.format.names import COMMIT

from .launch import reports, run_ok

pytestmark = [pytest.mark.timeout(240)]


def test_a_shared_tiers_every_seconds_keeps_saving_after_the_wall_clock_steps_back(
        root: str, shm_dir: str, tmp_path: Path) -> None:
    """The window number fell below the last one taken when the clock stepped back an hour, and
    the tier took no save until the clock caught up (steps 0 and 1 only, silently). Any other
    window, earlier ones included, is due: the ranks take the same saves, one per window."""
    out = tmp_path / "out"
    out.mkdir()
    run_ok(2, "clock_worker.py", [root, str(out)], out, shm_dir)
    got = reports(out, "clock", 2)
    committed = sorted(int(d.name[5:]) for d in Path(root).glob("step-*") if (d / COMMIT).exists())
    assert got[0]["written"] == got[1]["written"] == got[0]["listed"] == committed, (got, committed)
    after = [s for s in committed if s >= 2]
    assert len(after) >= 5, (got, committed)  # 6 saves after the step back, each in a window of its own
