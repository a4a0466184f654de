"""tests/warm_python.py: a child forked warm behaves as the fresh interpreter it stands for.

Every case runs the same command both ways (``NEBULA_COLD_PYTHON=1`` starts a fresh interpreter)
and compares what the child saw and did: its arguments, path, folder, environment, exit status,
standard streams, what it ran at exit; a SIGKILL is a real one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import warm_python

HERE = Path(__file__).resolve().parent
PROBE = str(HERE / "probe_child.py")


def _both(args: list[str], input: Any = None, cwd: Any = None, **extra: str) -> list[subprocess.CompletedProcess[str]]:
    """The command run warm, then cold; ``extra``: more environment variables."""
    got = []
    for cold in ("0", "1"):
        env = dict(os.environ, PROBE="seen", NEBULA_COLD_PYTHON=cold, **extra,
                   PYTHONPATH=os.pathsep.join([str(HERE / "probe-extra"), os.environ.get("PYTHONPATH", "")]))
        got.append(warm_python.run(args, env=env, capture_output=True, text=True, timeout=120, input=input,
                                   cwd=cwd))
    return got


def test_a_script_sees_and_does_what_it_would_in_a_fresh_interpreter(tmp_path: Path) -> None:
    warm, cold = _both([sys.executable, PROBE, "3"], cwd=tmp_path)
    for r in (warm, cold):
        assert r.returncode == 3, r.stderr
        lines = r.stdout.splitlines()
        seen = json.loads(lines[0])
        assert seen["argv"] == [PROBE, "3"] and seen["path0"] == str(HERE) and seen["cwd"] == str(tmp_path)
        assert seen["probe"] == "seen" and seen["name"] == "__main__" and seen["file"] == "probe_child.py"
        assert seen["ours"] == [] and seen["pythonpath"] == [str(HERE / "probe-extra")]
        assert seen["main_thread_is_the_process"]
        assert lines[1:] == ["thread joined", "atexit ran"], r.stdout  # threads joined, then atexit
        assert r.stderr == "to stderr\n"
    assert warm.stdout == cold.stdout


def test_a_child_takes_the_umask_its_parent_has_when_it_starts() -> None:
    warm_python.run([sys.executable, "-c", "pass"], timeout=120)  # the server runs, with the umask of then
    old = os.umask(0o027)
    try:
        got = _both([sys.executable, "-c", "import os; m = os.umask(0); print(oct(m))"])
    finally:
        os.umask(old)
    assert [r.stdout for r in got] == ["0o27\n", "0o27\n"], got


@pytest.mark.parametrize("form", ["-c", "-m", "-u", "warnings", "ctrl-c"])
def test_code_modules_and_unbuffered_output_as_python_runs_them(form: str) -> None:
    if form == "-c":
        args = [sys.executable, "-c", "import sys; print(sys.argv, sys.path[0] == '', __name__); sys.exit(5)", "a"]
        want = ("['-c', 'a'] True __main__\n", 5)
    elif form == "-m":
        args = [sys.executable, "-m", "json.tool", "--sort-keys"]
        want = ('{\n    "a": 1,\n    "b": 2\n}\n', 0)
    elif form == "-u":
        args = [sys.executable, "-u", "-c", "import sys; print('x', file=sys.stdout); import os; os._exit(7)"]
        want = ("x\n", 7)  # written through at once: os._exit flushes nothing
    elif form == "ctrl-c":  # an uncaught KeyboardInterrupt: atexit runs, then the process dies by SIGINT
        args = [sys.executable, "-c", "import atexit; atexit.register(print, 'atexit'); raise KeyboardInterrupt"]
        want = ("atexit\n", -signal.SIGINT)
    else:  # PYTHONWARNINGS=error: a warning raised as an error, as in a fresh interpreter
        args = [sys.executable, "-c", "import sys, warnings; print(sys.warnoptions)\n"
                "try:\n    warnings.warn('w', UserWarning)\nexcept UserWarning:\n    print('raised')"]
        want = ("['error::UserWarning']\nraised\n", 0)
    env = {"PYTHONWARNINGS": "error::UserWarning"} if form == "warnings" else {}
    for r in _both(args, input='{"b": 2, "a": 1}' if form == "-m" else None, **env):
        assert (r.stdout, r.returncode) == want, r.stderr


def test_a_sigkill_is_real_and_the_status_says_so() -> None:
    p = warm_python.popen([sys.executable, "-u", "-c", "import os, time; print(os.getpid()); time.sleep(60)"],
                          stdout=subprocess.PIPE, text=True)
    assert isinstance(p, warm_python.WarmProcess)
    pid = int(p.stdout.readline())
    assert pid == p.pid and pid not in (os.getpid(), warm_python._server.pid if warm_python._server else None)
    assert p.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(0.2)
    os.kill(pid, signal.SIGKILL)
    assert p.wait(30) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:  # reaped by the server
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}")


def test_what_the_import_of_torch_reads_from_the_environment_is_honoured() -> None:
    code = "import torch; print(torch.get_num_threads())"
    got = warm_python.run([sys.executable, "-c", code], env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=120)
    assert got.stdout.strip() == "1", got.stderr
    # an interpreter setting the server did not start with: a fresh interpreter, which honours it
    p = warm_python.popen([sys.executable, "-c", "import sys; print(sys.flags.optimize)"],
                          env=dict(os.environ, PYTHONOPTIMIZE="1"), stdout=subprocess.PIPE, text=True)
    assert not isinstance(p, warm_python.WarmProcess)
    assert p.communicate(timeout=120)[0].strip() == "1"


def test_a_console_script_of_this_interpreter_runs_warm_with_its_own_name() -> None:
    cli = os.path.join(os.path.dirname(sys.executable), "nebula-ckpt")
    if not os.path.exists(cli):
        pytest.skip("nebula-ckpt is not installed in this environment")
    warm, cold = _both([cli, "--help"])
    assert warm.returncode == cold.returncode == 0 and warm.stdout == cold.stdout
    assert warm.stdout.startswith("usage: nebula-ckpt")


def test_a_server_that_cannot_start_leaves_the_children_to_start_fresh(monkeypatch: pytest.MonkeyPatch,
                                                                        capfd: pytest.CaptureFixture[str]) -> None:
    for name, value in (("_server", None), ("_failed", False)):  # this process's server left as it is
        monkeypatch.setattr(warm_python, name, value)
    for name in ("_server_path", "_server_pid"):
        monkeypatch.setattr(warm_python, name, getattr(warm_python, name))
    monkeypatch.setattr(warm_python, "__file__", "/nonexistent/warm_python.py")  # the server's script is gone
    r = warm_python.run([sys.executable, "-c", "print('ran')"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == "ran\n", r.stderr
    assert "the server did not start" in capfd.readouterr().err
    p = warm_python.popen([sys.executable, "-c", "pass"])  # said once; fresh from then on
    assert not isinstance(p, warm_python.WarmProcess) and p.wait(120) == 0


def test_the_next_test_still_starts_its_children_warm() -> None:
    """After the case above (and whatever a test did to the server's folder): warm again."""
    p = warm_python.popen([sys.executable, "-c", "pass"])
    assert isinstance(p, warm_python.WarmProcess) and p.wait(120) == 0
