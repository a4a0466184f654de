"""The command line on incremental checkpoints (real chains of saves, a frozen part never written
again): ``ls`` shows what each step adds and which steps it needs, ``verify`` checks the bytes a
step refers to and names the step that holds damaged ones, ``inspect`` says where each tensor is
stored, ``export`` reads the referenced tensors.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import nebula_ckpt as nc
from nebula_ckpt.cli import main


class Frozen(torch.nn.Module):
    """A large frozen trunk and a small head that trains."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, 2)
        self.trunk.requires_grad_(False)


def _step(model: Frozen, opt: torch.optim.Optimizer, i: int) -> None:
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(i))
    model.head(model.trunk(x)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def save_chain(root: str, steps: tuple[int, ...] = (1, 2, 3),
               **kw: Any) -> tuple[Frozen, dict[int, dict[str, torch.Tensor]]]:
    """Saves of a model whose trunk is frozen; the model and each step's state dict as saved."""
    torch.manual_seed(0)
    model = Frozen()
    opt = torch.optim.AdamW(model.head.parameters(), lr=1e-2)
    saved = {}
    with nc.Checkpointer(root, memory_tier=False, **kw) as ck:
        for s in steps:
            _step(model, opt, s)
            ck.save(s, {"model": model, "optim": opt, "step": s})
            saved[s] = {k: v.clone() for k, v in model.state_dict().items()}
    return model, saved


@pytest.fixture
def chain(root: str) -> str:
    save_chain(root)
    return root


def _rows(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[int, dict[str, Any]]]:
    rc = main([*argv, "--json"])
    return rc, {r["step"]: r for r in json.loads(capsys.readouterr().out)}


def _flip_tensor_byte(root: str, step: int, key: str) -> None:
    """Flip the first byte of tensor ``key`` in ``step``'s own shard (its offsets from the manifest)."""
    man = json.loads(open(os.path.join(root, f"step-{step}", "manifest.json")).read())
    rec = man["tensors"][key]
    sh = man["shards"][rec.get("shard", 0)]
    assert "step" not in sh, f"step {step} does not hold {key} itself"
    with open(os.path.join(root, f"step-{step}", sh["file"]), "r+b") as f:
        f.seek(rec["offsets"][0])
        b = f.read(1)
        f.seek(rec["offsets"][0])
        f.write(bytes([b[0] ^ 0x55]))


def test_ls_shows_what_each_step_adds_and_the_steps_it_needs(chain: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, rows = _rows(capsys, "ls", chain)
    assert rc == 0 and all(r["healthy"] for r in rows.values())
    assert rows[1]["base_steps"] == [] and rows[1]["referenced_bytes"] == 0
    for s in (2, 3):
        assert rows[s]["base_steps"] == [1], rows[s]
        assert rows[s]["referenced_bytes"] >= 64 * 64 * 4          # the trunk's weight, in step 1's folder
        assert rows[s]["bytes"] < rows[1]["bytes"] - 64 * 64 * 4   # written by the step: the head, the optimizer
        assert {sh["step"] for sh in rows[s]["shards"]} == {1, s}
    assert main(["ls", chain]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["tier", "step", "written", "referenced", "needs", "tag", "state", "health"]
    cells = {int(ln.split()[1]): ln for ln in lines[1:]}
    assert "KiB" in cells[3] and cells[3].split()[-4] == "1" and cells[3].split()[-2:] == ["verified", "unknown"], \
        cells[3]
    assert cells[1].split()[4:6] == ["-", "-"], cells[1]   # a full checkpoint: needs nothing


def test_verify_checks_the_referenced_bytes_and_names_the_step_that_holds_them(
        chain: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, rows = _rows(capsys, "verify", chain)
    assert rc == 0 and rows[3]["base_steps"] == [1]
    assert main(["verify", chain, "--step", "3"]) == 0
    assert "refers to step 1" in capsys.readouterr().out
    _flip_tensor_byte(chain, 1, "model/trunk.weight")   # a frozen tensor: only step 1's folder holds it
    rc, rows = _rows(capsys, "verify", chain)
    assert rc == 1
    assert [s for s, r in rows.items() if not r["healthy"]] == [1, 2, 3]
    for s in (2, 3):
        why = rows[s]["problem"]
        assert "model/trunk.weight" in why and "step 1" in why and "step-1/" in why, why
    # step 3 alone: its own files are intact, the bytes it refers to are not
    assert main(["verify", chain, "--step", "3"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("DAMAGED") and "step-1/" in out, out


def test_a_lost_base_is_named_by_the_steps_that_need_it(chain: str, capsys: pytest.CaptureFixture[str]) -> None:
    shutil.rmtree(os.path.join(chain, "step-1"))
    rc, rows = _rows(capsys, "verify", chain)
    assert rc == 1 and set(rows) == {2, 3}
    assert all("step 1" in r["problem"] for r in rows.values()), rows
    rc, rows = _rows(capsys, "ls", chain)
    assert rc == 1 and rows[3]["base_steps"] is None   # not healthy: what it needs is not shown as known


def test_inspect_says_where_each_tensor_is_stored(chain: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", chain, "--step", "3", "--full"]) == 0
    out = capsys.readouterr().out
    assert "refers to step 1" in out.splitlines()[0]
    row = {ln.split()[0]: ln for ln in out.splitlines()[2:] if ln.startswith(("model/", "optim/"))}
    assert row["model/trunk.weight"].endswith("step 1") and row["model/head.weight"].endswith("step 3")
    assert main(["inspect", chain, "--step", "3", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["base_steps"] == [1] and any(sh.get("step") == 1 for sh in info["shards"])


@pytest.mark.parametrize("to", ["x.safetensors", "x.pt"])
def test_export_reads_the_referenced_tensors(root: str, tmp_path, to: str) -> None:  # noqa: ANN001
    _, saved = save_chain(root)
    dest = str(tmp_path / to)
    assert main(["export", root, "--step", "3", "--to", dest, "--key", "model"]) == 0
    got = load_file(dest) if to.endswith(".safetensors") else torch.load(dest, weights_only=True)
    assert got.keys() == saved[3].keys()
    for k, v in saved[3].items():
        assert torch.equal(got[k], v), k


def test_export_of_a_step_whose_referenced_bytes_are_damaged_writes_nothing(
        chain: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    _flip_tensor_byte(chain, 1, "model/trunk.weight")
    assert main(["export", chain, "--step", "3", "--to", str(tmp_path / "x.safetensors")]) == 1
    assert "step-1/" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x.safetensors")


def test_incremental_false_steps_need_nothing(root: str, capsys: pytest.CaptureFixture[str]) -> None:
    save_chain(root, incremental=False)
    rc, rows = _rows(capsys, "ls", root)
    assert rc == 0 and all(r["base_steps"] == [] and r["referenced_bytes"] == 0 for r in rows.values())


def test_ls_and_verify_follow_references_on_a_remote_tier(capsys: pytest.CaptureFixture[str]) -> None:
    url = "memory://nebula-cli-incremental/run"
    torch.manual_seed(0)
    model = Frozen()
    opt = torch.optim.AdamW(model.head.parameters(), lr=1e-2)
    with nc.Checkpointer(url, tiers=[nc.RemoteTier(url)]) as ck:
        for s in (1, 2):
            _step(model, opt, s)
            ck.save(s, {"model": model, "optim": opt})
    rc, rows = _rows(capsys, "verify", url)
    assert rc == 0 and rows[2]["base_steps"] == [1]
    rc, rows = _rows(capsys, "ls", url)
    assert rc == 0 and rows[2]["referenced_bytes"] >= 64 * 64 * 4
