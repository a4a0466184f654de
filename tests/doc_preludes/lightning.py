"""Names the Lightning snippet uses: a LightningModule that logs ``val_loss``, and a short ``Trainer``."""
import functools

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint  # noqa: F401  (the snippet uses it)


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.lin(batch).square().mean()

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.lin(batch).square().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.randn(16, 8), batch_size=4)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.randn(8, 8), batch_size=4)


model = Module()
# the reader's own Trainer settings: two short epochs on the CPU, quiet
Trainer = functools.partial(pl.Trainer, max_epochs=2, accelerator="cpu", logger=False,
                            enable_progress_bar=False, enable_model_summary=False)
