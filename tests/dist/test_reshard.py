"""Resharding restores: a checkpoint written by 4 FSDP2 ranks restored into 2 ranks and into one
process, gathered whole, and exported by the CLI; bit-exact against the full state every time.

The 4-rank save and the 2-rank load are real ``torch.distributed`` jobs (gloo on 127.0.0.1,
``tests/dist/reshard_worker.py``); they run once per test session (:func:`fsdp_jobs`) and the
tests here and in ``test_dcp_reader.py`` check what they left behind.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file

from nebula_ckpt.cli import main as cli
from nebula_ckpt.errors import CorruptCheckpointError, ValidationError
from nebula_ckpt.format.names import step_dir
from nebula_ckpt.format.records import DTensorInfo
from nebula_ckpt.restore.dcp_reader import newest_manifest
from nebula_ckpt.restore.reshard import gather_full, load_resharded
from nebula_ckpt.storage.local import LocalStorage
from records_view import flat_manifest, seal

from .launch import run_ranks

pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


_jobs: dict[str, Any] = {}


def fsdp_jobs() -> dict[str, Path]:
    """Run the 4-rank FSDP2 save (step 5 under ``root4``) and the 2-rank resharding load (which
    saves step 6 under ``root2``) once per session; return the folders (``out`` holds the
    workers' files). A failure is remembered too: the jobs are not run again for every test."""
    if "error" in _jobs:
        raise AssertionError(f"the FSDP2 jobs failed earlier in this session:\n{_jobs['error']}")
    if "paths" not in _jobs:
        try:
            _jobs["paths"] = _run_jobs()
        except AssertionError as e:
            _jobs["error"] = str(e)
            raise
    paths: dict[str, Path] = _jobs["paths"]
    return paths


def _run_jobs() -> dict[str, Path]:
    base = Path(tempfile.mkdtemp(prefix="nebula-reshard-"))
    atexit.register(shutil.rmtree, base, True)
    paths = {"root4": base / "root4", "root2": base / "root2", "out": base / "out", "shm": base / "shm"}
    paths["out"].mkdir()
    paths["shm"].mkdir()
    for world, scenario in ((4, "save"), (2, "load")):
        done = run_ranks(world, "reshard_worker.py",
                         [scenario, str(paths["root4"]), str(paths["out"]), str(paths["root2"])],
                         paths["out"], str(paths["shm"]), timeout=200)
        for r, p in enumerate(done):
            assert p.returncode == 0, f"{scenario} rank {r} of {world}:\n{p.stdout[-4000:]}"
    return paths


def plain_model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The workers' model, unsharded, with AdamW state created by one step."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 6))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    return model, opt


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Same keys as the workers' ``full_state``."""
    out: dict[str, Any] = {f"model/{k}": v for k, v in model.state_dict().items()}
    osd = opt.state_dict()
    for i, st in osd["state"].items():
        for k, v in st.items():
            out[f"optim/state/{i}/{k}"] = v
    out["lr"] = osd["param_groups"][0]["lr"]
    return out


def reference() -> dict[str, Any]:
    """The full state the 4 ranks saved at step 5 (written by rank 0 of the save job)."""
    return torch.load(fsdp_jobs()["out"] / "ref.pt", weights_only=True)


def assert_bit_exact(ref: dict[str, Any], got: dict[str, Any]) -> None:
    tensors = [k for k, v in ref.items() if isinstance(v, torch.Tensor)]
    assert sorted(tensors) == sorted(k for k, v in got.items() if isinstance(v, torch.Tensor))
    for k in tensors:
        assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), k


def rewrite_manifest(root: Path, step: int, change: Callable[[dict[str, Any]], None]) -> None:
    """Edit a manifest (every rank's records merged in) and commit it again with valid checksums
    (a buggy or hostile writer)."""
    d = root / step_dir(step)
    man = flat_manifest(d)
    change(man)
    seal(d, man)


def flip_byte_of(root: Path, step: int, key: str) -> str:
    """Flip the first data byte of stored tensor ``key``; return its shard's file name."""
    d = root / step_dir(step)
    man = flat_manifest(d)
    rec = man["tensors"][key]
    shard = man["shards"][rec.get("shard", 0)]["file"]
    with open(d / shard, "r+b") as f:
        f.seek(rec["offsets"][0])
        b = f.read(1)
        f.seek(rec["offsets"][0])
        f.write(bytes([b[0] ^ 0x55]))
    return str(shard)


@pytest.fixture
def root4(tmp_path: Path) -> Path:
    """A private copy of the 4-rank checkpoint (tests may damage or write to it)."""
    dst = tmp_path / "root4"
    shutil.copytree(fsdp_jobs()["root4"], dst)
    return dst


def test_four_fsdp2_ranks_restore_into_two_ranks_bit_exact() -> None:
    # before it: into an FSDP2 model whose AdamW has no state yet, refused naming the key and the fix
    refused = (fsdp_jobs()["out"] / "fresh-optimizer.txt").read_text()
    assert "optim/state/0/" in refused and "DTensor parameters" in refused and "optimizer.step()" in refused
    got = torch.load(fsdp_jobs()["out"] / "resharded.pt", weights_only=True)
    assert got["step"] == 5 and got["lr"] == 0.0123   # non-tensor leaves come back too
    assert_bit_exact(reference(), got)
    # the 2-rank job saved what it restored: a checkpoint of 2 ranks, each with its own shard
    man = newest_manifest(LocalStorage(str(fsdp_jobs()["root2"])))
    assert man.world_size == 2 and man.step == 6
    assert man.resolve("model/0.weight", 1).dtensor == DTensorInfo((32, 16), (16, 0), ("S(0)",), (2,))


def test_four_fsdp2_ranks_restore_into_one_process_bit_exact(root4: Path) -> None:
    storage = LocalStorage(str(root4))
    man = newest_manifest(storage)
    assert man.world_size == 4 and man.resolve("model/2.weight", 3).shape == (0, 32)  # an empty shard
    model, opt = plain_model(seed=3)
    into: dict[str, Any] = {"model": model, "optim": opt, "step": -1}
    load_resharded(storage, man.step, man, into)
    assert into["step"] == 5
    assert_bit_exact(reference(), state_of(model, opt))
    # the restored optimizer keeps training (its state is the optimizer's own, not a view of the file)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()


def test_checkpointer_load_latest_reshards_in_one_process(root4: Path) -> None:
    import nebula_ckpt as nc

    model, opt = plain_model(seed=4)
    into: dict[str, Any] = {"model": model, "optim": opt, "step": -1}
    with nc.Checkpointer(str(root4), memory_tier=False) as ck:
        assert ck.load_latest(into) == 5
    assert into["step"] == 5
    assert_bit_exact(reference(), state_of(model, opt))


def test_gather_full_is_the_full_state(root4: Path) -> None:
    storage = LocalStorage(str(root4))
    man = newest_manifest(storage)
    full = gather_full(storage, man.step, man)
    ref = reference()
    assert sorted(full) == sorted(k for k in ref if k != "lr")
    for k, v in full.items():
        assert torch.equal(v, ref[k]), k


def test_cli_export_of_a_two_rank_checkpoint_is_the_full_state(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    root2 = str(fsdp_jobs()["root2"])
    ref = reference()
    st = tmp_path / "full.safetensors"
    assert cli(["export", root2, "--step", "6", "--to", str(st), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["world_size"] == 2
    flat = load_file(str(st))
    assert sorted(flat) == sorted(k for k in ref if k != "lr")          # no r<R>/ prefixes
    for k, v in flat.items():
        assert torch.equal(v, ref[k]), k
    pt = tmp_path / "full.pt"
    assert cli(["export", root2, "--step", "6", "--to", str(pt)]) == 0
    tree = torch.load(pt, weights_only=True)
    assert tree["step"] == 6 and tree["optim"]["param_groups"][0]["lr"] == 0.0123
    assert torch.equal(tree["model"]["0.weight"], ref["model/0.weight"]) and tree["model"]["0.weight"].shape == (32, 16)
    assert torch.equal(tree["optim"]["state"][2]["exp_avg_sq"], ref["optim/state/2/exp_avg_sq"])


def test_cli_ls_verify_inspect_show_ranks_and_find_damage(root4: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = str(root4)
    assert cli(["ls", r, "--json"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert row["healthy"] and row["world_size"] == 4 and row["ranks"] == [0, 1, 2, 3]
    assert [s["rank"] for s in row["shards"]] == [0, 1, 2, 3]
    assert cli(["verify", r]) == 0
    assert "4-rank job" in capsys.readouterr().out
    assert cli(["inspect", r, "--step", "5", "--full"]) == 0
    out = capsys.readouterr().out
    assert "4-rank job" in out and "shard-g1-r3.safetensors" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("model/2.weight"))
    assert "(6, 32)" in line and "S(0)" in line and "r3 (0, 32)@(6, 0)" in line
    assert cli(["inspect", r, "--step", "5", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    w = info["logical"]["model/0.weight"]
    assert w["shape"] == [32, 16] and [p["offsets"] for p in w["pieces"]] == [[0, 0], [8, 0], [16, 0], [24, 0]]
    shard = flip_byte_of(root4, 5, "r2/optim/state/0/exp_avg")
    assert cli(["verify", r]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED" in out and "r2/optim/state/0/exp_avg" in out
    assert cli(["export", r, "--step", "5", "--to", str(root4.parent / "x.pt")]) == 1
    err = capsys.readouterr().err
    assert "r2/optim/state/0/exp_avg" in err and shard in err and not (root4.parent / "x.pt").exists()


def test_damaged_shard_is_a_corrupt_checkpoint_naming_key_and_file(root4: Path) -> None:
    shard = flip_byte_of(root4, 5, "r1/model/0.weight")
    storage = LocalStorage(str(root4))
    man = newest_manifest(storage)
    model, opt = plain_model(seed=5)
    with pytest.raises(CorruptCheckpointError, match=f"r1/model/0.weight.*{shard}"):
        load_resharded(storage, 5, man, {"model": model, "optim": opt, "step": -1})
    with pytest.raises(CorruptCheckpointError, match=f"r1/model/0.weight.*{shard}"):
        gather_full(storage, 5, man)


def test_one_process_restore_creates_a_fresh_optimizers_state(root4: Path) -> None:
    """A model and an optimizer just built (AdamW makes its state at its first step): restored at
    another world size as at the same one, the optimizer's state comes from the checkpoint (its
    load_state_dict makes it), bit-exact, and it trains on; through Checkpointer.load_latest too."""
    import nebula_ckpt as nc

    for how in ("load_resharded", "load_latest"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 6))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        assert not opt.state
        into: dict[str, Any] = {"model": model, "optim": opt, "step": -1}
        if how == "load_resharded":
            storage = LocalStorage(str(root4))
            load_resharded(storage, 5, newest_manifest(storage), into)
        else:
            with nc.Checkpointer(str(root4), read_only=True) as ck:
                assert ck.load_latest(into) == 5
        assert into["step"] == 5, how
        assert_bit_exact(reference(), state_of(model, opt))
        model(torch.randn(2, 16)).sum().backward()
        opt.step()


def test_mismatched_into_is_a_validation_error_naming_the_key(root4: Path) -> None:
    storage = LocalStorage(str(root4))
    man = newest_manifest(storage)
    torch.manual_seed(0)
    fresh = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 6))
    opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)    # no state yet: AdamW creates it lazily
    w0 = fresh[0].weight.detach().clone()
    with pytest.raises(ValidationError, match="'extra'"):
        load_resharded(storage, 5, man, {"model": fresh, "optim": opt, "step": 0, "extra": 1})
    assert torch.equal(fresh[0].weight, w0) and not opt.state  # nothing was changed
    with pytest.raises(ValidationError, match=r"model/2.weight.*\(6, 32\).*\(7, 32\)"):
        wrong = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 7))
        load_resharded(storage, 5, man, {"model": wrong})
    # a destination whose elements share memory (an expanded view) is refused before anything changes
    shared, _ = plain_model(seed=6)
    w6 = shared[0].weight.detach().clone()
    shared[2].weight = torch.nn.Parameter(torch.zeros(1, 32).expand(6, 32))
    with pytest.raises(ValidationError, match=r"model/2.weight.*share memory"):
        load_resharded(storage, 5, man, {"model": shared}, strict=False)
    assert torch.equal(shared[0].weight, w6)
    # strict=False: what into holds is restored (the model; the fresh optimizer's state made from the
    # checkpoint), the key it lacks ('step') is skipped
    model2, _ = plain_model(seed=7)
    opt2 = torch.optim.AdamW(model2.parameters())
    load_resharded(storage, 5, man, {"model": model2, "optim": opt2}, strict=False)
    assert_bit_exact(reference(), state_of(model2, opt2))
    # a model alone, strict=False: the optimizer's part of the checkpoint is skipped
    model3, _ = plain_model(seed=8)
    load_resharded(storage, 5, man, {"model": model3}, strict=False)
    assert torch.equal(model3[2].weight, reference()["model/2.weight"])
