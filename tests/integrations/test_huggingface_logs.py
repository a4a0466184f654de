"""Hugging Face ``Trainer`` through nebula_ckpt: what a user sees without looking for it.

Each save's metrics in the trainer's logs; ``resume_from_checkpoint=True`` on a first run;
``export_pretrained`` choosing the best checkpoint ``load_best_model_at_end`` kept, and writing
a tied ``lm_head`` once (as ``save_pretrained`` does). Real ``transformers.Trainer``, tiny GPT-2.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'nebula_ckpt[huggingface]')")

from integrations import hf_worker  # noqa: E402
from nebula_ckpt.integrations.huggingface import export_pretrained  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _durable(holder: dict[str, Any]) -> Any:
    """A callback making every save durable before training goes on: a busy disk tier would
    otherwise drop a save for a newer one (by design), and which checkpoints each tier holds would
    vary with the machine's load. ``holder["trainer"]``: the trainer."""
    from transformers import TrainerCallback

    class Durable(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            holder["trainer"].nebula.wait()

    return Durable()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_each_save_reports_its_metrics_into_the_trainer_logs(tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    out = str(tmp_path / "out")
    record, losses = hf_worker.loss_recorder()
    seen: list[dict[str, Any]] = []
    from transformers import TrainerCallback

    class Look(TrainerCallback):  # what a report_to logger receives
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "nebula/step" in logs:
                seen.append(dict(logs))

    holder: dict[str, Any] = {}
    tr = hf_worker.make_trainer(out, None, max_steps=6, save_steps=2, callbacks=(record, Look(), _durable(holder)))
    holder["trainer"] = tr
    tr.train()
    saves = tr.nebula_metrics
    assert sorted(int(h["nebula/step"]) for h in saves) == [2, 4, 6]
    # kept out of state.log_history: HF saves it in every checkpoint and compares it across a resume
    assert not any(any(k.startswith("nebula/") for k in h) for h in tr.state.log_history)
    assert [int(h["nebula/step"]) for h in seen] == [int(h["nebula/step"]) for h in saves]
    for h in saves:
        assert h["nebula/bytes"] > 100_000   # the tiny GPT-2 + AdamW: ~350 kB
        assert 0 < h["nebula/snapshot_s"] <= h["nebula/blocked_s"] + 1e-3
        for tier in ("memory", "local"):
            assert h[f"nebula/durable_s/{tier}"] > 0
            assert h[f"nebula/throughput_MBps/{tier}"] == pytest.approx(
                h["nebula/bytes"] / h[f"nebula/durable_s/{tier}"] / 1e6)
    assert sorted(losses) == list(range(1, 7))   # the steps' own logs are all still there

    quiet = hf_worker.make_trainer(str(tmp_path / "quiet"), None, max_steps=2, save_steps=2)
    from nebula_ckpt.integrations.huggingface import enable

    enable(quiet, log_metrics=False).train()
    assert not quiet.nebula_metrics


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_resume_true_on_a_first_run_starts_fresh(tmp_path, shm_dir: str,  # noqa: ANN001
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """One script for both: resume_from_checkpoint=True with nothing saved trains from step 0
    (HF's own Trainer raises 'No valid checkpoint found'); the second run resumes."""
    out = str(tmp_path / "out")
    tr = hf_worker.make_trainer(out, None, max_steps=4, save_steps=2)
    with caplog.at_level(logging.INFO, logger="nebula_ckpt"):
        tr.train(resume_from_checkpoint=True)
    assert tr.nebula_restored is None and tr.state.global_step == 4
    assert any("starting fresh" in r.getMessage() for r in caplog.records)
    again = hf_worker.make_trainer(out, None, max_steps=6, save_steps=2)
    again.train(resume_from_checkpoint=True)
    assert again.nebula_restored["step"] == 4 and again.state.global_step == 6


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_export_pretrained_takes_the_best_checkpoint_and_writes_tied_weights_once(tmp_path,  # noqa: ANN001
                                                                                  shm_dir: str) -> None:
    from safetensors import safe_open
    from transformers import GPT2LMHeadModel

    holder: dict[str, Any] = {}
    out, root = str(tmp_path / "out"), str(tmp_path / "root")
    # the eval set is unrelated random tokens: its loss rises as the model fits the train set
    tr = hf_worker.make_trainer(out, root, max_steps=6, save_steps=2, eval_strategy="steps", eval_steps=2,
                                load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=False,
                                eval_dataset=hf_worker.TinyData(8, seed=1), callbacks=(_durable(holder),))
    holder["trainer"] = tr
    tr.train()
    evals = {h["step"]: h["eval_loss"] for h in tr.state.log_history if "eval_loss" in h}
    best = min(evals, key=evals.__getitem__)
    assert best < 6, evals
    x = hf_worker.TinyData(2, seed=3).ids
    tr.model.eval()
    with torch.no_grad():
        want = tr.model(x).logits   # the best model, loaded at the end of train()

    folder = str(tmp_path / "best")
    assert export_pretrained(root, folder) == best
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys   # as save_pretrained writes it
    loaded = GPT2LMHeadModel.from_pretrained(folder).eval()
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, want)
    assert export_pretrained(root, str(tmp_path / "newest"), best=False) == 6
    assert export_pretrained(root, str(tmp_path / "named"), tag="checkpoint-4") == 4
