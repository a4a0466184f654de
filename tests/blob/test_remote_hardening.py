"""Issue #9 hardening of the remote storage, against real loopback servers (Azurite, moto S3).

* storage info from a manifest is validated against the object before anything is allocated;
* an outage (endpoint refusing, or hung) is reported within the ``remote_timeout_s`` deadline;
* nothing the storage shows (repr, attributes, exceptions, log lines) holds a credential;
* ``FsspecStorage(url)`` picks one backend class per service.
"""

from __future__ import annotations

import logging
import threading
import time
import tracemalloc
from typing import Any

import pytest

from nebula_ckpt import knobs
from nebula_ckpt.errors import CorruptCheckpointError
from nebula_ckpt.storage.remote import (
    AzureBlobStorage,
    FsspecStorage,
    GenericFsspecStorage,
    RemoteStorageError,
    RemoteUnavailableError,
    S3Storage,
    StorageInfoError,
    storage_class_for,
)

from .conftest import Store
from .util import backoff, captured_logs, exc_text, outage_after_first_part

TEST_TIME_LIMIT_S = 120
#: every test here is bounded (pytest-timeout) far below pytest.ini's global limit: a hung
#: server or upload fails one test instead of holding the suite
pytestmark = [pytest.mark.blob, pytest.mark.timeout(TEST_TIME_LIMIT_S)]

MiB = 1 << 20
GiB = 1 << 30
#: the deadline the outage tests run under, and the slack allowed on top of it for the
#: abort of the upload, thread joins and a loaded machine (a bound on an error path)
DEADLINE_S = 3.0
SLACK_S = 12.0


def _secrets_of(store: Store) -> list[str]:
    """The credential strings of a store's storage options (Azurite's real connection string)."""
    if store.kind == "azure":
        cs = store.storage_options["connection_string"]
        return [cs, cs.split("AccountKey=", 1)[1].split(";", 1)[0]]
    return [store.storage_options["key"], store.storage_options["secret"]]


def _part_bytes(kind: str) -> int:
    return 5 * MiB if kind == "s3" else 1 * MiB


# ------------------------------------------------------------- 1. memory decided by the file

#: crafted storage infos for a 181-byte object (the issue's case first)
_CRAFTED: list[tuple[str, Any]] = [
    ("1.5 GiB zstd frame table", {"stored_bytes": 181, "compression": "zstd",
                                  "frames": [[3 * GiB // 2, 181]]}),
    ("plain object claiming 1.5 GiB", {"stored_bytes": 3 * GiB // 2}),
    ("stored sizes not summing to the object", {"compression": "zstd", "frames": [[10, 100], [10, 100]]}),
    ("raw sizes not matching raw_bytes", {"stored_bytes": 181, "compression": "zstd",
                                         "raw_bytes": 999, "frames": [[1000, 181]]}),
    ("more frames than bytes", {"compression": "zstd", "frames": [[1, 1]] * 182}),
    ("negative size", {"compression": "zstd", "frames": [[-1, 181]]}),
    ("float size", {"compression": "zstd", "frames": [[1e9, 181]]}),
    ("bool size", {"stored_bytes": True}),
    ("string size", {"compression": "zstd", "frames": [["1000", 181]]}),
    ("frames not a list", {"compression": "zstd", "frames": {"0": [1, 181]}}),
    ("absurd raw_bytes", {"stored_bytes": 181, "raw_bytes": 1 << 60}),
    ("unknown compression", {"compression": "lz4", "stored_bytes": 181}),
]


def test_crafted_storage_info_is_refused_before_allocating(blob_store: Store) -> None:
    """A 181-byte object whose storage info claims far more: a clear error naming the object,
    raised before the buffer is allocated (peak Python allocation stays small)."""
    st = FsspecStorage(blob_store.url("root"), blob_store.storage_options)
    rel = "step-1/shard-g1-r0.safetensors"
    st.write_small(rel, bytes(range(181)))
    assert st.size(rel) == 181
    tracemalloc.start()
    try:
        for what, info in _CRAFTED:
            tracemalloc.reset_peak()
            with pytest.raises(StorageInfoError) as ei:
                st.read_buffer(rel, info)
            peak = tracemalloc.get_traced_memory()[1]
            err = ei.value
            assert isinstance(err, CorruptCheckpointError) and isinstance(err, ValueError), what
            assert f"{blob_store.url('root')}/{rel}" in str(err), (what, str(err))
            assert peak < 32 * MiB, f"{what}: {peak / MiB:.0f} MiB allocated before the check"
    finally:
        tracemalloc.stop()
    # the caller's expected size is checked too; the honest info still reads
    with pytest.raises(StorageInfoError, match="expected size"):
        st.read_buffer(rel, {"stored_bytes": 181}, expected_bytes=3 * GiB // 2)
    assert bytes(st.read_buffer(rel, {"stored_bytes": 181}, expected_bytes=181)) == bytes(range(181))


def test_real_frame_table_passes_validation(blob_store: Store) -> None:
    """What write_buffer records (frames, raw_bytes) passes, for highly compressible data too."""
    st = FsspecStorage(blob_store.url("root"), blob_store.storage_options, compression="zstd")
    part = _part_bytes(blob_store.kind)
    data = bytearray(3 * part + 123)  # zeros: close to zstd's largest expansion ratio
    with knobs.override(remote_part_bytes=part, remote_concurrency=2):
        info = st.write_buffer("z.bin", memoryview(data))
        assert info["raw_bytes"] == len(data) and len(info["frames"]) == 4
        assert bytes(st.read_buffer("z.bin", info, expected_bytes=len(data))) == bytes(data)


# ------------------------------------------------------------- 2. outage within a deadline

def _outage_after_first_part(st: FsspecStorage, take_down: Any) -> threading.Event:
    """Once part 0 is accepted, the server goes down (see util.outage_after_first_part)."""
    return outage_after_first_part(st, take_down)


@pytest.mark.parametrize("outage", ["stopped", "frozen"])
def test_outage_is_reported_within_the_deadline(blob_store: Store, outage: str) -> None:
    """Server refusing (stopped) or hung (SIGSTOP: connections accepted, never answered) in the
    middle of a multi-part upload: with NEBULA_REMOTE_TIMEOUT_S=3 and retries that would last
    minutes, the failure arrives within the deadline plus slack, names the object and the
    tier, says which knob bounds it, and holds no credential."""
    server = blob_store.server
    assert server is not None
    st = FsspecStorage(blob_store.url("root"), blob_store.storage_options)
    part = _part_bytes(blob_store.kind)
    big = bytearray(6 * part)
    take_down = server.stop if outage == "stopped" else server.freeze
    with backoff(0.2, 1.0), knobs.override(remote_timeout_s=DEADLINE_S, remote_retries=10_000,
                                           remote_part_bytes=part, remote_concurrency=2):
        st2 = FsspecStorage(blob_store.url("root"), blob_store.storage_options)  # timeouts from the knob
        down = _outage_after_first_part(st2, take_down)
        try:
            t0 = time.monotonic()
            with captured_logs() as logs, pytest.raises(RemoteStorageError) as ei:
                st2.write_buffer("step-2/shard.bin", memoryview(big))
            upload_s = time.monotonic() - t0
            assert down.is_set()
            t1 = time.monotonic()
            with pytest.raises(RemoteUnavailableError) as ei2:
                st2.exists("step-2/COMMIT")  # a single request: one deadline
            single_s = time.monotonic() - t1
        finally:
            server.thaw()
            server.start()
    err = ei.value
    assert isinstance(err, RemoteUnavailableError), exc_text(err)
    assert upload_s < DEADLINE_S + SLACK_S, f"upload failure took {upload_s:.1f} s"
    assert single_s < DEADLINE_S + SLACK_S / 2, f"stat failure took {single_s:.1f} s"
    for e in (err, ei2.value):
        msg = str(e)
        assert blob_store.url("root") in msg and "step-2/" in msg, msg
        assert "NEBULA_REMOTE_TIMEOUT_S" in msg, msg
    text = exc_text(err) + exc_text(ei2.value) + "\n".join(logs)
    for s in _secrets_of(blob_store):
        assert s not in text
    # the server is back: the same storage object works again
    st.write_small("after", b"ok")
    assert st.read_small("after") == b"ok"


def test_client_timeouts_follow_the_knob_unless_set(moto_s3: Any) -> None:
    """S3: connect/read timeouts passed to botocore are capped by remote_timeout_s; values the
    user put into storage_options are kept."""
    opts = moto_s3.storage_options
    url = f"{moto_s3.url_prefix}/root"
    with knobs.override(remote_timeout_s=4.0):
        st = FsspecStorage(url, opts)
        user = FsspecStorage(url, dict(opts, config_kwargs={"read_timeout": 99, "retries": {"max_attempts": 2}}))
    cfg = st.fs.config_kwargs  # what s3fs hands to botocore's Config
    assert cfg["connect_timeout"] == 4.0 and cfg["read_timeout"] == 4.0
    assert cfg["retries"]["max_attempts"] == 0
    ucfg = user.fs.config_kwargs
    assert ucfg["read_timeout"] == 99 and ucfg["connect_timeout"] == 4.0
    assert ucfg["retries"] == {"max_attempts": 2}
    with knobs.override(remote_timeout_s=300.0):
        assert FsspecStorage(url, opts).fs.config_kwargs["read_timeout"] == 60.0  # default kept


# ------------------------------------------------------------- 3. secrets

def test_nothing_the_storage_shows_holds_a_credential(blob_store: Store) -> None:
    """repr / str of the storage and of every attribute, errors and log lines, with Azurite's
    real connection string and moto's real key / secret (and a SAS-like query in the URL)."""
    secrets = _secrets_of(blob_store) + ["SASSIGNATUREabc123"]
    url = blob_store.url("root") + "?sv=2024-01-01&sig=SASSIGNATUREabc123"
    with captured_logs() as logs:
        st = FsspecStorage(url, blob_store.storage_options)
        shown = [repr(st), str(st), st.display_url] + [repr(v) for v in vars(st).values()]
        assert st.display_url == blob_store.url("root")
        errors: list[BaseException] = []
        with pytest.raises(FileNotFoundError) as e1:
            st.read_small("no/such/object")
        errors.append(e1.value)
        with pytest.raises(StorageInfoError) as e2:
            st.write_small("x", b"123")
            st.read_buffer("x", {"stored_bytes": 4})
        errors.append(e2.value)
        assert blob_store.server is not None
        blob_store.server.stop()
        try:
            with backoff(0.05), knobs.override(remote_retries=2, remote_timeout_s=DEADLINE_S), \
                    pytest.raises(RemoteUnavailableError) as e3:
                st.list()
            errors.append(e3.value)
        finally:
            blob_store.server.start()
        for e in errors:
            logging.getLogger("nebula_ckpt.test").error("failed", exc_info=e)
        st.close()
    text = "\n".join(shown + logs + [exc_text(e) for e in errors])
    assert "retrying" in text and "Traceback" in text  # logs and tracebacks were really captured
    for s in secrets:
        assert s not in text, f"a credential ({s[:6]}...) is shown"


# ------------------------------------------------------------- 4. one backend class per service

def test_backend_class_by_scheme(blob_store: Store) -> None:
    st = FsspecStorage(blob_store.url("root"), blob_store.storage_options)
    want = S3Storage if blob_store.kind == "s3" else AzureBlobStorage
    assert type(st) is want and isinstance(st, FsspecStorage)
    assert storage_class_for(blob_store.url("root")) is want
    assert type(FsspecStorage("memory://nebula-dispatch/root")) is GenericFsspecStorage

    class Direct(FsspecStorage):
        pass

    with pytest.raises(TypeError, match="storage_class_for"):
        Direct(blob_store.url("root"), blob_store.storage_options)
