"""The remote tier through the Checkpointer, against real loopback servers (Azurite and moto S3).

Faults are real: the server is stopped in the middle of an upload, the writer process is
SIGKILLed mid-upload and just before its commit marker, credentials are wrong, the bucket is
missing. Every test runs on both servers (``blob_store``) and is bounded in time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import pytest
import torch

import nebula_ckpt as nc
import warm_python
from nebula_ckpt import knobs
from nebula_ckpt.cli import main as cli
from nebula_ckpt.storage.remote import (
    FsspecStorage,
    RemoteAuthError,
    RemoteContainerNotFoundError,
    RemoteUnavailableError,
)

from .conftest import Store
from .remote_writer import make_state
from .servers import REPO
from .util import backoff
from .util import captured_logs as _captured_logs
from .util import exc_text as _exc_text

TEST_TIME_LIMIT_S = 120
#: every test here is bounded (pytest-timeout) far below pytest.ini's global limit: a hung
#: server or upload fails one test instead of holding the suite
pytestmark = [pytest.mark.blob, pytest.mark.timeout(TEST_TIME_LIMIT_S)]

MiB = 1 << 20


# ------------------------------------------------------------------------------------ helpers

def _part_bytes(kind: str) -> int:
    """Smallest part each backend takes (S3: 5 MiB), so that a few tens of MB make many parts."""
    return 5 * MiB if kind == "s3" else 1 * MiB


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _assert_same_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert list(got) == list(want)
    for k, w in want.items():
        g = got[k]
        if isinstance(w, torch.Tensor):
            assert isinstance(g, torch.Tensor) and g.dtype == w.dtype and g.shape == w.shape, k
            assert _bits(g) == _bits(w), f"{k}: bytes differ"
        else:
            assert type(g) is type(w) and g == w, (k, g, w)


def _zeros_like_state(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()}


def _secrets_of(store: Store) -> list[str]:
    """The credential strings of a store's storage options."""
    if store.kind == "azure":
        cs = store.storage_options["connection_string"]
        return [cs, cs.split("AccountKey=", 1)[1].split(";", 1)[0]]
    return [store.storage_options["key"], store.storage_options["secret"]]


class _HookedRemoteTier(nc.RemoteTier):
    """RemoteTier whose storage calls ``on_part(rel, index)`` after each accepted upload part."""

    def __init__(self, url: str, *, on_part: Any = None, **kw: Any) -> None:
        super().__init__(url, **kw)
        self.on_part = on_part

    def make_storage(self) -> FsspecStorage:
        st = super().make_storage()
        assert isinstance(st, FsspecStorage)
        st.on_part_uploaded = self.on_part
        return st


# ------------------------------------------------------------------------------------- tests

@pytest.mark.slow
def test_remote_root_restores_on_a_fresh_machine(blob_store: Store, shm_dir: str, tmp_path: Any) -> None:
    """Default tiers of a remote root (memory + remote); a few tens of MB go up and come down in
    many parallel parts; a "fresh machine" (empty memory tier, remote tier alone) restores bit for bit."""
    url, opts = blob_store.url("run"), blob_store.storage_options
    part = _part_bytes(blob_store.kind)
    state = make_state(100, 7 * MiB)  # 28 MiB of float32 + small leaves
    parts: list[int] = []
    with knobs.override(remote_part_bytes=part, remote_concurrency=4):
        ck = nc.Checkpointer(url, storage_options=opts)
        assert [t.kind for t in ck.tiers] == ["memory", "remote"]
        mem_dir = ck.tiers[0].display_url
        assert mem_dir.startswith(shm_dir)
        ck._runtimes[1].storage.on_part_uploaded = lambda rel, i: parts.append(i)  # type: ignore[attr-defined]
        t0 = time.monotonic()
        h = ck.save(100, state)
        assert sorted(h.tiers_written) == sorted(t.name for t in ck.tiers)
        ck.close()
        up_s = time.monotonic() - t0
    assert not os.path.exists(mem_dir)  # a clean close frees the memory tier
    assert len(set(parts)) >= 5, f"the shard went up in {len(set(parts))} part(s)"

    fresh_shm = tmp_path / "fresh-machine-shm"
    fresh_shm.mkdir()
    with knobs.override(shm_dir=str(fresh_shm), remote_part_bytes=part, remote_concurrency=4):
        fresh = nc.Checkpointer(url, storage_options=opts, tiers=[nc.RemoteTier(url, storage_options=opts)])
        ranged: list[tuple[Any, Any]] = []
        fs = fresh._runtimes[0].storage.fs  # type: ignore[attr-defined]
        real_cat = fs.cat_file

        def counting_cat(path: str, start: Any = None, end: Any = None, **kw: Any) -> Any:
            if start is not None:
                ranged.append((start, end))
            return real_cat(path, start=start, end=end, **kw)

        fs.cat_file = counting_cat
        out = _zeros_like_state(state)
        assert fresh.load_latest(into=out) == 100
        assert fresh.last_restore == {"step": 100, "tier": f"remote:{url}", "adopted_bytes": 0,
                                      "copy_on_write_bytes": 0, "health": "unknown", "health_reason": "",
                                      "skipped": []}
        _assert_same_state(out, state)
        assert len(ranged) >= 5, f"the shard came down in {len(ranged)} ranged read(s)"
        fresh.close()
        # the default tiers on the fresh machine (its memory tier is empty) find it remotely too
        with nc.Checkpointer(url, storage_options=opts) as ck2:
            out = _zeros_like_state(state)
            assert ck2.load_latest(into=out) == 100
            assert ck2.last_restore is not None and ck2.last_restore["tier"] == f"remote:{url}"
        _assert_same_state(out, state)
    assert up_s < 60


@pytest.mark.slow
def test_server_stopped_mid_upload(blob_store: Store, shm_dir: str) -> None:
    """The endpoint dies after the first part: the save fails after its retries, quickly, with a
    PersistError naming the tier; training goes on; step 1 stays intact; after the restart the
    next save commits and the failed steps leave nothing behind."""
    server = blob_store.server
    assert server is not None
    url, opts = blob_store.url("run"), blob_store.storage_options
    part = _part_bytes(blob_store.kind)
    fired, down, cancel = threading.Event(), threading.Event(), threading.Event()

    def stopper() -> None:
        if fired.wait(90) and not cancel.is_set():
            server.stop()
            down.set()

    def on_part(rel: str, index: int) -> None:
        if rel.startswith("step-2/") and not fired.is_set():
            fired.set()
            down.wait(30)  # the other parts now hit a dead endpoint

    threading.Thread(target=stopper, daemon=True, name="test-stopper").start()
    tier = _HookedRemoteTier(url, storage_options=opts, on_part=on_part)
    s1 = make_state(1, 4096)
    w = torch.randn(4 * part // 4 + 1000)  # > 4 parts
    try:
        with _captured_logs() as logs, backoff(0.05, 0.2), knobs.override(
                remote_part_bytes=part, remote_concurrency=2, remote_retries=3):
            ck = nc.Checkpointer(url, storage_options=opts, tiers=[tier], on_persist_error="log")
            ck.save(1, s1)
            t0 = time.monotonic()
            h2 = ck.save_async(2, {"w": w, "step": 2})
            h2.wait_snapshot()
            w.add_(1.0)  # training goes on while the upload is in trouble
            with pytest.raises(nc.PersistError) as ei:
                h2.result(timeout=90)
            elapsed = time.monotonic() - t0
            assert fired.is_set() and down.is_set()
            # the endpoint is still down: save_async returns at once, its failure comes on the handle
            t1 = time.monotonic()
            h3 = ck.save_async(3, {"w": w, "step": 3})
            h3.wait_snapshot()
            assert time.monotonic() - t1 < 5
            with pytest.raises(nc.PersistError):
                h3.result(timeout=60)
            assert time.monotonic() - t1 < 30
    finally:
        cancel.set()
        server.start()
    assert elapsed < 60, f"the failed save took {elapsed:.1f} s"
    err = ei.value
    msg = str(err)
    assert tier.name in err.failures and tier.name in msg and "step 2" in msg, msg
    assert isinstance(err.failures[tier.name], RemoteUnavailableError), msg
    assert "step-2/" in msg and "attempts" in msg, msg
    assert any("retrying" in line for line in logs)  # transient: it was retried before giving up
    text = _exc_text(err) + "\n".join(logs)
    for s in _secrets_of(blob_store):
        assert s not in text

    with knobs.override(remote_part_bytes=part, remote_concurrency=2):
        assert ck.list() == [1]
        out = _zeros_like_state(s1)
        assert ck.load_latest(into=out) == 1
        _assert_same_state(out, s1)
        h4 = ck.save(4, {"w": w, "step": 4})  # the server is back: this one commits
        assert h4.tiers_written == [tier.name]
        assert ck.list() == [1, 4]
        ck.close()  # failures were seen on their handles: close does not raise them again
        with nc.Checkpointer(url, storage_options=opts, tiers=[nc.RemoteTier(url, storage_options=opts)]) as r:
            assert r.list() == [1, 4]
            got: dict[str, Any] = {"w": torch.zeros_like(w), "step": 0}
            assert r.load_latest(into=got) == 4 and _bits(got["w"]) == _bits(w)
    st = FsspecStorage(url, opts)
    try:
        assert sorted(n for n in st.list("") if n.startswith("step-")) == ["step-1", "step-4"]
    finally:
        st.close()


def _run_writer_until_parked(spec: dict[str, Any]) -> list[str]:
    """Start remote_writer.py, wait until every job printed PARKED, SIGKILL it; return its stdout."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "remote_writer.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = warm_python.popen([sys.executable, script, json.dumps(spec)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    def kill_if_running() -> None:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)

    # kept beside the module's timeout mark: it bounds only the wait for the child to park, and
    # by killing the child it ends the stdout loop so the assertion reports the child's output
    # (a timed-out test would instead leave a child running that still holds the server)
    watchdog = threading.Timer(90, kill_if_running)
    watchdog.start()
    lines: list[str] = []
    waiting = {f"PARKED {park} {url}" for url, park in spec["jobs"]}
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.strip())
            waiting.discard(line.strip())
            if not waiting:
                os.kill(proc.pid, signal.SIGKILL)  # every job is parked: kill it mid-save
                break
    finally:
        watchdog.cancel()
        kill_if_running()
        proc.wait(10)
    err = proc.stderr.read() if proc.stderr is not None else ""
    assert not waiting and proc.returncode == -signal.SIGKILL, \
        f"rc={proc.returncode}, never parked: {waiting}\n{lines}\n{err[-3000:]}"
    for url, _ in spec["jobs"]:
        assert f"COMMITTED 1 {url}" in lines, lines
    return lines


@pytest.mark.slow
@pytest.mark.crash
def test_writer_killed_mid_save(blob_store: Store, shm_dir: str, capsys: pytest.CaptureFixture) -> None:
    """SIGKILL of the writer process mid-upload (root run-part: first part of step 2 accepted) and
    just before a marker (root run-commit: step 2's shard and manifest complete): nothing without
    a marker is ever loaded, and the next run's commit + retention removes the step-2/ leftovers."""
    opts = blob_store.storage_options
    part = _part_bytes(blob_store.kind)
    roots = {park: blob_store.url(f"run-{park}") for park in ("part", "commit")}
    _run_writer_until_parked({"storage_options": opts, "big": 3 * part // 4 + 999, "part": part,
                              "jobs": [[url, park] for park, url in roots.items()]})
    s1 = make_state(1, 4096)
    for park_at, url in roots.items():
        st = FsspecStorage(url, opts)
        try:
            leftovers = st.list("step-2")
            if park_at == "commit":
                # shard and manifest are there, complete; only the marker is missing
                assert "manifest.json" in leftovers and any(n.startswith("shard-") for n in leftovers), leftovers
            assert "COMMIT" not in leftovers
            with knobs.override(remote_part_bytes=part):
                ck = nc.Checkpointer(url, storage_options=opts, tiers=[nc.RemoteTier(url, storage_options=opts)])
                assert ck.list() == [1], park_at
                out = _zeros_like_state(s1)
                assert ck.load_latest(into=out) == 1, park_at
                _assert_same_state(out, s1)
                with pytest.raises(nc.NotFoundError):
                    ck.load(2)
                if park_at == "commit":
                    capsys.readouterr()
                    assert cli(["ls", url, "--json", "--storage-options", json.dumps(opts)]) == 0
                    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
                    assert rows[1]["committed"] and rows[1]["healthy"]
                    assert rows[2]["committed"] is False
                    capsys.readouterr()
                    assert cli(["verify", url, "--storage-options", json.dumps(opts)]) == 0  # step 1 only
                # the next run saves: commit + retention clean up the dead writer's leftovers
                ck.save(3, make_state(3, 4096))
                assert ck.list() == [1, 3]
                ck.close()
            assert sorted(n for n in st.list("") if n.startswith("step-")) == ["step-1", "step-3"], park_at
            assert st.list("step-2") == []
        finally:
            st.close()


def _wrong_credentials(store: Store) -> tuple[dict[str, Any], list[str]]:
    if store.kind == "azure":
        bad_key = "WRONGKEY" + "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo" * 2 + "AAAA=="
        cs = store.storage_options["connection_string"]
        good_key = cs.split("AccountKey=", 1)[1].split(";", 1)[0]
        bad_cs = cs.replace(good_key, bad_key)
        return {"connection_string": bad_cs}, [bad_key, bad_cs, good_key, cs]
    bad_secret = "WRONGSECRETwrongsecret0123456789abcdef"
    return dict(store.storage_options, secret=bad_secret), [bad_secret, store.storage_options["secret"]]


@pytest.mark.parametrize("problem", ["wrong_credentials", "missing_container"])
def test_bad_remote_config_fails_at_creation(blob_store: Store, shm_dir: str, problem: str) -> None:
    """Wrong credentials / a missing container or bucket: ONE clear error from the Checkpointer's
    constructor, fast, naming the tier and what to check, with no secret anywhere."""
    scheme = blob_store.url_prefix.split("://", 1)[0]
    secrets = _secrets_of(blob_store)
    expect: type[Exception]
    if problem == "wrong_credentials":
        opts, more = _wrong_credentials(blob_store)
        secrets += more
        url = blob_store.url("run")
        expect, words = RemoteAuthError, ["unauthorized", "credentials"]
    else:
        opts = blob_store.storage_options
        missing = f"nebula-missing-{uuid.uuid4().hex[:12]}"
        url = f"{scheme}://{missing}/run"
        expect, words = RemoteContainerNotFoundError, ["does not exist", missing]
    with _captured_logs() as logs:
        t0 = time.monotonic()
        with pytest.raises(nc.NebulaError) as ei:
            nc.Checkpointer(url, storage_options=opts)
        elapsed = time.monotonic() - t0
    assert elapsed < 30, f"took {elapsed:.1f} s"
    err = ei.value
    assert isinstance(err, expect), _exc_text(err)
    msg = str(err)
    assert url in msg and all(w in msg for w in words), msg
    assert not any("retrying" in line for line in logs), logs  # permanent: no retry loop
    text = _exc_text(err) + "\n".join(logs)
    for s in secrets:
        assert s not in text
    if problem == "missing_container":
        # the library did not create it
        st = FsspecStorage(url, blob_store.storage_options)
        try:
            with pytest.raises(RemoteContainerNotFoundError):
                st.check_access()
        finally:
            st.close()


# ------------------------------------------------------------------------------ known bugs

def test_remote_outage_keeps_the_memory_tier_working(blob_store: Store, shm_dir: str) -> None:
    server = blob_store.server
    assert server is not None
    url, opts = blob_store.url("run"), blob_store.storage_options
    with backoff(0.05, 0.1), knobs.override(remote_retries=2):
        ck = nc.Checkpointer(url, storage_options=opts, on_persist_error="log")
        mem = ck.tiers[0]
        ck.save(1, make_state(1, 4096))
        server.stop()
        try:
            h = ck.save_async(2, make_state(2, 4096))
            h.wait_snapshot()
            with pytest.raises(nc.PersistError):
                h.result(timeout=60)  # the remote tier cannot write: expected
            # ... but the memory tier needs no remote endpoint to keep a crash-safe copy
            assert h.tiers_written == [mem.name], h.error()
        finally:
            server.start()
            ck.close()


@pytest.mark.parametrize("blob_store", ["s3"], indirect=True)
def test_dead_writers_multipart_upload_is_aborted(blob_store: Store, shm_dir: str) -> None:
    import fsspec
    from fsspec.asyn import sync

    url, opts = blob_store.url("run"), blob_store.storage_options
    bucket = blob_store.url_prefix.split("://", 1)[1]
    with nc.Checkpointer(url, storage_options=opts, tiers=[nc.RemoteTier(url, storage_options=opts)]) as ck:
        ck.save(1, make_state(1, 4096))
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **opts)
    shard = next(n for n in FsspecStorage(url, opts).list("step-1") if n.startswith("shard-"))
    # what a writer killed after its first part leaves (test_writer_killed_mid_save makes the same
    # state with a real SIGKILL, on root run-part): an initiated upload with one part, never completed
    key = f"run/step-2/{shard}"
    up = sync(fs.loop, fs._call_s3, "create_multipart_upload", Bucket=bucket, Key=key)
    sync(fs.loop, fs._call_s3, "upload_part", Bucket=bucket, Key=key, UploadId=up["UploadId"],
         PartNumber=1, Body=b"x" * (5 * MiB))
    with nc.Checkpointer(url, storage_options=opts, tiers=[nc.RemoteTier(url, storage_options=opts)]) as ck2:
        ck2.save(3, make_state(3, 4096))  # the next run: commit + retention clean up after the dead one
        assert ck2.list() == [1, 3]
    left = sync(fs.loop, fs._call_s3, "list_multipart_uploads", Bucket=bucket, Prefix="run/")
    assert [u["Key"] for u in left.get("Uploads", [])] == []
