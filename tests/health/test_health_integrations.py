"""The integrations report the loss themselves: Hugging Face's ``Trainer`` (every step) and
Lightning (``NebulaSaveMetrics``, on rank 0), so their checkpoints get health marks and a resume
skips a step the loss went bad from."""

from __future__ import annotations

import contextlib
import io
import json
import math
from typing import Any

import pytest
import torch

from nebula_ckpt.cli import main


def _marks(root: str) -> dict[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(["ls", root, "--json"])
    return {r["step"]: r["health"] for r in json.loads(buf.getvalue()) if r["tier"].startswith("local:")}


def test_hugging_face_reports_each_step_and_a_resume_skips_the_step_that_went_bad(tmp_path: Any,
                                                                                 shm_dir: str) -> None:
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'nebula_ckpt[huggingface]')")
    from transformers import TrainerCallback

    from integrations.hf_worker import make_trainer

    out, root = str(tmp_path / "out"), str(tmp_path / "nebula")
    make_trainer(out, root, max_steps=12).train()             # saves 5, 10 and the last step, 12
    assert _marks(root) == {5: "healthy", 10: "healthy", 12: "unknown"}

    class Poison(TrainerCallback):  # the state goes bad right after the restore: a NaN loss at step 13
        def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            if state.global_step == 12:
                with torch.no_grad():
                    for p in model.parameters():
                        p.fill_(math.nan)

    poisoned = make_trainer(out, root, max_steps=16, callbacks=(Poison(),))
    poisoned.train(resume_from_checkpoint=True)               # goes on with NaN: saves 15 and 16
    assert poisoned.nebula_restored["step"] == 12
    assert _marks(root) == {5: "healthy", 10: "healthy", 12: "suspect", 15: "suspect", 16: "suspect"}
    again = make_trainer(out, root, max_steps=11)
    again.train(resume_from_checkpoint=True)
    assert again.nebula_restored["step"] == 10                 # the step before the one that went bad


def test_lightning_reports_each_batch_through_nebula_save_metrics(tmp_path: Any, shm_dir: str) -> None:
    pytest.importorskip("pytorch_lightning", reason="PyTorch Lightning is not installed")
    from pytorch_lightning.callbacks import ModelCheckpoint

    from integrations.lightning_worker import BATCH, SEED, ResumableLoader, TinyModule, make_data, make_trainer
    from nebula_ckpt.integrations.lightning import NebulaCheckpointIO, NebulaSaveMetrics

    root, dirpath = str(tmp_path / "root"), str(tmp_path / "ckpts")
    nio = NebulaCheckpointIO(root)
    cb = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=4, save_top_k=-1)
    trainer = make_trainer(nio, dirpath, [NebulaSaveMetrics(nio)], max_epochs=2, checkpoint_callback=cb)
    x, y = make_data()
    trainer.fit(TinyModule(), ResumableLoader(x, y, BATCH, SEED))
    marks = _marks(root)
    assert len(marks) == 4 and [marks[s] for s in sorted(marks)][:3] == ["healthy"] * 3, marks
