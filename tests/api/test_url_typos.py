"""A blob URL with a broken scheme is refused, naming the URL it likely meant; local paths that
merely look alike stay local.

``s3:/bucket/run`` (one slash), ``az:c/run``, ``s3//bucket/run``, ``abfs:/...``, ``gs:/...``
would otherwise become a local folder (``./s3:/bucket/run``) and training would save there. The
check is at every entry point (the Checkpointer, the one-liners, the command line), before
anything is created. A folder named ``s3``, a path with a colon elsewhere (``ckpt:v2/run``,
``/data/s3:/x``) or one that starts with ``./`` is a local path as before.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt.cli import main
from nebula_ckpt.errors import ValidationError

MISTYPED = [("s3:/bucket/run", "s3://bucket/run"), ("az:/container/run", "az://container/run"),
            ("s3//bucket/run", "s3://bucket/run"), ("abfs:/c@acct.dfs.core.windows.net/run", "abfs://"),
            ("gs:/bucket/run", "gs://bucket/run"), ("s3:bucket/run", "s3://bucket/run"),
            ("S3:/bucket/run", "s3://bucket/run"), ("file:/tmp/run", "file:///tmp/run"),
            ("file://tmp/run", "file:///tmp/run")]


@pytest.mark.parametrize("root,meant", MISTYPED, ids=[m[0] for m in MISTYPED])
def test_a_mistyped_blob_url_is_refused_before_anything_is_created(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str], shm_dir: str,
                                                                   root: str, meant: str) -> None:
    monkeypatch.chdir(tmp_path)
    for call in (lambda: nc.Checkpointer(root), lambda: nc.Checkpointer(root, read_only=True),
                 lambda: nc.load_latest(root), lambda: nc.save_async(root, 0, {"w": torch.ones(2)})):
        with pytest.raises(ValidationError) as e:
            call()
        assert repr(root) in str(e.value) and meant in str(e.value), e.value
    assert main(["ls", root]) == 2  # a usage error (docs/cli.md)
    assert meant in capsys.readouterr().err
    assert os.listdir(tmp_path) == [], "a local folder was created for the mistyped URL"


def test_the_message_never_shows_a_secret_in_a_mistyped_url() -> None:
    with pytest.raises(ValidationError) as e:
        nc.Checkpointer("s3:/AKIAKEY:s3cr3t@bucket/run")
    assert "s3cr3t" not in str(e.value) and "AKIAKEY" not in str(e.value)


@pytest.mark.parametrize("root", ["s3/bucket/run", "ckpt:v2/run", "./s3:/bucket/run", "az", "data/s3:/x",
                                  "run-2024-01-01T10:00:00"])
def test_local_paths_that_look_alike_stay_local(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, shm_dir: str,
                                                root: str) -> None:
    monkeypatch.chdir(tmp_path)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, {"w": torch.ones(2)})
    assert os.path.isfile(os.path.join(tmp_path, root, "step-1", "COMMIT"))
    with nc.Checkpointer(str(tmp_path / root), read_only=True) as ck:
        assert ck.list() == [1]


def test_a_file_url_names_localhost_or_no_host(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, shm_dir: str) -> None:
    """``file://localhost/p`` is ``/p`` (RFC 8089), as a root and as a remote tier; another host
    (``file://tmp/run``, the slip for ``file:///tmp/run``) is refused above, never a folder under
    the current directory."""
    monkeypatch.chdir(tmp_path)
    with nc.Checkpointer(f"file://localhost{tmp_path}/run", memory_tier=False) as ck:
        ck.save(1, {"w": torch.ones(2)})
    assert os.path.isfile(tmp_path / "run" / "step-1" / "COMMIT")
    tier = nc.RemoteTier(f"file://localhost{tmp_path}/remote")
    assert tier.url == f"file://{tmp_path}/remote"
    with pytest.raises(ValidationError, match="did you mean 'file:///tmp/run'"):
        nc.RemoteTier("file://tmp/run")
    assert sorted(os.listdir(tmp_path)) == ["run"]
