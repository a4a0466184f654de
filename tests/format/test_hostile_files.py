"""Files of a root that are not what the format writes are refused at once, naming them.

A checkpoint root is input: anyone who can write it can put a named pipe (whose ``open`` waits
for a writer forever), a folder, or a sparse file of a terabyte (no disk blocks; read whole, a
``MemoryError``) where a commit marker, a manifest, a shard, a health record or the run record
belongs. Every reader refuses such a file before reading it, naming its path, and treats it as it
treats a garbled file of that kind: a step is damaged and skipped, a health record ignored, a run
record refused for writing. The readers run on a thread with a deadline here, so a reader that
blocks fails the test instead of hanging the suite.

And every parser of a step field accepts exactly what a save accepts, ``[0, 2**63-1]``: no step
a save wrote is refused when read back, and no commit marker its readers would refuse is written.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import threading
from typing import Any, Callable

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt.cli import main
from nebula_ckpt.errors import CorruptCheckpointError
from nebula_ckpt.format.checks import MAX_STEP
from nebula_ckpt.format.commit import Commit, CommitProgress, commit_manifest
from nebula_ckpt.format.health import HealthRecord, parse_record
from nebula_ckpt.format.records import ShardRecord
from nebula_ckpt.ranks.fencing import Fence
from nebula_ckpt.storage.local import LocalStorage

DEADLINE_S = 60.0
HEALTH_RECORD = "_nebula/health/step-3/g1-t1-user.json"


def _within(fifo: str, fn: Callable[[], Any]) -> Any:
    """``fn()`` on a thread; the test fails if it still runs after :data:`DEADLINE_S` (the FIFO's
    write end is then opened and closed until the blocked reader returns, so the suite goes on)."""
    box: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box.append((False, e))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(DEADLINE_S)
    if t.is_alive():
        for _ in range(100):  # each blocked open() of the FIFO is let go with an end of file
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError as e:
                assert e.errno == errno.ENXIO, e  # no reader waits on it right now
            t.join(0.1)
            if not t.is_alive():
                break
        pytest.fail(f"a reader blocked for {DEADLINE_S} s opening the FIFO {fifo}")
    ok, value = box[0]
    if not ok:
        raise value
    return value


def _saved(root: str) -> torch.nn.Linear:
    m = torch.nn.Linear(4, 2)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        for s in (1, 2, 3):
            ck.save(s, {"model": m, "x": s})
    return m


def _shard(root: str, step: int) -> str:
    d = os.path.join(root, f"step-{step}")
    return os.path.join(f"step-{step}", next(n for n in os.listdir(d) if n.endswith(".safetensors")))


def _plant_fifo(root: str, rel: str) -> str:
    path = os.path.join(root, rel)
    if os.path.exists(path):
        os.unlink(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.mkfifo(path)
    return path


def _read_everything(root: str) -> dict[str, Any]:
    """What a restart and the command line read of ``root`` (rc: ls, verify, inspect)."""
    out: dict[str, Any] = {}
    with nc.Checkpointer(root, read_only=True) as ck:
        out["loaded"] = ck.load_latest(into={"model": torch.nn.Linear(4, 2), "x": 0})
        out["list"], out["tags"] = ck.list(), ck.tags()
    out["rc"] = [main([cmd, root]) for cmd in ("ls", "verify", "inspect")]
    return out


# (where the FIFO is planted, the step a restart loads, whether step 3 is damaged)
FIFOS = [("step-3/COMMIT", 2, True), ("step-3/manifest.json", 2, True), ("shard", 2, True),
         (HEALTH_RECORD, 3, False), ("_nebula/run.json", 3, False)]


@pytest.mark.parametrize("rel,loaded,damaged", FIFOS, ids=[f[0] for f in FIFOS])
def test_a_fifo_in_a_root_is_refused_at_once_by_every_reader(tmp_path, shm_dir, caplog, rel: str,  # noqa: ANN001
                                                              loaded: int, damaged: bool) -> None:
    root = str(tmp_path / "root")
    _saved(root)
    fifo = _plant_fifo(root, _shard(root, 3) if rel == "shard" else rel)
    caplog.set_level(logging.WARNING, logger="nebula_ckpt")
    got = _within(fifo, lambda: _read_everything(root))
    assert got["loaded"] == loaded and got["list"] == [1, 2, 3]
    assert got["rc"] == ([1, 1, 0] if damaged else [0, 0, 0]), got
    refused = f"'{fifo}' is a named pipe (FIFO), not a regular file"
    if rel == "shard":  # its size already says it is no shard; mapping it is refused as well
        assert "has 0 bytes, manifest says" in caplog.text, caplog.text
        with pytest.raises(CorruptCheckpointError, match=re.escape(refused)):
            _within(fifo, lambda: LocalStorage(root).read_buffer(_shard(root, 3)))
    else:
        assert refused in caplog.text, caplog.text
    if rel == "_nebula/run.json":  # a writer needs the run record: refused, naming it and the fix
        ck = nc.Checkpointer(root, memory_tier=False)
        try:
            with pytest.raises(nc.NebulaError, match=r"_nebula/run\.json.*named pipe.*remove it if no job is running"):
                _within(fifo, lambda: ck.save(4, {"x": 4}))
        finally:
            ck.close()
        return
    with nc.Checkpointer(root, memory_tier=False) as ck:  # saves go on beside it
        _within(fifo, lambda: ck.save(4, {"model": torch.nn.Linear(4, 2), "x": 4}))
    assert os.path.exists(fifo) or rel != HEALTH_RECORD


def _replace(path: str, how: str) -> None:
    os.unlink(path)
    if how == "folder":
        os.mkdir(path)
    else:
        with open(path, "wb") as f:
            f.truncate(1 << 40)  # 1 TiB, no disk blocks


@pytest.mark.parametrize("how", ["sparse", "folder"])
def test_saves_go_on_beside_a_commit_marker_that_is_sparse_or_a_folder(tmp_path, shm_dir, how: str) -> None:  # noqa: ANN001
    """The writer reads the markers of the root (which writes it holds) at every save and close:
    a marker it cannot read is no checkpoint, and never a MemoryError or an IsADirectoryError."""
    root = str(tmp_path / "root")
    _saved(root)
    _replace(os.path.join(root, "step-3", "COMMIT"), how)
    m = torch.nn.Linear(4, 2)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(4, {"model": m, "x": 4})
    out = torch.nn.Linear(4, 2)
    with nc.Checkpointer(root, read_only=True) as ck:
        assert ck.load_latest(into={"model": out, "x": 0}) == 4
    assert torch.equal(out.weight, m.weight)


@pytest.mark.parametrize("how", ["sparse", "folder"])
def test_a_run_record_that_is_sparse_or_a_folder_is_refused_naming_it(tmp_path, shm_dir, caplog, how: str) -> None:  # noqa: ANN001
    """Read as a garbled run record is: a reader goes on without it (a warning names the file,
    what it is and the fix), a writer refuses the root with a NebulaError saying the same."""
    root = str(tmp_path / "root")
    _saved(root)
    path = os.path.join(root, "_nebula", "run.json")
    _replace(path, how)
    what = "is a folder, not a regular file" if how == "folder" else "is 1099511627776 bytes, more than the 65536"
    caplog.set_level(logging.WARNING, logger="nebula_ckpt")
    with nc.Checkpointer(root, read_only=True) as ck:
        assert ck.load_latest(into={"model": torch.nn.Linear(4, 2), "x": 0}) == 3
    assert f"'{path}' {what}" in caplog.text and "remove it if no job is running on this root" in caplog.text
    assert main(["ls", root]) == 0
    ck = nc.Checkpointer(root, memory_tier=False)
    try:
        with pytest.raises(nc.NebulaError) as ei:
            ck.save(4, {"x": 4})
    finally:
        ck.close()
    msg = str(ei.value)
    assert f"'{path}' {what}" in msg and "must be the regular file nebula_ckpt wrote" in msg, msg
    assert "remove it if no job is running on this root" in msg, msg


def test_every_parser_of_a_step_takes_exactly_what_a_save_takes() -> None:
    """0 to 2**63-1: a commit marker, a shard's reference to an earlier step, a health record (a
    manifest's own step: ``test_hostile_manifest.py``, and a save of each end below)."""
    for step in (0, 2**62 + 1, MAX_STEP):
        c = Commit(step, 1, 10, 0, 0)
        assert Commit.parse(c.to_bytes(), "t") == c
        assert ShardRecord.parse({"file": "shard-g1-r0.safetensors", "bytes": 8, "step": step}, "t").step == step
        rec = HealthRecord(step, 1, 5, "suspect", "user", None, "why")
        assert parse_record(rec.to_bytes(), rec.name, step) == rec
    for step in (-1, MAX_STEP + 1):
        with pytest.raises(CorruptCheckpointError, match=r"step = .* is out of range \[0, 9223372036854775807\]"):
            Commit.parse(json.dumps({"step": step, "generation": 1, "manifest_bytes": 10,
                                     "manifest_crc32c": 0}).encode(), "t")
        with pytest.raises(CorruptCheckpointError, match=r"out of range \[0, 9223372036854775807\]"):
            ShardRecord.parse({"file": "shard-g1-r0.safetensors", "bytes": 8, "step": step}, "t")


def test_a_commit_marker_its_readers_would_refuse_is_never_written(tmp_path) -> None:  # noqa: ANN001
    """The marker is read back by the readers' parser before anything is written: a step beyond
    the format's range leaves no manifest and no marker (a committed step nothing can read would
    take a retention slot for good)."""
    st = LocalStorage(str(tmp_path / "root"))
    progress = CommitProgress()
    with pytest.raises(CorruptCheckpointError, match="out of range"):
        commit_manifest(st, Fence.past(st, 1).for_tier(st), MAX_STEP + 1, b"{}", progress, "t")
    assert not progress.may_commit and st.list("") == []


def test_the_largest_steps_save_list_read_and_retain(tmp_path, shm_dir) -> None:  # noqa: ANN001
    """Steps past 2**62 (up to 2**63-1, what a save accepts) are checkpoints like any other: they
    commit, list, read back, restore and count once in ``keep_last``."""
    root = str(tmp_path / "root")
    big = [2**62 + 1, MAX_STEP]
    with nc.Checkpointer(root, memory_tier=False, keep_last=2) as ck:
        for s in (1, *big):
            ck.save(s, {"x": torch.full((3,), float(s % 1000)), "s": s})
        assert ck.list() == big
        assert [ck.read(s)[1]["s"] for s in big] == big
    with nc.Checkpointer(root, read_only=True) as ck:
        assert ck.load_latest(into={"x": torch.zeros(3), "s": 0}) == MAX_STEP
    assert main(["verify", root]) == 0
    assert sorted(os.listdir(root)) == ["_nebula", *(f"step-{s}" for s in big)]
