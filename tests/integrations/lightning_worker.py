"""A small, deterministic Lightning training run for tests/integrations/test_lightning.py.

Imported by the tests (the module, the loader) and run as a subprocess by the crash test::

    python tests/integrations/lightning_worker.py --root R --dirpath D --out O --name N \
        [--kill-at K [--kill-when any|memory]] [--resume]

Every training step appends ``<global_step> <loss as float.hex>`` to ``O/losses-<run>.txt``; a run
that finishes writes ``O/final-<run>.json`` (a digest of the parameters and optimizer state, and
the global step it resumed from). ``--kill-at K``: at the start of the batch after global step K
(the saves of step K are then just in flight), once at least one checkpoint has committed
(``--kill-when any``) or once the newest ``last.ckpt`` has committed on the memory tier
(``memory``), the process SIGKILLs itself.

Determinism: a fixed seed, one CPU thread, dropout (so the torch RNG matters), a loader whose
batch order depends only on (seed, epoch) and which resumes mid-epoch from its ``state_dict``
(Lightning saves it with the loops' state), and the RNG states of ``random``, NumPy and torch
saved in the checkpoint by the module's ``on_save_checkpoint`` (Lightning does not save them).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import signal
import sys
import time
from typing import Any, Iterator, Optional

import numpy as np
import torch

ROOT_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT_DIR not in sys.path:  # run as a script: the repository's nebula_ckpt
    sys.path.insert(0, ROOT_DIR)

import pytorch_lightning as pl  # noqa: E402
from pytorch_lightning.callbacks import Callback, ModelCheckpoint  # noqa: E402

from nebula_ckpt.integrations.lightning import NebulaCheckpointIO, read_pointer  # noqa: E402

SEED = 1234
N_SAMPLES = 64
BATCH = 8  # 8 batches per epoch
EPOCHS = 3
EVERY_N_STEPS = 5


class _EpochSampler:
    """What Lightning calls ``set_epoch`` on at every epoch start (``loader.sampler``)."""

    def __init__(self, loader: "ResumableLoader") -> None:
        self.loader = loader

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)


class ResumableLoader:
    """Batches of a fixed dataset, shuffled by (seed, epoch) only; ``state_dict`` / ``load_state_dict``
    (Lightning's stateful-loader protocol) resume it mid-epoch at the next batch."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int) -> None:
        self.x, self.y, self.batch_size, self.seed = x, y, batch_size, seed
        self.sampler = _EpochSampler(self)
        self.epoch = 0
        self.pos = 0  # batches of this epoch handed out
        self._resume_at: Optional[int] = None

    def __len__(self) -> int:
        return len(self.x) // self.batch_size

    def set_epoch(self, epoch: int) -> None:
        if self._resume_at is not None and epoch == self.epoch:
            return  # restored mid-epoch: keep the position
        self.epoch, self._resume_at = epoch, None

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        start = self._resume_at or 0
        self._resume_at = None
        perm = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.seed * 1000 + self.epoch))
        for b in range(start, len(self)):
            self.pos = b + 1
            idx = perm[b * self.batch_size:(b + 1) * self.batch_size]
            yield self.x[idx], self.y[idx]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._resume_at = self.pos


def make_data(seed: int = SEED) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N_SAMPLES, 16, generator=g)
    y = (x @ torch.randn(16, 1, generator=g)).tanh() + 0.1 * torch.randn(N_SAMPLES, 1, generator=g)
    return x, y


class TinyModule(pl.LightningModule):
    """MLP with dropout, AdamW and a step-wise LR schedule; records each step's loss."""

    def __init__(self, hidden: int = 32, lr: float = 1e-2, loss_file: Optional[str] = None) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["loss_file"])
        self.net = torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(hidden, 1))
        self.loss_file = loss_file
        self.losses: list[tuple[int, str]] = []
        self.resumed_from: Optional[int] = None

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=True, prog_bar=False)
        rec = (int(self.global_step), float(loss.detach()).hex())
        self.losses.append(rec)
        if self.loss_file:
            with open(self.loss_file, "a") as f:
                f.write(f"{rec[0]} {rec[1]}\n")
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["rng"] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                             "numpy": np.random.get_state()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        rng = checkpoint["rng"]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        self.resumed_from = int(checkpoint["global_step"])


def digest(module: pl.LightningModule, trainer: pl.Trainer) -> str:
    """SHA-256 over the parameters and the optimizer state (bit-exact comparison of two runs)."""
    h = hashlib.sha256()
    for k, v in module.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    for st in trainer.optimizers[0].state.values():
        for k in sorted(st):
            h.update(k.encode())
            h.update(st[k].detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class _KillAt(Callback):
    """SIGKILL this process at the start of the batch after global step ``step``, once
    ``when``: ``"any"``: at least one checkpoint has committed somewhere (the saves of ``step`` may
    still be in flight on every tier); ``"memory"``: the newest ``last.ckpt`` save has committed on
    the memory tier (the disk tier may still be writing it)."""

    def __init__(self, step: int, plugin: NebulaCheckpointIO, when: str, dirpath: str) -> None:
        self.step, self.plugin, self.when, self.dirpath = step, plugin, when, dirpath

    def _ready(self) -> bool:
        ck = self.plugin.checkpointer
        if self.when == "any":
            return bool(ck.list())
        ptr = read_pointer(os.path.join(self.dirpath, "last.ckpt"))
        memory = [t.name for t in ck.tiers if t.kind == "memory"]
        return ptr is not None and bool(memory) and ptr["step"] in ck.list(detailed=True)[memory[0]]

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step != self.step:
            return
        deadline = time.monotonic() + 60
        while not self._ready() and time.monotonic() < deadline:
            time.sleep(0.005)
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def make_trainer(plugin: NebulaCheckpointIO, dirpath: str, callbacks: Optional[list[Callback]] = None,
                 max_epochs: int = EPOCHS, **kw: Any) -> pl.Trainer:
    kw.setdefault("logger", False)
    ckpt_cb = kw.pop("checkpoint_callback", None) or ModelCheckpoint(
        dirpath=dirpath, every_n_train_steps=EVERY_N_STEPS, save_top_k=2, monitor="train_loss", save_last=True)
    return pl.Trainer(accelerator="cpu", devices=1, max_epochs=max_epochs, plugins=[plugin],
                      callbacks=[*(callbacks or []), ckpt_cb], enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0,
                      default_root_dir=os.path.dirname(dirpath), **kw)


def run(root: str, dirpath: str, out: str, name: str, kill_at: Optional[int], kill_when: str, resume: bool) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(SEED, workers=True, verbose=False)
    x, y = make_data()
    model = TinyModule(loss_file=os.path.join(out, f"losses-{name}.txt"))
    plugin = NebulaCheckpointIO(root)
    callbacks: list[Callback] = [_KillAt(kill_at, plugin, kill_when, dirpath)] if kill_at is not None else []
    trainer = make_trainer(plugin, dirpath, callbacks, deterministic=True)
    trainer.fit(model, train_dataloaders=ResumableLoader(x, y, BATCH, SEED), ckpt_path="last" if resume else None)
    with open(os.path.join(out, f"final-{name}.json"), "w") as f:
        json.dump({"digest": digest(model, trainer), "global_step": trainer.global_step,
                   "resumed_from": model.resumed_from}, f)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--root", required=True)
    p.add_argument("--dirpath", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--kill-when", choices=["any", "memory"], default="any")
    p.add_argument("--resume", action="store_true")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    run(a.root, a.dirpath, a.out, a.name, a.kill_at, a.kill_when, a.resume)


if __name__ == "__main__":
    main()
