"""``torch.distributed.checkpoint.save`` / ``async_save`` through NebulaStorageWriter: one process
and real gloo ranks (FSDP2). What DCP writes is a normal nebula_ckpt checkpoint: Checkpointer and
NebulaStorageReader read it bit-exact, ``nebula-ckpt verify`` passes, a committed step is never
overwritten, and a rank failing (or killed) while writing leaves no COMMIT.
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint.api import CheckpointException

import nebula_ckpt as nc
import warm_python
from conftest import make_training, train_step
from nebula_ckpt.cli import main as cli
from nebula_ckpt.dcp import NebulaStorageReader, NebulaStorageWriter
from nebula_ckpt.errors import ConsistencyError, ValidationError
from nebula_ckpt.format import manifest as mf
from nebula_ckpt.format.commit import committed_steps
from nebula_ckpt.format.names import COMMIT, MANIFEST, SPLIT_VERSION
from nebula_ckpt.restore.open import read_manifest
from nebula_ckpt.storage.local import LocalStorage

from .launch import free_port, reports, run_ranks

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


# -- one process ---------------------------------------------------------------------------------------

def _trained(seed: int = 0, steps: int = 3) -> tuple[Any, Any, Any]:
    model, opt, sched = make_training(seed)
    for i in range(steps):
        train_step(model, opt, sched, i)
    return model, opt, sched


def _same(a: tuple[Any, Any], b: tuple[Any, Any]) -> None:
    for k, v in a[0].state_dict().items():
        assert torch.equal(v, b[0].state_dict()[k]), k
    sa, sb = a[1].state_dict(), b[1].state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sorted(sa["state"]) == sorted(sb["state"])
    for i, st in sa["state"].items():
        for k, v in st.items():
            assert torch.equal(v, sb["state"][i][k]), (i, k)


def _failure(e: CheckpointException) -> BaseException:
    return next(iter(e.failures.values()))[0]


def test_one_process_dcp_save_reads_back_bit_exact_everywhere(root: str, capsys: pytest.CaptureFixture[str]) -> None:
    model, opt, _ = _trained()
    sd = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 3,
          "extra": {"seen": [1, 2.5, None, "x"], "pair": (7, -0.0), "big": 2**100}}
    order: list[str] = []
    real_parts, real_small = LocalStorage.write_parts, LocalStorage.write_small

    def parts(self: LocalStorage, rel: str, p: list[memoryview]) -> dict[str, Any]:
        order.append(rel)
        return real_parts(self, rel, p)

    def small(self: LocalStorage, rel: str, data: bytes, *, create_only: bool = False) -> None:
        order.append(rel)
        real_small(self, rel, data, create_only=create_only)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LocalStorage, "write_parts", parts)
        mp.setattr(LocalStorage, "write_small", small)
        dcp.save(sd, storage_writer=NebulaStorageWriter(root, step=3))
    steps = [r for r in order if r.startswith("step-3/")]
    assert steps == ["step-3/shard-g1-r0.safetensors", "step-3/manifest.json", "step-3/COMMIT"]  # COMMIT last

    d = Path(root) / "step-3"
    assert sorted(p.name for p in d.iterdir()) == ["COMMIT", "manifest.json", "shard-g1-r0.safetensors"]
    man = mf.Manifest.parse((d / MANIFEST).read_bytes(), "test", 3)
    assert man.version == 1 and man.world_size == 1
    assert man.aliases == {"model/head.weight": "model/emb.weight"}            # tied: stored once
    assert "optim/state/0/exp_avg" in man.tensors
    assert '"pickle"' not in json.dumps(man.tree)                             # plain values: typed JSON
    with safe_open(str(d / "shard-g1-r0.safetensors"), "pt") as f:            # any tool opens the shard
        assert torch.equal(f.get_tensor("model/lin.weight"), model.lin.weight)

    # Checkpointer: restore into state dicts (int optimizer keys are back), then load_state_dict
    fresh, fopt, _ = _trained(seed=1, steps=1)
    into: dict[str, Any] = {"model": fresh.state_dict(), "optim": fopt.state_dict(), "step": 0, "extra": None}
    with nc.Checkpointer(root, memory_tier=False) as ck:
        assert ck.load_latest(into=into) == 3
    fopt.load_state_dict(into["optim"])
    _same((model, opt), (fresh, fopt))
    assert into["step"] == 3 and into["extra"] == sd["extra"] and type(into["extra"]["pair"]) is tuple
    assert str(into["extra"]["pair"][1]) == "-0.0" and into["extra"]["big"] == 2**100

    # NebulaStorageReader: dcp.load into nested state dicts
    m2, o2, _ = _trained(seed=2, steps=1)
    sd2 = {"model": m2.state_dict(), "optim": o2.state_dict(), "step": 0}
    dcp.load(sd2, storage_reader=NebulaStorageReader(root))
    m2.load_state_dict(sd2["model"])
    o2.load_state_dict(sd2["optim"])
    _same((model, opt), (m2, o2))
    assert sd2["step"] == 3

    assert cli(["verify", root]) == 0
    assert "OK" in capsys.readouterr().out
    rec = man.tensors["model/lin.weight"]
    with open(d / "shard-g1-r0.safetensors", "r+b") as f:   # every tensor has its CRC32C
        f.seek(rec.start)
        b = f.read(1)
        f.seek(rec.start)
        f.write(bytes([b[0] ^ 0x01]))
    assert cli(["verify", root]) == 1
    assert "model/lin.weight" in capsys.readouterr().out


def test_steps_from_the_constructor_or_checkpoint_id_and_committed_steps_are_refused(root: str) -> None:
    model, opt, _ = _trained(steps=1)
    sd = {"model": model.state_dict()}
    w = NebulaStorageWriter(root)
    dcp.save(sd, storage_writer=w, checkpoint_id=7)                       # an int
    dcp.save(sd, storage_writer=w, checkpoint_id="step-8")                # "step-N"
    dcp.save(sd, storage_writer=NebulaStorageWriter(root), checkpoint_id=f"{root}/step-9")
    dcp.save(sd, storage_writer=NebulaStorageWriter(f"{root}/step-10"))
    assert committed_steps(LocalStorage(root)) == [7, 8, 9, 10]
    assert NebulaStorageWriter.validate_checkpoint_id("step-3") and NebulaStorageWriter.validate_checkpoint_id(4)
    assert not NebulaStorageWriter.validate_checkpoint_id("/some/root")

    with pytest.raises(CheckpointException) as ei:                         # the same step again
        dcp.save(sd, storage_writer=w)
    err = _failure(ei.value)
    assert isinstance(err, ValidationError) and "step 8 is already committed" in str(err) and "step-8" in str(err)
    with pytest.raises(CheckpointException) as ei:
        dcp.save(sd, storage_writer=NebulaStorageWriter(root))             # no step at all
    assert "no step to write" in str(_failure(ei.value))
    with pytest.raises(ValidationError, match="names step 5, but step=6"):
        NebulaStorageWriter(f"{root}/step-5", step=6)
    assert committed_steps(LocalStorage(root)) == [7, 8, 9, 10]
    m3 = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load({"model": m3}, storage_reader=NebulaStorageReader(root, 7))
    assert all(torch.equal(m3[k], v) for k, v in model.state_dict().items())


def test_async_save_in_one_process(root: str) -> None:
    model, opt, _ = _trained()
    sd = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 4}
    fut = dcp.async_save(sd, storage_writer=NebulaStorageWriter(root, step=4))
    fut.result(timeout=120)
    fresh, fopt, _ = _trained(seed=5, steps=1)
    into: dict[str, Any] = {"model": fresh.state_dict(), "optim": fopt.state_dict(), "step": 0}
    with nc.Checkpointer(root, memory_tier=False) as ck:
        assert ck.load_latest(into=into) == 4
    fopt.load_state_dict(into["optim"])
    _same((model, opt), (fresh, fopt))


def test_a_failing_write_leaves_no_commit_and_the_next_save_cleans_up(root: str) -> None:
    model, opt, _ = _trained(steps=1)
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.save(sd, storage_writer=NebulaStorageWriter(root, step=1))

    def boom(self: LocalStorage, rel: str, parts: list[memoryview]) -> dict[str, Any]:
        (Path(self.root) / rel).parent.mkdir(parents=True, exist_ok=True)
        with open(Path(self.root) / rel, "wb") as f:   # half written, then the disk fails
            f.write(bytes(parts[0]))
        raise OSError(28, "injected: no space left on device")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LocalStorage, "write_parts", boom)
        with pytest.raises(CheckpointException) as ei:
            dcp.save(sd, storage_writer=NebulaStorageWriter(root, step=2))
    assert "no space left" in str(_failure(ei.value))
    d = Path(root) / "step-2"
    assert not d.exists()   # its own shard is removed, then the folder it left empty
    assert NebulaStorageReader(root).step == 1 and committed_steps(LocalStorage(root)) == [1]

    # a tensor modified while it is written: refused, nothing committed
    real = LocalStorage.write_parts

    def racing(self: LocalStorage, rel: str, parts: list[memoryview]) -> dict[str, Any]:
        out = real(self, rel, parts)
        with torch.no_grad():
            model.lin.weight.add_(1.0)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LocalStorage, "write_parts", racing)
        with pytest.raises(CheckpointException) as ei:
            dcp.save({"model": model.state_dict()}, storage_writer=NebulaStorageWriter(root, step=3))
    assert isinstance(_failure(ei.value), ConsistencyError)
    assert not (Path(root) / "step-3").exists()   # its shard is removed at once, then its empty folder
    dcp.save(sd, storage_writer=NebulaStorageWriter(root, step=4))
    assert sorted(p.name for p in Path(root).iterdir() if p.name.startswith("step-")) == ["step-1", "step-4"]


def test_a_commit_write_that_reports_an_error_deletes_nothing(root: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The COMMIT write reports an error (a lost response on a blob store) and its request lands
    afterwards: nothing of the step was deleted, so it is whole and restores bit-exact."""
    model, opt, _ = _trained(steps=1)
    sd = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 1}
    real = LocalStorage.write_small
    late: list[tuple[LocalStorage, str, bytes]] = []

    def lost(self: LocalStorage, rel: str, data: bytes, *, create_only: bool = False) -> None:
        if rel == f"step-1/{COMMIT}":
            late.append((self, rel, data))
            raise OSError(errno.ETIMEDOUT, "injected at stage 'commit': the response was lost")
        real(self, rel, data, create_only=create_only)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LocalStorage, "write_small", lost)
        mp.setattr(LocalStorage, "failed_create_is_final", False, raising=False)  # as on a blob store
        with pytest.raises(CheckpointException) as ei:
            dcp.save(sd, storage_writer=NebulaStorageWriter(root, step=1))
    d = Path(root) / "step-1"
    assert (d / MANIFEST).exists() and list(d.glob("shard-*"))            # nothing of it deleted
    assert "may have committed" in str(_failure(ei.value))
    for st, rel, data in late:                                                # the request lands
        real(st, rel, data, create_only=True)
    assert cli(["verify", root]) == 0 and "DAMAGED" not in capsys.readouterr().out
    fresh, fopt, _ = _trained(seed=1, steps=1)
    into: dict[str, Any] = {"model": fresh.state_dict(), "optim": fopt.state_dict(), "step": 0}
    with nc.Checkpointer(root, memory_tier=False) as ck:
        assert ck.load_latest(into=into) == 1
    fopt.load_state_dict(into["optim"])
    _same((model, opt), (fresh, fopt))


def test_the_coordinator_commits_only_shards_it_sees_with_their_size(root: str, tmp_path: Path) -> None:
    """A rank whose root is another folder (a node-local path) or whose shard is short: no COMMIT."""
    sd = {"w": torch.arange(64.0)}
    elsewhere = LocalStorage(str(tmp_path / "node-local"))
    real = LocalStorage.write_parts
    def node_local(self: LocalStorage, rel: str, parts: list[memoryview]) -> dict[str, Any]:
        return real(elsewhere, rel, parts)

    def short(self: LocalStorage, rel: str, parts: list[memoryview]) -> dict[str, Any]:  # claims more than written
        return dict(real(self, rel, parts[:-1]), stored_bytes=sum(map(len, parts)))

    for fake, match in [(node_local, "every rank must write to the same root"), (short, "bytes")]:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(LocalStorage, "write_parts", fake)
            with pytest.raises(CheckpointException) as ei:
                dcp.save(sd, storage_writer=NebulaStorageWriter(root, step=1))
        assert match in str(_failure(ei.value)) and "not committed" in str(_failure(ei.value))
        assert not (Path(root) / "step-1").exists()   # the coordinator removed what the save wrote
    dcp.save(sd, storage_writer=NebulaStorageWriter(root, step=1))
    assert NebulaStorageReader(root).step == 1


def test_values_are_typed_json_or_refused_without_allow_pickle(root: str) -> None:
    sd = {"w": torch.arange(6.0), "tags": {"a", "b"}, "n": 1}
    with pytest.raises(CheckpointException) as ei:
        dcp.save(sd, storage_writer=NebulaStorageWriter(root, step=1))
    err = _failure(ei.value)
    assert isinstance(err, ValidationError) and "'tags'" in str(err) and "allow_pickle=True" in str(err)
    assert not (Path(root) / "step-1" / COMMIT).exists()

    dcp.save(sd, storage_writer=NebulaStorageWriter(root, step=1, allow_pickle=True))
    with nc.Checkpointer(root, memory_tier=False, allow_pickle=True) as ck:
        step, tree = ck.read()
    assert step == 1 and tree["tags"] == {"a", "b"} and torch.equal(tree["w"], torch.arange(6.0))
    # the reader exposes the pickled value only with allow_pickle=True
    assert "tags" not in NebulaStorageReader(root).metadata.state_dict_metadata
    got: dict[str, Any] = {"tags": None, "n": 0}
    dcp.load(got, storage_reader=NebulaStorageReader(root, allow_pickle=True))
    assert got == {"tags": {"a", "b"}, "n": 1}


def test_checkpointer_and_dcp_saves_of_one_process_share_the_root(root: str) -> None:
    """A job that saves with both (or resumes with a Checkpointer, then saves with DCP) holds one
    writer generation: neither fences the other."""
    model, opt, sched = _trained(steps=1)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, {"model": model, "optim": opt})
        dcp.save({"model": model.state_dict()}, storage_writer=NebulaStorageWriter(root, step=2))
        ck.save(3, {"model": model, "optim": opt})
        dcp.save({"model": model.state_dict()}, storage_writer=NebulaStorageWriter(root, step=4))
    assert committed_steps(LocalStorage(root)) == [1, 2, 3, 4]
    assert {p.name for p in Path(root).glob("step-*/shard-*")} == {"shard-g1-r0.safetensors"}
    # another process's newer generation fences this one (a stale job must not commit)
    LocalStorage(root).write_small("_nebula/writers/g-2.json", json.dumps(
        {"host": "another-node", "pid": 1, "time": 0.0}).encode(), create_only=True)
    with pytest.raises(CheckpointException) as ei:
        dcp.save({"model": model.state_dict()}, storage_writer=NebulaStorageWriter(root, step=5))
    assert "newer writer (generation 2)" in str(_failure(ei.value))
    assert not (Path(root) / "step-5" / COMMIT).exists()


def _raw(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def test_every_dtype_and_shape_round_trips_bit_exact(root: str, ops_path: str) -> None:
    base = torch.randn(5, 7)
    sd: dict[str, Any] = {
        "bf16": base.bfloat16(), "f16": base.half(), "f64": base.double(), "f8": base.to(torch.float8_e4m3fn),
        "f8b": base.to(torch.float8_e5m2), "bool": base > 0, "c64": torch.complex(base, -base),
        "u16": torch.arange(10).to(torch.uint16), "i8": torch.arange(-5, 5, dtype=torch.int8),
        "scalar": torch.tensor(3.5), "empty": torch.empty(0, 3), "strided": base.t(), "nan": torch.tensor(
            [float("nan"), float("inf"), -0.0]),
        "nested": {"list": [torch.ones(2), torch.zeros(3, dtype=torch.int64)]},
    }
    dcp.save(sd, storage_writer=NebulaStorageWriter(root, step=1))
    with nc.Checkpointer(root, memory_tier=False) as ck:
        step, tree = ck.read()
    assert step == 1 and isinstance(tree["nested"]["list"], list)
    flat = {k: v for k, v in sd.items() if k != "nested"}
    flat.update({"l0": sd["nested"]["list"][0], "l1": sd["nested"]["list"][1]})
    got = {k: v for k, v in tree.items() if k != "nested"}
    got.update({"l0": tree["nested"]["list"][0], "l1": tree["nested"]["list"][1]})
    for k, v in flat.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and _raw(got[k]) == _raw(v), k
    assert cli(["verify", root]) == 0


def test_conj_and_neg_views_keep_their_own_values_not_their_base_tensors(root: str, ops_path: str) -> None:
    x = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    y = torch.tensor([5 - 6j, -7 + 8j, 9j], dtype=torch.complex128)
    # "b" and "conj_im" share the memory of "a" and "im" (a conj / neg bit): not tied weights;
    # "lone" is a conj view whose base is not saved
    sd = {"a": x, "b": x.conj(), "im": x.imag, "conj_im": x.conj().imag, "lone": y.conj(),
          "tied": x, "tied_conj": x.conj()}
    want = {k: v.resolve_conj().resolve_neg().clone() for k, v in sd.items()}
    dcp.save(sd, storage_writer=NebulaStorageWriter(root, step=1))
    man = mf.Manifest.parse((Path(root) / "step-1" / MANIFEST).read_bytes(), "test", 1)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(2, sd)  # the checkpointer's copy path (native or pure-PyTorch) too
        got = {s: ck.read(s)[1] for s in (1, 2)}
    assert man.aliases == {"tied": "a", "tied_conj": "b"}
    dest = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(dest, storage_reader=NebulaStorageReader(root, step=1))
    for k, v in want.items():
        assert _raw(dest[k]) == _raw(v) and _raw(got[1][k]) == _raw(v) and _raw(got[2][k]) == _raw(v), k



def test_the_saved_tensors_stay_resizable_like_with_the_stock_writer(root: str, ops_path: str) -> None:
    """The writer only reads the tensors (and their checksums): a later ``resize_`` or growing
    ``out=`` works, as after a save with the stock ``FileSystemWriter``."""
    sd = {"t": torch.randn(4, 4), "v": torch.arange(10, dtype=torch.int64)}
    dcp.save(sd, storage_writer=NebulaStorageWriter(root, step=1))
    sd["t"].resize_(8, 4)
    torch.arange(20, out=sd["v"])
    assert tuple(sd["t"].shape) == (8, 4) and sd["v"].numel() == 20

# -- real ranks: FSDP2 over 2 gloo ranks --------------------------------------------------------------------

WORLD = 2
_jobs: dict[str, Any] = {}


def jobs() -> dict[str, Path]:
    """Run the save, kill and load jobs once per session (see ``dcp_writer_worker.py``)."""
    if "error" in _jobs:
        raise AssertionError(f"the DCP writer jobs failed earlier in this session:\n{_jobs['error']}")
    if "paths" not in _jobs:
        try:
            _jobs["paths"] = _run_jobs()
        except AssertionError as e:
            _jobs["error"] = str(e)
            raise
    paths: dict[str, Path] = _jobs["paths"]
    return paths


def _run_jobs() -> dict[str, Path]:
    base = Path(tempfile.mkdtemp(prefix="nebula-dcpw-"))
    atexit.register(shutil.rmtree, base, True)
    paths = {"root": base / "root", "out": base / "out", "shm": base / "shm"}
    paths["out"].mkdir()
    paths["shm"].mkdir()
    for scenario in ("save", "kill", "load"):
        done = run_ranks(WORLD, "dcp_writer_worker.py", [scenario, str(paths["root"]), str(paths["out"])],
                         paths["out"], str(paths["shm"]), timeout=200)
        for r, p in enumerate(done):
            if scenario == "kill" and r == WORLD - 1:
                assert p.returncode == -9, f"kill rank {r}: expected SIGKILL, got {p.returncode}:\n{p.stdout[-3000:]}"
                continue
            assert p.returncode == 0, f"{scenario} rank {r} of {WORLD}:\n{p.stdout[-4000:]}"
    return paths


def _assert_bit_exact(ref: dict[str, Any], got: dict[str, Any]) -> None:
    tensors = sorted(k for k, v in ref.items() if isinstance(v, torch.Tensor))
    assert tensors and tensors == sorted(k for k, v in got.items() if isinstance(v, torch.Tensor))
    for k in tensors:
        assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), k
    assert got["lr"] == ref["lr"] == 0.0123


def test_two_fsdp2_ranks_write_a_normal_multi_rank_checkpoint() -> None:
    root = jobs()["root"]
    d = root / "step-5"
    # the multi-rank layout every writer of a shared root commits (format version 4)
    assert sorted(p.name for p in d.iterdir()) == ["COMMIT", "manifest.json", "ranks.json", "records-g1-r0.json",
                                                   "records-g1-r1.json", "shard-g1-r0.safetensors",
                                                   "shard-g1-r1.safetensors"]
    assert json.loads((d / MANIFEST).read_bytes())["version"] == SPLIT_VERSION
    man = read_manifest(LocalStorage(str(root)), 5)
    assert man.world_size == 2 and list(man.ranks) == [0, 1] and man.stats["writer"] == "torch.distributed.checkpoint"
    for r in range(2):  # each rank's local shard of an FSDP2 parameter, with where it lies
        info = man.tensors[f"r{r}/model/2.weight"].dtensor
        assert info is not None and info.shape == (6, 32) and info.offsets == (3 * r, 0)
        assert info.placements == ("S(0)",) and info.mesh == (2,)
    # values DCP wrote once are every rank's (one tree), tensors it deduplicated are aliases
    assert set(man.rank_tree.values()) == {0}
    reader = NebulaStorageReader(str(root), 5)
    md = reader.metadata.state_dict_metadata["model/2.weight"]
    assert tuple(md.size) == (6, 32) and [tuple(c.offsets) for c in md.chunks] == [(0, 0), (3, 0)]
    assert "optim.param_groups.0.lr" in reader.metadata.state_dict_metadata


def test_two_ranks_load_it_back_with_dcp_and_the_checkpointer_bit_exact() -> None:
    p = jobs()
    ref5 = torch.load(p["out"] / "ref5.pt", weights_only=True)
    got = torch.load(p["out"] / "dcp5.pt", weights_only=True)
    assert got["step"] == 5
    _assert_bit_exact(ref5, got)
    # Checkpointer.load_latest on the same world size: the newest step, 8 (the state of step 6)
    got = torch.load(p["out"] / "ck.pt", weights_only=True)
    assert got["step"] == 8 and reports(p["out"], "load", WORLD)[0]["latest"] == 8
    _assert_bit_exact(torch.load(p["out"] / "ref6.pt", weights_only=True), got)


def test_one_process_loads_the_two_rank_checkpoint_bit_exact() -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from .dcp_writer_worker import build, full_sd, train

    p = jobs()
    model, opt = build(77, sharded=False)
    train(model, opt, 1, seed=3)
    msd, osd = get_state_dict(model, opt)
    sd: dict[str, Any] = {"model": msd, "optim": osd, "step": 0}
    dcp.load(sd, storage_reader=NebulaStorageReader(str(p["root"]), 5))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert sd["step"] == 5
    _assert_bit_exact(torch.load(p["out"] / "ref5.pt", weights_only=True), full_sd(*get_state_dict(model, opt)))

    model, opt = build(78, sharded=False)
    train(model, opt, 1, seed=4)
    msd, osd = get_state_dict(model, opt)
    into: dict[str, Any] = {"model": msd, "optim": osd, "step": 0}
    with nc.Checkpointer(str(p["root"]), memory_tier=False) as ck:
        assert ck.load_latest(into=into) == 8  # resharded: 2 ranks -> 1 process
    set_state_dict(model, opt, model_state_dict=into["model"], optim_state_dict=into["optim"])
    _assert_bit_exact(torch.load(p["out"] / "ref6.pt", weights_only=True), full_sd(*get_state_dict(model, opt)))


def test_async_save_on_two_ranks_and_a_committed_step_is_refused() -> None:
    p = jobs()
    assert (p["root"] / "step-6" / COMMIT).exists()
    for rep in reports(p["out"], "save", WORLD):
        assert "step 5 is already committed" in rep["again5"]


def test_a_rank_failing_in_write_data_means_no_commit() -> None:
    p = jobs()
    for rep in reports(p["out"], "save", WORLD):
        assert "injected: no space left" in rep["step7"] and f"rank {WORLD - 1}" in rep["step7"]
        assert COMMIT not in (rep["after7"] or []) and MANIFEST not in (rep["after7"] or [])
        assert f"shard-g1-r{WORLD - 1}.safetensors" not in (rep["after7"] or [])
    assert not (p["root"] / "step-7").exists()   # the next save (step 8) removed what was left


def test_a_rank_killed_in_write_data_means_no_commit(capsys: pytest.CaptureFixture[str]) -> None:
    p = jobs()
    rep = json.loads((p["out"] / "kill-r0.json").read_text())
    assert rep["step9"] != "committed"
    assert not (p["root"] / "step-9" / COMMIT).exists()
    assert NebulaStorageReader(str(p["root"])).step == 8
    assert committed_steps(LocalStorage(str(p["root"]))) == [5, 6, 8]
    assert cli(["verify", str(p["root"])]) == 0
    out = capsys.readouterr().out
    assert out.count("OK ") == 3 and "DAMAGED" not in out


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "dcp_save.py"


@pytest.mark.parametrize("ranks", [0, 2])
def test_the_example_runs(tmp_path: Path, ranks: int) -> None:
    root = str(tmp_path / "ck")
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
              str(free_port())] if ranks else [sys.executable]
    cmd = launch + [str(EXAMPLE), "--root", root] + (["--fsdp"] if ranks else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", NEBULA_SHM_DIR=str(tmp_path / "shm"))
    for first in (0, 10):  # run twice: the second run saves new steps
        p = warm_python.run(cmd, env=env, text=True, capture_output=True, timeout=240)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        assert f"saved steps {first} and {first + 5}" in p.stdout and "model bit-exact: True" in p.stdout
    assert cli(["verify", root]) == 0


def test_a_sharded_tensor_with_several_chunks_on_one_rank_is_refused_naming_the_key_and_the_fix(
        root: str, tmp_path: Path) -> None:
    """DCP's own FileSystemWriter takes a ShardedTensor holding several local shards on one rank;
    this writer keeps one chunk per rank and key: it refuses it before writing anything, naming
    the key and what to do instead (the documented limit, docs/multi-rank.md)."""
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        st = init_from_local_shards([
            Shard(torch.arange(4.0).reshape(2, 2), ShardMetadata([0, 0], [2, 2], "rank:0/cpu")),
            Shard(torch.arange(4.0, 8.0).reshape(2, 2), ShardMetadata([2, 0], [2, 2], "rank:0/cpu"))],
                                    [4, 2])
        with pytest.raises((ValidationError, CheckpointException)) as got:
            dcp.save({"w": st}, storage_writer=NebulaStorageWriter(root, step=1))
        msg = str(got.value)
        assert "'w'" in msg and "several chunks" in msg and "DTensor" in msg and "nothing was written" in msg
        assert not os.path.isdir(os.path.join(root, "step-1")) or not committed_steps(LocalStorage(root))
        dcp.save({"w": st}, checkpoint_id=str(tmp_path / "stock"))  # the stock writer takes it
        assert os.path.isfile(tmp_path / "stock" / ".metadata")
    finally:
        dist.destroy_process_group()
