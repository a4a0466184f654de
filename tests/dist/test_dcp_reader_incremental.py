"""``torch.distributed.checkpoint.load`` through NebulaStorageReader of incremental checkpoints: each
step of a chain (a frozen trunk written once, by the first save) loads bit for bit; damage in the
bytes a step refers to is refused naming the step folder that holds them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import nebula_ckpt as nc
from nebula_ckpt.errors import CorruptCheckpointError
from nebula_ckpt.format.names import step_dir
from nebula_ckpt.restore.dcp_reader import NebulaStorageReader
from nebula_ckpt.restore.open import read_manifest
from nebula_ckpt.storage.local import LocalStorage
from records_view import flat_manifest

pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

STEPS = (1, 2, 3, 4)


def _training(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 8))
    model[0].requires_grad_(False)
    model[1].requires_grad_(False)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    idx = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i))
    model(idx).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _copy(sd: Any) -> Any:
    if isinstance(sd, torch.Tensor):
        return sd.clone()
    if isinstance(sd, dict):
        return {k: _copy(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_copy(v) for v in sd]
    return sd


def _equal(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _equal(x, y, f"{path}/{i}")
    else:
        assert a == b, path


@pytest.fixture
def chain(root: str) -> tuple[str, dict[int, dict[str, Any]]]:
    """Four incremental saves (the default) on the disk tier; each step's state dicts as saved."""
    model, opt = _training(0)
    want = {}
    with nc.Checkpointer(root, memory_tier=False) as ck:
        for s in STEPS:
            _step(model, opt, s)
            ck.save(s, {"model": model, "optim": opt, "step": s})
            want[s] = _copy({"model": model.state_dict(), "optim": opt.state_dict(), "step": s})
    return root, want


def _fresh_state() -> dict[str, Any]:
    model, opt = _training(1)
    _step(model, opt, 100)   # materialise the optimizer's state (other values than any saved)
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": 0}


def _held_by(root: str, step: int, key: str) -> int:
    """The step whose folder holds the bytes of tensor ``key`` of ``step``."""
    man = read_manifest(LocalStorage(root), step)
    sh = man.shards[man.tensors[key].shard]
    return step if sh.step is None else sh.step


def _flip(root: str, step: int, key: str) -> str:
    """Flip the first byte of stored tensor ``key`` of ``step`` where it lies; the file's path."""
    man = flat_manifest(Path(root) / step_dir(step))   # a multi-rank step: its ranks' records merged in
    rec = man["tensors"][key]
    sh = man["shards"][rec.get("shard", 0)]
    rel = f"{step_dir(sh.get('step', step))}/{sh['file']}"
    with open(Path(root) / rel, "r+b") as f:
        f.seek(rec["offsets"][0])
        b = f.read(1)
        f.seek(rec["offsets"][0])
        f.write(bytes([b[0] ^ 0x55]))
    return rel


def test_dcp_load_of_every_step_of_a_chain_is_bit_exact(chain: tuple[str, dict[int, dict[str, Any]]]) -> None:
    root, want = chain
    assert _held_by(root, 4, "model/0.weight") == 1 and _held_by(root, 4, "model/2.weight") == 4
    for s in STEPS:
        sd = _fresh_state()
        with NebulaStorageReader(root, s) as reader:
            assert reader.step == s
            dcp.load(sd, storage_reader=reader)
        _equal(want[s], sd, f"step {s}")
    sd = _fresh_state()
    dcp.load(sd, storage_reader=NebulaStorageReader(root))   # the newest: step 4
    _equal(want[4], sd)


def test_a_reader_given_the_manifest_reads_the_referenced_shards(chain: tuple[str, dict[int, dict[str, Any]]]) -> None:
    """The resharding restore's path: the caller verified the step and hands its manifest over."""
    root, want = chain
    st = LocalStorage(root)
    sd = _fresh_state()
    dcp.load(sd, storage_reader=NebulaStorageReader(st, 4, manifest=read_manifest(st, 4)))
    _equal(want[4], sd)


def test_damaged_referenced_bytes_are_refused_naming_the_step_that_holds_them(
        chain: tuple[str, dict[int, dict[str, Any]]]) -> None:
    root, _ = chain
    assert _flip(root, 4, "model/0.weight").startswith("step-1/")   # the frozen embedding: step 1's bytes
    with pytest.raises(CorruptCheckpointError, match="(?s)step 4.*model/0.weight"):
        NebulaStorageReader(root, 4)
    # every step refers to step 1's embedding: none is healthy, and the newest one's damage is named
    with pytest.raises(CorruptCheckpointError, match="(?s)no healthy checkpoint.*model/0.weight"):
        NebulaStorageReader(root)


def test_bytes_damaged_after_the_reader_opened_name_the_referenced_file(
        chain: tuple[str, dict[int, dict[str, Any]]]) -> None:
    root, _ = chain
    st = LocalStorage(root)
    reader = NebulaStorageReader(st, 4, manifest=read_manifest(st, 4))
    rel = _flip(root, 4, "model/1.weight")
    sd = _fresh_state()
    with pytest.raises(CheckpointException) as ei:
        dcp.load(sd, storage_reader=reader)
    err = ei.value.failures[0][0]
    assert isinstance(err, CorruptCheckpointError) and "model/1.weight" in str(err) and rel in str(err), err


def test_a_lost_base_is_refused_naming_it(chain: tuple[str, dict[int, dict[str, Any]]]) -> None:
    import shutil

    root, _ = chain
    shutil.rmtree(Path(root) / step_dir(1))
    with pytest.raises(CorruptCheckpointError, match="(?s)step 4.*step 1"):
        NebulaStorageReader(root, 4)


def _load_all(root: str, step: int) -> dict[str, torch.Tensor]:
    with NebulaStorageReader(root, step) as reader:
        sd = {}
        for k in reader.keys:
            md = reader.metadata.state_dict_metadata[k]
            sd[k] = torch.full(tuple(md.size), -7, dtype=md.properties.dtype)  # type: ignore[union-attr]
        dcp.load(sd, storage_reader=reader)
    return sd


def test_a_two_rank_chain_loads_in_one_process_and_exports_through_references(
        root: str, shm_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two gloo ranks save steps 1..4 of a DDP model with a frozen parameter and a per-rank tensor
    that never changes (each rank's share of steps 2..4 refers to its step-1 shard); one process
    reads every step through DCP, the CLI verifies and exports step 4."""
    from nebula_ckpt.cli import main as cli
    from nebula_ckpt.format.commit import references
    from nebula_ckpt.restore.reshard import gather_full

    from .launch import run_ranks

    out = tmp_path / "out"
    out.mkdir()
    for r, p in enumerate(run_ranks(2, "rank_worker.py", ["frozen_save", root, str(out)], out, shm_dir,
                                    env_extra={"TEST_MEMORY_TIER": "0"})):
        assert p.returncode == 0, f"rank {r}:\n{p.stdout[-4000:]}"
    st = LocalStorage(root)
    man4 = read_manifest(st, 4)
    assert man4.multi_rank and references(man4) == {1}
    first, last = _load_all(root, 1), _load_all(root, 4)
    frozen = next(k for k in first if k.endswith("frozen"))
    assert _held_by(root, 4, f"r0/{frozen}") == 1 and _held_by(root, 4, "r1/still") == 1
    assert first.keys() == last.keys() and torch.equal(first[frozen], last[frozen])
    assert torch.equal(last["still"], torch.zeros(8192))   # DCP semantics: the lowest rank's value
    assert any(not torch.equal(first[k], last[k]) for k in first if k.startswith("model/"))   # it trained
    _equal(gather_full(st, 4, man4), last)   # the resharding path (a reader given the manifest)

    dest = tmp_path / "step4.safetensors"
    assert cli(["export", root, "--step", "4", "--to", str(dest)]) == 0
    from safetensors.torch import load_file

    _equal(load_file(str(dest)), last)
    assert cli(["verify", root, "--step", "4"]) == 0
    assert "2-rank job" in capsys.readouterr().out
    rel = _flip(root, 1, "r1/still")   # rank 1's share: only its step-1 shard holds it
    assert rel == "step-1/shard-g1-r1.safetensors"
    assert cli(["verify", root, "--step", "4"]) == 1
    text = capsys.readouterr().out
    assert "DAMAGED" in text and "r1/still" in text and rel in text, text
