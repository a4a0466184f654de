"""FsspecStorage against real loopback blob servers (Azurite, moto S3) and memory://. No mocks."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import fsspec
import fsspec.exceptions
import pytest
from fsspec.implementations.memory import MemoryFileSystem

import warm_python
from nebula_ckpt import knobs
from nebula_ckpt.errors import CorruptCheckpointError, NebulaError, ValidationError
from nebula_ckpt.storage.remote import (
    FsspecStorage,
    RemoteAuthError,
    RemoteContainerNotFoundError,
    RemoteStorageError,
    RemoteUnavailableError,
    StorageInfoError,
)

from .conftest import Store
from .servers import REPO
from .util import backoff, outage_after_first_part
from .util import captured_logs as _captured_logs
from .util import exc_text as _exc_text

pytestmark = pytest.mark.blob

MiB = 1 << 20


def _part_bytes(kind: str) -> int:
    """Smallest part size each backend accepts (S3: 5 MiB), to keep the data small."""
    return 5 * MiB if kind == "s3" else 1 * MiB


def _data(n: int, seed: int = 0) -> bytearray:
    """Half compressible, half random bytes."""
    rnd = os.urandom(max(1, n // 2))
    pattern = (b"nebula-checkpoint-%d " % seed) * (n // 40 + 1)
    return bytearray((pattern[: n - len(rnd)] + rnd)[:n])


def _storage(store: Store, prefix: str = "root", *, compression: str | None = None) -> FsspecStorage:
    return FsspecStorage(store.url(prefix), store.storage_options, compression=compression)


# ------------------------------------------------------------------ no server needed (+ memory)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_roundtrip_small(any_store: Store, compression: str | None) -> None:
    st = _storage(any_store, compression=compression)
    assert st.compression == compression
    data = _data(10_000)
    info = st.write_buffer("step-1/small.bin", memoryview(data))
    json.dumps(info)  # goes into the manifest
    back = st.read_buffer("step-1/small.bin", info)
    assert isinstance(back, memoryview) and bytes(back) == bytes(data)
    if compression == "zstd":
        assert info["compression"] == "zstd" and len(info["frames"]) == 1
        assert info["stored_bytes"] < len(data)
        # reading decides by the stored info, not by the reader's own setting
        plain = _storage(any_store)
        assert bytes(plain.read_buffer("step-1/small.bin", info)) == bytes(data)
        plain.close()
    else:
        assert info == {"stored_bytes": len(data)}
        assert bytes(st.read_buffer("step-1/small.bin")) == bytes(data)  # info is optional
    assert st.size("step-1/small.bin") == info["stored_bytes"]
    st.close()
    st.close()  # idempotent


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_roundtrip_multipart(any_store: Store, compression: str | None) -> None:
    part = _part_bytes(any_store.kind)
    data = _data(int(3.5 * part), seed=1)
    st = _storage(any_store, compression=compression)
    parts: list[int] = []
    st.on_part_uploaded = lambda rel, i: parts.append(i)
    with knobs.override(remote_part_bytes=part, remote_concurrency=3):
        info = st.write_buffer("step-2/shard-0.bin", memoryview(data))
        back = st.read_buffer("step-2/shard-0.bin", info)
    assert bytes(back) == bytes(data)
    if compression == "zstd":
        assert [f[0] for f in info["frames"]] == [part, part, part, part // 2]
        assert sum(f[1] for f in info["frames"]) == info["stored_bytes"] < len(data) * 0.7
    else:
        assert info == {"stored_bytes": len(data)}
    if any_store.kind == "azure" or (any_store.kind == "s3" and compression is None):
        assert sorted(parts) == [0, 1, 2, 3]  # really went up as 4 parts
    elif any_store.kind == "s3":
        assert len(parts) >= 1  # small zstd frames are coalesced into >= 5 MiB parts
    assert st.size("step-2/shard-0.bin") == info["stored_bytes"]


def test_empty_and_noncompressible(any_store: Store) -> None:
    st = _storage(any_store)
    assert st.write_buffer("e.bin", memoryview(b"")) == {"stored_bytes": 0}
    assert bytes(st.read_buffer("e.bin", {"stored_bytes": 0})) == b""
    zst = _storage(any_store, compression="zstd")
    info = zst.write_buffer("ez.bin", memoryview(bytearray()))
    assert bytes(zst.read_buffer("ez.bin", info)) == b""
    rnd = os.urandom(50_000)
    info = zst.write_buffer("r.bin", memoryview(rnd))
    assert bytes(zst.read_buffer("r.bin", info)) == rnd


def test_unknown_compression_refused_at_construction() -> None:
    """The encoding is the storage's setting: an unknown one fails when it is built."""
    with pytest.raises(ValueError, match=r"memory://nebula-comp/root.*'lz4'.*'zstd'"):
        FsspecStorage("memory://nebula-comp/root", compression="lz4")
    with pytest.raises(TypeError):
        FsspecStorage("memory://nebula-comp/root").write_buffer(  # type: ignore[call-arg]
            "x.bin", memoryview(b"abc"), compression="zstd")


def test_create_only_and_overwrite(any_store: Store) -> None:
    st = _storage(any_store)
    st.write_small("step-3/COMMIT", b"first", create_only=True)
    with pytest.raises(FileExistsError) as ei:
        st.write_small("step-3/COMMIT", b"second", create_only=True)
    assert "step-3/COMMIT" in str(ei.value)
    assert st.read_small("step-3/COMMIT") == b"first"
    st.write_small("step-3/manifest.json", b"{}")
    st.write_small("step-3/manifest.json", b'{"v": 2}')  # overwrite
    assert st.read_small("step-3/manifest.json") == b'{"v": 2}'


def _s3_requests(st: FsspecStorage) -> list[str]:
    """The HTTP requests ``st`` makes from now on (S3: botocore's ``before-send`` event), as ``"METHOD key"``."""
    sent: list[str] = []
    st.list()  # the client exists once a first request was made

    def note(request: Any, **_: Any) -> None:  # returns None: the request goes out as it is
        sent.append(f"{request.method} {request.url.split('?')[0].rsplit('/', 2)[-2:]}")

    st.fs.s3.meta.events.register("before-send.s3", note)
    return sent


def test_read_small_is_one_request_of_what_a_reader_takes(any_store: Store) -> None:
    """A small file (a commit marker, a manifest) is read by one ranged request of ``max_bytes + 1``
    bytes, its size not asked first: the whole of it (an empty one too); one larger than a
    reader takes is refused, naming its real size; a missing one is not found."""
    st = _storage(any_store)
    st.write_small("step-1/COMMIT", b"x" * 200)
    st.write_small("step-2/COMMIT", b"")
    sent = _s3_requests(st) if any_store.kind == "s3" else None
    assert st.read_small("step-1/COMMIT", 200) == b"x" * 200
    assert sent is None or len(sent) == 1 and sent[0].startswith("GET"), sent  # was HEAD, GET
    assert st.read_small("step-2/COMMIT", 200) == b""
    with pytest.raises(CorruptCheckpointError, match="COMMIT is 200 bytes, more than the 199 a reader takes"):
        st.read_small("step-1/COMMIT", 199)
    with pytest.raises(FileNotFoundError):
        st.read_small("step-3/COMMIT", 200)


def test_namespace_semantics(any_store: Store) -> None:
    """list / exists / size / remove / remove_dir behave the same on every backend."""
    st = _storage(any_store)
    for rel in ["a/x", "a/y", "a/sub/z", "step-1/f", "step-10/f", "top"]:
        st.write_small(rel, rel.encode())
    assert st.list() == ["a", "step-1", "step-10", "top"]
    assert st.list("a") == ["sub", "x", "y"]
    assert st.list("a/") == ["sub", "x", "y"]
    assert st.list("missing") == []
    assert st.list("top") == []  # a file has no children
    assert st.exists("a/x") and st.exists("top")
    assert not st.exists("a") and not st.exists("nope") and not st.exists("a/nope")
    assert st.size("a/sub/z") == len(b"a/sub/z")
    with pytest.raises(FileNotFoundError):
        st.size("nope")
    with pytest.raises(FileNotFoundError):
        st.size("a")  # a directory is not a file
    with pytest.raises(FileNotFoundError):
        st.read_small("a/nope")
    with pytest.raises(FileNotFoundError):
        st.read_buffer("a/nope")

    st.remove("a/x")
    st.remove("a/x")  # missing is fine
    st.remove("never/was")
    assert not st.exists("a/x") and st.list("a") == ["sub", "y"]

    st.remove_dir("step-1")  # must not touch step-10
    assert st.list() == ["a", "step-10", "top"]
    assert st.read_small("step-10/f") == b"step-10/f"
    st.remove_dir("step-1")  # missing is fine
    st.remove_dir("nothing/here")
    st.remove_dir("a")
    assert st.list("a") == [] and st.list() == ["step-10", "top"]
    st.remove_dir("")  # everything under the root, never the container itself
    assert st.list() == []
    st.write_small("again", b"1")  # container still usable
    assert st.list() == ["again"]


def test_listing_never_cached(any_store: Store) -> None:
    a = _storage(any_store)
    b = _storage(any_store)
    assert a.list("d") == []
    b.write_small("d/one", b"1")
    assert a.list("d") == ["one"] and a.exists("d/one")
    b.write_small("d/two", b"2")
    b.remove("d/one")
    assert a.list("d") == ["two"] and not a.exists("d/one")


def test_paths_validated_and_display_url() -> None:
    st = FsspecStorage("memory://nebula-paths/root?sig=SUPERSECRETSIG&sv=2020")
    assert st.display_url == "memory://nebula-paths/root"
    assert "SUPERSECRETSIG" not in repr(st)
    for bad in ["../x", "a/../b", "a//b", "./a"]:
        with pytest.raises(ValueError):
            st.write_small(bad, b"x")
    # a password in the URL is refused (credentials go in storage_options), never shown
    with pytest.raises(ValidationError, match="storage_options") as ei:
        FsspecStorage("s3://user:hunter2secret@bucket/prefix", {"key": "k", "secret": "hunter2secret"})
    assert "hunter2" not in str(ei.value)
    # a user name alone is no secret: Azure's container@account stays, as adlfs reads it
    st3 = FsspecStorage("abfs://container@account.dfs.core.windows.net/p", {"account_key": "a2V5"})
    assert st3.display_url == "abfs://container@account.dfs.core.windows.net/p"


def test_missing_backend_hint() -> None:
    from nebula_ckpt.storage.remote.registry import INSTALL_HINTS
    assert "nebula_ckpt[azure]" in INSTALL_HINTS["az"]
    assert "nebula_ckpt[s3]" in INSTALL_HINTS["s3"]
    missing = _a_protocol_not_installed()
    with pytest.raises(ImportError, match=f"'{missing}://' backend is not installed"):
        FsspecStorage(f"{missing}://some/place")


def _a_protocol_not_installed() -> str:
    """A protocol fsspec knows whose package is not installed here (which ones are depends on
    what the test set-up installed: accelerate brings huggingface_hub, so hf:// works)."""
    import importlib.util

    from fsspec.registry import known_implementations

    for proto in ("oci", "dropbox", "box", "gdrive", "wandb", "ocilake", "hf"):
        cls = known_implementations.get(proto, {}).get("class", "")
        if cls and importlib.util.find_spec(cls.split(".")[0]) is None:
            return proto
    pytest.skip("every fsspec backend tried is installed here")


def test_corrupt_frame_table(any_store: Store) -> None:
    st = _storage(any_store, compression="zstd")
    data = _data(20_000)
    info = st.write_buffer("c.bin", memoryview(data))
    # a frame table consistent with itself whose frame decodes to fewer bytes than it says
    bad = dict(info, frames=[[info["frames"][0][0] + 5, info["frames"][0][1]]], raw_bytes=len(data) + 5)
    with pytest.raises(RemoteStorageError, match="c.bin") as ei:
        st.read_buffer("c.bin", bad)
    assert isinstance(ei.value, CorruptCheckpointError)
    # raw sizes that disagree with the recorded raw size: refused before reading
    with pytest.raises(StorageInfoError, match="c.bin"):
        st.read_buffer("c.bin", dict(bad, raw_bytes=len(data)))
    with pytest.raises(ValueError):
        st.read_buffer("c.bin", dict(info, stored_bytes=info["stored_bytes"] + 1))


# ------------------------------------------------------------------ real servers only


def test_check_access_ok(blob_store: Store) -> None:
    st = _storage(blob_store)
    st.check_access()


def _secrets_of(store: Store) -> list[str]:
    """The credential strings of a store's storage_options."""
    if store.kind == "azure":
        cs = store.storage_options["connection_string"]
        return [cs, cs.split("AccountKey=", 1)[1].split(";", 1)[0]]
    return [store.storage_options["key"], store.storage_options["secret"]]


def _wrong_credentials(store: Store) -> tuple[dict, list[str]]:
    if store.kind == "azure":
        bad_key = "WRONGKEY" + "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo" * 2 + "AAAA=="
        cs = store.storage_options["connection_string"]
        good_key = cs.split("AccountKey=", 1)[1].split(";", 1)[0]
        bad_cs = cs.replace(good_key, bad_key)
        return {"connection_string": bad_cs}, [bad_key, bad_cs, good_key]
    bad_secret = "WRONGSECRETwrongsecret0123456789abcdef"
    return dict(store.storage_options, secret=bad_secret), [bad_secret, store.storage_options["secret"]]


def test_wrong_credentials_are_rejected_and_never_shown(blob_store: Store) -> None:
    opts, secrets = _wrong_credentials(blob_store)
    st = FsspecStorage(blob_store.url("root"), opts)
    assert not any(s in repr(st) for s in secrets)
    with _captured_logs() as logs:
        t0 = time.monotonic()
        with pytest.raises(RemoteAuthError) as ei:
            st.check_access()
        assert time.monotonic() - t0 < 10  # permanent: no retries
        errors: list[BaseException] = [ei.value]
        with pytest.raises(RemoteAuthError) as ei2:
            st.write_buffer("step-1/x.bin", memoryview(b"x" * 100))
        errors.append(ei2.value)
        with pytest.raises(RemoteAuthError) as ei3:
            st.write_small("step-1/COMMIT", b"c", create_only=True)
        errors.append(ei3.value)
        for e in errors:
            logging.getLogger("nebula_ckpt.test").error("save failed", exc_info=e)
    assert isinstance(ei.value, NebulaError) and isinstance(ei.value, PermissionError)
    assert "credentials" in str(ei.value) and blob_store.url("root") in str(ei.value)
    assert "step-1/x.bin" in str(ei2.value)
    text = "\n".join(logs) + "\n".join(_exc_text(e) for e in errors)
    assert "save failed" in text and "Traceback" in text  # the logs did include the tracebacks
    for s in secrets:
        assert s not in text


def test_missing_container_fails_fast(blob_store: Store) -> None:
    url = blob_store.url_prefix.split("://")[0] + "://nebula-no-such-container-xyz/root"
    st = FsspecStorage(url, blob_store.storage_options)
    t0 = time.monotonic()
    with pytest.raises(RemoteContainerNotFoundError) as ei:
        st.check_access()
    assert time.monotonic() - t0 < 30
    assert "does not exist" in str(ei.value) and "nebula-no-such-container-xyz" in str(ei.value)
    assert not isinstance(ei.value, FileNotFoundError)  # never reads as "no checkpoint"
    with pytest.raises(RemoteStorageError):
        st.list()
    with pytest.raises(RemoteStorageError) as ei2:
        st.write_buffer("x.bin", memoryview(b"123"))
    for s in _secrets_of(blob_store):
        assert s not in _exc_text(ei.value) and s not in _exc_text(ei2.value)


def test_unreachable_endpoint_fails_fast(blob_store: Store) -> None:
    server = blob_store.server
    assert server is not None
    st = _storage(blob_store)
    server.stop()
    try:
        with backoff(0.05, 0.2), knobs.override(remote_retries=3):
            t0 = time.monotonic()
            with pytest.raises(RemoteUnavailableError) as ei:
                st.check_access()
            with pytest.raises(RemoteUnavailableError):
                st.exists("step-1/COMMIT")  # an outage is not "missing"
            with pytest.raises(RemoteUnavailableError):
                st.list()
            assert time.monotonic() - t0 < 15
        assert "3 attempts" in str(ei.value)
    finally:
        server.start()
    st.check_access()


def _stop_on_first_part(st: FsspecStorage, server, restart_after: float | None = None) -> threading.Event:  # noqa: ANN001
    """Once part 0 is accepted, the server stops (and restarts after ``restart_after`` s)."""
    return outage_after_first_part(st, server.stop, server.start if restart_after is not None else None,
                                   restart_after or 0.0)


def test_server_stopped_mid_upload(blob_store: Store) -> None:
    server = blob_store.server
    assert server is not None
    zst = _storage(blob_store, compression="zstd")
    old = _data(100_000, seed=7)
    old_info = zst.write_buffer("step-1/shard.bin", memoryview(old))
    zst.write_small("step-1/COMMIT", b"step-1", create_only=True)
    zst.close()
    st = _storage(blob_store)  # raw writes; still reads the compressed step 1 below

    part = _part_bytes(blob_store.kind)
    big = _data(6 * part, seed=8)
    down = _stop_on_first_part(st, server)
    with backoff(0.05, 0.2), knobs.override(remote_part_bytes=part, remote_concurrency=2, remote_retries=3):
        t0 = time.monotonic()
        try:
            with pytest.raises(RemoteStorageError) as ei:
                st.write_buffer("step-2/shard.bin", memoryview(big))
        finally:
            server.start()
        elapsed = time.monotonic() - t0
    assert down.is_set()
    assert elapsed < 60
    msg = str(ei.value)
    assert "step-2/shard.bin" in msg and blob_store.url("root") in msg
    assert isinstance(ei.value, RemoteUnavailableError), msg
    for s in _secrets_of(blob_store):
        assert s not in _exc_text(ei.value)

    # after the restart: old data intact, the failed upload left no visible object, new writes work
    st.on_part_uploaded = None
    assert bytes(st.read_buffer("step-1/shard.bin", old_info)) == bytes(old)
    assert st.read_small("step-1/COMMIT") == b"step-1"
    assert not st.exists("step-2/shard.bin")
    with knobs.override(remote_part_bytes=part, remote_concurrency=2):
        info = st.write_buffer("step-2/shard-retry.bin", memoryview(big))
        assert bytes(st.read_buffer("step-2/shard-retry.bin", info)) == bytes(big)


def test_transient_outage_is_retried(blob_store: Store) -> None:
    """The server goes away after the first part and comes back: retries carry the upload."""
    server = blob_store.server
    assert server is not None
    st = _storage(blob_store, compression="zstd")
    part = _part_bytes(blob_store.kind)
    big = _data(4 * part, seed=9)
    down = _stop_on_first_part(st, server, restart_after=0.3)
    with _captured_logs() as logs, backoff(0.1, 1.0), knobs.override(
            remote_part_bytes=part, remote_concurrency=2, remote_retries=10):
        info = st.write_buffer("step-5/shard.bin", memoryview(big))
    assert down.is_set()
    assert any("retrying" in line for line in logs)
    st.on_part_uploaded = None
    assert bytes(st.read_buffer("step-5/shard.bin", info)) == bytes(big)


_WRITER = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, {repo!r})
    from nebula_ckpt import knobs
    from nebula_ckpt.storage.remote import FsspecStorage
    loc = json.loads(sys.argv[1])
    st = FsspecStorage(loc["url_prefix"] + "/root", loc["storage_options"])
    st.write_small("step-1/COMMIT", b"from-child", create_only=True)
    def hook(rel, i):
        print("part", i, flush=True)
        time.sleep(60)  # parked mid-upload until the parent SIGKILLs us
    st.on_part_uploaded = hook
    with knobs.override(remote_part_bytes={part}, remote_concurrency=1):
        st.write_buffer("step-2/big.bin", memoryview(bytearray({size})))
""")


def test_writer_subprocess_killed_mid_upload(blob_store: Store) -> None:
    """Connection info is plain data: a child process writes, is SIGKILLed mid-upload."""
    loc = blob_store.location()
    assert loc is not None
    part = _part_bytes(blob_store.kind)
    code = _WRITER.format(repo=str(REPO), part=part, size=3 * part)
    proc = warm_python.popen([sys.executable, "-c", code, json.dumps(loc.plain())],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # not a test time limit (pytest-timeout is that): it bounds only the wait for the child's
    # first line, and by killing the child it unblocks readline() so the assertion below can
    # report what the child said; a timed-out test would leave the child running instead
    watchdog = threading.Timer(90, lambda: os.kill(proc.pid, signal.SIGKILL))
    watchdog.start()
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("part 0"), proc.stderr.read() if proc.poll() is not None else line
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    st = _storage(blob_store)
    assert st.read_small("step-1/COMMIT") == b"from-child"
    assert not st.exists("step-2/big.bin")  # a killed multi-part upload publishes nothing
    st.write_buffer("step-2/big.bin", memoryview(b"fresh"))
    assert st.read_small("step-2/big.bin") == b"fresh"


def test_scrubber_removes_credentials() -> None:
    from nebula_ckpt.storage.remote.scrub import Scrubber as _Scrubber
    from nebula_ckpt.storage.remote.scrub import collect_secrets as _collect_secrets
    opts = {"account_name": "acct", "sas_token": "sv=2024-01-01&sp=rwdl&sig=Zm9vYmFyc2lnbmF0dXJl%3D",
            "connection_string": "AccountName=acct;AccountKey=c2VjcmV0a2V5c2VjcmV0a2V5;",
            "client_kwargs": {"endpoint_url": "http://127.0.0.1:1"},
            "config_kwargs": {"signature_version": "s3v4"}, "secret": "s3cr3t-value"}
    scrub = _Scrubber(_collect_secrets(opts))
    text = ("GET https://acct.blob.core.windows.net/c/b?sv=2024-01-01&sp=rwdl&sig=Zm9vYmFyc2lnbmF0dXJl%3D "
            "AccountKey=c2VjcmV0a2V5c2VjcmV0a2V5 secret=s3cr3t-value "
            "Authorization: SharedKey acct:c2lnbmF0dXJl X-Amz-Signature=abcdef0123 via s3v4")
    out = scrub(text)
    for s in ["Zm9vYmFyc2lnbmF0dXJl", "c2VjcmV0a2V5c2VjcmV0a2V5", "s3cr3t-value", "c2lnbmF0dXJl",
              "abcdef0123"]:
        assert s not in out
    assert "acct.blob.core.windows.net" in out and "s3v4" in out  # non-secrets kept


class _BlipMemoryFileSystem(MemoryFileSystem):
    """``memory://`` under a scheme of its own whose next ``blips`` writes fail as a network blip
    does (fsspec's ``FSTimeoutError``: transient, retried)."""

    protocol = "blipmem"
    blips = 0

    @classmethod
    def _blip(cls) -> None:
        if cls.blips > 0:
            cls.blips -= 1
            raise fsspec.exceptions.FSTimeoutError("simulated network blip")

    def pipe_file(self, path: str, value: bytes, *args: Any, **kwargs: Any) -> Any:
        self._blip()
        return super().pipe_file(path, value, *args, **kwargs)

    def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        if "w" in mode:
            self._blip()
        return super()._open(path, mode, *args, **kwargs)


def test_retry_jitter_leaves_the_global_random_stream_alone() -> None:
    """A retried blob write draws its jitter from a generator of its own: the program's ``random``
    stream (which LoopState restores for an exact resume) goes on as if no blip had happened."""
    import random

    fsspec.register_implementation("blipmem", _BlipMemoryFileSystem, clobber=True)

    def draws(blips: int, name: str) -> list[float]:
        random.seed(0)
        out = [random.random()]
        _BlipMemoryFileSystem.blips = blips
        with backoff(0.001, 0.002), _captured_logs() as logs:
            st = FsspecStorage(f"blipmem://nebula-jitter-{name}/root")
            st.write_buffer("step-1/shard.bin", memoryview(b"x" * 1000))
        assert _BlipMemoryFileSystem.blips == 0
        assert (blips > 0) == any("retrying" in line for line in logs), logs
        return out + [random.random() for _ in range(3)]

    assert draws(1, "blip") == draws(0, "clean")
