"""Lightning's "the newest" (``fit(ckpt_path="last")``, a ``last*.ckpt`` path) means the newest
checkpoint not marked suspect (docs/health.md, nebula_ckpt/integrations/lightning_resume.py), and a
restore through the plugin is judged by the losses ``NebulaSaveMetrics`` reports, so a run whose
loss goes bad after a resume does not resume the same state on every restart. Real Trainers on the
CPU; the weights go NaN right after the restore, the marks come from the Checkpointer's monitor."""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import pytest
import torch

pl = pytest.importorskip("pytorch_lightning", reason="PyTorch Lightning is not installed: "
                         "pip install 'nebula_ckpt[lightning]' (pytorch-lightning) to run these tests")

from pytorch_lightning.callbacks import Callback, ModelCheckpoint  # noqa: E402

import nebula_ckpt as nc  # noqa: E402
from integrations.lightning_worker import BATCH, SEED, ResumableLoader, TinyModule, make_data  # noqa: E402
from nebula_ckpt.integrations.lightning import NebulaCheckpointIO, NebulaSaveMetrics, tag_for_path  # noqa: E402


class _Diverge(Callback):
    """The restored state is bad: every loss after the restore is NaN."""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        with torch.no_grad():
            next(pl_module.parameters()).fill_(float("nan"))


def _fit(root: str, dirpath: str, max_steps: int, ckpt_path: Optional[str] = None, diverge: bool = False) -> Any:
    """One run (a restart): a checkpoint every 5 steps (all kept) and last.ckpt; the global step it
    resumed from, or the exception ``fit`` raised."""
    torch.manual_seed(SEED)
    io = NebulaCheckpointIO(root)
    cb = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=5, save_top_k=-1, save_last=True)
    model = TinyModule()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, plugins=[io],
                         callbacks=[NebulaSaveMetrics(io), cb, *([_Diverge()] if diverge else [])], logger=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         default_root_dir=os.path.dirname(dirpath))
    try:
        trainer.fit(model, ResumableLoader(*make_data(), BATCH, SEED), ckpt_path=ckpt_path)
    except nc.CorruptCheckpointError as e:
        return e
    return model.resumed_from


def _newest(root: str) -> Any:
    with nc.Checkpointer(root, read_only=True) as ck:
        return ck.latest()


@pytest.mark.timeout(120)
def test_resume_last_passes_over_suspect_steps_and_refuses_when_all_are(tmp_path, shm_dir: str, caplog) -> None:  # noqa: ANN001
    """epoch=0-step=5 (healthy), epoch=1-step=10 and last.ckpt (step 10). A resume from "last" goes
    NaN: the restored step is marked suspect, and so is the last.ckpt saved after the bad loss.
    The next resume from "last" loads epoch=1-step=10 (a WARNING says why), goes NaN, and marks it;
    the next loads epoch=0-step=5; once that went bad too, "last" raises CorruptCheckpointError
    naming the checkpoints and the command that clears a mark. A file named by its own name loads
    whatever its mark (the documented rule)."""
    root, dirpath = str(tmp_path / "root"), str(tmp_path / "ckpts")
    step5, step10 = (os.path.join(dirpath, n) for n in ("epoch=0-step=5.ckpt", "epoch=1-step=10.ckpt"))
    assert _fit(root, dirpath, 10) is None
    assert sorted(os.listdir(dirpath)) == ["epoch=0-step=5.ckpt", "epoch=1-step=10.ckpt", "last.ckpt"]

    assert _fit(root, dirpath, 12, "last", diverge=True) == 10  # last.ckpt: step 10
    assert _newest(root) == (2, tag_for_path(step10))  # last.ckpt (step 12) was saved after the NaN: suspect
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nebula_ckpt"):
        assert _fit(root, dirpath, 12, "last", diverge=True) == 10  # not the suspect last.ckpt of step 12
    assert any("last.ckpt names step" in r.getMessage() and "loading step 2" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert _newest(root) == (0, tag_for_path(step5))  # the restore from epoch=1-step=10 went bad: marked
    assert _fit(root, dirpath, 12, str(tmp_path / "ckpts" / "last.ckpt"), diverge=True) == 5  # a last*.ckpt path

    refused = _fit(root, dirpath, 12, "last")
    assert isinstance(refused, nc.CorruptCheckpointError), refused
    assert "every one is marked suspect" in str(refused) and tag_for_path(step5) in str(refused)
    assert "nebula-ckpt mark " in str(refused) and "--healthy STEP" in str(refused)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nebula_ckpt"):
        assert _fit(root, dirpath, 12, step10) == 10  # by its own name: loaded, marked suspect, with a warning
    assert any("marked suspect" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
