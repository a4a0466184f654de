"""Reading never creates a root; the first save does, and an unwritable root is named then.

A resume from a mistyped root (``/ckpt/godo`` for ``/ckpt/good``) must not leave ``godo/_nebula/``
behind (so it looks like a run), nor start from scratch without a word: ``load_latest`` says at
WARNING that the root does not exist, naming it, and ``must_exist=True`` raises instead. No read
(``load_latest``, ``list``, ``load``, ``read``, the command line's ``ls`` / ``verify`` /
``inspect``) creates the root, anything in it, or an object on a blob store. A root that cannot
be written (an immutable parent, a path under ``/proc``, a read-only mount) is a
``ValidationError`` naming the root, the tier and the fix at the first save, never a raw
``PermissionError`` / ``FileNotFoundError``.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from typing import Any, Iterator

import fsspec
import pytest
import torch

import nebula_ckpt as nc
import warm_python
from nebula_ckpt.cli import main
from nebula_ckpt.errors import NotFoundError, ValidationError


def _reads(ck: nc.Checkpointer) -> None:
    assert ck.load_latest(into={"w": torch.zeros(3)}) is None
    assert ck.list() == [] and ck.tags() == {}
    with pytest.raises(NotFoundError):
        ck.load(1)
    with pytest.raises(NotFoundError):
        ck.read()


def test_reads_of_a_missing_root_create_nothing(tmp_path: Any, shm_dir: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    root = str(tmp_path / "godo")
    with nc.Checkpointer(root) as ck:
        _reads(ck)
    assert nc.load_latest(root) is None
    nc.close_all()
    for cmd in (["ls", root], ["verify", root], ["inspect", root]):
        main(cmd)
    assert not os.path.lexists(root), os.listdir(root)
    assert os.listdir(shm_dir) in ([], [f"nebula_ckpt-{os.geteuid()}"])  # no memory tier left
    for d in os.listdir(shm_dir):
        assert os.listdir(os.path.join(shm_dir, d)) == [], "a memory tier folder was left behind"


def test_reads_of_a_missing_blob_root_create_no_object(shm_dir: str) -> None:
    url = f"memory://nebula-{uuid.uuid4().hex[:10]}/run"
    with nc.Checkpointer(url) as ck:
        _reads(ck)
    assert fsspec.filesystem("memory").find(url.split("://")[1]) == []


@pytest.fixture
def caplog_warning(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.WARNING, logger="nebula_ckpt")
    yield caplog


def test_a_resume_from_a_missing_root_says_so_naming_it(tmp_path: Any, shm_dir: str,
                                                       caplog_warning: pytest.LogCaptureFixture) -> None:
    root = str(tmp_path / "godo")
    with nc.Checkpointer(root) as ck:
        assert ck.load_latest(into={"w": torch.zeros(3)}) is None
        warned = [r for r in caplog_warning.records if r.levelno == logging.WARNING and root in r.getMessage()]
        assert warned and "does not exist" in warned[0].getMessage(), caplog_warning.text
        with pytest.raises(NotFoundError, match="godo.*does not exist"):
            ck.load_latest(into={"w": torch.zeros(3)}, must_exist=True)
    with pytest.raises(NotFoundError, match="godo"):
        nc.load_latest(root, must_exist=True)
    nc.close_all()
    assert not os.path.lexists(root)


def test_the_first_save_creates_the_root_and_a_resume_finds_it(tmp_path: Any, shm_dir: str,
                                                               caplog_warning: pytest.LogCaptureFixture) -> None:
    root = str(tmp_path / "good")
    with nc.Checkpointer(root) as ck:
        assert ck.load_latest() is None
        ck.save(1, {"w": torch.ones(3)})
        with open(os.path.join(root, "_nebula", "run.json")) as f:
            assert json.load(f)["run_id"] == ck.run_id  # the memory tier was claimed for this id
        mem = next(t for t in ck.tiers if t.kind == "memory").path
        with open(os.path.join(str(mem), "ROOT")) as f:
            assert ck.run_id in f.read()
    caplog_warning.clear()
    with nc.Checkpointer(root) as ck:
        out = {"w": torch.zeros(3)}
        assert ck.load_latest(into=out, must_exist=True) == 1 and torch.equal(out["w"], torch.ones(3))
    assert "does not exist" not in caplog_warning.text


def _immutable_parent(tmp_path: Any) -> Iterator[str]:
    folder = tmp_path / "locked"
    folder.mkdir()
    if warm_python.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i needs root on a file system with attributes")
    try:
        yield str(folder / "run")
    finally:
        warm_python.run(["chattr", "-i", str(folder)], check=True)


def _read_only_mount(tmp_path: Any) -> Iterator[str]:
    folder = tmp_path / "ro"
    folder.mkdir()
    if warm_python.run(["mount", "--bind", "-o", "ro", str(folder), str(folder)], capture_output=True).returncode:
        pytest.skip("a read-only bind mount needs root (CAP_SYS_ADMIN)")
    try:
        yield str(folder / "run")
    finally:
        warm_python.run(["umount", str(folder)], check=True)


def _under_proc(tmp_path: Any) -> Iterator[str]:
    yield f"/proc/nebula-{uuid.uuid4().hex[:8]}/run"


UNWRITABLE = {"an immutable parent": (_immutable_parent, "chattr -i"),
              "a read-only mount": (_read_only_mount, "read-only"), "a path under /proc": (_under_proc, "/proc")}


@pytest.mark.parametrize("how", list(UNWRITABLE))
def test_an_unwritable_root_is_named_with_its_tier_and_fix_at_the_first_save(tmp_path: Any, shm_dir: str,
                                                                              how: str) -> None:
    make, fix = UNWRITABLE[how]
    for root in make(tmp_path):
        with nc.Checkpointer(root, memory_tier=False) as ck:
            with pytest.raises(ValidationError) as e:
                ck.save(1, {"w": torch.ones(3)})
        msg = str(e.value)
        assert root in msg and "tier local:" in msg and fix in msg and "Nothing was saved" in msg, msg
