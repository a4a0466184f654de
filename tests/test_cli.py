"""The nebula-ckpt command line: ls, verify, inspect, export; exit codes and --json."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import nebula_ckpt as nc
from nebula_ckpt.cli import main


@pytest.fixture
def saved(root: str) -> str:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, {"model": model, "step": 1, "cfg": {"lr": 0.1, "betas": (0.9, 0.99)}})
        ck.save(2, {"model": model, "step": 2, "cfg": {"lr": 0.1, "betas": (0.9, 0.99)}})
    os.makedirs(os.path.join(root, "step-3"))  # an uncommitted leftover
    return root


def test_ls_json(saved: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", saved, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    by_step = {r["step"]: r for r in rows}
    assert by_step[1]["committed"] and by_step[1]["healthy"] and by_step[1]["bytes"] > 0
    assert not by_step[3]["committed"] and not by_step[3]["healthy"]


def test_ls_text_and_empty(saved: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    assert main(["ls", saved]) == 0
    out = capsys.readouterr().out
    assert "step        1" in out and "healthy" in out and "uncommitted" in out
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


def test_inspect(saved: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", saved, "--step", "2"]) == 0
    out = capsys.readouterr().out
    assert "model/weight" in out and "float32" in out and "(4, 8)" in out
    assert "'betas'" in out and "0.9" in out
    assert main(["inspect", saved, "--step", "2", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["step"] == 2 and "model/bias" in info["tensors"]
    assert main(["inspect", saved, "--step", "7"]) == 1


def test_export_both_formats(saved: str, tmp_path) -> None:  # noqa: ANN001
    st = str(tmp_path / "out.safetensors")
    assert main(["export", saved, "--step", "2", "--to", st]) == 0
    tensors = load_file(st)
    pt = str(tmp_path / "out.pt")
    assert main(["export", saved, "--step", "2", "--to", pt]) == 0
    tree = torch.load(pt, weights_only=True)
    assert torch.equal(tree["model"]["weight"], tensors["model/weight"])
    assert tree["step"] == 2 and tree["cfg"]["betas"] == (0.9, 0.99)


def test_console_script_usage_error() -> None:
    r = subprocess.run([sys.executable, "-m", "nebula_ckpt.cli", "inspect"], capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr
