"""First contact: the mistakes a new user makes get a clear answer, and nothing is written."""

from __future__ import annotations

import os

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt import knobs


def _tree(*roots: str) -> set[str]:
    out = set()
    for r in roots:
        for d, dirs, files in os.walk(r):
            out.update(os.path.join(d, n) for n in dirs + files)
    return out


@pytest.mark.parametrize("where", ["root", "below", "local_tier"])
def test_a_file_where_a_folder_belongs_is_a_validation_error_before_anything_is_written(
        tmp_path, shm_dir, where) -> None:  # noqa: ANN001
    f = tmp_path / "a_file"
    f.write_text("not a folder")
    before = _tree(str(tmp_path), shm_dir)
    with pytest.raises(nc.ValidationError, match="is a file, not a folder") as e:
        if where == "root":
            nc.Checkpointer(str(f))
        elif where == "below":
            nc.Checkpointer(str(f / "run" / "x"))
        else:
            nc.Checkpointer(str(tmp_path / "root"), tiers=[nc.MemoryTier(), nc.LocalTier(str(f / "disk"))])
    assert str(f) in str(e.value)
    assert _tree(str(tmp_path), shm_dir) == before  # no folder, no run.json, no memory tier
    assert f.read_text() == "not a folder"


def test_knobs_are_listed_as_a_readable_table() -> None:
    text = knobs.table()
    lines = text.splitlines()
    assert lines[0].split() == ["knob", "environment", "value", "meaning"]
    for name, (env, value, _doc) in knobs.describe().items():
        row = next(ln for ln in lines if ln.startswith(name + " "))
        assert env in row and repr(value) in row


def test_printing_knobs_describe_shows_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    described = knobs.describe()
    print(described)
    assert capsys.readouterr().out.strip() == knobs.table()  # not one raw dict on a line
    env, value, doc = described["copy_threads"]  # still the mapping it was
    assert env == "NEBULA_COPY_THREADS" and value == knobs.get("copy_threads") and doc


def test_a_memory_tier_folder_that_does_not_exist_is_said_loudly(tmp_path, caplog) -> None:  # noqa: ANN001
    """NEBULA_SHM_DIR set to a folder that is not there: the save still lands on disk, and a
    warning names the folder (the memory tier is not dropped silently)."""
    missing = str(tmp_path / "no-such-tmpfs")
    root = str(tmp_path / "ck")
    with knobs.override(shm_dir=missing), caplog.at_level("WARNING", logger="nebula_ckpt"):
        with nc.Checkpointer(root) as ck:
            ck.save(0, {"w": torch.ones(4)})
            assert list(ck.list(detailed=True)) == [f"local:{os.path.abspath(root)}"]
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("memory tier skipped" in m and missing in m and "NEBULA_SHM_DIR" in m for m in said), said


def test_building_without_a_compiler_names_the_way_out(tmp_path) -> None:  # noqa: ANN001
    """No C++ compiler: the build stops with a message that names NEBULA_NO_EXTENSION=1 (and how to
    get a compiler), not a compiler traceback; so does a compiler that fails."""
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for cxx in ("/nonexistent/c++", "/bin/false"):
        r = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path / "lib"),
                            "--build-temp", str(tmp_path / "tmp")], cwd=repo, capture_output=True, text=True,
                           timeout=600, env=dict(os.environ, CXX=cxx, CC=cxx))
        said = r.stdout + r.stderr
        assert r.returncode != 0 and "Traceback" not in said, said[-3000:]
        assert "NEBULA_NO_EXTENSION=1 pip install" in said and "C++ compiler" in said, said[-3000:]
    assert not os.path.exists(tmp_path / "lib" / "nebula_ckpt")


@pytest.mark.parametrize("how", ["not built", "broken"])
def test_the_pure_path_is_said_as_what_it_is(how: str, monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """Installed without the extension on purpose (NEBULA_NO_EXTENSION=1): one INFO line that says what
    the pure path costs, no warning; an extension that is there but does not load: a warning to rebuild."""
    import sys
    import types

    import nebula_ckpt
    from nebula_ckpt import native

    monkeypatch.setattr(native, "_native", None)
    fake = None if how == "not built" else types.ModuleType("_C")
    monkeypatch.setitem(sys.modules, "nebula_ckpt._C", fake)
    if fake is None:
        monkeypatch.delattr(nebula_ckpt, "_C", raising=False)
    else:
        monkeypatch.setattr(nebula_ckpt, "_C", fake, raising=False)
    with caplog.at_level("INFO", logger="nebula_ckpt"):
        assert native.get_ops() is native.fallback_ops()
    said = [(r.levelname, r.getMessage()) for r in caplog.records if "pure-PyTorch path" in r.getMessage()]
    assert len(said) == 1, said
    level, text = said[0]
    if how == "not built":
        assert level == "INFO" and "NEBULA_NO_EXTENSION=1" in text and "torch.save" in text, said
    else:
        assert level == "WARNING" and "does not load" in text and "Rebuild" in text, said


def test_the_demo_closing_hint_runs_as_typed(tmp_path, shm_dir) -> None:  # noqa: ANN001
    """``make demo`` ends with ``Try: <cli> ls ROOT``: typed in a shell whose PATH lacks the virtual
    environment (as after ``make demo``), from the repository and from elsewhere, it runs."""
    import subprocess

    from nebula_ckpt.demo import cli_command

    root = str(tmp_path / "demo_ckpt")
    with nc.Checkpointer(root) as ck:
        ck.save(1, {"w": torch.ones(4)})
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PATH="/usr/bin:/bin", NEBULA_SHM_DIR=shm_dir)
    for cwd in (repo, str(tmp_path)):
        cmd = f"{cli_command(cwd)} ls {root}"
        r = subprocess.run(cmd, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and "verified" in r.stdout, (cmd, r.stdout, r.stderr[-2000:])
