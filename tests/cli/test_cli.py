"""The nebula-ckpt command line: ls, verify, inspect, export; exit codes and --json."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import nebula_ckpt as nc
import warm_python
from nebula_ckpt.cli import main


@pytest.fixture
def saved(root: str) -> str:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, {"model": model, "step": 1, "cfg": {"lr": 0.1, "betas": (0.9, 0.99)}})
        _train(model)   # each step holds bytes of its own (incremental saves write what changed)
        ck.save(2, {"model": model, "step": 2, "cfg": {"lr": 0.1, "betas": (0.9, 0.99)}})
    os.makedirs(os.path.join(root, "step-3"))  # an uncommitted leftover
    return root


def _train(model: torch.nn.Module) -> None:
    """Change every parameter, as a training step would."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)


def _row(out: str, step: int) -> str:
    """The row of ``step`` in ``nebula-ckpt ls``'s table (columns: tier, step, written, referenced,
    needs, tag, state, health)."""
    return next(ln for ln in out.splitlines()[1:] if ln.split()[1:2] == [str(step)])


def test_ls_json(saved: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", saved, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    by_step = {r["step"]: r for r in rows}
    assert by_step[1]["committed"] and by_step[1]["healthy"] and by_step[1]["bytes"] > 0
    assert not by_step[3]["committed"] and not by_step[3]["healthy"]


def test_ls_text_and_empty(saved: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    assert main(["ls", saved]) == 0
    out = capsys.readouterr().out
    assert _row(out, 1).split()[-2:] == ["verified", "unknown"] and "uncommitted" in _row(out, 3)
    assert main(["ls", str(tmp_path / "nothing")]) == 1


def test_verify_exit_codes(saved: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", saved, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in res] == [1, 2] and all(r["healthy"] for r in res)
    shard = next(f for f in os.listdir(os.path.join(saved, "step-2")) if f.endswith(".safetensors"))
    p = os.path.join(saved, "step-2", shard)
    with open(p, "r+b") as f:
        f.seek(-3, 2)
        f.write(b"\xff\xfe\xfd")
    assert main(["verify", saved]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED" in out and "step 2" in out and "model/" in out
    assert main(["verify", saved, "--step", "1"]) == 0
    assert main(["verify", saved, "--step", "99"]) == 1


def test_verify_json_with_nothing_to_check_is_one_json_document(saved: str, tmp_path,  # noqa: ANN001
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    for argv in (["verify", str(empty), "--json"], ["verify", saved, "--step", "99", "--json"]):
        assert main(argv) == 1
        captured = capsys.readouterr()
        assert json.loads(captured.out) == [], captured.out  # stdout is the JSON alone
        assert "no committed checkpoint" in captured.err
    assert main(["verify", str(empty)]) == 1  # without --json the sentence is the output
    assert "no committed checkpoint" in capsys.readouterr().out


@pytest.mark.parametrize("cmd", ["verify", "inspect", "export"])
def test_a_step_that_is_no_step_number_is_a_usage_error_for_every_command(
        saved: str, cmd: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    extra = ["--to", str(tmp_path / "out.pt")] if cmd == "export" else []
    for value in ("-1", "soon"):
        with pytest.raises(SystemExit) as ei:
            main([cmd, saved, "--step", value, *extra])
        assert ei.value.code == 2
        err = capsys.readouterr().err
        assert "--step" in err and "step number" in err, err


def test_ls_of_a_root_where_nothing_committed_exits_1(root: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The first save was killed while it wrote: its folder is there, its commit marker is not."""
    os.makedirs(os.path.join(root, "step-1"))
    with open(os.path.join(root, "step-1", "shard-g1-r0.safetensors"), "wb") as f:
        f.write(b"\0" * 64)
    assert main(["ls", root]) == 1
    captured = capsys.readouterr()
    assert "uncommitted" in _row(captured.out, 1) and "no committed checkpoint" in captured.err
    assert main(["ls", root, "--json"]) == 1
    assert [(r["step"], r["committed"]) for r in json.loads(capsys.readouterr().out)] == [(1, False)]


def test_a_reader_that_goes_away_ends_the_command_quietly(saved: str) -> None:
    """``nebula-ckpt ls ROOT | head``: the reader closed the pipe before the output was written."""
    p = warm_python.popen([sys.executable, "-m", "nebula_ckpt.cli", "ls", saved], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE)
    assert p.stdout is not None
    p.stdout.close()
    _, err = p.communicate(timeout=300)
    assert err == b"", err  # neither "[Errno 32] Broken pipe" nor an ignored exception at exit
    assert p.returncode == 1  # what Python's documentation advises for a closed pipe


def test_inspect(saved: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", saved, "--step", "2", "--full"]) == 0
    out = capsys.readouterr().out
    assert "model/weight" in out and "float32" in out and "(4, 8)" in out
    assert "'betas'" in out and "0.9" in out
    assert main(["inspect", saved, "--step", "2", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["step"] == 2 and "model/bias" in info["tensors"]
    assert main(["inspect", saved, "--step", "7"]) == 1


def test_inspect_summarises_by_default(root: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A small training run's state (a model, AdamW, a scheduler, a LoopState with every random
    stream) is a few lines by default: a row per top-level key with its kind, tensors, bytes and
    other values, and the totals; ``--full`` lists every tensor and value."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(5, {"model": model, "optim": opt, "sched": sched, "loop": nc.LoopState(), "step": 5})
    capsys.readouterr()
    assert main(["inspect", root]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) <= 10, lines
    assert lines[0].startswith("step 5  (")
    assert lines[1].split() == ["key", "kind", "tensors", "bytes", "other", "values"]
    rows = {ln.split()[0]: ln.split() for ln in lines[2:-1]}
    assert rows["model"][1:3] == ["torch.nn.modules.container.Sequential", "4"]
    assert rows["optim"][1:3] == ["torch.optim.adamw.AdamW", "12"] and rows["sched"][2] == "0"
    assert rows["step"][1:] == ["int", "0", "-", "=", "5"]
    assert int(rows["loop"][2]) >= 3 and int(rows["total"][1]) == 4 + 12 + int(rows["loop"][2]), rows
    assert main(["inspect", root, "--full"]) == 0
    full = capsys.readouterr().out
    assert len(full.splitlines()) > 3 * len(lines) and "model/0.weight" in full


def test_a_step_that_is_not_there_is_answered_with_the_steps_that_are(saved: str,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    for cmd in (["inspect"], ["export", "--to", "never.pt"]):
        capsys.readouterr()
        assert main([cmd[0], saved, "--step", "999", *cmd[1:]]) == 1
        err = capsys.readouterr().err
        assert "no checkpoint of step 999" in err and "committed steps there: 1, 2" in err, err


def test_export_both_formats(saved: str, tmp_path) -> None:  # noqa: ANN001
    st = str(tmp_path / "out.safetensors")
    assert main(["export", saved, "--step", "2", "--to", st]) == 0
    tensors = load_file(st)
    pt = str(tmp_path / "out.pt")
    assert main(["export", saved, "--step", "2", "--to", pt]) == 0
    tree = torch.load(pt, weights_only=True)
    assert torch.equal(tree["model"]["weight"], tensors["model/weight"])
    assert tree["step"] == 2 and tree["cfg"]["betas"] == (0.9, 0.99)


def test_a_torch_export_is_read_by_a_plain_torch_load_and_by_bench(root: str, tmp_path,  # noqa: ANN001
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A state holding NumPy values (np.random's state, a LoopState's streams, a NumPy scalar):
    ``export --to state.pt`` writes them as tensors and Python numbers, says so, and plain
    ``torch.load`` (weights_only=True, torch's default) and ``bench --state`` read the file."""
    from nebula_ckpt import quickbench

    np_state = np.random.get_state()
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, {"model": torch.nn.Linear(4, 2), "np_rng": np_state, "loop": nc.LoopState(),
                    "lr": np.float32(0.5), "step": 1})
    capsys.readouterr()
    pt = tmp_path / "state.pt"
    assert main(["export", root, "--to", str(pt)]) == 0
    err = capsys.readouterr().err
    assert "NumPy value(s) are written as torch tensors" in err and "np_rng/1" in err and "lr" in err, err
    tree = torch.load(pt)  # weights_only=True: the default
    assert torch.equal(tree["np_rng"][1], torch.from_numpy(np_state[1])) and tree["np_rng"][2] == np_state[2]
    assert type(tree["lr"]) is float and tree["lr"] == 0.5 and tree["step"] == 1
    state, _ = quickbench.load_state(quickbench.Options(state=str(pt)))
    assert torch.equal(state["model"]["weight"], tree["model"]["weight"])
    assert main(["export", root, "--to", str(tmp_path / "s.pt"), "--json"]) == 0
    assert "np_rng/1" in json.loads(capsys.readouterr().out)["converted"]


def test_a_safetensors_export_names_what_it_leaves_out(saved: str, tmp_path,  # noqa: ANN001
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    out = tmp_path / "x.safetensors"
    assert main(["export", saved, "--step", "2", "--to", str(out)]) == 0
    err = capsys.readouterr().err
    assert "holds tensors only: 4 other value(s) of step 2" in err, err
    assert "step, cfg/lr, cfg/betas/0, cfg/betas/1" in err and ".pt file" in err, err
    assert main(["export", saved, "--step", "2", "--to", str(tmp_path / "y.safetensors"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["left_out"] == ["step", "cfg/lr", "cfg/betas/0", "cfg/betas/1"]


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_a_dtype_safetensors_lacks_is_refused_naming_it_before_anything_is_made(  # noqa: ANN001
        root: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    state = {"w": torch.randn(4), "phase": torch.randn(3, dtype=torch.complex128),
             "half": torch.randn(2, dtype=torch.complex64).to(torch.complex32),
             "raw": torch.arange(5, dtype=torch.int16).view(torch.bits16)}
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, state)
        ck.save(2, {"model": state})
    capsys.readouterr()
    for step, key, to in ((1, [], str(tmp_path / "out" / "x.safetensors")),
                          (2, ["--key", "model"], str(tmp_path / "hf") + os.sep),  # a folder: model.safetensors
                          (2, [], str(tmp_path / "new" / "y.safetensors"))):
        assert main(["export", root, "--step", str(step), *key, "--to", to]) == 1
        err = capsys.readouterr().err
        prefix = "model/" if step == 2 else ""
        for name, dtype in (("phase", "complex128"), ("half", "complex32"), ("raw", "bits16")):
            assert f"'{prefix}{name}' ({dtype})" in err, err
        assert "--format torch" in err and "KeyError" not in err and f"'{prefix}w'" not in err, err
        assert not os.path.exists(os.path.dirname(to))  # no folder made
    to = tmp_path / "out" / "x.pt"  # what the message says: a torch.save file keeps them
    assert main(["export", root, "--step", "1", "--to", str(to)]) == 0
    got = torch.load(to, weights_only=True)
    for k, v in state.items():
        assert got[k].dtype == v.dtype and got[k].view(torch.uint8).equal(v.view(torch.uint8)), k


def test_version_says_which_path_runs_and_why(capsys: pytest.CaptureFixture[str]) -> None:
    from nebula_ckpt import knobs
    from nebula_ckpt.native import describe

    assert main(["--version"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"nebula-ckpt {nc.__version__} ({describe()['path']} path") and torch.__version__ in line
    with knobs.override(disable_native=True):
        assert main(["--version"]) == 0
    assert "(pure-pytorch path: disabled by NEBULA_DISABLE_NATIVE" in capsys.readouterr().out


def test_doctor_reports_path_cuda_memory_tier_compiler_and_backends(shm_dir: str,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from nebula_ckpt import knobs

    main(["doctor", "--json"])  # exit 0 or 1: depends on this machine
    f = json.loads(capsys.readouterr().out)
    assert f["version"] == nc.__version__ and f["path"] in ("native", "pure-pytorch") and f["shm"]["dir"] == shm_dir
    assert set(f["backends"]) == {"az", "s3", "gs"} and "available" in f["cuda"]
    free = f["shm"]["bytes"]
    rc = main(["doctor", "--size-gb", str(free / 1e9)])  # twice the tmpfs' size: too small for it
    text = capsys.readouterr().out
    assert rc == 1 and any(ln.startswith("! memory tier:") and "too small" in ln and "--shm-size" in ln
                           for ln in text.splitlines()), text
    assert "C++ compiler:" in text and "blob backends:" in text
    with knobs.override(disable_native=True):
        rc = main(["doctor", "--size-gb", "0.000001"])
    text = capsys.readouterr().out
    assert rc == 1 and "! pure-PyTorch path: disabled by NEBULA_DISABLE_NATIVE" in text, text
    assert "NEBULA_NO_EXTENSION=1" in text  # a user who chose the pure path on purpose is told it is fine


def test_every_command_takes_json() -> None:
    """docs/cli.md: every command takes ``--json`` (bench's own options do too; ``--version`` is one line)."""
    from nebula_ckpt.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sp in sub.choices.items():
        if name != "bench":  # the harness's own parser (bench --help)
            assert any("--json" in a.option_strings for a in sp._actions), name


def test_console_script_usage_error() -> None:
    r = warm_python.run([sys.executable, "-m", "nebula_ckpt.cli", "inspect"], capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr


def _flip_last_byte(root: str, step: int) -> None:
    d = os.path.join(root, f"step-{step}")
    p = os.path.join(d, next(f for f in os.listdir(d) if f.endswith(".safetensors")))
    with open(p, "r+b") as f:
        f.seek(-1, 2)
        b = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([b[0] ^ 0xFF]))


def test_ls_checks_checksums_like_verify(saved: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A flipped byte keeps every size right: ls must still say DAMAGED (it verifies fully), as verify does."""
    _flip_last_byte(saved, 2)
    assert main(["ls", saved, "--json"]) == 1   # damage found: exit 1, as verify
    captured = capsys.readouterr()
    rows = {r["step"]: r for r in json.loads(captured.out)}
    assert rows[1]["healthy"] and rows[1]["verified"] == "full"
    assert rows[2]["healthy"] is False and "checksum mismatch" in rows[2]["problem"]
    assert captured.err == ""  # --json: no progress bar
    assert main(["ls", saved]) == 1
    captured = capsys.readouterr()
    line2 = _row(captured.out, 2)
    assert "DAMAGED" in line2 and "checksum mismatch" in line2
    assert captured.err == ""  # no progress bar: stderr is no terminal
    assert main(["verify", saved, "--step", "2"]) == 1


def test_ls_quick_checks_sizes_only(saved: str, capsys: pytest.CaptureFixture[str]) -> None:
    _flip_last_byte(saved, 2)
    assert main(["ls", saved, "--quick"]) == 0
    out = capsys.readouterr().out
    assert not any(ln.split()[-2:-1] == ["verified"] for ln in out.splitlines())  # no row says it was verified
    line2 = _row(out, 2)
    assert "committed (not verified)" in line2
    assert main(["ls", saved, "--quick", "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[2]["verified"] == "size" and rows[2]["committed"]
    os.truncate(os.path.join(saved, "step-1", "shard-g1-r0.safetensors"), 100)
    assert main(["ls", saved, "--quick"]) == 1
    line1 = _row(capsys.readouterr().out, 1)
    assert "DAMAGED" in line1 and "truncated" in line1


def _break_manifest(root: str, step: int) -> None:
    """A hostile manifest with a valid commit checksum: a bogus dtype."""
    import crc32c

    d = os.path.join(root, f"step-{step}")
    man = json.load(open(os.path.join(d, "manifest.json")))
    man["tensors"]["model/weight"]["dtype"] = "float99"
    mb = json.dumps(man).encode()
    open(os.path.join(d, "manifest.json"), "wb").write(mb)
    commit = json.load(open(os.path.join(d, "COMMIT")))
    commit.update(manifest_bytes=len(mb), manifest_crc32c=crc32c.crc32c(mb))
    open(os.path.join(d, "COMMIT"), "w").write(json.dumps(commit))


@pytest.mark.parametrize("cmd", [["inspect"], ["inspect", "--json"], ["export", "--to", "X.pt"],
                                 ["export", "--to", "X.safetensors"]])
def test_inspect_and_export_fail_cleanly_on_damage(saved: str, tmp_path, cmd: list[str]) -> None:  # noqa: ANN001
    _break_manifest(saved, 2)
    cmd = [c.replace("X", str(tmp_path / "out")) for c in cmd]
    r = warm_python.run([sys.executable, "-m", "nebula_ckpt.cli", cmd[0], saved, "--step", "2", *cmd[1:]],
                        capture_output=True, text=True)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and "float99" in r.stderr and "step 2" in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / "out.pt") and not os.path.exists(tmp_path / "out.safetensors")


@pytest.mark.parametrize("cmd", ["ls", "verify", "inspect", "export"])
def test_storage_options_bad_json_is_a_usage_error_without_the_value(cmd: str) -> None:
    secret = '{"account_key": "SECRET-KEY-abc123"'  # not valid JSON: the closing brace is missing
    extra = {"inspect": ["--step", "1"], "export": ["--step", "1", "--to", "x.pt"]}.get(cmd, [])
    r = warm_python.run([sys.executable, "-m", "nebula_ckpt.cli", cmd, "az://c/ckpt", "--storage-options", secret,
                        *extra], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert "usage" in r.stderr and "--storage-options" in r.stderr and "not valid JSON" in r.stderr
    assert "SECRET" not in r.stderr + r.stdout and "Traceback" not in r.stderr


def test_storage_options_must_be_an_object(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        main(["ls", "/nowhere", "--storage-options", '["SECRET"]'])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "JSON object" in err and "SECRET" not in err


def _link_into_step(root: str, step: int, what: str, elsewhere: str) -> str:
    """Replace ``what`` of ``step`` (its shard, manifest, commit marker or whole folder) by a
    symlink to an intact copy outside the root; return the link's path below the root."""
    d = os.path.join(root, f"step-{step}")
    if what == "step folder":
        shutil.copytree(d, elsewhere)
        shutil.rmtree(d)
        os.symlink(elsewhere, d)
        return f"step-{step}"
    name = {"shard": next((f for f in os.listdir(d) if f.endswith(".safetensors")), ""),
            "manifest": "manifest.json", "commit marker": "COMMIT"}[what]
    shutil.copy(os.path.join(d, name), elsewhere)
    os.unlink(os.path.join(d, name))
    os.symlink(elsewhere, os.path.join(d, name))
    return f"step-{step}/{name}"


@pytest.mark.parametrize("what", ["shard", "manifest", "commit marker", "step folder"])
def test_a_symlink_in_a_step_is_damage_to_every_command(saved: str, tmp_path, what: str,  # noqa: ANN001
                                                         capsys: pytest.CaptureFixture[str],
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """Links inside a tier are never followed, so a step with one (even to an intact copy) cannot be
    read: ls lists it DAMAGED naming the link, verify exits 1 naming it, inspect and export refuse
    it naming it, and a restore falls back to the older healthy step."""
    link = _link_into_step(saved, 2, what, str(tmp_path / "elsewhere"))
    assert main(["ls", saved, "--json"]) == 1
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[1]["healthy"] and not rows[3]["committed"]
    assert rows[2]["committed"] and not rows[2]["healthy"], rows[2]
    assert f"'{link}'" in rows[2]["problem"] and "symlink" in rows[2]["problem"], rows[2]
    assert main(["ls", saved]) == 1
    line2 = _row(capsys.readouterr().out, 2)
    assert "DAMAGED" in line2 and f"'{link}'" in line2
    for args in ([], ["--step", "2"]):
        assert main(["verify", saved, *args]) == 1
        out = capsys.readouterr().out
        assert "DAMAGED local" in out and "step 2" in out and f"'{link}'" in out, out
    assert main(["verify", saved, "--step", "1"]) == 0
    capsys.readouterr()
    for cmd in (["inspect"], ["export", "--to", str(tmp_path / "out.pt")]):
        assert main([cmd[0], saved, "--step", "2", *cmd[1:]]) == 1
        err = capsys.readouterr().err
        assert f"'{link}'" in err and "symlink" in err, err
    assert not os.path.exists(tmp_path / "out.pt")
    model = torch.nn.Linear(8, 4)
    with nc.Checkpointer(saved, memory_tier=False) as ck:
        assert ck.load_latest(into={"model": model, "step": 0, "cfg": None}) == 1
    assert any(f"'{link}'" in r.getMessage() for r in caplog.records if r.levelname == "WARNING"), caplog.text


# -- what a new user runs into ---------------------------------------------------------------------
@pytest.fixture
def tagged(root: str) -> str:
    """Steps 1, 2, 3 tagged warmup, epoch-1, epoch-1 (a tag saved twice: its newest step counts)."""
    model = torch.nn.Linear(8, 4)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        for step, tag in ((1, "warmup"), (2, "epoch-1"), (3, "epoch-1")):
            _train(model)
            ck.save(step, {"model": model, "step": step}, tag=tag)
    return root


def test_inspect_and_export_take_a_tag_or_latest(tagged: str, tmp_path,  # noqa: ANN001
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", tagged, "--tag", "warmup", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 1
    assert main(["inspect", tagged, "--tag", "epoch-1"]) == 0
    assert capsys.readouterr().out.startswith("step 3 ")
    for latest in (["--step", "latest"], []):  # no --step / --tag: the newest healthy step
        assert main(["inspect", tagged, *latest, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["step"] == 3
    out = str(tmp_path / "warm.pt")
    assert main(["export", tagged, "--tag", "warmup", "--to", out, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 1 and torch.load(out, weights_only=True)["step"] == 1
    assert main(["export", tagged, "--step", "latest", "--to", out]) == 0
    assert torch.load(out, weights_only=True)["step"] == 3
    capsys.readouterr()
    assert main(["inspect", tagged, "--tag", "epoch-9"]) == 1
    err = capsys.readouterr().err
    assert "no committed checkpoint tagged 'epoch-9'" in err and "'warmup'" in err and "'epoch-1'" in err
    _flip_last_byte(tagged, 3)  # the newest is damaged: latest is the newest healthy one
    assert main(["export", tagged, "--to", out, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 2


@pytest.mark.parametrize("argv", [["--step", "3", "--tag", "warmup"], ["--step", "soon"]])
def test_step_and_tag_usage_errors(tagged: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        main(["inspect", tagged, *argv])
    assert ei.value.code == 2
    assert "--step" in capsys.readouterr().err


class Opaque:
    """A value only pickle can store."""

    def __init__(self, n: int) -> None:
        self.n = n


def test_the_pickle_hint_names_the_cli_flag(root: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    with nc.Checkpointer(root, memory_tier=False, allow_pickle=True) as ck:
        ck.save(1, {"w": torch.ones(2), "obj": Opaque(7)})
    out = str(tmp_path / "x.pt")
    assert main(["export", root, "--step", "1", "--to", out]) == 1
    err = capsys.readouterr().err
    assert "--allow-pickle" in err and "allow_pickle=True" not in err and "'obj'" in err, err
    assert not os.path.exists(out)
    assert main(["export", root, "--step", "1", "--to", out, "--allow-pickle"]) == 0
    assert torch.load(out, weights_only=False)["obj"].n == 7


def test_export_creates_the_folder_of_to(saved: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    deep = tmp_path / "no" / "such" / "dir" / "x.pt"
    assert main(["export", saved, "--step", "2", "--to", str(deep)]) == 0
    assert torch.load(deep, weights_only=True)["step"] == 2
    capsys.readouterr()
    # --to naming a folder (existing, or ending in a separator): a file named for the step inside it
    for folder in (str(tmp_path / "out") + os.sep, str(tmp_path / "no")):
        assert main(["export", saved, "--step", "2", "--to", folder, "--json"]) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["to"] == os.path.join(folder.rstrip(os.sep), "step-2.safetensors")
        assert set(load_file(info["to"])) == {"model/weight", "model/bias"}
    # a failed export creates no folder
    _flip_last_byte(saved, 1)
    assert main(["export", saved, "--step", "1", "--to", str(tmp_path / "new" / "x.pt")]) == 1
    assert not os.path.exists(tmp_path / "new")


def test_export_to_below_a_file_is_a_clear_error(saved: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    (tmp_path / "a_file").write_text("keep me")
    assert main(["export", saved, "--step", "2", "--to", str(tmp_path / "a_file" / "x.pt")]) == 1
    err = capsys.readouterr().err
    assert "a_file" in err and "not a folder" in err and "Traceback" not in err, err
    assert (tmp_path / "a_file").read_text() == "keep me"


def test_ls_has_a_header_and_human_sizes(saved: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", saved]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["tier", "step", "written", "referenced", "needs", "tag", "state", "health"]
    row = _row("\n".join(lines), 2)
    assert " B " in row or "KiB" in row, row  # a 200-byte checkpoint is not "0.0 MiB"
    assert "0.0 MiB" not in "\n".join(lines)
    from nebula_ckpt.cli.common import human_bytes

    assert [human_bytes(n) for n in (0, 999, 1536, 5 * 2**20, 3 * 2**40)] == \
        ["0 B", "999 B", "1.5 KiB", "5.0 MiB", "3.0 TiB"]


def test_compression_ratio_only_when_compressed(tmp_path, shm_dir, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    state = {"w": torch.zeros(64, 1024)}  # compresses well
    plain, packed = "memory://nebula-cli-ratio/plain", "memory://nebula-cli-ratio/packed"
    for url, comp in ((plain, None), (packed, "zstd")):
        with nc.Checkpointer(url, tiers=[nc.RemoteTier(url, compression=comp)]) as ck:
            ck.save(1, state)
    assert main(["ls", plain, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["compression_ratio"] is None and row["compression"] is None
    assert main(["ls", packed, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["compression"] == "zstd" and row["compression_ratio"] > 10
    assert main(["ls", packed]) == 0
    assert "zstd x" in capsys.readouterr().out


def _ls_on_a_terminal(root: str, *extra: str, delay: str | None = None, cmd: str = "ls",
                      env: dict[str, str] | None = None) -> str:
    """stderr of ``nebula-ckpt ls`` (or ``cmd``) run with a pseudo-terminal as its stderr."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new pty is 0 columns wide
    # the command in a fresh process, with the bar's delay (a module constant) set in its own code
    code = ("import sys; from nebula_ckpt.cli import common, main; "
            + (f"common.PROGRESS_DELAY_S = {float(delay)!r}; " if delay is not None else "")
            + "sys.argv[0] = 'nebula-ckpt'; sys.exit(main())")
    try:
        r = warm_python.run([sys.executable, "-c", code, cmd, root, *extra], stdout=subprocess.PIPE,
                            stderr=slave, timeout=120, env=env)
        os.close(slave)
        chunks = []
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child's side is closed and everything was read
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(master)
    assert r.returncode == 0
    return b"".join(chunks).decode(errors="replace")


def test_progress_bars_only_on_a_terminal_for_long_work(saved: str, capsys: pytest.CaptureFixture[str]) -> None:
    os.rmdir(os.path.join(saved, "step-3"))  # no leftover: ls exits 0
    assert main(["ls", saved]) == 0
    assert capsys.readouterr().err == ""  # stderr is no terminal here
    assert "checking" in _ls_on_a_terminal(saved, delay="0")  # long work on a terminal (any work, at delay 0)
    assert "checking" not in _ls_on_a_terminal(saved, "--json", delay="0")
    assert "checking" not in _ls_on_a_terminal(saved)  # two small checkpoints: done before the bar's delay


KILLED_AFTER_A_MEMORY_ONLY_STEP = r"""
import os, signal, sys, torch, nebula_ckpt as nc
ck = nc.Checkpointer(sys.argv[1], tiers=[nc.MemoryTier(), nc.LocalTier(sys.argv[1], every=2)])
for s in (1, 2):
    ck.save(s, {"w": torch.full((1024,), float(s))})
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_persist_memory_shows_progress_only_for_long_work(root: str, shm_dir: str) -> None:
    """A quick persist-memory on a terminal prints its answer alone, as every command does."""
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir)
    for delay in (None, "0"):
        warm_python.run([sys.executable, "-c", KILLED_AFTER_A_MEMORY_ONLY_STEP, root], env=env, capture_output=True,
                        timeout=120)
        err = _ls_on_a_terminal(root, delay=delay, cmd="persist-memory", env=env)
        assert ("part written" in err) == (delay == "0"), err  # a few KiB: done before the delay
        shutil.rmtree(root)


# -- nebula-ckpt bench: the harness of a checkout, else the quick benchmark ---------------------------
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _installed_copy(tmp_path) -> str:  # noqa: ANN001
    """The package alone in a site-packages-like folder (what pip installs: no benchmarks/ beside it)."""
    site = tmp_path / "site-packages"
    shutil.copytree(os.path.join(REPO, "nebula_ckpt"), site / "nebula_ckpt",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return str(site)


def _bench(pythonpath: str, cwd: str, *argv: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=pythonpath)
    return warm_python.popen([sys.executable, "-m", "nebula_ckpt.cli", "bench", *argv], cwd=cwd, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _done(p: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=300)
    return p.returncode, out, err


def test_bench_state_is_the_same_command_in_every_install_mode(tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    """``nebula-ckpt bench --state FILE`` measures the file in a checkout (an editable install imports
    the package of the checkout), with an installed package run from inside a checkout, and with an
    installed package elsewhere; a state ``export --to state.pt`` wrote is such a file."""
    state = tmp_path / "state.pt"
    torch.save({"model": {"w": torch.randn(64, 64)}, "step": 3, "rng": torch.get_rng_state()}, state)
    installed = _installed_copy(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    argv = ["--state", str(state), "--saves", "2", "--torch-reps", "1", "--root", str(tmp_path), "--json"]
    modes = {"checkout": _bench(REPO, str(elsewhere), *argv),
             "installed, in a checkout": _bench(installed, REPO, *argv),
             "installed": _bench(installed, str(elsewhere), *argv)}
    for mode, p in modes.items():
        rc, out, err = _done(p)
        assert rc == 0, (mode, err[-3000:])
        res = json.loads(out)
        assert res["source"] == f"file: {state}" and res["tensors"] == 2, (mode, res)
        assert res["nebula"]["restore_s"]["fastest_tier"] > 0 and res["torch_save"]["load_s"] > 0, mode


def test_bench_harness_options_run_the_harness_of_a_checkout_only(tmp_path) -> None:  # noqa: ANN001
    from nebula_ckpt.cli.bench import find_checkout

    assert find_checkout(str(tmp_path)) == REPO  # the folder above the imported package
    installed = _installed_copy(tmp_path)
    runs = {"checkout": _bench(REPO, str(tmp_path), "--systems", "nebula", "--help"),
            "installed, in a checkout": _bench(installed, REPO, "--systems", "nebula", "--help"),
            "installed": _bench(installed, str(tmp_path), "--systems", "nebula"),
            "help": _bench(installed, str(tmp_path), "--help")}
    for mode in ("checkout", "installed, in a checkout"):
        rc, out, err = _done(runs[mode])
        assert rc == 0 and "usage: nebula-ckpt bench" in out and "--recovery" in out, (mode, err)
    rc, out, err = _done(runs["installed"])
    assert rc == 2 and "--systems is an option of the full benchmark harness" in err and "--state" in err, err
    rc, out, err = _done(runs["help"])
    assert rc == 0 and "--state" in out and "--size-gb" in out and "--systems" not in out, out


def _json_run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, object, str]:
    """``nebula-ckpt ARGS``: its exit code (argparse's usage errors exit), its stdout parsed as one
    JSON value (an error if it is not), its stderr."""
    try:
        rc = main(args)
    except SystemExit as e:
        rc = int(e.code or 0)
    got = capsys.readouterr()
    return rc, json.loads(got.out), got.err


def test_every_json_command_prints_one_json_value_on_every_exit(saved: str, tmp_path,  # noqa: ANN001
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """docs/cli.md: with ``--json``, stdout holds one JSON value whatever the exit: a command that
    fails without an answer of its own gives ``{"error": ..., "exit": N}``, the error stderr shows."""
    failing = [(["mark", saved, "--healthy", "7", "--json"], 1, "no committed step 7"),
               (["mark", saved, "--suspect", "-1", "--json"], 2, "STEP must be a non-negative int"),
               (["mark", saved, "--healthy", "x", "--json"], 2, "invalid int value: 'x'"),   # argparse's usage error
               (["inspect", saved, "--step", "9", "--json"], 1, "no checkpoint of step 9"),
               (["ls", "s3:/bucket/x", "--json"], 2, "broken scheme"),
               (["gc", "--force", "--json"], 2, "--force removes steps"),
               (["export", saved, "--to", os.path.join(saved, "x.pt"), "--json"], 1, "which this command reads")]
    for args, code, words in failing:
        rc, got, err = _json_run(args, capsys)
        assert rc == code and isinstance(got, dict) and got["exit"] == code, (args, rc, got, err)
        assert words in got["error"] and got["error"] in err and not got["error"].startswith("nebula-ckpt"), \
            (args, got, err)
    rc, got, _ = _json_run(["ls", "az://c/ckpt", "--storage-options", '{"account_key": "SECRET-1"', "--json"], capsys)
    assert rc == 2 and "not valid JSON" in got["error"] and "SECRET" not in json.dumps(got), got  # type: ignore[index]
    rc, got, _ = _json_run(["verify", str(tmp_path / "empty"), "--json"], capsys)
    assert (rc, got) == (1, [])  # nothing found is verify's own answer, not an error
    rc, got, _ = _json_run(["mark", saved, "--healthy", "2", "--json"], capsys)
    assert rc == 0 and [r["step"] for r in got] == [2]  # type: ignore[union-attr]


def test_persist_memory_json_on_a_live_job_is_an_error_object(root: str, shm_dir: str) -> None:
    """Exit 2 (a live process writes the root's memory tier here) still answers in JSON on stdout."""
    with nc.Checkpointer(root, tiers=[nc.MemoryTier(), nc.LocalTier(root, every=10)]) as ck:
        ck.save(1, {"w": torch.ones(4)}).result()
        ck.save(2, {"w": torch.ones(4) * 2}).result()   # in memory only
        r = warm_python.run([sys.executable, "-m", "nebula_ckpt.cli", "persist-memory", root, "--json"],
                            capture_output=True, text=True, env=dict(os.environ, NEBULA_SHM_DIR=shm_dir), timeout=120)
    got = json.loads(r.stdout)
    assert r.returncode == 2 and got["exit"] == 2 and "live process" in got["error"], (r.stdout, r.stderr)
