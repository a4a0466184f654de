"""Train a small LightningModule with nebula_ckpt's ``CheckpointIO`` plugin, then resume from "last".

    pip install 'nebula_ckpt[lightning]'
    python examples/lightning_train.py --dir /tmp/lightning-run      # again: resumes; --fresh: starts over

The one line that matters is ``plugins=[NebulaCheckpointIO(root)]``: ``ModelCheckpoint`` works as
before (top-k, ``last.ckpt``, removal of what fell out of the top k), but each path it writes holds a
small pointer file (``<dir>/checkpoints``) and the checkpoint itself is saved asynchronously through
the memory tier (``/dev/shm``) to the nebula_ckpt root (``<dir>/nebula``).
``trainer.fit(..., ckpt_path="last")`` resumes from the newest committed ``last.ckpt`` (after a
crash, from the memory tier). Run it twice: the second run resumes and trains
two more epochs.
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
import shutil

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from nebula_ckpt.integrations.lightning import NebulaCheckpointIO, read_pointer

log = logging.getLogger("lightning_train")


class Regressor(pl.LightningModule):
    def __init__(self, hidden: int = 64, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])


def loaders() -> tuple[torch.utils.data.DataLoader, torch.utils.data.DataLoader]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    y = (x @ torch.randn(16, 1, generator=g)).tanh()
    train = torch.utils.data.TensorDataset(x[:448], y[:448])
    val = torch.utils.data.TensorDataset(x[448:], y[448:])
    return (torch.utils.data.DataLoader(train, batch_size=32, shuffle=True, generator=g),
            torch.utils.data.DataLoader(val, batch_size=64))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/tmp/nebula_ckpt-example/lightning-run", help="the run's folder")
    p.add_argument("--epochs", type=int, default=2, help="epochs to train in this run")
    p.add_argument("--fresh", action="store_true", help="delete earlier checkpoints of this example first")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    root = os.path.join(a.dir, "nebula")  # the checkpoints' bytes (and, on a crash, /dev/shm)
    dirpath = os.path.join(a.dir, "checkpoints")  # where ModelCheckpoint writes its (pointer) files
    if a.fresh:
        shutil.rmtree(a.dir, ignore_errors=True)
    torch.manual_seed(0)

    plugin = NebulaCheckpointIO(root)
    checkpoints = ModelCheckpoint(dirpath=dirpath, monitor="val_loss", save_top_k=2, save_last=True)
    last = os.path.join(dirpath, "last.ckpt")
    done = 0
    pointer = read_pointer(last)
    if pointer is not None:
        done = pointer["epoch"] + 1
        log.info("found %s (epoch %d, nebula_ckpt step %d): resuming from it", last, done - 1, pointer["step"])
    trainer = pl.Trainer(max_epochs=done + a.epochs, plugins=[plugin], callbacks=[checkpoints], accelerator="cpu",
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=a.dir)
    train, val = loaders()
    trainer.fit(Regressor(), train, val, ckpt_path="last")  # nothing to resume on the first run: starts fresh

    log.info("best: %s (val_loss %.4f)", checkpoints.best_model_path, float(checkpoints.best_model_score or 0))
    log.info("files in %s: %s", dirpath, sorted(os.listdir(dirpath)))
    pointers = [read_pointer(f) for f in sorted(glob.glob(os.path.join(dirpath, "*.ckpt")))]
    tags = {os.path.basename(p["tag"]): p["step"] for p in pointers if p is not None}
    log.info("Lightning's files -> nebula_ckpt steps under %s: %s", root, tags)
    with open(last) as f:
        log.info("%s is a pointer:\n%s", last, f.read().strip())


if __name__ == "__main__":
    main()
