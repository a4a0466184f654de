"""No ``nebula-ckpt`` error shows the value of ``--storage-options`` (account keys, secrets):
not for an unknown argument beside it, not for an invalid value, not for an ambiguous
abbreviation, whichever command's parser reports it; and a valid value is taken by every
command with a ROOT (``gc`` included) and shown nowhere."""

from __future__ import annotations

import json
import sys
from typing import Optional

import pytest

import warm_python
from nebula_ckpt.cli import main

SECRET = "TOPSECRET-DO-NOT-PRINT"
OPTIONS = json.dumps({"key": "AKIAEXAMPLE", "secret": SECRET, "quote's": "back\\slash"})
ROOT = "memory://nebula-cli-credentials"
#: every command with a ROOT, with what it needs besides (inspect / export: a step; mark: a verdict)
WITH_ROOT = {"ls": [], "verify": [], "inspect": ["--step", "1"], "export": ["--step", "1", "--to", "out.pt"],
             "mark": ["--healthy", "1"], "gc": ["--dry-run"], "persist-memory": []}


def _main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[Optional[int], str]:
    """``nebula-ckpt argv`` in this process: its exit code (argparse's too) and stdout + stderr."""
    try:
        rc: Optional[int] = main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else None
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


def _shown(text: str) -> bool:
    return SECRET in text or "AKIAEXAMPLE" in text or "slash" in text


def _forms(value: str) -> list[list[str]]:
    """The ways a user can give ``--storage-options``: separate value, ``=``, an abbreviation."""
    return [["--storage-options", value], [f"--storage-options={value}"], ["--storage", value],
            [f"--storage-opt={value}"]]


@pytest.mark.parametrize("cmd", [*WITH_ROOT, "doctor", "bench"])
def test_an_unknown_argument_beside_storage_options_never_shows_them(
        cmd: str, tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    monkeypatch.chdir(tmp_path)
    root = [] if cmd in ("doctor", "bench") else [ROOT]
    for form in _forms(OPTIONS):
        rc, text = _main([cmd, *root, *WITH_ROOT.get(cmd, []), "--no-such-option", *form], capsys)
        assert rc == 2 and "usage" in text or cmd == "bench", (cmd, form, text)
        assert rc == 2 and not _shown(text), (cmd, form, text)
        assert "--no-such-option" in text or cmd == "bench", text  # the error still names what is wrong


@pytest.mark.parametrize("argv", [
    ["--storage-options", OPTIONS, "ls", ROOT],         # before the command: the top parser's errors
    [f"--storage-options={OPTIONS}", "verify", ROOT],
    ["verify", ROOT, f"--st={OPTIONS}"],                # ambiguous: --storage-options or --step
    ["verify", ROOT, "--st", OPTIONS],
    ["ls", ROOT, "--storage-options", OPTIONS, "--storage-options"],  # the second one lacks its value
])
def test_no_parser_error_shows_the_value(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    rc, text = _main(argv, capsys)
    assert rc == 2 and "error" in text and not _shown(text), text


@pytest.mark.parametrize("cmd", list(WITH_ROOT))
def test_an_invalid_storage_options_value_is_a_usage_error_that_never_shows_it(
        cmd: str, tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    monkeypatch.chdir(tmp_path)
    for bad in (OPTIONS[:-1], json.dumps([SECRET])):      # not JSON (the brace missing); not an object
        for form in _forms(bad):
            rc, text = _main([cmd, ROOT, *WITH_ROOT[cmd], *form], capsys)
            assert rc == 2 and "--storage-options" in text and not _shown(text), (cmd, form, text)


@pytest.mark.parametrize("cmd", list(WITH_ROOT))
def test_every_command_with_a_root_takes_storage_options_and_shows_them_nowhere(
        cmd: str, tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    monkeypatch.chdir(tmp_path)
    for verbose in ([], ["-v"]):
        for form in _forms(OPTIONS)[:2]:
            rc, text = _main([*verbose, cmd, ROOT, *WITH_ROOT[cmd], *form], capsys)
            assert rc in (0, 1) and "usage" not in text, (cmd, form, text)  # taken: the command ran
            assert not _shown(text), (cmd, form, text)


def test_gc_storage_options_need_a_root(capsys: pytest.CaptureFixture[str]) -> None:
    rc, text = _main(["gc", "--storage-options", OPTIONS], capsys)
    assert rc == 2 and "ROOT" in text and not _shown(text), text
    rc, text = _main(["gc", "/a/local/root", "--storage-options", OPTIONS], capsys)
    assert rc == 1 and "local path" in text and not _shown(text), text


def test_the_console_script_never_shows_them() -> None:
    """The report's case, as a user runs it: ``nebula-ckpt gc ROOT --storage-options JSON`` is taken
    (it was an unknown argument, echoed with the secret), and an unknown option beside it is an
    error that does not show it."""
    for extra, rc in (([], 0), (["--no-such-option"], 2)):
        r = warm_python.run([sys.executable, "-m", "nebula_ckpt.cli", "gc", "s3://bucket/run", "--storage-options",
                            OPTIONS, *extra], capture_output=True, text=True, timeout=300)
        assert r.returncode == rc and not _shown(r.stdout + r.stderr), (r.stdout, r.stderr)
