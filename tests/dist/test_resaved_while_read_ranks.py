"""A step saved again while the ranks of a job read it: every rank restores one write of it.

Two real ranks (gloo on 127.0.0.1) restore the newest step of a shared root; rank 0 has opened
step 2 when rank 1, about to open it too, finds a later write of step 2 in its place (a job saved
it again: same writer generation, a new save). Rank 1 opens the new write's files, so it must not
restore them as the write the ranks agreed on (rank 0 holds the old one): the ranks agree again,
and both restore the new write, never a mix of the two nor an older step.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .launch import reports, run_ok

pytestmark = [pytest.mark.timeout(300)]


def test_the_ranks_agree_again_on_the_new_write_of_a_step_saved_again_while_read(root: str, shm_dir: str,
                                                                                 tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    new = str(tmp_path / "new")
    run_ok(2, "resaved_worker.py", ["write", root, "1:1,2:2"], out, shm_dir)
    run_ok(2, "resaved_worker.py", ["write", new, "1:1,2:2,2:22"], out, shm_dir)  # step 2's second write
    run_ok(2, "resaved_worker.py", ["read", root, new, str(out)], out, shm_dir)
    assert (out / "old-step-2").exists()  # the hook did replace the step while the ranks read it
    got = reports(out, "read", 2)
    assert [(r["step"], r["train"]) for r in got] == [(2, [22.0] * 8)] * 2, got
