"""What a long run keeps stays bounded by retention, counted over many saves: health records, the
handles of failed saves, the folders of saves whose COMMIT put failed, the saves a restore follows.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import time
import weakref
from typing import Any, Iterator

import fsspec
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

import nebula_ckpt as nc

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import flaky_fs  # noqa: E402


def _health_steps(root: str) -> set[int]:
    folder = os.path.join(root, "_nebula", "health")
    return {int(n.split("-")[1]) for n in os.listdir(folder)} if os.path.isdir(folder) else set()


def test_health_records_of_deleted_steps_go_while_an_old_step_is_kept(root: str) -> None:
    """keep_every keeps step 0 and every 50th: the records of the steps retention deleted go all the same,
    and every step still listed keeps its marks."""
    model = torch.nn.Linear(4, 4)
    with nc.Checkpointer(root, tiers=[nc.MemoryTier(), nc.LocalTier(root, keep_last=2, keep_every=50)]) as ck:
        for i in range(120):
            ck.report(i, loss=1.0)
            ck.save(i, {"model": model})
        listed = set(ck.list())
    kept = _health_steps(root)
    orphans = kept - listed
    assert len(orphans) <= 20, f"{len(orphans)} record folders of deleted steps after 120 saves"
    assert {0, 50, 100} <= kept, f"a kept milestone lost its marks: records of {sorted(kept)}"


def test_health_records_stay_bounded_while_every_save_is_suspect(root: str) -> None:
    """A run that keeps saving after bad losses writes a suspect mark per save and no healthy one: its
    records are dropped as well."""
    model = torch.nn.Linear(4, 4)
    with nc.Checkpointer(root, keep_last=2) as ck:
        for i in range(80):
            ck.report(i, loss=float("nan"))
            ck.save(i, {"model": model})
        listed = set(ck.list())
    orphans = _health_steps(root) - listed
    assert len(orphans) <= 20, f"{len(orphans)} record folders of deleted steps after 80 suspect saves"


def test_the_saves_a_restore_follows_are_bounded_when_the_job_never_reports(root: str) -> None:
    model = torch.nn.Linear(4, 4)
    with nc.Checkpointer(root, keep_last=2) as ck:
        ck.save(0, {"m": model})
    with nc.Checkpointer(root, keep_last=2) as ck:
        ck.load_latest(into={"m": model})
        for i in range(1, 200):
            ck.save_async(i, {"m": model}).result()
        followed = len(ck._health._descendants)  # noqa: SLF001 - the bound is on this very list
    assert followed <= 64, f"{followed} saves followed after 199 saves since the restore"


@pytest.fixture
def down_store(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("NEBULA_REMOTE_RETRIES", "1")
    monkeypatch.setenv("NEBULA_REMOTE_TIMEOUT_S", "0.5")
    flaky_fs.register()
    yield
    flaky_fs.FlakyFileSystem.fault = None


@pytest.fixture
def quiet() -> Iterator[None]:
    """No records: pytest's log capture keeps each one, and with it the error and its frames (not the Checkpointer)."""
    logger = logging.getLogger("nebula_ckpt")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    yield
    logger.setLevel(level)


def _down() -> None:
    raise ConnectionError("the store is down")  # a new error each time, as a real client raises


@pytest.mark.parametrize("mode", ["log", "raise"])
def test_failed_saves_handles_are_not_kept_in_log_mode(tmp_path: Any, shm_dir: str, down_store: None, mode: str,
                                                       quiet: None) -> None:
    """on_persist_error="log": the handles of failed saves the job dropped are let go; "raise" keeps the one
    whose failure a later call raises."""
    model = torch.nn.Linear(8, 8)
    ck = nc.Checkpointer(str(tmp_path / "root"), on_persist_error=mode,
                         tiers=[nc.MemoryTier(), nc.RemoteTier(f"flakyfs://{tmp_path}/remote")])
    try:
        ck.save(0, {"model": model})
        flaky_fs.FlakyFileSystem.fault = _down
        refs = []
        n = 1 if mode == "raise" else 40
        for i in range(1, n + 1):
            h = ck.save_async(i, {"model": model})
            h.wait(30)
            refs.append(weakref.ref(h))
            del h
        gc.collect()
        alive = sum(r() is not None for r in refs)
        if mode == "log":
            assert alive <= 2, f"{alive} of {n} failed saves' handles still held"
        else:
            assert alive == 1
            with pytest.raises(nc.PersistError):
                ck.save_async(n + 1, {"model": model})
    finally:
        flaky_fs.FlakyFileSystem.fault = None
        ck.close()


class CommitFails(LocalFileSystem):
    """Local files; the writes of COMMIT objects fail while ``fail`` is set (a small put that times out).
    ``lands``: the failed put lands all the same (its response was lost)."""

    protocol = "f14commitfails"
    fail = False
    lands = False

    def __init__(self, *a: Any, **k: Any) -> None:
        k.setdefault("auto_mkdir", True)
        super().__init__(*a, **k)

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **k: Any) -> None:
        if CommitFails.fail and str(path).endswith("COMMIT"):
            if CommitFails.lands:
                super().pipe_file(path, value, **k)
            raise ConnectionError("the put of COMMIT timed out")
        super().pipe_file(path, value, **k) if mode == "overwrite" else super().pipe_file(path, value, mode=mode, **k)


@pytest.mark.parametrize("lands", [False, True])
def test_uncertain_commits_are_settled_by_a_later_prune(tmp_path: Any, shm_dir: str, down_store: None,
                                                        lands: bool) -> None:
    """Saves whose COMMIT put failed: once it can no longer land (older than the remote deadline), a later
    commit's prune removes those that did not commit and lets retention have those that did."""
    fsspec.register_implementation(CommitFails.protocol, CommitFails, clobber=True)
    CommitFails.lands = lands
    remote = tmp_path / "remote"
    model = torch.nn.Linear(32, 32)
    tiers = [nc.MemoryTier(), nc.RemoteTier(f"{CommitFails.protocol}://{remote}", keep_last=3)]
    with nc.Checkpointer(str(tmp_path / "root"), on_persist_error="log", tiers=tiers) as ck:
        try:
            for i in range(30):
                CommitFails.fail = 5 <= i < 25
                ck.save_async(i, {"model": model}).wait(30)
                if i == 24:
                    time.sleep(0.6)  # past the deadline: no failed put can land any more
        finally:
            CommitFails.fail = False
    folders = [d for d in os.listdir(remote) if d.startswith("step-")]
    uncommitted = [d for d in folders if not os.path.exists(remote / d / "COMMIT")]
    assert uncommitted == [], f"uncommitted folders left: {sorted(uncommitted)}"
    assert len(folders) <= 4, f"{len(folders)} step folders with keep_last=3: {sorted(folders)}"
