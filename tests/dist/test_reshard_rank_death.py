"""A rank that dies or stalls during a resharded ``load_latest`` (a 2-rank checkpoint restored by 3
ranks): the others raise the protocol's :class:`~nebula_ckpt.errors.PersistError` naming their
rank, as at the same world size, never gloo's raw ``RuntimeError``; ``into`` keeps what it held.

Real gloo jobs on 127.0.0.1 (``tests/dist/reshard_death_worker.py``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from .launch import run_ok, run_ranks, shm_folder

TIMEOUT_S = "8"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root holding steps 1 and 2 saved by 2 ranks."""
    tmp = tmp_path_factory.mktemp("reshard-death")
    root = tmp / "root"
    root.mkdir()
    with shm_folder(tmp) as shm:
        run_ok(2, "reshard_death_worker.py", ["save", str(root), str(tmp)], tmp, shm, timeout=120)
    return root


@pytest.mark.parametrize("mode", ["agree", "dcp", "stall"])
def test_a_rank_lost_during_a_resharded_restore_is_a_persist_error_naming_the_rank(
        saved: Path, tmp_path: Path, mode: str) -> None:
    root = tmp_path / "root"
    shutil.copytree(saved, root)
    out = tmp_path / "out"
    out.mkdir()
    with shm_folder(tmp_path) as shm:
        done = run_ranks(3, "reshard_death_worker.py", [mode, str(root), str(out)], out, shm, timeout=120,
                         env_extra={"NEBULA_COMMIT_TIMEOUT_S": TIMEOUT_S})
    for r in (0, 2):
        assert (out / f"{mode}-r{r}.json").exists(), f"rank {r} reported nothing:\n{done[r].stdout[-4000:]}"
    for r in (0, 2):
        got = json.loads((out / f"{mode}-r{r}.json").read_text())
        assert got["kind"] == "PersistError" and got["persist"], got
        assert got["msg"].startswith(f"rank {r}: the ranks did not all meet"), got["msg"]
        assert "resharded restore of" in got["msg"] and "died or stalled" in got["msg"], got["msg"]
        assert got["step"] == -1 and got["w_sum"] == 0.0, got  # nothing of step 2 restored
