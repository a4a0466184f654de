"""``remove()`` of an incremental base is durable: recorded on the tier, honoured by any later process.

Steps 2 and 3 refer to step 1's bytes, so ``remove(1)`` keeps step 1 (listed, restorable) until
nothing refers to it. The request is a ``REMOVED`` record in step 1's folder, written before
``remove()`` returns: a Checkpointer closed (or a process killed) right after it does not forget
it, and the next process that deletes on the tier (``remove()``, retention) deletes step 1 once
nothing refers to it; a later save that commits step 1 again is never deleted by that old request.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from typing import Any

import pytest
import torch

import nebula_ckpt as nc
import warm_python
from nebula_ckpt.cli import main
from nebula_ckpt.errors import CorruptCheckpointError
from nebula_ckpt.format.commit import Commit
from nebula_ckpt.format.removal import MAX_REMOVAL_BYTES, Removal

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _frozen() -> torch.Tensor:
    return torch.randn(256, 256, generator=torch.Generator().manual_seed(1))  # 256 KiB


def _state(value: float) -> dict[str, Any]:
    return {"frozen": _frozen(), "w": torch.full((64,), float(value))}


def _on_disk(root: str) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step-"))


def _chain(root: str, **kw: Any) -> None:
    """Steps 1, 2, 3 on the local tier of ``root``: 2 and 3 refer to step 1's frozen bytes; then
    ``remove(1)`` (kept: referred to) and the Checkpointer closes."""
    kw.setdefault("memory_tier", False)
    with nc.Checkpointer(root, keep_last=10, **kw) as ck:
        for i in (1, 2, 3):
            ck.save(i, _state(i))
        assert ck.remove(1) == [1] and ck.list() == [1, 2, 3]  # kept while 2 and 3 refer to it
    assert os.path.isfile(os.path.join(root, "step-1", "REMOVED"))


def _assert_empty(root: str, **kw: Any) -> None:
    """Nothing is left of the steps, on disk or to a restore."""
    assert _on_disk(root) == [], os.listdir(root)
    into = _state(0)
    with nc.Checkpointer(root, read_only=True, **kw) as ck:
        assert ck.list() == [] and ck.load_latest(into=into) is None
    assert float(into["w"][0]) == 0.0


def test_a_removed_base_goes_when_a_later_process_removes_its_referrers(tmp_path, shm_dir,  # noqa: ANN001
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    root = str(tmp_path / "ck")
    _chain(root)
    assert main(["verify", root]) == 0  # the record is no damage to any reader
    with nc.Checkpointer(root, keep_last=10, memory_tier=False) as ck:
        assert ck.list() == [1, 2, 3]
        assert ck.read(1)[1]["w"][0] == 1.0  # still restorable while referred to
        assert ck.remove(2) == [2] and ck.list() == [1, 3]
        assert ck.remove(3) == [3]
        assert ck.list() == []  # nothing refers to step 1 any more: its earlier removal is done
        assert ck.load_latest(into=_state(0)) is None
    _assert_empty(root)


def test_a_removed_base_goes_when_a_later_process_retention_drops_its_referrers(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    with nc.Checkpointer(root, tiers=[nc.LocalTier(root, keep_every=5)], keep_last=10) as ck:
        for i in (0, 1, 2):  # 1 and 2 refer to step 0
            ck.save(i, _state(i))
        assert ck.remove(0) == [0] and ck.list() == [0, 1, 2]
    # a later job: its retention drops 1 and 2 (keep_last=1) and would keep step 0 for good
    # (keep_every=5), but for the removal asked for it
    with nc.Checkpointer(root, tiers=[nc.LocalTier(root, keep_every=5)], keep_last=1) as ck:
        ck.save(3, _state(3))
        assert ck.list() == [3]
    assert _on_disk(root) == [3]


def test_a_removal_survives_a_sigkill_right_after_remove_returned(tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    child = (
        "import sys, time, torch, nebula_ckpt as nc\n"
        "frozen = torch.randn(256, 256, generator=torch.Generator().manual_seed(1))\n"
        "ck = nc.Checkpointer(sys.argv[1], keep_last=10)\n"  # the memory tier too (it outlives the process)
        "for i in (1, 2, 3):\n"
        "    ck.save(i, {'frozen': frozen, 'w': torch.full((64,), float(i))})\n"
        "print('removed', ck.remove(1), flush=True)\n"
        "time.sleep(600)\n")
    p = warm_python.popen([sys.executable, "-c", child, root], stdout=subprocess.PIPE, text=True, cwd=REPO,
                          env={**os.environ, "NEBULA_SHM_DIR": shm_dir})
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "removed [1]"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    assert _on_disk(root) == [1, 2, 3] and os.path.isfile(os.path.join(root, "step-1", "REMOVED"))
    with nc.Checkpointer(root, keep_last=10) as ck:  # the memory tier the killed job left behind too
        assert ck.list() == [1, 2, 3]
        assert ck.remove(3) == [3] and ck.remove(2) == [2]
        assert ck.list(detailed=True) == {t.name: [] for t in ck.tiers}
    _assert_empty(root)


def test_a_step_saved_again_is_never_deleted_by_the_removal_of_its_earlier_commit(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    with nc.Checkpointer(root, keep_last=10, memory_tier=False) as ck:
        for i in (1, 2, 3):
            ck.save(i, _state(i))
        assert ck.remove(1) == [1]
        ck.save(1, _state(11))  # the run went back: step 1 committed again (2 and 3 go first)
        ck.save(2, _state(12))  # refers to the new step 1
        assert ck.list() == [1, 2]
        assert ck.remove(2) == [2]
        assert ck.list() == [1]  # the new step 1: nobody asked for its removal
    with nc.Checkpointer(root, keep_last=10, memory_tier=False) as ck:
        into = _state(0)
        assert ck.load_latest(into=into) == 1 and float(into["w"][0]) == 11.0
    assert _on_disk(root) == [1]


def test_an_old_request_beside_a_new_commit_of_the_step_is_not_honoured(tmp_path, shm_dir) -> None:  # noqa: ANN001
    """A record of an earlier commit of the step (a crash left it, a store that removed the folder
    in part) names another commit than the marker there now: the step stays."""
    root = str(tmp_path / "ck")
    _chain(root)
    stale = os.path.join(str(tmp_path), "REMOVED.old")
    shutil.copy(os.path.join(root, "step-1", "REMOVED"), stale)
    with nc.Checkpointer(root, keep_last=10, memory_tier=False) as ck:  # a new job goes back to step 1
        ck.save(1, _state(11))
        ck.save(2, _state(12))
    shutil.copy(stale, os.path.join(root, "step-1", "REMOVED"))
    with nc.Checkpointer(root, keep_last=10, memory_tier=False) as ck:
        assert ck.remove(2) == [2] and ck.list() == [1]
        ck.save(5, _state(15))  # retention runs, the step-1 record is read and refused
        assert ck.list() == [1, 5]
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
        assert float(ck.read(1)[1]["w"][0]) == 11.0


@pytest.mark.parametrize("content", [b"{", b"[]", b"x" * (MAX_REMOVAL_BYTES + 1), "step", "version", "field",
                                     "link", "fifo"])
def test_a_garbled_removal_record_is_no_request(tmp_path, shm_dir, content: Any) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    _chain(root)
    path = os.path.join(root, "step-1", "REMOVED")
    if content in ("link", "fifo"):  # a planted link (to a valid record) or named pipe: never opened as one
        os.rename(path, os.path.join(str(tmp_path), "REMOVED"))
        if content == "link":
            os.symlink(os.path.join(str(tmp_path), "REMOVED"), path)
        else:
            os.mkfifo(path)
    elif isinstance(content, str):
        with open(path) as f:
            rec = json.load(f)
        rec.update({"step": {"step": 2}, "version": {"version": 2}, "field": {"extra": 1}}[content])
        content = json.dumps(rec).encode()
    if isinstance(content, bytes):
        with open(path, "wb") as f:
            f.write(content)
    with nc.Checkpointer(root, keep_last=10, memory_tier=False) as ck:
        assert ck.remove(3) == [3] and ck.remove(2) == [2]
        assert ck.list() == [1]  # never deleted on the strength of a record that does not read
    assert _on_disk(root) == [1]


def test_removal_record_round_trip_and_checks() -> None:
    c = Commit(7, 3, 1234, 99, save=4)
    r = Removal.of(c)
    assert Removal.parse(r.to_bytes(), "t", 7) == r and r.matches(c)
    assert not r.matches(Commit(7, 3, 1234, 98, save=4)) and not r.matches(Commit(7, 4, 1234, 99, save=4))
    assert not r.matches(None)
    no_save = Removal.of(Commit(7, 3, 1, 2))
    assert Removal.parse(no_save.to_bytes(), "t", 7) == no_save
    with pytest.raises(CorruptCheckpointError, match="names step 7, not the step of its folder"):
        Removal.parse(r.to_bytes(), "t", 8)
    with pytest.raises(CorruptCheckpointError, match="generation must be an integer"):
        Removal.parse(json.dumps({**json.loads(r.to_bytes()), "generation": True}).encode(), "t", 7)


def test_load_latest_after_every_step_is_removed_says_the_root_holds_none_any_more(
        tmp_path, shm_dir, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    caplog.set_level(logging.WARNING, logger="nebula_ckpt")
    with nc.Checkpointer(root, keep_last=10, memory_tier=False) as ck:
        for i in (1, 2, 3):
            ck.save(i, _state(i))
        assert ck.remove(1) == [1] and ck.remove(2) == [2] and ck.remove(3) == [3] and ck.list() == []
        assert ck.load_latest(into=_state(0)) is None
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and root in r.getMessage()]
    assert warned and "holds no committed checkpoint any more" in warned[0], caplog.text
    assert "no run has written it" not in caplog.text
