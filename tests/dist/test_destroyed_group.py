"""A job that destroys its process group before closing its Checkpointer: the save cut short says
so, naming the fix, and every save committed before stays (gloo ranks on 127.0.0.1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nebula_ckpt.format.names import COMMIT, step_dir

from .launch import reports, run_ok

pytestmark = [pytest.mark.timeout(240)]


def test_destroying_the_group_before_close_names_the_fix(root: str, shm_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    run_ok(2, "destroyed_worker.py", [root, str(out)], out, shm_dir)
    for r, got in enumerate(reports(out, "destroyed", 2)):
        # the save in flight fails on the shared root, and the message says why and what to do
        for what in (got["step3"], got["close"]):
            assert "destroy_process_group()" in what and "Close the Checkpointer first" in what, (r, what)
            assert "died" not in what, (r, what)  # no rank died: the message must not send anyone looking
        assert got["listed"] == [1, 2], (r, got["listed"])
    assert Path(root, step_dir(1), COMMIT).exists() and Path(root, step_dir(2), COMMIT).exists()
    assert not Path(root, step_dir(3), COMMIT).exists()
