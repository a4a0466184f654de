"""The command line on a blob root that does not answer for some of a step's objects (Azurite, moto
S3 on 127.0.0.1; every request for those objects fails at the fsspec layer, beside the real server,
as a connection reset): a step that cannot be read is never taken for damage, nor passed over for
an older one. ``export`` / ``inspect`` stop with the outage, as ``load_latest`` raises it; ``verify``
/ ``ls`` / ``mark`` say the step could not be checked, never ``DAMAGED``: exit 3, not 1.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import nebula_ckpt as nc
from blob.conftest import Store, _store, azurite, moto_s3  # noqa: F401  (the session's servers, fixtures)
from blob.util import backoff
from nebula_ckpt import knobs
from nebula_ckpt.cli import main
from nebula_ckpt.storage.remote import RemoteUnavailableError

pytestmark = [pytest.mark.blob, pytest.mark.timeout(300)]

#: the exit code of a command that could not read what it had to (docs/cli.md)
UNREADABLE = 3


@pytest.fixture(params=["azure", "s3"])
def blob_store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """A fresh container (Azurite) / bucket (moto) per test, as tests/blob's fixture of that name."""
    yield from _store(request, request.param)


def _saved(store: Store, tagged: bool = False) -> str:
    url = store.url("run")
    with nc.Checkpointer(url, storage_options=store.storage_options, memory_tier=False, keep_last=5) as ck:
        for i in range(4):
            ck.save(i, {"w": torch.full((64,), float(i)), "i": i}, tag="last" if tagged else f"t{i}")
    return url


@contextlib.contextmanager
def _unreachable(monkeypatch: pytest.MonkeyPatch, kind: str, pattern: str) -> Iterator[None]:
    """Every read (``_cat_file``) and stat (``_info``) of an object whose path matches ``pattern``
    fails as a connection reset before it is sent, the retries too; with short retries."""
    import adlfs
    import s3fs
    from fsspec.asyn import sync_wrapper

    cls = adlfs.AzureBlobFileSystem if kind == "azure" else s3fs.S3FileSystem
    pat = re.compile(pattern)
    for name in ("_cat_file", "_info"):
        orig = getattr(cls, name)

        def make(orig: Any) -> Any:
            async def failing(self: Any, path: str, *a: Any, **kw: Any) -> Any:
                if pat.search(str(path)):
                    raise ConnectionResetError(104, "Connection reset by peer (injected)")
                return await orig(self, path, *a, **kw)
            return failing

        monkeypatch.setattr(cls, name, make(orig))
        monkeypatch.setattr(cls, name[1:], sync_wrapper(make(orig)))
    with backoff(0.01, 0.02), knobs.override(remote_timeout_s=5.0, remote_retries=2):
        yield
    monkeypatch.undo()


def _run(store: Store, *args: str) -> tuple[int, str, str]:
    o, e = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        rc = main([*args, "--storage-options", json.dumps(store.storage_options)])
    return rc, o.getvalue(), e.getvalue()


def test_export_and_inspect_stop_at_an_unreachable_newest_step_never_an_older_one(
        blob_store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = _saved(blob_store)
    to = tmp_path / "out" / "model.pt"
    for obj in ("shard", "manifest"):
        with _unreachable(monkeypatch, blob_store.kind, rf"step-3/{obj}"):
            with nc.Checkpointer(url, storage_options=blob_store.storage_options, read_only=True,
                                 memory_tier=False) as r, pytest.raises(RemoteUnavailableError):
                r.load_latest()  # what a restart does: the outage, never step 2
            for args in (["export", url, "--to", str(to)], ["inspect", url],
                         ["export", url, "--json", "--to", str(to)]):
                rc, out, err = _run(blob_store, *args)
                assert rc == UNREADABLE, (args, rc, out, err)
                assert "step 2" not in out and "skipped (damaged)" not in err, (args, out, err)
                assert "step 3" in err and "not damaged" in err and "reachable" in err, err
                if "--json" in args:
                    assert json.loads(out)["exit"] == UNREADABLE
            assert not to.exists() and not to.parent.exists()
    rc, out, _ = _run(blob_store, "export", url, "--to", str(to))
    assert rc == 0 and "step 3" in out and torch.load(to)["i"] == 3  # the store answers again


def test_export_by_tag_stops_at_its_unreachable_newest_step(blob_store: Store, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    url = _saved(blob_store, tagged=True)
    to = tmp_path / "model.pt"
    with _unreachable(monkeypatch, blob_store.kind, r"step-3/manifest"):
        rc, out, err = _run(blob_store, "export", url, "--tag", "last", "--to", str(to))
        assert rc == UNREADABLE and "step 3" in err and "not damaged" in err, (rc, out, err)
        assert not to.exists()
    rc, out, _ = _run(blob_store, "export", url, "--tag", "last", "--to", str(to))
    assert rc == 0 and "step 3" in out


def test_verify_ls_and_mark_call_an_unreachable_step_unchecked_never_damaged(
        blob_store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    url = _saved(blob_store)
    for obj in ("shard", "manifest", "COMMIT"):
        with _unreachable(monkeypatch, blob_store.kind, rf"step-2/{obj}"):
            rc, out, err = _run(blob_store, "verify", url)
            assert rc == UNREADABLE and "DAMAGED" not in out, (obj, rc, out, err)
            line = next(ln for ln in out.splitlines() if "step 2" in ln)
            assert line.startswith("UNCHECKED") and "not damaged" in line, line
            assert sum(ln.startswith("OK ") for ln in out.splitlines()) == 3, out
            rc, out, _ = _run(blob_store, "verify", url, "--json")
            rows = {r["step"]: r for r in json.loads(out)}
            assert rc == UNREADABLE and rows[2]["healthy"] is None and rows[2]["problem"] is None
            assert "step-2" in rows[2]["unchecked"] and all(rows[s]["healthy"] for s in (0, 1, 3))
            rc, out, _ = _run(blob_store, "ls", url)
            assert rc == UNREADABLE and "DAMAGED" not in out and "UNCHECKED" in out, out
            rc, out, _ = _run(blob_store, "ls", url, "--json")
            rows = {r["step"]: r for r in json.loads(out)}
            assert rc == UNREADABLE and rows[2]["healthy"] is None and rows[2]["unchecked"], rows[2]
            if obj == "COMMIT":
                rc, out, err = _run(blob_store, "mark", url, "--suspect", "2")
                assert rc == UNREADABLE and "no committed step" not in err and "not damaged" in err, (rc, err)
    rc, out, _ = _run(blob_store, "verify", url)
    assert rc == 0 and "UNCHECKED" not in out  # the same steps, once the store answers


def test_a_root_that_cannot_be_listed_is_exit_3(blob_store: Store) -> None:
    url = _saved(blob_store)
    assert blob_store.server is not None
    with backoff(0.01, 0.02), knobs.override(remote_timeout_s=5.0, remote_retries=1):
        blob_store.server.stop()
        try:
            for cmd in ("ls", "verify", "inspect"):
                rc, out, err = _run(blob_store, cmd, url)
                assert rc == UNREADABLE and "reachable" in err, (cmd, rc, out, err)
        finally:
            blob_store.server.start()
