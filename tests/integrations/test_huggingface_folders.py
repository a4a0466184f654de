"""Hugging Face ``Trainer`` through nebula_ckpt, judged the way HF's own checkpoint tests judge it.

What carries over from HF's tests (facts about ``Trainer``, in our words): a checkpoint is the
folder ``<output_dir>/checkpoint-N/`` with ``trainer_state.json`` inside; ``train(resume_from_checkpoint=
<that folder>)`` ends in the same weights and trainer state (``log_history`` included) as the run
that was not interrupted; ``save_total_limit`` keeps the newest folders and the best one;
``get_last_checkpoint(output_dir)`` names the newest; another run may start from a run's folder.
And what the integration promises: a busy disk tier never drops a save (every checkpoint reaches
every tier), so ``load_best_model_at_end`` loads the best one. Real ``Trainer``, tiny GPT-2, real files.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'nebula_ckpt[huggingface]')")

import nebula_ckpt as nc  # noqa: E402
from integrations import hf_worker  # noqa: E402
from nebula_ckpt.storage.local import LocalStorage  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _weights(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(180)
def test_checkpoint_folders_resume_rotate_and_match_an_uninterrupted_run(tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    from transformers import TrainerState
    from transformers.trainer_utils import get_last_checkpoint

    out = str(tmp_path / "out")
    kw: dict[str, Any] = dict(max_steps=8, save_steps=2, save_total_limit=2)
    full = hf_worker.make_trainer(out, None, **kw)
    full.train()
    end_weights, end_state = _weights(full.model), dataclasses.asdict(full.state)
    folders = sorted(d for d in os.listdir(out) if d.startswith("checkpoint-"))
    assert folders == ["checkpoint-6", "checkpoint-8"]  # the limit: the two newest (no best metric)
    assert get_last_checkpoint(out) == os.path.join(out, "checkpoint-8")
    for d in folders:
        files = set(os.listdir(os.path.join(out, d)))
        assert {"trainer_state.json", "config.json", "nebula_checkpoint.json"} <= files
        assert not files & {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"}
    saved = TrainerState.load_from_json(os.path.join(out, "checkpoint-6", "trainer_state.json"))
    assert saved.global_step == 6
    assert not any(any(k.startswith("nebula/") for k in h) for h in end_state["log_history"])
    assert [int(m["nebula/step"]) for m in full.nebula_metrics] == [2, 4, 6, 8]
    assert sorted(full.nebula.tags()) == folders  # removed from the tiers with their folders
    full.nebula.close()

    again = hf_worker.make_trainer(out, None, **kw)
    again.train(resume_from_checkpoint=os.path.join(out, "checkpoint-6"))
    assert again.nebula_restored is not None and again.nebula_restored["step"] == 6
    assert _same_weights(_weights(again.model), end_weights)
    resumed = dataclasses.asdict(again.state)
    timing = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss")
    strip = [{k: v for k, v in h.items() if k not in timing} for h in end_state["log_history"]]
    assert [{k: v for k, v in h.items() if k not in timing} for h in resumed["log_history"]] == strip
    assert {k: v for k, v in resumed.items() if k != "log_history"} == \
        {k: v for k, v in end_state.items() if k != "log_history"}
    again.nebula.close()

    # another run (its own output_dir and root) starts from this run's folder, as HF allows
    other = hf_worker.make_trainer(str(tmp_path / "out2"), None, **kw)
    other.train(resume_from_checkpoint=os.path.join(out, "checkpoint-6"))
    assert _same_weights(_weights(other.model), end_weights)
    assert "checkpoint-8" in os.listdir(tmp_path / "out2") and sorted(other.nebula.tags()) == ["checkpoint-8"]
    other.nebula.close()

    bogus = hf_worker.make_trainer(str(tmp_path / "other"), None, **kw)
    with pytest.raises(nc.NotFoundError, match="Can't find a valid checkpoint at"):
        bogus.train(resume_from_checkpoint=os.path.join(out, "checkpoint-6-bogus"))
    bogus.nebula.close()


class _SlowCommitStorage(LocalStorage):
    """Local storage that takes its time before each commit marker: a busy disk."""

    def write_small(self, rel: str, data: bytes, *, create_only: bool = False) -> None:
        if rel.endswith("COMMIT"):
            time.sleep(0.3)
        super().write_small(rel, data, create_only=create_only)


class _SlowTier(nc.LocalTier):
    def make_storage(self) -> LocalStorage:
        return _SlowCommitStorage(self.path)


@pytest.mark.timeout(180)
def test_a_busy_disk_tier_drops_no_save_and_the_best_model_is_loaded(tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    out = str(tmp_path / "out")
    disk = str(tmp_path / "disk")
    tr = hf_worker.make_trainer(out, disk, max_steps=6, save_steps=1, eval_dataset=hf_worker.TinyData(8, seed=3),
                                eval_strategy="steps", eval_steps=1, load_best_model_at_end=True,
                                # the highest loss is the best: an early checkpoint, not the last weights
                                metric_for_best_model="eval_loss", greater_is_better=True,
                                nebula_options={"tiers": [nc.MemoryTier(), _SlowTier(disk)]})
    tr.train()
    on_disk = nc.Checkpointer(disk, memory_tier=False, read_only=True)
    try:
        assert sorted(on_disk.tags().values()) == [1, 2, 3, 4, 5, 6]  # every save reached the busy tier
        best = tr.state.best_model_checkpoint
        assert best is not None and os.path.basename(best) == f"checkpoint-{tr.state.best_global_step}"
        _, tree = on_disk.read(tag=os.path.basename(best))
    finally:
        on_disk.close()
    assert tr.state.best_global_step < 6
    live = _weights(tr.model)
    assert set(tree["model"]) <= set(live) and all(torch.equal(live[k], tree["model"][k]) for k in tree["model"])
