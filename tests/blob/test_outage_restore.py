"""A blob store that does not answer while a job resumes (Azurite, moto S3; the server stopped or
frozen for real): the restore raises the outage, never answers "nothing committed" (the job would
start afresh and its saves then delete the real run) and never passes the newest step over for an
older one as if it were damaged. A memory tier holding the newest step is restored from meanwhile.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import nebula_ckpt as nc
import warm_python
from dist.launch import reports, run_ranks  # tests/dist (pytest puts tests/ on sys.path)
from nebula_ckpt import knobs
from nebula_ckpt.errors import NotFoundError
from nebula_ckpt.storage.remote import FsspecStorage, RemoteUnavailableError

from .conftest import Store

pytestmark = [pytest.mark.blob, pytest.mark.timeout(300)]

#: an outage is reported within this deadline (one request with its retries), while the restore runs
QUICK = {"remote_timeout_s": 5.0, "remote_retries": 2}


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((20_000,), float(step)), "step": step}


def _saved(store: Store, steps: tuple[int, ...]) -> str:
    url = store.url("run")
    with nc.Checkpointer(url, storage_options=store.storage_options, memory_tier=False, keep_last=3) as ck:
        for s in steps:
            ck.save(s, _state(s), tag=f"t{s}")
    return url


def _outage(store: Store, call: Callable[[], Any]) -> RemoteUnavailableError:
    with pytest.raises(RemoteUnavailableError) as got:
        call()
    assert not isinstance(got.value, NotFoundError)
    assert store.url("run").split("://", 1)[1] in str(got.value) and "reachable" in str(got.value)  # names tier, fix
    return got.value


def test_an_outage_at_a_resume_is_raised_never_an_empty_root(blob_store: Store, tmp_path: Path) -> None:
    url = _saved(blob_store, (100, 200, 300))
    with knobs.override(shm_dir=str(tmp_path), **QUICK):
        assert blob_store.server is not None
        # a fresh machine (its memory tier empty), the store down while the job resumes
        with nc.Checkpointer(url, storage_options=blob_store.storage_options, keep_last=3) as ck:
            blob_store.server.stop()
            try:
                _outage(blob_store, lambda: ck.load_latest(into=_state(-1)))
                _outage(blob_store, lambda: ck.load_latest(must_exist=True))  # the outage, not NotFoundError
                _outage(blob_store, ck.latest)
                _outage(blob_store, ck.tags)
            finally:
                blob_store.server.start()
            into = _state(-1)
            assert ck.load_latest(into=into) == 300 and torch.equal(into["w"], _state(300)["w"])
            assert ck.latest() == (300, "t300") and ck.tags() == {"t100": 100, "t200": 200, "t300": 300}


def _stopped_once(server: Any, orig: Any, when: Callable[[str], bool], fired: list[str]) -> Any:
    """The storage method ``orig`` with the store stopped during its first call whose path ``when``
    picks (``fired`` records it), and started again once that call returns."""
    def call(self: FsspecStorage, rel: str, *a: Any, **kw: Any) -> Any:
        if when(rel) and not fired:
            fired.append(rel)
            server.stop()
            try:
                return orig(self, rel, *a, **kw)
            finally:
                server.start()
        return orig(self, rel, *a, **kw)
    return call


def test_an_outage_while_the_newest_step_is_read_is_raised_not_an_older_step(
        blob_store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = _saved(blob_store, (1, 2, 3))
    with knobs.override(shm_dir=str(tmp_path), **QUICK):
        server, fired = blob_store.server, []
        assert server is not None
        # the store stops while step 3's shard is read
        monkeypatch.setattr(FsspecStorage, "read_buffer", _stopped_once(
            server, FsspecStorage.read_buffer, lambda rel: rel.startswith("step-3/shard"), fired))
        with nc.Checkpointer(url, storage_options=blob_store.storage_options, memory_tier=False) as ck:
            into = _state(-1)
            with pytest.raises(RemoteUnavailableError):
                ck.load_latest(into=into)
            assert fired and into["step"] == -1 and torch.equal(into["w"], _state(-1)["w"])  # nothing restored
            assert ck.load_latest(into=into) == 3 and torch.equal(into["w"], _state(3)["w"])  # the store is back


def test_an_outage_while_a_failed_step_is_checked_again_is_not_damage(
        blob_store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 3's shard is really gone; the store stops when the restore reads its commit marker again
    (was it saved again meanwhile?): not knowing is no damage, so the outage is raised."""
    url = _saved(blob_store, (1, 2, 3))
    with knobs.override(shm_dir=str(tmp_path), **QUICK):
        server = blob_store.server
        assert server is not None
        with nc.Checkpointer(url, storage_options=blob_store.storage_options, memory_tier=False) as ck:
            ck.load_latest()  # step 3 whole: its manifest names its shard
        import fsspec
        fs = fsspec.filesystem(url.split("://")[0], **blob_store.storage_options)
        shard = next(p for p in fs.ls(url.split("://", 1)[1] + "/step-3", detail=False) if "/shard" in p)
        fs.rm(shard)
        orig_small, orig_size, orig_read = FsspecStorage.read_small, FsspecStorage.size, FsspecStorage.read_buffer
        missed: list[str] = []
        stopped: list[str] = []

        def note(orig: Any) -> Any:
            def call(self: FsspecStorage, rel: str, *a: Any, **kw: Any) -> Any:
                if rel.startswith("step-3/shard"):
                    missed.append(rel)
                return orig(self, rel, *a, **kw)
            return call

        monkeypatch.setattr(FsspecStorage, "size", note(orig_size))
        monkeypatch.setattr(FsspecStorage, "read_buffer", note(orig_read))
        # the store stops when step 3's marker is checked again after the failure
        monkeypatch.setattr(FsspecStorage, "read_small", _stopped_once(
            server, orig_small, lambda rel: rel == "step-3/COMMIT" and bool(missed), stopped))
        with nc.Checkpointer(url, storage_options=blob_store.storage_options, memory_tier=False) as ck:
            with pytest.raises(RemoteUnavailableError):
                ck.load_latest(into=_state(-1))
            assert missed and stopped
            assert ck.load_latest(into=_state(-1)) == 2  # once the store answers, the damage is damage


_CRASHED_WRITER = """
import os, sys, torch, nebula_ckpt as nc
ck = nc.Checkpointer(sys.argv[1], storage_options={opts})
for s in (1, 2, 3):
    ck.save(s, {{"w": torch.full((20_000,), float(s)), "step": s}})
os._exit(0)  # a crash: the memory tier keeps its steps
"""


def test_a_memory_tier_holding_the_newest_step_is_restored_while_the_store_is_down(
        blob_store: Store, tmp_path: Path) -> None:
    url, opts = blob_store.url("run"), blob_store.storage_options
    shm = tmp_path / "shm"
    shm.mkdir()
    code = _CRASHED_WRITER.format(opts=repr(opts))
    env = dict(os.environ, NEBULA_SHM_DIR=str(shm))
    done = warm_python.run([sys.executable, "-c", code, url], env=env, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-4000:]
    assert blob_store.server is not None
    with knobs.override(shm_dir=str(shm), **QUICK):
        with nc.Checkpointer(url, storage_options=opts) as ck:
            blob_store.server.stop()
            try:
                into = _state(-1)
                assert ck.load_latest(into=into) == 3 and torch.equal(into["w"], _state(3)["w"])
                assert ck.last_restore is not None and not ck.last_restore["tier"].startswith("remote")
            finally:
                blob_store.server.start()


def _job(scenario: str, url: str, store: Store, out: Path, shm_dir: str) -> list[dict[str, Any]]:
    assert store.server is not None and store.server.pid is not None
    quick = {} if scenario == "save" else {"NEBULA_REMOTE_TIMEOUT_S": str(QUICK["remote_timeout_s"]),
                                           "NEBULA_REMOTE_RETRIES": str(QUICK["remote_retries"])}
    done = run_ranks(2, str(Path(__file__).with_name("outage_worker.py")), [scenario, url, str(out)], out, shm_dir,
                     timeout=200, env_extra={"TEST_STORAGE_OPTIONS": json.dumps(store.storage_options),
                                             "TEST_SERVER_PID": str(store.server.pid), **quick})
    store.server.thaw()
    for r, p in enumerate(done):
        assert p.returncode == 0, f"rank {r}:\n{p.stdout[-4000:]}"
    return reports(out, scenario, 2)


@pytest.mark.parametrize("scenario", ["list_down", "read_down"])
def test_two_ranks_raise_an_outage_together(blob_store: Store, shm_dir: str, tmp_path: Path, scenario: str) -> None:
    """The store frozen while two ranks resume (``list_down``), or while rank 1 alone reads its part
    of the newest step (``read_down``): every rank raises, none waits on the others or restores an older step."""
    url = blob_store.url("run")
    _job("save", url, blob_store, tmp_path, shm_dir)
    got = _job(scenario, url, blob_store, tmp_path, shm_dir)
    for r in range(2):
        assert got[r]["first"] == "RemoteUnavailableError", (r, got[r])
        assert got[r]["again"] == 3 and got[r]["exact"], (r, got[r])
