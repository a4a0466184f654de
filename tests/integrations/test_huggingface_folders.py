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
import importlib.util
import json
import os
import shutil
import sys
import time
from typing import Any

import pytest
import torch

import warm_python

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'nebula_ckpt[huggingface]')")

import nebula_ckpt as nc  # noqa: E402
from integrations import hf_worker  # noqa: E402
from nebula_ckpt.integrations.huggingface import folders as hf_folders  # noqa: E402
from nebula_ckpt.integrations.huggingface import get_last_checkpoint  # noqa: E402
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


# -- a checkpoint durable before a SIGKILL has its folder ---------------------------------------------
HERE = os.path.dirname(os.path.abspath(__file__))


def _crash(tmp_path: Any, shm_dir: str, *flags: str) -> dict[str, Any]:
    """Run ``hf_worker.py`` into ``tmp_path/out`` until it SIGKILLs itself; what it wrote."""
    out = str(tmp_path / "out")
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE),
                                                                                os.environ.get("PYTHONPATH", "")]))
    result = str(tmp_path / "crashed.json")
    p = warm_python.run([sys.executable, os.path.join(HERE, "hf_worker.py"), out, os.path.join(out, "nebula"), result,
                        *flags], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == -9, p.stdout[-2000:] + p.stderr[-4000:]
    with open(result) as f:
        return dict(json.load(f))


def _checkpoint_folders(out: str) -> list[str]:
    return sorted((d for d in os.listdir(out) if d.startswith("checkpoint-")), key=lambda d: int(d.split("-")[1]))


@pytest.mark.crash
@pytest.mark.timeout(120)
def test_a_checkpoint_durable_before_a_sigkill_has_its_folder_before_and_after_the_resume(  # noqa: ANN201
        tmp_path, shm_dir: str):  # noqa: ANN001
    """The pattern of examples/hf_trainer.py: an on_save callback waits until checkpoint-10 is
    durable (trainer.nebula.wait()), then SIGKILLs the process. As with the stock Trainer, its
    folder is there, transformers' get_last_checkpoint names it, and a resume keeps it."""
    from transformers import TrainerState
    from transformers.trainer_utils import get_last_checkpoint

    out = str(tmp_path / "out")
    crashed = _crash(tmp_path, shm_dir, "--kill-at", "10", "--kill-on-save")
    assert crashed["committed"] == [5, 10]
    assert _checkpoint_folders(out) == ["checkpoint-5", "checkpoint-10"]  # before the kill, not at the resume
    assert get_last_checkpoint(out) == os.path.join(out, "checkpoint-10")
    assert TrainerState.load_from_json(os.path.join(out, "checkpoint-10", "trainer_state.json")).global_step == 10
    assert hf_folders.read(os.path.join(out, "checkpoint-10"))["step"] == 10
    assert not os.path.exists(os.path.join(out, hf_folders.PENDING_DIR))  # nothing left staged

    tr = hf_worker.make_trainer(out, None)
    tr.train(resume_from_checkpoint=True)
    assert tr.nebula_restored is not None and tr.nebula_restored["step"] == 10
    tags = tr.nebula.tags()
    tr.nebula.close()
    assert _checkpoint_folders(out) == sorted(tags, key=tags.__getitem__)  # one folder per committed checkpoint
    assert "checkpoint-10" in tags and get_last_checkpoint(out) == os.path.join(out, max(tags, key=tags.__getitem__))


@pytest.mark.crash
@pytest.mark.timeout(120)
def test_folders_a_crash_left_staged_are_put_in_place_and_a_rotated_one_never_comes_back(  # noqa: ANN201
        tmp_path, shm_dir: str):  # noqa: ANN001
    """The process dies each time between a commit and the folder (--lose-folders) with
    save_total_limit=1: checkpoint-5 was removed by the limit (and checkpoint-10 too when 15 was
    durable before the limit was applied), all three are staged. A reader (the drop-in
    get_last_checkpoint) and the next trainer opening the root put the folders of the committed ones
    in place; a removed one's never comes back, not even after the resume."""
    from transformers.trainer_utils import get_last_checkpoint as hf_last

    out = str(tmp_path / "out")
    pending = os.path.join(out, hf_folders.PENDING_DIR)
    crashed = _crash(tmp_path, shm_dir, "--kill-at", "15", "--kill-on-save", "--lose-folders",
                     "--save-total-limit", "1")
    committed = [f"checkpoint-{s}" for s in crashed["committed"]]
    assert committed in (["checkpoint-10", "checkpoint-15"], ["checkpoint-15"])  # 5 removed by the limit
    removed = sorted({"checkpoint-5", "checkpoint-10"} - set(committed))
    assert _checkpoint_folders(out) == [] and hf_last(out) is None
    assert sorted(os.listdir(pending)) == sorted(committed + removed)
    shutil.copytree(pending, str(tmp_path / "pending"))

    # a reader: the folder it names exists; it removes nothing (a live run may still be saving)
    assert get_last_checkpoint(out) == os.path.join(out, "checkpoint-15")
    assert _checkpoint_folders(out) == committed and hf_last(out) == os.path.join(out, "checkpoint-15")
    assert sorted(os.listdir(pending)) == removed

    # the same crash, seen first by the next trainer: it puts them in place, and drops the others
    for d in committed:
        shutil.rmtree(os.path.join(out, d))
    shutil.rmtree(pending)
    shutil.copytree(str(tmp_path / "pending"), pending)
    tr = hf_worker.make_trainer(out, None, save_total_limit=1)
    assert sorted(tr.nebula.tags()) == sorted(committed)
    assert _checkpoint_folders(out) == committed
    assert hf_folders.read(os.path.join(out, "checkpoint-15"))["step"] == 15
    assert not os.path.exists(pending)  # the removed checkpoints' staged folders went with them

    tr.train(resume_from_checkpoint=True)
    assert tr.nebula_restored is not None and tr.nebula_restored["step"] == 15
    tags = tr.nebula.tags()
    tr.nebula.close()
    assert not set(removed) & set(tags) and _checkpoint_folders(out) == sorted(tags) and len(tags) == 1


@pytest.mark.timeout(120)
def test_the_last_save_has_its_folder_when_hf_ends_training_with_save_total_limit_1(  # noqa: ANN201
        tmp_path, shm_dir: str):  # noqa: ANN001
    """save_total_limit=1 with a best metric: at the end of training HF compares each checkpoint
    folder with state.best_model_checkpoint (the last save here, on a busy disk tier), which must
    exist then, as the stock Trainer's does once its save returns."""
    out = str(tmp_path / "out")
    tr = hf_worker.make_trainer(out, None, max_steps=6, save_steps=2, save_total_limit=1,
                                eval_dataset=hf_worker.TinyData(8, seed=3), eval_strategy="steps", eval_steps=2,
                                metric_for_best_model="eval_loss", greater_is_better=False,
                                nebula_options={"tiers": [nc.MemoryTier(), _SlowTier(str(tmp_path / "disk"))]})
    tr.train()
    best = tr.state.best_model_checkpoint
    assert best is not None and os.path.isdir(best)
    tags = tr.nebula.tags()
    tr.nebula.close()
    assert _checkpoint_folders(out) == sorted(tags) == [os.path.basename(best)]


def test_get_last_checkpoint_after_a_rollback_names_the_new_runs_checkpoint(tmp_path, root: str,  # noqa: ANN001
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A run that reached checkpoint-12, then a run resumed from checkpoint-4 that saved 6 and 8 again
    (another learning rate): the drop-in names checkpoint-8, the step ``resume_from_checkpoint=True``
    restores, not the abandoned run's checkpoint-12; a step marked suspect is passed over too."""
    import nebula_ckpt as nc
    from nebula_ckpt.cli import main

    out = str(tmp_path / "out")
    w = {"w": torch.zeros(4)}
    with nc.Checkpointer(root, keep_last=10, memory_tier=False) as ck:
        for step in (4, 8, 12):
            ck.save(step, {"w": torch.full((4,), float(step))}, tag=f"checkpoint-{step}")
    with nc.Checkpointer(root, keep_last=10, memory_tier=False) as ck:
        ck.load(tag="checkpoint-4", into=w)
        for step in (6, 8):
            ck.save(step, {"w": torch.full((4,), 100.0 + step)}, tag=f"checkpoint-{step}")
    with nc.Checkpointer(root, read_only=True) as ck:
        assert ck.read()[0] == 8 and float(ck.read()[1]["w"][0]) == 108.0  # what a resume restores
    assert get_last_checkpoint(out, root=root) == os.path.join(out, "checkpoint-8")
    assert main(["mark", root, "--suspect", "8"]) == 0
    capsys.readouterr()
    assert get_last_checkpoint(out, root=root) == os.path.join(out, "checkpoint-6")


def _folder_tags(out: str) -> dict[str, str]:
    """checkpoint-N folder -> the tag its pointer names."""
    return {d: hf_folders.read(os.path.join(out, d))["tag"] for d in _checkpoint_folders(out)}


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed (pip install peft)")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("limit,peft", [(None, True), (2, True), (2, False)])
def test_a_rerun_without_resume_leaves_only_loadable_folders_and_keeps_its_own_newest(  # noqa: ANN201
        tmp_path, shm_dir: str, limit: Any, peft: bool):  # noqa: ANN001
    """The script run again in the same output dir without resume_from_checkpoint: run 1 saved
    checkpoint-1..6, run 2 saves 1..4. With a LoRA adapter (the base weights stay as they were, so
    each later step refers to step 1's bytes) saving step 1 again makes the tiers drop run 1's
    later steps; without one they stay. Either way every checkpoint-N folder left names a
    checkpoint a tier holds, save_total_limit keeps run 2's newest (stock: by mtime), and
    get_last_checkpoint and resume_from_checkpoint=True work."""
    from transformers.trainer_utils import get_last_checkpoint as hf_last

    out = str(tmp_path / "out")
    kw: dict[str, Any] = dict(save_steps=1, save_total_limit=limit, peft=peft)
    hf_worker.make_trainer(out, None, max_steps=6, **kw).train()
    rerun = hf_worker.make_trainer(out, None, max_steps=4, learning_rate=1e-3, **kw)
    rerun.train()
    tags = rerun.nebula.tags()
    rerun.nebula.close()
    assert all(d == t and t in tags for d, t in _folder_tags(out).items())  # no folder of a checkpoint gone
    assert {"checkpoint-3", "checkpoint-4"} <= set(tags) and {"checkpoint-3", "checkpoint-4"} <= set(_folder_tags(out))
    if limit is not None:  # run 2's two newest, not run 1's higher steps
        assert _checkpoint_folders(out) == ["checkpoint-3", "checkpoint-4"]
    last = hf_last(out)
    assert last is not None and os.path.basename(last) in tags
    assert os.path.basename(get_last_checkpoint(out)) in tags

    again = hf_worker.make_trainer(out, None, max_steps=5, **kw)
    again.train(resume_from_checkpoint=True)
    assert again.nebula_restored is not None and again.nebula_restored["step"] in (4, 6)
    tags = again.nebula.tags()
    again.nebula.close()
    assert all(d == t and t in tags for d, t in _folder_tags(out).items())


@pytest.mark.timeout(120)
def test_opening_the_root_removes_the_folder_of_a_checkpoint_no_tier_holds(tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    """A checkpoint deleted while no trainer watched (another process's remove(), or a process that
    died before it noticed): the next trainer opening the root removes its folder, so HF's
    get_last_checkpoint names a checkpoint that loads."""
    from transformers.trainer_utils import get_last_checkpoint as hf_last

    out = str(tmp_path / "out")
    tr = hf_worker.make_trainer(out, None, max_steps=4, save_steps=2)
    tr.train()
    tr.nebula.close()
    with nc.Checkpointer(os.path.join(out, "nebula")) as ck:
        ck.remove(tag="checkpoint-4")
    assert _checkpoint_folders(out) == ["checkpoint-2", "checkpoint-4"]
    again = hf_worker.make_trainer(out, None, max_steps=4, save_steps=2)
    assert sorted(again.nebula.tags()) == ["checkpoint-2"]
    assert _checkpoint_folders(out) == ["checkpoint-2"] and hf_last(out) == os.path.join(out, "checkpoint-2")
    again.nebula.close()


@pytest.mark.timeout(180)
def test_save_total_limit_never_deletes_the_checkpoint_a_restart_resumes_from(tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    """save_total_limit=1 and a run that diverges after step 12: checkpoint-10 is confirmed healthy
    (steps 11 and 12 finite), checkpoint-15 and -20 are saved from the diverged state (suspect at
    once). The rotation keeps checkpoint-10, the step a restart resumes from (as the core's
    retention keeps the newest healthy step), so ``resume_from_checkpoint=True`` restores it
    instead of raising for want of a step not marked suspect."""
    from transformers import TrainerCallback

    class Diverge(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            if state.global_step == 12:
                with torch.no_grad():
                    next(model.parameters()).fill_(float("nan"))

    out = str(tmp_path / "out")
    root = os.path.join(out, "nebula")
    tr = hf_worker.make_trainer(out, root, max_steps=20, save_steps=5, save_total_limit=1, callbacks=(Diverge(),))
    tr.train()
    with nc.Checkpointer(root, read_only=True) as ck:
        assert "checkpoint-10" in ck.tags() and ck.latest() == (10, "checkpoint-10"), ck.tags()
    assert "checkpoint-10" in _checkpoint_folders(out)
    again = hf_worker.make_trainer(out, root, max_steps=22, save_steps=5, save_total_limit=1)
    again.train(resume_from_checkpoint=True)
    assert again.nebula_restored is not None and again.nebula_restored["step"] == 10
    assert again.nebula_restored["health"] == "healthy"


def test_get_last_checkpoint_refuses_when_every_checkpoint_is_suspect(tmp_path, root: str,  # noqa: ANN001
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Every checkpoint marked suspect: the drop-in raises CorruptCheckpointError naming them and the
    command that clears a mark, as ``resume_from_checkpoint=True`` does, rather than name a suspect
    one (``train(resume_from_checkpoint=get_last_checkpoint(out))`` would restore it on every restart)."""
    from nebula_ckpt.cli import main

    out = str(tmp_path / "out")
    with nc.Checkpointer(root, keep_last=10, memory_tier=False) as ck:
        for step in (4, 8):
            ck.save(step, {"w": torch.full((4,), float(step))}, tag=f"checkpoint-{step}")
    assert get_last_checkpoint(out, root=root) == os.path.join(out, "checkpoint-8")
    assert main(["mark", root, "--suspect", "8"]) == 0
    assert get_last_checkpoint(out, root=root) == os.path.join(out, "checkpoint-4")
    assert main(["mark", root, "--suspect", "4"]) == 0
    capsys.readouterr()
    with pytest.raises(nc.CorruptCheckpointError, match="marked suspect") as e:
        get_last_checkpoint(out, root=root)
    assert "checkpoint-4 (step 4)" in str(e.value) and "checkpoint-8 (step 8)" in str(e.value)
    assert "nebula-ckpt mark" in str(e.value) and "--healthy" in str(e.value)
    with nc.Checkpointer(root, read_only=True) as ck, pytest.raises(nc.CorruptCheckpointError):
        ck.load_latest()  # what resume_from_checkpoint=True does: the two agree
    assert main(["mark", root, "--healthy", "4"]) == 0
    assert get_last_checkpoint(out, root=root) == os.path.join(out, "checkpoint-4")
