"""A create-only write whose response was lost: the read-back that tells whether the object is ours
runs under the retry policy, and one that cannot be done is "uncertain", never "another writer's".

Faults are injected at the fsspec layer (adlfs / s3fs) beside the real Azurite / moto server: a
request that lands and then loses its response (a connection reset after the call), or one reset
before the request is sent.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from fsspec.asyn import sync_wrapper

import nebula_ckpt as nc
from nebula_ckpt import knobs
from nebula_ckpt.storage.remote import FsspecStorage, RemoteUnavailableError

from .conftest import Store
from .util import backoff


class Faults:
    """Connection resets at named coroutines of the store's fsspec class, for matching paths.

    ``add(meth, pattern, when, times)``: ``when="after"`` lets the request land and loses its
    response; ``"before"`` fails it unsent. ``hits`` records ``(meth, when)`` of each fault."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
        if kind == "azure":
            from adlfs import AzureBlobFileSystem as fs_cls
        else:
            from s3fs import S3FileSystem as fs_cls
        self.rules: list[dict[str, Any]] = []
        self.hits: list[tuple[str, str]] = []
        for meth in ("_pipe_file", "_cat_file"):
            wrapped = self._wrap(meth, getattr(fs_cls, meth))
            monkeypatch.setattr(fs_cls, meth, wrapped)
            monkeypatch.setattr(fs_cls, meth[1:], sync_wrapper(wrapped))

    def add(self, meth: str, pattern: str, when: str, times: int = 1) -> None:
        self.rules.append({"meth": meth, "pat": re.compile(pattern), "when": when, "left": times})

    def _match(self, meth: str, path: str) -> str:
        for r in self.rules:
            if r["meth"] == meth and r["left"] > 0 and r["pat"].search(path):
                r["left"] -= 1
                self.hits.append((meth, r["when"]))
                return str(r["when"])
        return ""

    def _wrap(self, meth: str, orig: Any) -> Any:
        async def wrapped(fs: Any, path: str, *args: Any, **kwargs: Any) -> Any:
            when = self._match(meth, path)
            if when == "before":
                raise ConnectionResetError(104, "Connection reset by peer (injected)")
            out = await orig(fs, path, *args, **kwargs)
            if when == "after":
                raise ConnectionResetError(104, "Connection reset by peer (injected)")
            return out
        return wrapped


def _state(i: int) -> dict[str, Any]:
    return {"w": torch.full((256,), float(i)), "i": i}


def test_a_commit_whose_response_and_first_read_back_are_lost_is_committed(
        blob_store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The COMMIT create lands, its response is lost, the retry answers "exists", and one reset
    hits the read-back: the save succeeded (no CommitUncertain), and the next save goes on."""
    faults = Faults(monkeypatch, blob_store.kind)
    url = blob_store.url("run")
    with knobs.override(shm_dir=str(tmp_path)), backoff(0.01), \
            nc.Checkpointer(url, storage_options=blob_store.storage_options, memory_tier=False) as ck:
        ck.save(0, _state(0))
        faults.add("_pipe_file", r"step-1/COMMIT$", "after")  # landed, response lost
        faults.add("_cat_file", r"step-1/COMMIT$", "before")  # one reset on the read-back
        h = ck.save_async(1, _state(1))
        assert h.wait(60)
        assert h.error() is None, h.error()
        assert faults.hits == [("_pipe_file", "after"), ("_cat_file", "before")]
        ck.save(2, _state(2))  # on_persist_error="raise": nothing unseen is raised here
        assert ck.list() == [0, 1, 2]
    with knobs.override(shm_dir=str(tmp_path)), \
            nc.Checkpointer(url, storage_options=blob_store.storage_options, memory_tier=False) as ck2:
        _, got = ck2.read(1)
    assert got["i"] == 1 and torch.equal(got["w"], _state(1)["w"])


def test_a_read_back_that_cannot_be_done_is_uncertain_not_another_writers(
        blob_store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a lost create response: a read-back failing through every retry raises an outage
    that says the object may be ours (never FileExistsError); other bytes there stay
    FileExistsError."""
    faults = Faults(monkeypatch, blob_store.kind)
    st = FsspecStorage(blob_store.url("root"), blob_store.storage_options)
    try:
        with backoff(0.01), knobs.override(remote_retries=3):
            faults.add("_pipe_file", r"a/COMMIT$", "after")
            faults.add("_cat_file", r"a/COMMIT$", "before", times=3)
            with pytest.raises(RemoteUnavailableError) as ei:
                st.write_small("a/COMMIT", b"ours", create_only=True)
            assert not isinstance(ei.value, FileExistsError)
            assert "uncertain" in str(ei.value) and "may be this write's own" in str(ei.value)
            assert "a/COMMIT" in str(ei.value)
            assert st.read_small("a/COMMIT") == b"ours"  # it was ours indeed

            st.write_small("b/COMMIT", b"theirs", create_only=True)
            faults.add("_pipe_file", r"b/COMMIT$", "before")  # our first try never sent
            with pytest.raises(FileExistsError):
                st.write_small("b/COMMIT", b"ours", create_only=True)
        assert faults.hits == [("_pipe_file", "after")] + [("_cat_file", "before")] * 3 + [("_pipe_file", "before")]
    finally:
        st.close()
