"""Two Checkpointers on one root in each rank's process, the second made while the first still
persists (real gloo ranks): the second one's constructor takes the job's writer generation, and
the first one's committed checkpoint must survive it. What DeepSpeed's own tests do when they
build a second engine to load the first one's checkpoint (tests/peers/README.md). The same in one
process, where the second Checkpointer takes the root at its first save:
``tests/tiers/memory/test_two_writers_one_process.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .launch import reports, run_ok

pytestmark = [pytest.mark.timeout(300), pytest.mark.skipif(not os.path.isdir("/dev/shm"),
                                                           reason="needs a tmpfs memory tier")]


def test_a_second_checkpointer_of_each_rank_finds_what_the_first_one_committed(root: str, shm_dir: str,
                                                                              tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    done = run_ok(2, "two_writers_worker.py", [root, str(out)], out, shm_dir, timeout=240)
    for r, rep in enumerate(reports(out, "two", 2)):
        log = done[r].stdout
        assert rep["older_before"] == {"written": [rep["older_before"]["written"][0]], "disk_paused": True}, rep
        assert rep["older_before"]["written"][0].startswith("memory:"), rep  # committed there, disk still writing
        assert rep["older_result"] == "no error", rep  # its persist finished before the hand-over
        assert rep["read_t1"] == "no error" and rep["read_t1_value"] == [1, 10.0 + r], rep
        assert rep["newer_tiers"] == {"memory": [2], "local": [1, 2]}, rep  # the newer one writes the memory tier
        assert rep["older_again"].startswith("FencedError: ") and "newer Checkpointer of this process" in \
            rep["older_again"], rep
        assert rep["restart"] == [1, 2], rep
        assert "another live process" not in log and "took over this checkpoint root" not in log, log[-4000:]
