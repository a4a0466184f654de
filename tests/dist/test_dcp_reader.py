"""``torch.distributed.checkpoint.load`` through NebulaStorageReader: one process and real ranks,
one-process (v1) and multi-rank (v2) checkpoints, bit-exact; hostile manifests and damaged
shards surface as CorruptCheckpointError naming what is wrong, never as a crash.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import nebula_ckpt as nc
from conftest import make_training, train_step
from nebula_ckpt.cli import main as cli
from nebula_ckpt.errors import CorruptCheckpointError, NotFoundError, ValidationError
from nebula_ckpt.format.names import MANIFEST, shard_name, step_dir
from nebula_ckpt.restore.dcp_reader import NebulaStorageReader, newest_manifest
from nebula_ckpt.restore.reshard import gather_full
from nebula_ckpt.storage.local import LocalStorage
from records_view import as_version_2
from test_hostile_multirank import write_multi_rank

from .test_reshard import (
    assert_bit_exact,
    flip_byte_of,
    fsdp_jobs,
    plain_model,
    reference,
    rewrite_manifest,
    state_of,
)

pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


@pytest.fixture
def v1_root(root: str) -> tuple[str, Any, Any, Any]:
    """A one-process checkpoint of TinyNet (tied weights, BatchNorm) + AdamW + StepLR at step 3."""
    model, opt, sched = make_training(0)
    for i in range(3):
        train_step(model, opt, sched, i)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(3, {"model": model, "optim": opt, "sched": sched, "step": 3})
    return root, model, opt, sched


def _same_training_state(a: tuple[Any, Any], b: tuple[Any, Any]) -> None:
    for k, v in a[0].state_dict().items():
        assert torch.equal(v, b[0].state_dict()[k]), k
    sa, sb = a[1].state_dict(), b[1].state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i, st in sa["state"].items():
        for k, v in st.items():
            assert torch.equal(v, sb["state"][i][k]), (i, k)


def test_dcp_load_of_a_one_process_checkpoint_bit_exact(v1_root: tuple[str, Any, Any, Any]) -> None:
    root, model, opt, _ = v1_root
    fresh, fopt, fsched = make_training(1)
    train_step(fresh, fopt, fsched, 0)
    # nested state dicts: DCP flattens them to "model.lin.weight", "optim.state.0.exp_avg", ...
    sd = {"model": fresh.state_dict(), "optim": fopt.state_dict(), "step": 0}
    with NebulaStorageReader(root) as reader:
        assert reader.step == 3 and "model/head.weight" in reader.keys   # the tied key is a key too
        dcp.load(sd, storage_reader=reader)
    fresh.load_state_dict(sd["model"])
    fopt.load_state_dict(sd["optim"])
    assert sd["step"] == 3 and fopt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    _same_training_state((model, opt), (fresh, fopt))
    # a flat state dict keyed like the checkpoint ("model/lin.weight") reads the same bytes
    flat = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load({f"model/{k}": v for k, v in flat.items()}, storage_reader=NebulaStorageReader(root, 3))
    for k, v in model.state_dict().items():
        assert torch.equal(flat[k], v), k


def test_reader_finds_steps_and_checkpoint_ids(v1_root: tuple[str, Any, Any, Any], tmp_path: Path) -> None:
    root = v1_root[0]
    assert NebulaStorageReader(f"{root}/step-3").step == 3
    assert NebulaStorageReader.validate_checkpoint_id(root) and NebulaStorageReader.validate_checkpoint_id(
        f"{root}/step-3")
    assert not NebulaStorageReader.validate_checkpoint_id(str(tmp_path / "nothing"))
    with pytest.raises(NotFoundError, match="step 9"):
        NebulaStorageReader(root, 9)
    with pytest.raises(NotFoundError):
        NebulaStorageReader(str(tmp_path / "empty"))
    # dcp.load(checkpoint_id=...) re-points a reader (reset)
    reader = NebulaStorageReader(LocalStorage(root))
    model = v1_root[1]
    sd = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(sd, checkpoint_id=f"{root}/step-3", storage_reader=reader)
    assert torch.equal(sd["model"]["lin.weight"], model.lin.weight)
    full = gather_full(reader.storage, 3, reader.manifest)
    assert torch.equal(full["model/head.weight"], model.head.weight) and "model/emb.weight" in full


def test_dcp_load_on_two_ranks_of_a_four_rank_checkpoint_bit_exact() -> None:
    """The 2-rank job loaded nested FSDP2 state dicts (DTensors over 2 ranks) with dcp.load."""
    got = torch.load(fsdp_jobs()["out"] / "dcp.pt", weights_only=True)
    assert got["step"] == 5 and got["lr"] == 0.0123
    assert_bit_exact(reference(), got)


def test_dcp_load_in_one_process_of_a_four_rank_checkpoint_bit_exact() -> None:
    model, opt = plain_model(seed=11)
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    reader = NebulaStorageReader(str(fsdp_jobs()["root4"]))
    md = reader.read_metadata().state_dict_metadata["model/2.weight"]
    assert tuple(md.size) == (6, 32) and len(md.chunks) == 3        # rank 3's shard of it is empty
    assert [tuple(c.offsets) for c in md.chunks] == [(0, 0), (2, 0), (4, 0)]
    dcp.load(sd, storage_reader=reader)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    assert_bit_exact(reference(), state_of(model, opt))


@pytest.fixture
def root4(tmp_path: Path) -> Path:
    dst = tmp_path / "root4"
    shutil.copytree(fsdp_jobs()["root4"], dst)
    return dst


def _dtensor(key: str, **change: Any) -> Any:
    def edit(man: dict[str, Any]) -> None:
        man["tensors"][key]["dtensor"].update(change)
    return edit


@pytest.mark.parametrize("edit, match", [
    # refused by Manifest.parse already
    (_dtensor("r1/model/0.weight", offsets=[30, 0]), "outside the global size"),
    (_dtensor("r1/model/0.weight", offsets=[8]), "do not match"),
    (_dtensor("r1/model/0.weight", placements=["S(5)"]), "placement"),
    # well-formed records that disagree across ranks: refused by the reader
    # (on the grid of DTensor's own layout, a chunk anywhere else is refused as such; the exact
    # coverage check of other layouts: tests/format/test_hostile_multirank.py)
    (_dtensor("r1/model/0.weight", offsets=[0, 0]), "rank 1's chunk .* is not where the grid"),
    (_dtensor("r2/model/0.weight", offsets=[4, 0]), "rank 2's chunk .* is not where the grid"),
    (_dtensor("r1/model/0.weight", shape=[64, 16]), "model/0.weight.*rank 1.*disagree"),
    (lambda man: man["tensors"]["r3/model/0.bias"].pop("dtensor"), "model/0.bias.*plain tensor on rank 3"),
])
def test_hostile_manifests_are_corrupt_checkpoints(root4: Path, edit: Any, match: str) -> None:
    rewrite_manifest(root4, 5, edit)
    with pytest.raises(CorruptCheckpointError, match=match):
        NebulaStorageReader(str(root4))
    with pytest.raises(CorruptCheckpointError):  # dcp.load never starts: the reader is refused first
        dcp.load({"model.0.weight": torch.zeros(32, 16)}, storage_reader=NebulaStorageReader(str(root4), 5))


def test_a_damaged_shard_is_refused_before_dcp_load_naming_the_key(root4: Path) -> None:
    flip_byte_of(root4, 5, "r2/optim/state/1/exp_avg")
    model, opt = plain_model(seed=12)
    # the whole step is verified when the reader opens, before DCP plans (even a load of the model
    # only, which would not read the damaged tensor): no healthy step is left, and step 5 is damaged
    with pytest.raises(CorruptCheckpointError, match="(?s)no healthy checkpoint.*r2/optim/state/1/exp_avg"):
        NebulaStorageReader(str(root4))
    with pytest.raises(CorruptCheckpointError, match="(?s)step 5.*r2/optim/state/1/exp_avg"):
        NebulaStorageReader(str(root4), 5)
    # verify=False reads it anyway (the caller vouches for the bytes)
    dcp.load({"optim": opt.state_dict()}, storage_reader=NebulaStorageReader(str(root4), verify=False))


def test_bytes_damaged_after_the_reader_opened_fail_the_read_naming_key_and_file(root4: Path) -> None:
    """A reader given the manifest (the resharding restore, which verified the step) checks the
    checksum of each tensor as DCP reads it."""
    reader = NebulaStorageReader(LocalStorage(str(root4)), 5, manifest=newest_manifest(LocalStorage(str(root4))))
    shard = flip_byte_of(root4, 5, "r2/optim/state/1/exp_avg")
    _, opt = plain_model(seed=12)
    # DCP reports a failed read as a CheckpointException (a BaseException) carrying each rank's error
    with pytest.raises(CheckpointException) as ei:
        dcp.load({"optim": opt.state_dict()}, storage_reader=reader)
    err = ei.value.failures[0][0]
    assert isinstance(err, CorruptCheckpointError) and "r2/optim/state/1/exp_avg" in str(err) and shard in str(err)


def test_a_newer_damaged_manifest_falls_back_to_the_older_step(v1_root: tuple[str, Any, Any, Any]) -> None:
    root, model, opt, sched = v1_root
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(4, {"model": model, "optim": opt, "sched": sched, "step": 4})
    (Path(root) / step_dir(4) / MANIFEST).write_text(json.dumps({"garbled": True}))
    assert NebulaStorageReader(root).step == 3
    with pytest.raises(CorruptCheckpointError, match="commit marker"):
        NebulaStorageReader(root, 4)


def test_a_memory_tier_copy_of_one_rank_is_refused_but_verifiable(root4: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    def only_rank0(man: dict[str, Any]) -> None:
        keep = {k: v for k, v in man["tensors"].items() if k.startswith("r0/")}
        for a, b in list(man["aliases"].items()):
            if a.startswith("r0/"):
                keep[a] = man["tensors"][b]  # rank 0's own copy of what another rank stored
        man["tensors"] = keep
        man["aliases"] = {}
        man["ranks"], man["rank_tree"] = [0], {"0": 0}
        if "sha256" in man:   # the hashes of the tensors kept
            man["sha256"] = {k: v for k, v in man["sha256"].items() if k in keep}
        as_version_2(man)  # what a rank's memory tier holds

    rewrite_manifest(root4, 5, only_rank0)
    with pytest.raises(ValidationError, match="rank's own memory tier"):
        NebulaStorageReader(str(root4))
    # the CLI checks such a copy rank by rank (it is what a rank's memory tier holds)
    assert cli(["verify", str(root4)]) == 0
    assert "rank(s) 0 of a 4-rank job" in capsys.readouterr().out
    assert cli(["export", str(root4), "--step", "5", "--to", str(root4.parent / "x.pt")]) == 1
    assert "Only one rank's memory-tier copy holds step 5" in capsys.readouterr().err  # never "damaged"


def test_two_dim_mesh_replicas_are_read_once_and_the_lowest_rank_wins(tmp_path: Path) -> None:
    """Mesh (2, 2), placements (S(0), R): ranks 0/1 and 2/3 hold the same rows (rank 1 stores its
    own copy, rank 3 aliases rank 2's); a plain tensor that differs per rank is rank 0's."""
    w = torch.arange(12, dtype=torch.float32).reshape(4, 3)

    def piece(r: int) -> Any:
        rows = w[:2] if r < 2 else w[2:]
        return rows, {"shape": [4, 3], "offsets": [0 if r < 2 else 2, 0], "placements": ["S(0)", "R"], "mesh": [2, 2]}

    pieces = {r: {"w": piece(r), "b": (torch.full((3,), float(r)), None)} for r in range(3)}
    pieces[3] = {"b": (torch.full((3,), 3.0), None)}
    root = tmp_path / "ck"
    write_multi_rank(root, 1, 4, pieces, aliases={"r3/w": "r2/w"})
    reader = NebulaStorageReader(str(root))
    md = reader.metadata.state_dict_metadata
    assert [tuple(c.offsets) for c in md["w"].chunks] == [(0, 0), (2, 0)] and tuple(md["w"].size) == (4, 3)
    assert len(md["b"].chunks) == 1
    sd = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
    dcp.load(sd, storage_reader=reader)
    assert torch.equal(sd["w"], w) and torch.equal(sd["b"], torch.zeros(3))
    # a one-process model of the full tensors restores from it
    into = {"w": torch.zeros(4, 3), "b": torch.ones(3)}
    from nebula_ckpt.restore.reshard import load_resharded

    load_resharded(reader.storage, 1, reader.manifest, into)
    assert torch.equal(into["w"], w) and torch.equal(into["b"], torch.zeros(3))


# -- a damaged newest step: the reader falls back to the newest healthy one, as load_latest does --

def _w(step: int) -> torch.Tensor:
    return torch.arange(12, dtype=torch.float32).reshape(4, 3) + 100 * step


def _two_rank_steps(root: Path, steps: tuple[int, ...] = (1, 2)) -> None:
    """Steps of a 2-rank job: ``w`` sharded by rows over the ranks, ``b`` a plain tensor per rank."""
    for step in steps:
        pieces = {r: {"w": (_w(step)[2 * r:2 * r + 2],
                            {"shape": [4, 3], "offsets": [2 * r, 0], "placements": ["S(0)"], "mesh": [2]}),
                      "b": (torch.full((3,), float(step * 10 + r)), None)} for r in range(2)}
        write_multi_rank(root, step, 2, pieces, aliases={})


def _flip(root: Path, step: int) -> str:
    flip_byte_of(root, step, "r1/w")
    return "checksum mismatch in tensor 'r1/w'"


def _truncate(root: Path, step: int) -> str:
    shard = root / step_dir(step) / shard_name(1, 1)
    shard.write_bytes(shard.read_bytes()[:-1])
    return shard.name


def _drop_rank(root: Path, step: int) -> str:
    (root / step_dir(step) / shard_name(1, 1)).unlink()
    return shard_name(1, 1)


def _world(n: int) -> Any:
    def damage(root: Path, step: int) -> str:
        rewrite_manifest(root, step, lambda man: man.update(world_size=n))
        return f"{n}-rank job" if n > 2 else "one-process checkpoint"
    return damage


DAMAGE = {"flipped_byte": _flip, "truncated_shard": _truncate, "missing_rank": _drop_rank,
          "world_size_3": _world(3), "world_size_1": _world(1)}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_reader_falls_back_past_a_damaged_newest_step(tmp_path: Path, kind: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "ck"
    _two_rank_steps(root)
    named = DAMAGE[kind](root, 2)
    with caplog.at_level("INFO", logger="nebula_ckpt"):
        reader = NebulaStorageReader(str(root))
    assert reader.step == 1
    assert any("step 1" in r.getMessage() and "NebulaStorageReader" in r.getMessage() for r in caplog.records)
    sd = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
    dcp.load(sd, storage_reader=reader)
    assert torch.equal(sd["w"], _w(1)) and torch.equal(sd["b"], torch.full((3,), 10.0))
    # the same check as load_latest: it restores the same step
    into = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
    with nc.Checkpointer(str(root), memory_tier=False) as ck:
        assert ck.load_latest(into=into) == 1 and torch.equal(into["w"], _w(1))
    # step 2 asked for by name is never replaced by another: it raises, naming the damage
    with pytest.raises((CorruptCheckpointError, ValidationError), match="step 2") as ei:
        NebulaStorageReader(str(root), 2)
    assert named in str(ei.value)
    with pytest.raises((CorruptCheckpointError, ValidationError), match=named):
        NebulaStorageReader(f"{root}/step-2")


@pytest.mark.parametrize("kind", ["flipped_byte", "truncated_shard", "missing_shard"])
def test_reader_falls_back_past_a_damaged_one_process_step(v1_root: tuple[str, Any, Any, Any], kind: str) -> None:
    root, model, opt, sched = v1_root
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(4, {"model": model, "optim": opt, "sched": sched, "step": 4})
    (shard,) = (Path(root) / step_dir(4)).glob("shard-*.safetensors")
    if kind == "flipped_byte":
        flip_byte_of(Path(root), 4, "optim/state/0/exp_avg")
    elif kind == "truncated_shard":
        shard.write_bytes(shard.read_bytes()[:-7])
    else:
        shard.unlink()
    reader = NebulaStorageReader(root)
    assert reader.step == 3
    sd = {"optim": opt.state_dict(), "step": 0}
    dcp.load(sd, storage_reader=reader)
    assert sd["step"] == 3
    with pytest.raises(CorruptCheckpointError, match="step 4") as ei:
        NebulaStorageReader(root, 4)
    assert ("'optim/state/0/exp_avg'" if kind == "flipped_byte" else shard.name) in str(ei.value)


@pytest.mark.slow
def test_two_gloo_ranks_fall_back_past_a_damaged_newest_step(tmp_path: Path) -> None:
    from .launch import run_ranks

    roots = []
    for kind, damage in sorted(DAMAGE.items()):
        root = tmp_path / kind
        _two_rank_steps(root)
        damage(root, 2)
        roots.append(str(root))
    healthy = tmp_path / "healthy"
    _two_rank_steps(healthy)
    # roots that are not shared: each rank its own, rank 1's newest step damaged (it alone falls back)
    for r in range(2):
        _two_rank_steps(tmp_path / f"own{r}")
    _flip(tmp_path / "own1", 2)
    own = str(tmp_path / "own{rank}")
    out = tmp_path / "out"
    out.mkdir()
    done = run_ranks(2, "dcp_fallback_worker.py", [str(out), str(healthy), own, *roots], out,
                     str(tmp_path / "shm"), timeout=200)
    assert all(p.returncode == 0 for p in done), "\n".join(p.stdout[-3000:] for p in done)
    for r in range(2):
        got = json.loads((out / f"fallback-r{r}.json").read_text())
        assert got[str(healthy)]["step"] == 2 and got[str(healthy)]["w"] == _w(2).tolist()
        # never a mix of steps: the load fails on every rank, naming each rank's step
        assert "chose different steps" in got[own].get("error", "") and "{0: 2, 1: 1}" in got[own]["error"], got[own]
        for root in roots:
            assert got[root].get("step") == 1, (r, root, got[root])
            assert got[root]["w"] == _w(1).tolist() and got[root]["b"] == [10.0] * 3, (r, root)


# -- a step marked suspect: skipped as load_latest skips it, read when named -------------------------

def test_reader_skips_a_step_marked_suspect_as_load_latest_does(v1_root: tuple[str, Any, Any, Any],
                                                                caplog: pytest.LogCaptureFixture) -> None:
    root, model, opt, sched = v1_root
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(4, {"model": model, "optim": opt, "sched": sched, "step": 4})
    assert cli(["mark", root, "--suspect", "4", "--reason", "loss went NaN"]) == 0
    with caplog.at_level("INFO", logger="nebula_ckpt"):
        reader = NebulaStorageReader(root)
    assert reader.step == 3
    assert any(r.levelname == "WARNING" and "step 4" in r.getMessage() and "loss went NaN" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    sd = {"step": 0}
    dcp.load(sd, storage_reader=reader)
    assert sd["step"] == 3
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
        assert ck.read()[0] == 3   # the same step as the Checkpointer's restore
    # named, the suspect step is read, with a warning
    caplog.clear()
    with caplog.at_level("WARNING", logger="nebula_ckpt"), NebulaStorageReader(f"{root}/step-4") as named:
        assert named.step == 4
    assert any("marked suspect" in r.getMessage() and "step 4" in r.getMessage() for r in caplog.records)
    # every step suspect: nothing to read as the newest, the error names them and the way out
    assert cli(["mark", root, "--suspect", "3"]) == 0
    with pytest.raises(CorruptCheckpointError, match=r"marked suspect \(steps \[4, 3\]") as ei:
        NebulaStorageReader(root)
    assert "step=N" in str(ei.value) and "--healthy" in str(ei.value)
    assert cli(["mark", root, "--healthy", "4"]) == 0   # a person's mark clears it
    with NebulaStorageReader(root) as reader:
        assert reader.step == 4


@pytest.mark.slow
def test_two_gloo_ranks_skip_a_step_marked_suspect(tmp_path: Path) -> None:
    from .launch import run_ranks

    shared = tmp_path / "shared"
    _two_rank_steps(shared)
    assert cli(["mark", str(shared), "--suspect", "2", "--reason", "loss went NaN"]) == 0
    # roots that are not shared: step 2 is marked suspect on rank 1's only, so the ranks would choose
    # different steps: the load fails on both, never a mix
    for r in range(2):
        _two_rank_steps(tmp_path / f"own{r}")
    assert cli(["mark", str(tmp_path / "own1"), "--suspect", "2"]) == 0
    own, named = str(tmp_path / "own{rank}"), f"{shared}/step-2"
    out = tmp_path / "out"
    out.mkdir()
    done = run_ranks(2, "dcp_fallback_worker.py", [str(out), str(shared), named, own], out,
                     str(tmp_path / "shm"), timeout=200)
    assert all(p.returncode == 0 for p in done), "\n".join(p.stdout[-3000:] for p in done)
    for r, p in enumerate(done):
        got = json.loads((out / f"fallback-r{r}.json").read_text())
        assert got[str(shared)].get("step") == 1 and got[str(shared)]["w"] == _w(1).tolist(), (r, got)
        assert "skipped 1 step(s) marked suspect: step 2" in p.stdout, p.stdout[-3000:]
        assert got[named].get("step") == 2 and got[named]["w"] == _w(2).tolist(), (r, got)
        assert "chose different steps" in got[own].get("error", "") and "{0: 2, 1: 1}" in got[own]["error"], got[own]
