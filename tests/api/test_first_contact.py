"""First contact: the mistakes a new user makes get a clear answer, and nothing is written."""

from __future__ import annotations

import json
import os

import fsspec
import pytest
import torch

import nebula_ckpt as nc
from memory_paths import user_dir_name
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


@pytest.mark.parametrize("read_only", [False, True])
@pytest.mark.parametrize("where", ["step-2", "step-2/deeper", "_nebula", "step-9-uncommitted"])
def test_a_folder_of_a_root_used_as_a_root_is_refused_naming_the_root(tmp_path, shm_dir, where,  # noqa: ANN001
                                                                      read_only) -> None:
    """The Hugging Face habit (``resume_from_checkpoint="out/checkpoint-500"``): a step folder (or
    one inside it, or the root's records) opened as a root would nest a run in that step, which
    the root's retention deletes with it. Refused before anything is written, naming the root."""
    run = str(tmp_path / "ckpt" / "run")
    with nc.Checkpointer(run) as ck:
        for s in (1, 2):
            ck.save(s, {"w": torch.full((2,), float(s))})
    os.makedirs(os.path.join(run, "step-9"))  # a step being written: no marker yet
    path = os.path.join(run, where.replace("-uncommitted", ""))
    before = _tree(str(tmp_path), shm_dir)
    with pytest.raises(nc.ValidationError) as e:
        nc.Checkpointer(path, read_only=read_only)
    msg = str(e.value)
    assert f"of the checkpoint root {run}" in msg and path in msg, msg
    if where.startswith("step-2"):
        assert "load(step=2)" in msg and "read(2)" in msg, msg
    assert _tree(str(tmp_path), shm_dir) == before


def test_a_memory_tier_used_as_a_root_is_refused_naming_its_run(tmp_path, shm_dir) -> None:  # noqa: ANN001
    """The memory tier's folder, as ``tiers_written``, the log and ``ls`` print it, opened as a root
    would write into that run's memory tier, whose next restore would take it for its own."""
    run = str(tmp_path / "run")
    with nc.Checkpointer(run) as ck:
        h = ck.save(3, {"w": torch.full((2,), 3.0)})
        h.result()
        folder = next(t for t in h.tiers_written if t.startswith("memory:"))[len("memory:"):]
        before = _tree(str(tmp_path), shm_dir)
        for path in (folder, os.path.join(folder, "step-3"), os.path.join(folder, "new")):
            with pytest.raises(nc.ValidationError, match="the memory tier of the run at") as e:
                nc.Checkpointer(path)
            assert f"Open {run} instead" in str(e.value)
        with nc.Checkpointer(folder, read_only=True) as reader:  # read as a folder of steps: nothing written
            assert reader.list() == [3]
        assert _tree(str(tmp_path), shm_dir) == before
        assert ck.list() == [3]


@pytest.mark.parametrize("where", ["shm", "step-named"])
def test_roots_that_only_look_alike_still_work(tmp_path, shm_dir, where) -> None:  # noqa: ANN001
    """A root under the tmpfs beside the memory tiers, and a new root named like a step folder
    (not in a root): ordinary roots."""
    path = os.path.join(shm_dir, "plain", "run") if where == "shm" else str(tmp_path / "sweep" / "step-5")
    with nc.Checkpointer(path) as ck:
        assert ck.load_latest() is None
        ck.save(1, {"w": torch.ones(2)})
    w = torch.zeros(2)
    with nc.Checkpointer(path) as ck:
        assert ck.load_latest(into={"w": w}) == 1
    assert torch.all(w == 1)


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


#: (variable, a value outside the knob's range, the range the error states) for every knob with one
OUT_OF_RANGE = [
    ("NEBULA_ZSTD_LEVEL", "99", "from -131072 to 22"), ("NEBULA_ZSTD_LEVEL", "-200000", "from -131072 to 22"),
    ("NEBULA_COPY_THREADS", "0", "from 1 to 256"), ("NEBULA_COPY_THREADS", "100000000000000000000000", "to 256"),
    ("NEBULA_IO_THREADS", "-1", "from 1 to 256"), ("NEBULA_IO_THREADS", "257", "from 1 to 256"),
    ("NEBULA_SHM_MIN_FREE", "1.5", "from 0 to 1"), ("NEBULA_SHM_MIN_FREE", "-0.1", "from 0 to 1"),
    ("NEBULA_REMOTE_TIMEOUT_S", "inf", "from 0.1 to 1000000000"), ("NEBULA_REMOTE_TIMEOUT_S", "0", "from 0.1"),
    ("NEBULA_COMMIT_TIMEOUT_S", "1e20", "from 0.1 to 1000000000"), ("NEBULA_COMMIT_TIMEOUT_S", "nan", "from 0.1"),
    ("NEBULA_REPLICA_TIMEOUT_S", "1e10", "from 0.1 to 1000000000"), ("NEBULA_REPLICA_TIMEOUT_S", "-1", "from 0.1"),
    ("NEBULA_EXIT_TIMEOUT_S", "inf", "from 0 to 1000000000"), ("NEBULA_EXIT_TIMEOUT_S", "nan", "from 0 to"),
    ("NEBULA_INCREMENTAL_FULL_EVERY", "0", ">= 1"),
]


@pytest.mark.parametrize(("env", "value", "bounds"), OUT_OF_RANGE)
def test_a_knob_out_of_its_range_is_refused_naming_the_variable_before_anything_is_written(
        tmp_path, shm_dir, monkeypatch: pytest.MonkeyPatch, env: str, value: str, bounds: str) -> None:  # noqa: ANN001
    """Above its most value as below its least (NaN, inf too): refused when the Checkpointer is
    created, naming the variable, the value and the range, not on the writer thread of a save."""
    monkeypatch.setenv(env, value)
    root = tmp_path / "ck"
    before = _tree(str(tmp_path), shm_dir)
    with pytest.raises(ValueError) as e:
        nc.Checkpointer(str(root))
    assert f"{env}={value!r}" in str(e.value) and bounds in str(e.value), str(e.value)
    assert _tree(str(tmp_path), shm_dir) == before  # no folder, no run record, no memory tier


@pytest.mark.parametrize("level", [str(knobs.ZSTD_LEVELS[0]), "-5", "0", str(knobs.ZSTD_LEVELS[1])])
def test_every_zstd_level_in_the_range_saves_and_restores_on_a_compressed_remote_tier(
        shm_dir, monkeypatch: pytest.MonkeyPatch, level: str) -> None:  # noqa: ANN001
    zstandard = pytest.importorskip("zstandard")
    assert knobs.ZSTD_LEVELS[1] == zstandard.MAX_COMPRESSION_LEVEL  # the range is zstandard's
    monkeypatch.setenv("NEBULA_ZSTD_LEVEL", level)
    url = f"memory://nebula-zstd-{os.getpid()}-{level}"
    state = {"w": torch.arange(4096, dtype=torch.float32) % 7}
    with nc.Checkpointer(url, tiers=[nc.RemoteTier(url, compression="zstd")]) as ck:
        ck.save(1, state)
    with nc.Checkpointer(url, tiers=[nc.RemoteTier(url, compression="zstd")], read_only=True) as ck:
        step, got = ck.read(1)
    assert step == 1 and torch.equal(got["w"], state["w"])
    man = json.loads(fsspec.filesystem("memory").cat(f"{url}/step-1/manifest.json"))
    assert [sh["storage"]["compression"] for sh in man["shards"]] == ["zstd"]  # stored compressed
    monkeypatch.setenv("NEBULA_ZSTD_LEVEL", str(knobs.ZSTD_LEVELS[1] + 1))  # one above: refused up front
    with pytest.raises(ValueError, match=r"NEBULA_ZSTD_LEVEL='23'.*from -131072 to 22"):
        nc.Checkpointer(url, tiers=[nc.RemoteTier(url, compression="zstd")])


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


@pytest.mark.parametrize("where", ["a file", "below a file", "its user folder a file"])
def test_a_memory_tier_folder_that_is_a_file_stands_aside_and_the_root_still_restores_and_saves(
        tmp_path, caplog, where) -> None:  # noqa: ANN001
    """NEBULA_SHM_DIR that is a file (a typo, a stray file where the tmpfs folder was), lies below
    one, or holds a file where this user's folder belongs: the memory tier stands aside with its
    warning, as for any unusable folder, and every Checkpointer (read-only too) restores the root's
    steps and saves to disk; nothing blames the root."""
    root = str(tmp_path / "ck")
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, {"w": torch.ones(4)})
    f = tmp_path / "a_file"
    f.write_text("not a folder")
    shm = {"a file": f, "below a file": f / "shm", "its user folder a file": tmp_path / "shm"}[where]
    if where == "its user folder a file":
        shm.mkdir()
        (shm / user_dir_name()).write_text("not a folder")
    with knobs.override(shm_dir=str(shm)):
        with nc.Checkpointer(root, read_only=True) as ck:
            into = {"w": torch.zeros(4)}
            assert ck.load_latest(into=into) == 1 and torch.equal(into["w"], torch.ones(4))
        with caplog.at_level("WARNING", logger="nebula_ckpt"), nc.Checkpointer(root) as ck:
            assert ck.load_latest(into={"w": torch.zeros(4)}) == 1
            ck.save(2, {"w": torch.full((4,), 2.0)})
            assert ck.list() == [1, 2]
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("memory tier" in m and ("skipped" in m or "not used" in m) for m in said), said
    assert f.read_text() == "not a folder"


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
