"""NebulaCheckpointIO with real PyTorch Lightning: top-k / last / removal through every tier,
bit-identical resume after SIGKILL, background failures surfacing from fit."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback
from typing import Any

import numpy as np
import pytest
import torch

import warm_python

pl = pytest.importorskip("pytorch_lightning", reason="PyTorch Lightning is not installed: "
                         "pip install 'nebula_ckpt[lightning]' (pytorch-lightning) to run these tests")

from pytorch_lightning.callbacks import Callback, ModelCheckpoint  # noqa: E402

import nebula_ckpt as nc  # noqa: E402
from faults import FaultyTier  # noqa: E402
from integrations.lightning_worker import (  # noqa: E402
    BATCH,
    SEED,
    ResumableLoader,
    TinyModule,
    make_data,
    make_trainer,
)
from nebula_ckpt.integrations.lightning import (  # noqa: E402
    POINTER_FORMAT,
    NebulaCheckpointIO,
    load_checkpoint,
    read_pointer,
    tag_for_path,
    write_pointer,
)

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lightning_worker.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _state(seed: int = 0) -> dict[str, Any]:
    """A Lightning-shaped checkpoint dict (live tensors, optimizer state, plain values)."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return {"epoch": seed, "global_step": 10 * seed, "pytorch-lightning_version": pl.__version__,
            "state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()],
            "callbacks": {"ModelCheckpoint{'monitor': 'val_loss'}": {"best_k_models": {"/a/b.ckpt": torch.tensor(.5)}}},
            "hyper_parameters": {"lr": 1e-3, "name": "x"}}


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b and type(a) is type(b), where


def _tier_steps(root: str) -> dict[str, set[int]]:
    """Committed steps per tier of ``root`` (a fresh reader)."""
    with nc.Checkpointer(root) as ck:
        return {t: set(s) for t, s in ck.list(detailed=True).items()}


def _pointers(dirpath: str) -> dict[str, dict[str, Any]]:
    out = {}
    for name in sorted(os.listdir(dirpath)):
        p = os.path.join(dirpath, name)
        ptr = read_pointer(p)
        if ptr is not None:
            out[name] = ptr
    return out


# -- units -----------------------------------------------------------------------------------------
def test_is_a_lightning_checkpoint_io(root: str) -> None:
    from lightning_fabric.plugins import CheckpointIO

    io = NebulaCheckpointIO(root)
    assert isinstance(io, CheckpointIO)
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({"a": 1}, os.path.join(root, "..", "x.ckpt"), storage_options={"x": 1})


def test_a_pathlib_root_is_taken_as_its_string(root: str) -> None:
    from pathlib import Path

    assert NebulaCheckpointIO(Path(root)).root == root


def test_tag_for_path(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpts").mkdir()
    plain = tag_for_path("ckpts/epoch=3-step=1200.ckpt")
    assert plain == f"{os.path.realpath(tmp_path)}/ckpts/epoch=3-step=1200.ckpt"
    assert tag_for_path("./ckpts/epoch=3-step=1200.ckpt") == plain
    odd = tag_for_path("ckpts/val loss='0.5' ~x.ckpt")
    assert " " not in odd and "'" not in odd and odd.endswith("val~20loss=~270.5~27~20~7ex.ckpt")
    assert tag_for_path("ckpts/a b.ckpt") != tag_for_path("ckpts/a~20b.ckpt")  # the escape is escaped too
    long1, long2 = tag_for_path("ckpts/" + "é" * 300 + "1.ckpt"), tag_for_path("ckpts/" + "é" * 300 + "2.ckpt")
    assert long1 != long2 and len(long1) <= 256 and len(long2) <= 256
    assert tag_for_path("s3://bucket/run/last.ckpt") == "s3://bucket/run/last.ckpt"


def test_pointer_is_atomic_json_and_torch_files_are_not_pointers(tmp_path) -> None:  # noqa: ANN001
    p = str(tmp_path / "d" / "last.ckpt")
    write_pointer(p, {"format": POINTER_FORMAT, "root": "/r", "step": 3, "tag": "/d/last.ckpt"})
    assert read_pointer(p) == {"format": POINTER_FORMAT, "root": "/r", "step": 3, "tag": "/d/last.ckpt"}
    assert os.listdir(tmp_path / "d") == ["last.ckpt"]  # no temporary file left behind
    assert (os.stat(p).st_mode & 0o777) == 0o666 & ~_umask()
    t = str(tmp_path / "t.ckpt")
    torch.save({"state_dict": {"w": torch.ones(2)}}, t)
    assert read_pointer(t) is None
    assert read_pointer(str(tmp_path / "missing.ckpt")) is None
    bad = str(tmp_path / "bad.ckpt")
    with open(bad, "w") as f:
        json.dump({"format": POINTER_FORMAT, "root": "/r", "step": "3", "tag": "x"}, f)
    with pytest.raises(nc.NebulaError, match="'step'"):
        read_pointer(bad)


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


def test_save_load_resave_remove(root: str, tmp_path) -> None:  # noqa: ANN001
    io = NebulaCheckpointIO(root)
    d = tmp_path / "ckpts"
    a, last = str(d / "epoch=0-step=10.ckpt"), str(d / "last.ckpt")
    try:
        s0 = _state(0)
        io.save_checkpoint(s0, a)
        io.save_checkpoint(_state(1), last)
        io.save_checkpoint(_state(2), last)  # a path saved again: the older step goes once this one is durable
        io.wait()
        assert io.last_save_seconds is not None
        tags = io.checkpointer.tags()
        assert tags == {tag_for_path(a): 0, tag_for_path(last): 2}
        # saves outside fit close their Checkpointer, which frees the memory tier: the disk keeps both
        assert {t: set(s) for t, s in io.checkpointer.list(detailed=True).items()} == {
            io.checkpointer.tiers[0].name: set(), io.checkpointer.tiers[1].name: {0, 2}}
        _assert_same(io.load_checkpoint(a), s0)
        _assert_same(io.load_checkpoint(last), _state(2))
        # save_last="link": removing the link leaves its target
        link = str(d / "last-link.ckpt")
        os.symlink(os.path.basename(a), link)
        _assert_same(io.load_checkpoint(link), s0)
        io.remove_checkpoint(link)
        assert not os.path.lexists(link) and os.path.exists(a)
        io.remove_checkpoint(a)
        assert not os.path.exists(a)
        assert set(io.checkpointer.tags()) == {tag_for_path(last)}
        with pytest.raises(FileNotFoundError):
            io.load_checkpoint(a)
    finally:
        io.teardown()
    per = _tier_steps(root)
    assert per.pop(f"local:{os.path.realpath(root)}") == {2}
    assert list(per.values()) == [set()]  # close() freed the memory tier


def test_pointer_to_uncommitted_save_loads_previous(root: str, tmp_path, caplog) -> None:  # noqa: ANN001
    """The pointer is written when the save starts; killed before the commit, the path resolves to
    the newest committed checkpoint saved at it."""
    io = NebulaCheckpointIO(root)
    last = str(tmp_path / "last.ckpt")
    try:
        io.save_checkpoint(_state(1), last)
        io.wait()
        ptr = read_pointer(last)
        assert ptr is not None
        write_pointer(last, {**ptr, "step": 99})  # as if the save of step 99 had been killed
        with caplog.at_level(logging.WARNING, logger="nebula_ckpt"):
            _assert_same(io.load_checkpoint(last), _state(1))
        assert "never committed" in caplog.text
    finally:
        io.teardown()


def test_foreign_torch_file_loads(root: str, tmp_path) -> None:  # noqa: ANN001
    p = str(tmp_path / "from-elsewhere.ckpt")
    torch.save(_state(3), p)
    io = NebulaCheckpointIO(root)
    _assert_same(io.load_checkpoint(p), _state(3))
    io.remove_checkpoint(p)
    assert not os.path.exists(p)
    io.teardown()


def test_remove_checkpoint_of_a_folder_or_link_is_stocks(root: str, tmp_path) -> None:  # noqa: ANN001
    """What is not a pointer file is removed as ``TorchCheckpointIO`` removes it (``fs.rm(path,
    recursive=True)``): a folder (a sharded / DeepSpeed checkpoint, which ModelCheckpoint's top-k
    removal hands over) with everything in it, a link unlinked; never a link's target."""
    from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO

    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "keep.pt").write_bytes(b"k")
    for label, io in (("stock", TorchCheckpointIO()), ("nebula", NebulaCheckpointIO(root))):
        d = tmp_path / label
        (d / "dir.ckpt" / "sub").mkdir(parents=True)
        (d / "dir.ckpt" / "sub" / "x.pt").write_bytes(b"x" * 10)
        os.symlink(outside, d / "dir.ckpt" / "link-out")  # a link inside: unlinked, not followed
        os.symlink(outside, d / "link.ckpt")  # a link to a folder: the link only
        io.remove_checkpoint(str(d / "dir.ckpt"))
        io.remove_checkpoint(str(d / "link.ckpt"))
        io.remove_checkpoint(str(d / "missing.ckpt"))
        assert sorted(os.listdir(d)) == [], label
        assert (outside / "sub" / "keep.pt").read_bytes() == b"k", label
    assert not os.path.exists(root)  # nothing of nebula_ckpt's was touched, not even created


def test_a_refused_save_outside_fit_closes_the_checkpointer(root: str, tmp_path) -> None:  # noqa: ANN001
    """A save outside fit is complete when the call returns, its Checkpointer closed: also when it is
    refused (a value typed JSON cannot hold), else the Checkpointer outlives the call and is reported
    unclosed at exit."""
    import threading

    io = NebulaCheckpointIO(root)
    p = str(tmp_path / "x.ckpt")
    before = set(threading.enumerate())
    with pytest.raises(nc.ValidationError, match="'bad'"):
        io.save_checkpoint({**_state(0), "bad": {1, 2}}, p)
    assert io._ckpt is None  # closed by the failed call itself
    assert {t for t in threading.enumerate() if t.is_alive()} <= before
    assert not os.path.exists(p)
    io.save_checkpoint(_state(1), p)  # the plugin goes on: a new Checkpointer, closed again
    assert io._ckpt is None
    _assert_same(io.load_checkpoint(p), _state(1))


def test_a_pointer_whose_root_is_gone_says_so(root: str, tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    """The root a pointer names deleted (and the memory tier with it): the error names that root and
    says it no longer exists, not that the save never committed (it did); nothing is created."""
    io = NebulaCheckpointIO(root)
    last = str(tmp_path / "ckpts" / "last.ckpt")
    io.save_checkpoint(_state(1), last)  # outside fit: durable on every tier when it returns
    shutil.rmtree(root)
    for name in os.listdir(shm_dir):
        shutil.rmtree(os.path.join(shm_dir, name))
    with pytest.raises(nc.NotFoundError) as e:
        NebulaCheckpointIO(root).load_checkpoint(last)
    msg = str(e.value)
    assert f"root it names, {os.path.realpath(root)}, no longer exists" in msg and "never committed" not in msg
    assert f"remove {last}" in msg
    assert not os.path.exists(root)
    os.makedirs(root)  # the root there but without the checkpoint: that other message
    with pytest.raises(nc.NotFoundError, match="never committed"):
        NebulaCheckpointIO(root).load_checkpoint(last)


def test_removing_a_copy_of_a_pointer_keeps_what_another_pointer_names(root: str, tmp_path) -> None:  # noqa: ANN001
    """A pointer file's content names the checkpoint of the path it was written at; a copy of it
    (a user's backup, Lightning's ``last.ckpt`` where it cannot link) names the same one. Removing
    any of them removes the checkpoint only once no other pointer file names it."""
    io = NebulaCheckpointIO(root)
    d = tmp_path / "ckpts"
    a, backup, last = str(d / "epoch=1.ckpt"), str(d / "backup.ckpt"), str(d / "last.ckpt")
    elsewhere = str(tmp_path / "keep" / "mine.ckpt")
    try:
        io.save_checkpoint(_state(1), a)
        io.wait()
        shutil.copy(a, backup)
        shutil.copy(a, str(d / ".epoch=1.ckpt.x1y2z3.nebula-tmp"))  # a pointer's temporary file left by a crash
        os.makedirs(os.path.dirname(elsewhere))
        shutil.copy(a, elsewhere)
        io.remove_checkpoint(backup)  # a copy beside the original
        assert not os.path.exists(backup)
        _assert_same(io.load_checkpoint(a), _state(1))
        io.remove_checkpoint(elsewhere)  # a copy in another folder: the original is where it says
        assert not os.path.exists(elsewhere)
        _assert_same(io.load_checkpoint(a), _state(1))
        # the original goes while a copy of it still names its checkpoint (top-k eviction of the
        # file last.ckpt was copied from): the checkpoint stays for the copy
        shutil.copy(a, last)
        io.remove_checkpoint(a)
        assert not os.path.exists(a)
        _assert_same(io.load_checkpoint(last), _state(1))
        assert set(io.checkpointer.tags()) == {tag_for_path(a)}
        # Lightning replaces last.ckpt itself (os.remove, then a new link or copy): the checkpoint no
        # pointer file names any more is removed at the plugin's next save
        os.remove(last)
        b = str(d / "epoch=2.ckpt")
        io.save_checkpoint(_state(2), b)
        io.wait()
        assert set(io.checkpointer.tags()) == {tag_for_path(b)}
        # removing the last pointer file of a checkpoint removes it
        io.remove_checkpoint(b)
        assert io.checkpointer.tags() == {} and os.listdir(d) == [".epoch=1.ckpt.x1y2z3.nebula-tmp"]
    finally:
        io.teardown()


class _AllPointersLoad(Callback):
    """At every epoch end: every pointer file in the folder loads (none names a removed checkpoint)."""

    def __init__(self, io: NebulaCheckpointIO, dirpath: str) -> None:
        self.io, self.dirpath, self.checked = io, dirpath, 0

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if not os.path.isdir(self.dirpath):
            return
        self.io.wait()
        for name in sorted(os.listdir(self.dirpath)):
            got = self.io.load_checkpoint(os.path.join(self.dirpath, name))
            assert "state_dict" in got, name
            self.checked += 1


@pytest.mark.timeout(180)
@pytest.mark.parametrize("save_last,links,last_name", [
    ("link", False, "last-{epoch}"),   # Lightning copies the pointer (no symlinks), last-N removed each epoch
    ("link", False, "last"),           # ... last.ckpt replaced by a copy with os.remove, behind the plugin
    ("link", True, "last-{epoch}"),    # real symlinks
    (True, True, "last-{epoch}"),      # last-N saved as checkpoints of their own
], ids=["link-copied-last-N", "link-copied-last", "link-symlink-last-N", "save_last-last-N"])
def test_fit_save_last_copies_and_links_never_lose_a_checkpoint(root: str, tmp_path, monkeypatch,  # noqa: ANN001
                                                                save_last: Any, links: bool,
                                                                last_name: str) -> None:
    """A real Trainer with save_top_k and save_last: top-k eviction and the removal of an older
    last file never remove a checkpoint another pointer file (a copy) still names; at the end the
    root holds exactly the checkpoints the pointer files name (nothing dangling, nothing leaked)."""
    if not links:  # as on a file system (or platform) without symlinks: Lightning falls back to copying
        def no_symlink(*_: Any, **__: Any) -> None:
            raise OSError(1, "symlinks not permitted here")
        monkeypatch.setattr(os, "symlink", no_symlink)
    torch.manual_seed(SEED)
    x, y = make_data()
    val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:16], y[:16]), batch_size=8)
    dirpath = str(tmp_path / "ckpts")
    io = NebulaCheckpointIO(root)
    check = _AllPointersLoad(io, dirpath)
    cb = ModelCheckpoint(dirpath=dirpath, monitor="val_loss", save_top_k=2, save_last=save_last)
    cb.CHECKPOINT_NAME_LAST = last_name
    trainer = make_trainer(io, dirpath, [check], max_epochs=6, checkpoint_callback=cb)
    trainer.fit(TinyModule(), ResumableLoader(x, y, BATCH, SEED), val)
    assert check.checked >= 10
    names = sorted(os.listdir(dirpath))
    files = {n: read_pointer(os.path.join(dirpath, n)) for n in names}
    if not links:
        assert not any(os.path.islink(os.path.join(dirpath, n)) for n in names)
    assert {os.path.basename(p) for p in cb.best_k_models} <= set(names) and len(names) == 3, names
    for n in names:
        assert "state_dict" in load_checkpoint(os.path.join(dirpath, n)), n
    with nc.Checkpointer(root, read_only=True) as ck:
        assert set(ck.tags()) == {p["tag"] for p in files.values() if p is not None}, (names, ck.tags())


# -- real fits -----------------------------------------------------------------------------------------
class _CheckTiers(Callback):
    """At every epoch end: every tier holds exactly the checkpoints whose pointers exist."""

    def __init__(self, io: NebulaCheckpointIO, dirpath: str) -> None:
        self.io, self.dirpath, self.checked = io, dirpath, 0

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if not os.path.isdir(self.dirpath):
            return
        self.io.wait()
        live = {p["step"] for p in _pointers(self.dirpath).values()}
        per = self.io.checkpointer.list(detailed=True)
        mem, disk = (set(per[t.name]) for t in self.io.checkpointer.tiers)
        assert disk == live, (disk, live)
        # the memory tier keeps the newest, and an older step only while a newer one refers to its
        # bytes (incremental)
        assert mem <= live and max(live) in mem, (mem, live)
        self.checked += 1


@pytest.mark.timeout(120)
def test_fit_top_k_last_and_resume_last(root: str, tmp_path) -> None:  # noqa: ANN001
    torch.manual_seed(SEED)
    x, y = make_data()
    val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:16], y[:16]), batch_size=8)
    dirpath = str(tmp_path / "ckpts")
    io = NebulaCheckpointIO(root)
    check = _CheckTiers(io, dirpath)
    cb = ModelCheckpoint(dirpath=dirpath, monitor="val_loss", save_top_k=2, save_last=True)
    model = TinyModule()
    trainer = make_trainer(io, dirpath, [check], max_epochs=5, checkpoint_callback=cb)
    trainer.fit(model, ResumableLoader(x, y, BATCH, SEED), val)
    assert check.checked >= 4

    files = _pointers(dirpath)
    kept = {os.path.basename(p) for p in cb.best_k_models} | {"last.ckpt"}
    assert set(files) == kept and len(kept) == 3, (set(files), kept)
    assert set(os.listdir(dirpath)) == kept  # no temporary or stray files
    with nc.Checkpointer(root) as ck:
        tags = ck.tags()
        assert tags == {tag_for_path(os.path.join(dirpath, n)): p["step"] for n, p in files.items()}
        # everything else (top-k files that fell out, older "last" saves) is gone from every tier
        assert set(ck.list()) == {p["step"] for p in files.values()}
    # the best checkpoint is the model of that epoch
    best = io.load_checkpoint(cb.best_model_path)
    assert best["global_step"] == files[os.path.basename(cb.best_model_path)]["global_step"]
    io.teardown()
    # without a Trainer or plugin (what LightningModule.load_from_checkpoint cannot do with a pointer)
    standalone = load_checkpoint(cb.best_model_path)
    _assert_same(standalone, best)
    again = TinyModule(**standalone["hyper_parameters"])
    again.load_state_dict(standalone["state_dict"])

    # resume from "last" in a new Trainer (new plugin, same root): one more epoch
    io2 = NebulaCheckpointIO(root)
    model2 = TinyModule()
    cb2 = ModelCheckpoint(dirpath=dirpath, monitor="val_loss", save_top_k=2, save_last=True)
    trainer2 = make_trainer(io2, dirpath, max_epochs=6, checkpoint_callback=cb2)
    trainer2.fit(model2, ResumableLoader(x, y, BATCH, SEED), val, ckpt_path="last")
    assert trainer2.global_step == 6 * (64 // BATCH) and trainer2.current_epoch == 6
    assert set(_pointers(dirpath)) == {os.path.basename(p) for p in cb2.best_k_models} | {"last.ckpt"}
    with nc.Checkpointer(root) as ck:
        assert set(ck.list()) == {p["step"] for p in _pointers(dirpath).values()}
        assert ck.read(tag=tag_for_path(os.path.join(dirpath, "last.ckpt")))[1]["epoch"] == 5


@pytest.mark.timeout(120)
@pytest.mark.parametrize("when", ["next_save", "teardown"])
def test_background_failure_surfaces_from_fit(tmp_path, shm_dir: str, when: str) -> None:  # noqa: ANN001
    """A persist that fails in the background is raised by the next save, or by teardown at the end of fit."""
    x, y = make_data()
    root = str(tmp_path / "ckpt")
    # every_n_train_steps=5 over 8 steps: one save (step 0, at global step 5) ...; 16 steps: saves 0, 1, 2, 3
    tier = FaultyTier(root, fail_at="shard", fail_steps={0})
    io = NebulaCheckpointIO(root, tiers=[tier])
    dirpath = str(tmp_path / "ckpts")
    cb = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=5, save_top_k=-1)
    trainer = make_trainer(io, dirpath, max_epochs=2 if when == "next_save" else 1, checkpoint_callback=cb)
    with pytest.raises(nc.PersistError, match="injected failure") as ei:
        trainer.fit(TinyModule(), ResumableLoader(x, y, BATCH, SEED))
    if when == "next_save":
        assert trainer.global_step == 10  # the second save (global step 10) raised it: training stopped there
    else:
        assert trainer.global_step == 8  # the end of fit
    assert "step 0" in str(ei.value)
    raised_in = [f.name for f in traceback.extract_tb(ei.value.__traceback__)]
    assert ("save_checkpoint" if when == "next_save" else "teardown") in raised_in, raised_in
    io.teardown()  # already closed: nothing raised twice


# -- crash and resume (subprocesses) -------------------------------------------------------------------
def _run_worker(tmp: str, name: str, root: str, dirpath: str, env: dict[str, str], *extra: str) -> int:
    log_path = os.path.join(tmp, f"{name}.log")
    with open(log_path, "w") as logf:
        proc = warm_python.run([sys.executable, WORKER, "--root", root, "--dirpath", dirpath, "--out", tmp,
                               "--name", name, *extra], env=env, stdout=logf, stderr=subprocess.STDOUT,
                               timeout=240, cwd=REPO)
    if proc.returncode not in (0, -signal.SIGKILL):
        with open(log_path) as f:
            pytest.fail(f"worker {name} exited {proc.returncode}:\n{f.read()[-4000:]}")
    return proc.returncode


def _losses(path: str) -> dict[int, str]:
    out: dict[int, str] = {}
    with open(path) as f:
        for line in f:
            step, loss = line.split()
            out[int(step)] = loss
    return out


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The uninterrupted run: per-step losses and the final digest."""
    tmp = str(tmp_path_factory.mktemp("lightning-ref"))
    shm = _private_shm(tmp)
    try:
        env = {**os.environ, "NEBULA_SHM_DIR": shm, "PYTHONWARNINGS": "ignore"}
        _run_worker(tmp, "full", os.path.join(tmp, "root"), os.path.join(tmp, "ckpts"), env)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    with open(os.path.join(tmp, "final-full.json")) as f:
        final = json.load(f)
    return {"losses": _losses(os.path.join(tmp, "losses-full.txt")), **final}


def _private_shm(tmp: str) -> str:
    """A private memory-tier folder on the real tmpfs (/dev/shm) where there is one."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tmp
    return tempfile.mkdtemp(prefix="nebula-test-lightning-", dir=base)


@pytest.mark.slow
@pytest.mark.crash
@pytest.mark.timeout(400)
@pytest.mark.parametrize("resume_from", ["memory", "disk"])
def test_sigkill_then_resume_last_is_bit_identical(reference_run: dict[str, Any], tmp_path, shm_dir: str,  # noqa: ANN001
                                                   resume_from: str) -> None:
    """Killed with SIGKILL right after the saves of global step 10 started; a new process resumes
    with ckpt_path="last" (from the memory tier, or from disk after the memory tier is wiped: the
    step-10 checkpoint if it reached the disk, else the step-5 one, through the pointer's fallback)
    and its per-step losses and final parameters / optimizer state are bit-identical to an
    uninterrupted run's."""
    tmp, shm = str(tmp_path), shm_dir
    env = {**os.environ, "NEBULA_SHM_DIR": shm, "PYTHONWARNINGS": "ignore"}
    root, dirpath = os.path.join(tmp, "root"), os.path.join(tmp, "ckpts")
    # "memory": killed once the newest last.ckpt is in the memory tier (the disk may still be writing it);
    # "disk": killed as soon as anything committed, then the memory tier is wiped
    when = "memory" if resume_from == "memory" else "any"
    assert _run_worker(tmp, "crash", root, dirpath, env, "--kill-at", "10", "--kill-when", when) == -signal.SIGKILL
    assert not os.path.exists(os.path.join(tmp, "final-crash.json"))
    ref = reference_run["losses"]
    before = _losses(os.path.join(tmp, "losses-crash.txt"))
    assert max(before) == 9 and all(before[s] == ref[s] for s in before)  # steps 0..9 ran, then the kill
    if resume_from == "disk":
        shutil.rmtree(shm)
        os.makedirs(shm)
        with nc.Checkpointer(root, memory_tier=False) as ck:
            assert ck.list(), "nothing committed on disk before the kill"
    _run_worker(tmp, "resume", root, dirpath, env, "--resume")
    with open(os.path.join(tmp, "final-resume.json")) as f:
        final = json.load(f)
    after = _losses(os.path.join(tmp, "losses-resume.txt"))
    assert final["resumed_from"] in ((10,) if resume_from == "memory" else (5, 10)), final
    assert min(after) == final["resumed_from"] and max(after) == max(ref)
    mismatched = {s: (after[s], ref[s]) for s in after if after[s] != ref[s]}
    assert not mismatched, f"losses differ after resuming from step {final['resumed_from']}: {mismatched}"
    assert final["digest"] == reference_run["digest"] and final["global_step"] == reference_run["global_step"]
    with open(os.path.join(tmp, "resume.log")) as f:
        text = f.read()
    loaded = [ln for ln in text.splitlines() if "nebula_ckpt.integrations.lightning" in ln and "last.ckpt" in ln]
    assert len(loaded) == 1, text[-3000:]
    if resume_from == "memory":
        assert "from tier memory:" in loaded[0], loaded
    else:
        assert f"from tier local:{os.path.realpath(root)}" in loaded[0], loaded


@pytest.mark.slow
@pytest.mark.crash
@pytest.mark.timeout(400)
@pytest.mark.parametrize("how", ["mv"])  # "cp": the same pointers, tests/integrations/test_deepspeed.py
def test_run_folder_moved_or_copied_resumes_bit_identical(reference_run: dict[str, Any], tmp_path,  # noqa: ANN001
                                                          shm_dir: str, how: str) -> None:
    """A run folder holding the root and the checkpoint folder, SIGKILLed mid-run, then moved
    (``mv``) or copied (``cp -r``) elsewhere: ``ckpt_path="last"`` in the new place resumes from the
    root inside it (the pointers name it relative to themselves), bit-identical to an
    uninterrupted run; a copy leaves the original untouched."""
    env = {**os.environ, "NEBULA_SHM_DIR": shm_dir, "PYTHONWARNINGS": "ignore"}
    old, new = tmp_path / "run", tmp_path / "elsewhere" / "run2"
    tmp = str(tmp_path)
    rc = _run_worker(tmp, "crash", str(old / "nebula"), str(old / "ckpts"), env, "--kill-at", "10",
                     "--kill-when", "any")
    assert rc == -signal.SIGKILL
    with nc.Checkpointer(str(old / "nebula"), memory_tier=False) as ck:
        committed = ck.list()
    assert committed, "nothing committed on disk before the kill"
    new.parent.mkdir()
    if how == "mv":
        shutil.move(str(old), str(new))
    else:
        shutil.copytree(str(old), str(new), symlinks=True)
    if how == "mv":  # the old root is gone: a pointer written before the move finds the root beside it
        moved = str(new / "ckpts" / "last.ckpt")
        before = TinyModule.load_from_checkpoint(moved)  # Lightning's own torch.load of the file
        _assert_same(dict(before.state_dict()), load_checkpoint(moved)["state_dict"])
    _run_worker(tmp, "resume", str(new / "nebula"), str(new / "ckpts"), env, "--resume")
    with open(os.path.join(tmp, "final-resume.json")) as f:
        final = json.load(f)
    ref = reference_run["losses"]
    after = _losses(os.path.join(tmp, "losses-resume.txt"))
    assert final["resumed_from"] in (5, 10) and min(after) == final["resumed_from"] and max(after) == max(ref)
    assert {s: after[s] for s in after} == {s: ref[s] for s in after}
    assert final["digest"] == reference_run["digest"] and final["global_step"] == reference_run["global_step"]
    with open(os.path.join(tmp, "resume.log")) as f:
        text = f.read()
    loaded = [ln for ln in text.splitlines() if "nebula_ckpt.integrations.lightning" in ln and "last.ckpt" in ln]
    assert len(loaded) == 1 and f"from tier local:{os.path.realpath(new / 'nebula')}" in loaded[0], text[-3000:]
    if how == "cp":
        with nc.Checkpointer(str(old / "nebula"), memory_tier=False, read_only=True) as ck:
            assert ck.list() == committed  # the original run is as it was
    # the new run's pointers all load, and name checkpoints of its own root
    for name in os.listdir(new / "ckpts"):
        assert "state_dict" in load_checkpoint(str(new / "ckpts" / name)), name
    # every checkpoint the new root holds is named by a pointer file (nothing leaked by the move)
    with nc.Checkpointer(str(new / "nebula"), read_only=True) as ck:
        named = {p["tag"] for p in _pointers(str(new / "ckpts")).values()}
        assert set(ck.tags()) == named, (ck.tags(), named)


def test_torch_load_of_a_pointer_file(root: str, tmp_path) -> None:  # noqa: ANN001
    """``LightningModule.load_from_checkpoint`` (Lightning's own ``torch.load``, weights_only by
    default) reads a pointer file; in a process that never imported the adapter,
    ``torch.load(weights_only=True)`` refuses it naming the adapter's ``open_pointer``, and
    ``weights_only=False`` returns the checkpoint."""
    torch.manual_seed(0)
    model = TinyModule(hidden=8)
    dirpath = str(tmp_path / "ckpts")
    io = NebulaCheckpointIO(root)
    x, y = make_data()
    trainer = make_trainer(io, dirpath, max_epochs=1, checkpoint_callback=ModelCheckpoint(dirpath=dirpath))
    trainer.fit(model, ResumableLoader(x, y, BATCH, SEED))
    path = os.path.join(dirpath, os.listdir(dirpath)[0])
    assert read_pointer(path) is not None
    again = TinyModule.load_from_checkpoint(path)
    _assert_same(dict(again.state_dict()), dict(model.state_dict()))
    code = ("import sys, torch\n"
            f"p = {path!r}\n"
            "try:\n    torch.load(p, weights_only=True)\nexcept Exception as e:\n    print('REFUSED', e)\n"
            "ck = torch.load(p, weights_only=False)\n"
            "print('KEYS', sorted(ck['state_dict']))\n")
    out = warm_python.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": REPO}, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "REFUSED" in out.stdout and "nebula_ckpt.integrations.lightning.open_pointer" in out.stdout, out.stdout
    assert f"KEYS {sorted(model.state_dict())}" in out.stdout, out.stdout


def test_save_metrics_reach_the_trainers_logger(root: str, tmp_path) -> None:  # noqa: ANN001
    """NebulaSaveMetrics logs every save's blocked / snapshot / durable-per-tier times, bytes and
    throughput through the Trainer's loggers, at the global step of the save."""
    from pytorch_lightning.loggers import CSVLogger

    from nebula_ckpt.integrations.lightning import NebulaSaveMetrics

    dirpath = str(tmp_path / "ckpts")
    io = NebulaCheckpointIO(root)
    metrics = NebulaSaveMetrics(io)
    x, y = make_data()
    cb = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=4, save_top_k=-1)
    trainer = make_trainer(io, dirpath, [metrics], max_epochs=2, checkpoint_callback=cb,
                           logger=CSVLogger(str(tmp_path / "logs")))
    trainer.fit(TinyModule(), ResumableLoader(x, y, BATCH, SEED))
    assert [s for s, _ in metrics.logged] == [4, 8, 12, 16]
    for _, values in metrics.logged:
        assert values["nebula/bytes"] > 0 and 0 < values["nebula/blocked_s"] < 60
        assert values["nebula/snapshot_s"] >= 0
        assert set(k.split("/", 2)[2] for k in values if k.startswith("nebula/durable_s/")) == {"memory", "local"}
        assert values["nebula/throughput_MBps/local"] > 0
    import csv

    with open(os.path.join(trainer.logger.log_dir, "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r.get("nebula/durable_s/local")]
    assert sorted(int(r["step"]) for r in rows) == [4, 8, 12, 16]


def test_find_roots_of_pointer_files_and_folders(root: str, tmp_path) -> None:  # noqa: ANN001
    """find_roots resolves a pointer file, Lightning's dirpath, a root, a Hugging Face output_dir
    (its ``nebula`` root) to the roots they refer to; a folder of plain files to none."""
    from nebula_ckpt.integrations.pointers import find_root, find_roots

    io = NebulaCheckpointIO(root)
    d = tmp_path / "ckpts"
    try:
        io.save_checkpoint(_state(1), str(d / "last.ckpt"))
        io.save_checkpoint(_state(2), str(d / "sub" / "epoch=2.ckpt"))
    finally:
        io.teardown()
    mine = [os.path.realpath(root)]
    assert find_roots(str(d / "last.ckpt")) == mine
    assert find_roots(str(d)) == mine and find_roots(root) == mine
    out = tmp_path / "hf-out"
    with nc.Checkpointer(str(out / "nebula"), memory_tier=False) as ck:
        ck.save(1, {"w": torch.ones(2)}, tag="checkpoint-1")
    (out / "runs").mkdir()
    assert find_roots(str(out)) == [os.path.realpath(out / "nebula")]
    plain = tmp_path / "plain"
    plain.mkdir()
    torch.save({"w": torch.ones(2)}, str(plain / "x.ckpt"))
    assert find_roots(str(plain)) == [] and find_roots(str(plain / "x.ckpt")) == []
    assert find_roots(str(tmp_path / "missing")) == []
    # what a command line's ROOT argument means
    assert find_root(str(d / "last.ckpt")) == mine[0] and find_root(root) == root
    assert find_root(str(plain)) == str(plain) and find_root("s3://b/run") == "s3://b/run"
    other = NebulaCheckpointIO(str(tmp_path / "other-root"))
    try:
        other.save_checkpoint(_state(3), str(d / "from-other.ckpt"))
    finally:
        other.teardown()
    with pytest.raises(nc.ValidationError, match="refers to 2 checkpoint roots"):
        find_root(str(d))


def test_nebula_ckpt_ls_of_a_pointer_file_and_a_dirpath(root: str, tmp_path, capsys) -> None:  # noqa: ANN001
    """``nebula-ckpt ls`` given Lightning's checkpoint file or its dirpath lists the root they name."""
    from nebula_ckpt.cli import main

    io = NebulaCheckpointIO(root)
    d = tmp_path / "ckpts"
    try:
        io.save_checkpoint(_state(1), str(d / "epoch=1.ckpt"))
        io.save_checkpoint(_state(2), str(d / "last.ckpt"))
    finally:
        io.teardown()
    capsys.readouterr()
    for given in (str(d / "last.ckpt"), str(d)):
        assert main(["ls", given, "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)
        assert {(r["step"], r["tag"]) for r in rows if r["healthy"]} == {
            (0, tag_for_path(str(d / "epoch=1.ckpt"))), (1, tag_for_path(str(d / "last.ckpt")))}
    assert main(["ls", str(d / "last.ckpt")]) == 0
    assert f"-> checkpoint root {os.path.realpath(root)}" in capsys.readouterr().out


def test_a_moved_pointer_saved_over_falls_back_then_frees_the_old_checkpoint(root: str, tmp_path) -> None:  # noqa: ANN001
    """A pointer file moved with its run folder names its checkpoint under the old path's tag. A
    save at the new path gets the new path's tag; until it commits, loading the path falls back
    to the checkpoint it replaced (prev_tag), and once it is durable the old one is removed (no
    pointer file names it any more)."""
    io = NebulaCheckpointIO(root)
    old, new = tmp_path / "a" / "last.ckpt", tmp_path / "b" / "last.ckpt"
    try:
        io.save_checkpoint(_state(1), str(old))
        io.wait()
        new.parent.mkdir()
        shutil.move(str(old), str(new))  # as mv of the run folder moves it
        io.save_checkpoint(_state(2), str(new))
        ptr = read_pointer(str(new))
        assert ptr is not None and ptr["prev_tag"] == tag_for_path(str(old)) and ptr["tag"] == tag_for_path(str(new))
        io.wait()
        # killed before that save committed: the pointer names a step that never committed
        write_pointer(str(new), {**ptr, "tag": tag_for_path(str(new)) + "x", "step": 99})
        _assert_same(io.load_checkpoint(str(new)), _state(1))
        write_pointer(str(new), ptr)
        _assert_same(io.load_checkpoint(str(new)), _state(2))
        io.save_checkpoint(_state(3), str(new))  # the second save at the path: nothing falls back any more
        io.wait()
        assert "prev_tag" not in (read_pointer(str(new)) or {})
    finally:
        io.teardown()
    with nc.Checkpointer(root, read_only=True) as ck:
        assert set(ck.tags()) == {tag_for_path(str(new))}


def test_torch_load_of_a_pointer_never_reaches_a_remote_root(tmp_path) -> None:  # noqa: ANN001
    """A pointer naming a remote root is not followed by ``torch.load`` (no network request from a
    file's content): the error names the file and what to call instead."""
    p = str(tmp_path / "x.ckpt")
    write_pointer(p, {"format": POINTER_FORMAT, "root": "s3://bucket/run", "step": 0, "tag": "x"})
    with pytest.raises(nc.NebulaError, match=r"remote root s3://bucket/run.*load_checkpoint\(path, storage_options"):
        torch.load(p, weights_only=True)
    with pytest.raises(nc.NebulaError, match=r"x\.ckpt is a NebulaCheckpointIO pointer"):
        torch.load(p, weights_only=False)


class _FrozenBody(pl.LightningModule):
    """A frozen body and a trained head: each save after the first refers to the first one's body."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(128, 128)
        self.body.requires_grad_(False)
        self.head = torch.nn.Linear(128, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.head(self.body(batch)).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.head.parameters(), lr=0.1)


class _RemoveOnceDurable(ModelCheckpoint):
    """Top-k that removes a checkpoint once the newer save is durable (so the newer one surely
    refers to the removed one's bytes: the removal is deferred, never done at once)."""

    def _remove_checkpoint(self, trainer: "pl.Trainer", filepath: str) -> None:
        trainer.strategy.checkpoint_io.wait()
        super()._remove_checkpoint(trainer, filepath)


def test_top_k_removals_of_a_fit_are_done_by_a_later_fit(root: str, tmp_path) -> None:  # noqa: ANN001
    """ModelCheckpoint(save_top_k=1) removes each older checkpoint; the first one, which the later
    saves refer to, stays while they do. Once a later fit's plugin removes the last of them, nothing
    is left on any tier (the removals of the first fit are recorded on the tiers, not in its process)."""
    torch.manual_seed(SEED)
    dirpath = str(tmp_path / "ckpts")
    data = torch.utils.data.DataLoader(torch.randn(16, 128), batch_size=8)
    cb = _RemoveOnceDurable(dirpath=dirpath, save_top_k=1, monitor="step", mode="max")
    trainer = make_trainer(NebulaCheckpointIO(root), dirpath, max_epochs=3, checkpoint_callback=cb)
    trainer.fit(_FrozenBody(), data)
    (kept,) = _pointers(dirpath).values()
    steps = _tier_steps(root)
    assert all(0 in s and kept["step"] in s for s in steps.values() if s), steps  # step 0: referred to
    io = NebulaCheckpointIO(root)  # the next fit's plugin: its top-k drops the checkpoint kept so far
    try:
        io.remove_checkpoint(cb.best_model_path)
    finally:
        io.teardown()
    assert _pointers(dirpath) == {}
    assert all(not s for s in _tier_steps(root).values()), _tier_steps(root)
