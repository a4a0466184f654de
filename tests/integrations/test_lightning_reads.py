"""NebulaCheckpointIO judged the way Lightning's own tests judge a ``CheckpointIO``.

What carries over from Lightning's tests (facts about Lightning, in our words): a checkpoint
``trainer.save_checkpoint(path)`` wrote is read back at once by ``torch.load(path)``,
``Module.load_from_checkpoint(path)`` and ``Trainer.fit(ckpt_path=path)``, in this process or in
another one; and a test leaves no thread behind (Lightning's suite checks it after every test),
also after a save or a removal outside ``fit``. Real Lightning, real files, a real second process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Any

import pytest
import torch

import warm_python

pl = pytest.importorskip("pytorch_lightning", reason="PyTorch Lightning is not installed: "
                         "pip install 'nebula_ckpt[lightning]' (pytorch-lightning) to run these tests")

from pytorch_lightning.callbacks import Callback, ModelCheckpoint  # noqa: E402

import nebula_ckpt as nc  # noqa: E402
from integrations.lightning_worker import BATCH, SEED, ResumableLoader, TinyModule, make_data  # noqa: E402
from nebula_ckpt.integrations.lightning import NebulaCheckpointIO, load_checkpoint  # noqa: E402
from nebula_ckpt.storage.local import LocalStorage  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_READ_ELSEWHERE = ("import logging, sys, torch, nebula_ckpt.integrations.lightning\n"
                   "logging.basicConfig(level=logging.INFO)\n"
                   "print('n', torch.load(sys.argv[1])['callbacks']['_SaveThenRead']['n'], flush=True)\n")


class _HeldStorage(LocalStorage):
    """Local storage whose commit marker waits for ``gate`` (``reached`` says it is there)."""

    def __init__(self, root: str, gate: threading.Event, reached: threading.Event) -> None:
        super().__init__(root)
        self.gate, self.reached = gate, reached

    def write_small(self, rel: str, data: bytes, *, create_only: bool = False) -> None:
        if rel.endswith("COMMIT"):
            self.reached.set()
            self.gate.wait(300)
        super().write_small(rel, data, create_only=create_only)


class _HeldTier(nc.LocalTier):
    """A disk tier whose commits wait for the test: a save stays in flight as long as it likes."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.gate, self.reached = threading.Event(), threading.Event()

    def make_storage(self) -> LocalStorage:
        return _HeldStorage(self.path, self.gate, self.reached)

    def release_next(self) -> threading.Thread:
        """Let the next commit through once it is reached (from another thread)."""
        self.gate.clear()
        self.reached.clear()

        def go() -> None:
            self.reached.wait(120)
            self.gate.set()
        t = threading.Thread(target=go, daemon=True)
        t.start()
        return t


class _Module(TinyModule):
    loaded_n = None

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.loaded_n = checkpoint["callbacks"]["_SaveThenRead"]["n"]


def _trainer(plugin: Any, dirpath: str, callbacks: list[Callback], **kw: Any) -> pl.Trainer:
    kw.setdefault("max_epochs", 1)
    return pl.Trainer(accelerator="cpu", devices=1, plugins=[plugin] if plugin is not None else None,
                      callbacks=[*callbacks, ModelCheckpoint(dirpath=dirpath, save_top_k=0, save_last=False)],
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, logger=False,
                      default_root_dir=dirpath, **kw)


class _SaveThenRead(Callback):
    """At the end of the epoch (inside ``fit``): save ``path`` while the tier holds its commit
    (each save numbered in the callback's state), then read it back every way Lightning users do,
    in another process and in this one."""

    def __init__(self, path: str, tier: _HeldTier) -> None:
        self.path, self.tier, self.n = path, tier, 0
        self.seen: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def _save(self, trainer: pl.Trainer) -> None:
        self.n += 1
        self.tier.gate.clear()
        self.tier.reached.clear()
        trainer.save_checkpoint(self.path)  # its commit waits for the gate: the save is in flight

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        p = self.path
        self._save(trainer)
        # another process reads while the save is in flight; the gate opens once it says it
        # waits (or once it is over: then it read something else, or failed)
        proc = warm_python.popen([sys.executable, "-c", _READ_ELSEWHERE, p], cwd=REPO, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": REPO})
        assert proc.stderr is not None
        err = []
        for line in proc.stderr:
            err.append(line)
            if "waiting for it to commit" in line:
                break
        self.tier.gate.set()
        out, rest = proc.communicate(timeout=240)
        self.seen["elsewhere"] = (out.strip(), "".join(err) + rest)
        for how in ("torch.load", "load_from_checkpoint", "load_checkpoint"):
            self._save(trainer)  # a newer save of the same path, in flight again
            releaser = self.tier.release_next()
            if how == "torch.load":
                self.seen[how] = (self.n, torch.load(p)["callbacks"]["_SaveThenRead"]["n"])
            elif how == "load_from_checkpoint":
                self.seen[how] = (self.n, _Module.load_from_checkpoint(p).loaded_n)
            else:
                self.seen[how] = (self.n, load_checkpoint(p)["callbacks"]["_SaveThenRead"]["n"])
            releaser.join()


@pytest.mark.timeout(300)
def test_a_checkpoint_is_read_right_after_its_save_by_whoever_reads(tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    root = str(tmp_path / "root")
    tier = _HeldTier(root)
    io = NebulaCheckpointIO(root, tiers=[tier])
    p = str(tmp_path / "ckpts" / "manual.ckpt")
    look = _SaveThenRead(p, tier)
    x, y = make_data()
    try:
        _trainer(io, str(tmp_path / "ckpts"), [look], max_steps=3).fit(
            TinyModule(), train_dataloaders=ResumableLoader(x, y, BATCH, SEED))
    finally:
        tier.gate.set()
    out, err = look.seen["elsewhere"]
    assert out == "n 1", err[-2000:]
    for how in ("torch.load", "load_from_checkpoint", "load_checkpoint"):
        saved, read = look.seen[how]
        assert read == saved, how
    # and a new Trainer resumes from it at once (another plugin object, its own Checkpointer)
    resumed = _Module()
    trainer = _trainer(NebulaCheckpointIO(root), str(tmp_path / "ckpts2"), [], max_steps=4, max_epochs=2)
    trainer.fit(resumed, train_dataloaders=ResumableLoader(x, y, BATCH, SEED), ckpt_path=p)
    assert resumed.loaded_n == look.n and resumed.resumed_from == 3 and trainer.global_step == 4


def _threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.is_alive()}


@pytest.mark.timeout(120)
def test_a_save_or_removal_outside_fit_leaves_no_thread_and_is_durable(tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    root = str(tmp_path / "root")
    io = NebulaCheckpointIO(root)
    x, y = make_data()
    trainer = _trainer(io, str(tmp_path / "ckpts"), [], max_steps=2)
    trainer.fit(TinyModule(), train_dataloaders=ResumableLoader(x, y, BATCH, SEED))
    before = _threads()
    a, b = str(tmp_path / "after" / "a.ckpt"), str(tmp_path / "after" / "b.ckpt")
    trainer.save_checkpoint(a)
    assert _threads() <= before, "a save after fit left threads running"
    trainer.save_checkpoint(b)
    trainer.strategy.checkpoint_io.remove_checkpoint(a)
    assert _threads() <= before, "a removal after fit left threads running"
    assert not os.path.exists(a)
    # durable on the root when the call returned: a reader without the memory tier finds it
    ck = nc.Checkpointer(root, memory_tier=False, read_only=True)
    try:
        assert len(ck.list()) >= 1 and any(t.endswith("/b.ckpt") for t in ck.tags())
        assert not any(t.endswith("/a.ckpt") for t in ck.tags())
    finally:
        ck.close()
    assert load_checkpoint(b)["global_step"] == 2
