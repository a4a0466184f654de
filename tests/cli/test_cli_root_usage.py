"""A ROOT that is a malformed URL (a broken scheme, a scheme fsspec does not know) is a usage error
(exit 2, as documented), said before anything is read, naming the ROOT and the fix. A ROOT that is
a file, or a path under one, holds nothing (exit 1), said as such: never a raw ``[Errno 20] Not a
directory``."""

from __future__ import annotations

import os
import sys

import pytest

import warm_python
from nebula_ckpt.cli import main

#: every command that takes a ROOT, with the arguments it needs beside it
COMMANDS = {"ls": [], "verify": [], "inspect": [], "export": ["--to", "{tmp}/out.pt"], "mark": ["--healthy", "1"],
            "persist-memory": []}


def _argv(cmd: str, root: str, tmp: str) -> list[str]:
    return [cmd, root, *(a.format(tmp=tmp) for a in COMMANDS[cmd])]


@pytest.mark.parametrize("cmd", [*COMMANDS, "gc"])
def test_a_root_url_with_a_broken_scheme_is_a_usage_error(cmd: str, tmp_path, shm_dir: str,  # noqa: ANN001
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(_argv(cmd, "s3:/bucket/x", str(tmp_path)) if cmd != "gc" else ["gc", "s3:/bucket/x"]) == 2
    err = capsys.readouterr().err
    assert "'s3://bucket/x'" in err and "Traceback" not in err, err
    assert sorted(os.listdir(tmp_path)) == [], "a local folder was created for the mistyped URL"


@pytest.mark.parametrize("cmd", list(COMMANDS))
def test_a_root_url_of_an_unknown_scheme_is_a_usage_error(cmd: str, tmp_path, shm_dir: str,  # noqa: ANN001
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_argv(cmd, "nosuchscheme://bucket/x", str(tmp_path))) == 2
    err = capsys.readouterr().err
    assert "unknown URL scheme 'nosuchscheme://'" in err and "s3://bucket/prefix" in err, err


@pytest.mark.parametrize("under", [False, True], ids=["the file", "a path under it"])
@pytest.mark.parametrize("cmd", list(COMMANDS))
def test_a_root_that_is_a_file_holds_nothing_and_the_message_names_it(cmd: str, under: bool, tmp_path,  # noqa: ANN001
                                                          shm_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "a_file"
    f.write_text("not a checkpoint root")
    root = str(f / "run") if under else str(f)
    assert main(_argv(cmd, root, str(tmp_path))) == 1
    err = capsys.readouterr().err
    assert f"'{f}'" in err and "is a file" in err and "not a checkpoint root" in err, err
    assert "the folder the checkpoints were saved to" in err, err  # the fix
    assert "Errno" not in err and "Not a directory" not in err, err
    assert sorted(os.listdir(tmp_path)) == ["a_file"] and f.read_text() == "not a checkpoint root"


def test_the_installed_command_says_so_too(tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    """``nebula-ckpt ls /etc/passwd`` as a user types it (the tester's report), and ``verify s3:/bucket/x``."""
    env = {**os.environ, "NEBULA_SHM_DIR": shm_dir}
    f = tmp_path / "passwd"
    f.write_text("root:x:0:0::/root:/bin/sh\n")
    for argv, code, said in ((["ls", str(f)], 1, f"ROOT '{f}' is a file"),
                             (["verify", "s3:/bucket/x"], 2, "'s3://bucket/x'")):
        r = warm_python.run([sys.executable, "-m", "nebula_ckpt.cli", *argv], capture_output=True, text=True, env=env,
                            cwd=tmp_path)
        assert r.returncode == code and said in r.stderr and "Errno" not in r.stderr, (r.returncode, r.stderr)


@pytest.mark.parametrize("cmd", ["ls", "inspect", "verify"])
def test_a_step_folder_as_root_names_the_real_root(cmd: str, tmp_path, shm_dir: str,  # noqa: ANN001
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``nebula-ckpt ls ckpt/run/step-2`` (a folder ``find`` shows): exit 1 naming the root to give
    instead, never "no checkpoints under ..."; the memory tier's folder (as ``tiers_written``
    prints it) is listed."""
    import torch

    import nebula_ckpt as nc

    run = str(tmp_path / "run")
    with nc.Checkpointer(run) as ck:
        ck.save(1, {"w": torch.ones(2)})
        h = ck.save(2, {"w": torch.ones(2)})
        h.result()
        memory = next(t for t in h.tiers_written if t.startswith("memory:"))[len("memory:"):]
        assert main([cmd, os.path.join(run, "step-2")]) == 1
        err = capsys.readouterr().err
        assert f"step 2 of the checkpoint root {run}" in err and "no checkpoints under" not in err, err
        assert main([cmd, memory]) == 0  # a memory tier's steps may be looked at (nothing is written)
