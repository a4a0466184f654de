"""Hugging Face ``Trainer`` through nebula_ckpt (issue #13), with the real ``transformers.Trainer``.

A tiny GPT-2 (2 layers, 32 wide) on an in-memory dataset (``hf_worker.py``): training takes well
under a second, so most of the time here is importing transformers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

import warm_python

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'nebula_ckpt[huggingface]')")

import nebula_ckpt as nc  # noqa: E402
from integrations import hf_worker  # noqa: E402
from nebula_ckpt.integrations.huggingface import (  # noqa: E402
    enable,
    export_pretrained,
    get_last_checkpoint,
    to_hf_checkpoint,
)

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    """The worker trains on one intra-op thread (bit-identical runs, gentle on shared cores)."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _steps_on_disk(path: str) -> list[int]:
    return sorted(int(d[5:]) for d in os.listdir(path) if d.startswith("step-"))


def _flip_a_tensor_byte(step_dir: str) -> None:
    """Damage one tensor's bytes (its CRC32C no longer matches) in the shard of ``step_dir``."""
    man = json.load(open(os.path.join(step_dir, "manifest.json")))
    key, rec = max(man["tensors"].items(), key=lambda kv: kv[1]["offsets"][1] - kv[1]["offsets"][0])
    start, end = rec["offsets"]
    shard = os.path.join(step_dir, next(f for f in os.listdir(step_dir) if f.endswith(".safetensors")))
    with open(shard, "r+b") as f:
        f.seek(start + (end - start) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))


# -- the crash test ------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.crash
@pytest.mark.timeout(180)
def test_sigkill_then_resume_gives_bit_identical_losses(tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    """Train (seeded, dropout on), SIGKILL the process at step 12 once checkpoint-10 committed,
    resume in a new process with resume_from_checkpoint=True: the newest checkpoint comes from the
    memory tier, and every step after it has the loss of an uninterrupted run, bit for bit."""
    ref = str(tmp_path / "ref.json")
    hf_worker.main([str(tmp_path / "ref"), str(tmp_path / "ref" / "nebula"), ref])   # uninterrupted, in-process
    want = json.load(open(ref))["losses"]
    assert len(want) == hf_worker.MAX_STEPS

    out, root = str(tmp_path / "run"), str(tmp_path / "run" / "nebula")
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE),
                                                                                os.environ.get("PYTHONPATH", "")]))

    def worker(result: str, *flags: str) -> subprocess.CompletedProcess[str]:
        return warm_python.run([sys.executable, os.path.join(HERE, "hf_worker.py"), out, root, result, *flags],
                               env=env, capture_output=True, text=True, timeout=120)

    crashed = str(tmp_path / "crashed.json")
    p = worker(crashed, "--kill-at", "12")
    assert p.returncode == -9, p.stdout[-2000:] + p.stderr[-4000:]
    before = json.load(open(crashed))
    assert before["killed_at"] == 12 and before["committed"] == [5, 10]
    assert all(before["losses"][k] == want[k] for k in before["losses"])   # same run up to the kill
    # HF's folders name committed checkpoints only, and hold no weights (those are in the tiers)
    folders = [d for d in os.listdir(out) if d.startswith("checkpoint-")]
    assert set(folders) <= {"checkpoint-5", "checkpoint-10"}
    assert not any(os.path.exists(os.path.join(out, d, "model.safetensors")) for d in folders)

    resumed = str(tmp_path / "resumed.json")
    p = worker(resumed, "--resume")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    after = json.load(open(resumed))
    assert after["restored"]["step"] == 10
    assert after["restored"]["tier"].startswith("memory"), after["restored"]   # the fastest tier
    assert after["final_step"] == hf_worker.MAX_STEPS
    got = after["losses"]
    assert sorted(map(int, got)) == list(range(11, hf_worker.MAX_STEPS + 1))
    assert {k: got[k] for k in got} == {k: want[k] for k in got}   # float.hex: bit-identical


@pytest.mark.slow
@pytest.mark.crash
@pytest.mark.timeout(400)
def test_two_ranks_sigkill_then_resume_gives_bit_identical_losses(tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    """The same under DDP with 2 ranks (gloo, env:// as torchrun sets it): both ranks SIGKILLed at
    step 12 once checkpoint-10 committed on both; a new 2-rank job resumes from each rank's memory
    tier and every later step's loss (HF's mean over the ranks) equals an uninterrupted 2-rank run's."""
    from dist.launch import run_ranks

    def job(name: str, *flags: str) -> tuple[list[subprocess.CompletedProcess[str]], list[dict[str, Any]]]:
        """One 2-rank job on root ``<name>/nebula``; each rank's result (``{}`` if it wrote none)."""
        result = tmp_path / f"{name}.json"
        for r in range(2):
            (tmp_path / f"{name}.json.r{r}").unlink(missing_ok=True)
        procs = run_ranks(2, "../integrations/hf_worker.py",
                          [str(tmp_path / "out" / name), str(tmp_path / name / "nebula"), str(result), *flags],
                          tmp_path, shm_dir, timeout=300)
        paths = [tmp_path / f"{name}.json.r{r}" for r in range(2)]
        return procs, [json.loads(p.read_text()) if p.exists() else {} for p in paths]

    procs, ref = job("ref")
    assert all(p.returncode == 0 for p in procs), procs[0].stdout[-3000:] + procs[1].stdout[-3000:]
    want = ref[0]["losses"]
    assert len(want) == hf_worker.MAX_STEPS and ref[1]["losses"] == want  # HF logs the mean over ranks

    procs, crashed = job("run", "--kill-at", "12")
    assert [p.returncode for p in procs] == [-9, -9], procs[0].stdout[-3000:] + procs[1].stdout[-3000:]
    for before in crashed:
        assert before["killed_at"] == 12 and before["committed"] == [5, 10]
        assert all(before["losses"][k] == want[k] for k in before["losses"])
    man = json.loads((tmp_path / "run" / "nebula" / "step-10" / "manifest.json").read_text())
    assert man["world_size"] == 2, man.get("world_size")  # one checkpoint of both ranks, committed once

    procs, resumed = job("run", "--resume")
    assert all(p.returncode == 0 for p in procs), procs[0].stdout[-3000:] + procs[1].stdout[-3000:]
    for after in resumed:
        assert after["restored"]["step"] == 10 and after["restored"]["tier"].startswith("memory"), after["restored"]
        assert after["final_step"] == hf_worker.MAX_STEPS
        got = after["losses"]
        assert sorted(map(int, got)) == list(range(11, hf_worker.MAX_STEPS + 1))
        assert got == {k: want[k] for k in got}   # float.hex: bit-identical


# -- retention, damage, best model -----------------------------------------------------------------
@pytest.mark.parametrize("trainer_state", ["not json {", "[" * 100_000 + "]" * 100_000, "[1, 2]"])
def test_export_of_a_checkpoint_whose_trainer_state_is_not_the_trainers_json(
        tmp_path, shm_dir: str, trainer_state: str) -> None:  # noqa: ANN001
    """``export_pretrained`` looks for the best checkpoint the saved trainer state names: a state
    that is no JSON object (garbled, or nested past the parser's stack) names none, and the newest
    checkpoint is exported, never a ValueError or RecursionError."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=16))
    root, folder = str(tmp_path / "root"), str(tmp_path / "pretrained")
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(3, {"model": model, "config": model.config.to_json_string(), "trainer_state": trainer_state})
    assert export_pretrained(root, folder) == 3
    loaded = GPT2LMHeadModel.from_pretrained(folder)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_save_total_limit_on_every_tier_and_resume_skips_damage(tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    from transformers import TrainerCallback

    out = str(tmp_path / "out")
    disk_a, disk_b = str(tmp_path / "a"), str(tmp_path / "b")
    options = {"tiers": [nc.MemoryTier(keep_last=10), nc.LocalTier(disk_a), nc.LocalTier(disk_b)]}
    seen: dict[str, Any] = {}

    class Look(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            # every save durable before the next: a busy disk tier would otherwise drop one for a
            # newer save (by design, tested elsewhere) and the tiers' step lists would vary with load
            tr.nebula.wait()    # after 6: 2, 4, 6 durable, and the end of step 7 applies the limit

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 7:   # (the step about to run is 8)
                seen["mid"] = tr.nebula.list(detailed=True)

    root = str(tmp_path / "root")
    tr = hf_worker.make_trainer(out, root, max_steps=10, save_steps=2, save_total_limit=2, callbacks=(Look(),),
                                nebula_options=options)
    tr.train()
    # step 2 was removed from every tier (the memory tier by itself would keep 10)
    assert list(seen["mid"].values()) == [[4, 6]] * 3, seen["mid"]
    # at the end, exactly save_total_limit remain on every persistent tier (memory freed at close)
    assert _steps_on_disk(disk_a) == _steps_on_disk(disk_b) == [8, 10]
    with nc.Checkpointer(root, tiers=[nc.LocalTier(disk_a), nc.LocalTier(disk_b)]) as ck:
        assert ck.tags() == {"checkpoint-8": 8, "checkpoint-10": 10}

    # the newest is damaged on every tier: resume=True falls back to checkpoint-8 and trains on
    for d in (disk_a, disk_b):
        _flip_a_tensor_byte(os.path.join(d, "step-10"))
    tr2 = hf_worker.make_trainer(out, root, max_steps=12, save_strategy="no", nebula_options=options)
    tr2.train(resume_from_checkpoint=True)
    assert tr2.nebula_restored["step"] == 8
    assert tr2.state.global_step == 12
    # a path as HF names it resumes that checkpoint; a damaged one named so is refused, not replaced
    tr3 = hf_worker.make_trainer(out, root, max_steps=9, save_strategy="no", nebula_options=options)
    tr3.train(resume_from_checkpoint=os.path.join(out, "checkpoint-8"))
    assert tr3.nebula_restored["step"] == 8 and tr3.state.global_step == 9
    with pytest.raises(nc.CorruptCheckpointError, match="checkpoint-10"):
        tr3.train(resume_from_checkpoint="checkpoint-10")
    with pytest.raises(nc.NotFoundError, match="checkpoint-4"):
        tr3.train(resume_from_checkpoint="checkpoint-4")    # removed by the limit


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_best_checkpoint_is_kept_and_loaded_at_end(tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    """load_best_model_at_end with save_total_limit=1: the best checkpoint survives rotation, is the
    one left at the end (HF's rule), and its weights are the model's after train()."""
    out, root = str(tmp_path / "out"), str(tmp_path / "root")
    # the eval set is unrelated random tokens: its loss rises as the model fits the train set
    tr = hf_worker.make_trainer(out, root, max_steps=8, save_steps=2, save_total_limit=1, eval_strategy="steps",
                                eval_steps=2, load_best_model_at_end=True, metric_for_best_model="loss",
                                greater_is_better=False, eval_dataset=hf_worker.TinyData(8, seed=1))
    tr.train()
    evals = {h["step"]: h["eval_loss"] for h in tr.state.log_history if "eval_loss" in h}
    best = min(evals, key=evals.__getitem__)
    assert best < 8, evals          # not the newest: only the best-checkpoint rule keeps it
    assert tr.state.best_model_checkpoint == os.path.join(out, f"checkpoint-{best}")
    with nc.Checkpointer(root) as ck:
        assert ck.tags() == {f"checkpoint-{best}": best}   # limit 1 at the end: the best alone (HF's rule)
        _, tree = ck.read(tag=f"checkpoint-{best}")
    for k, v in tr.model.state_dict().items():
        assert torch.equal(v, tree["model"][k]), k


# -- from_pretrained, stock folders, one-line enable ----------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_exported_weights_load_with_from_pretrained(tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    from transformers import GPT2LMHeadModel

    from nebula_ckpt.cli import main as cli

    out, root = str(tmp_path / "out"), str(tmp_path / "root")
    tr = hf_worker.make_trainer(out, root, max_steps=4, save_steps=4)
    tr.train()
    x = hf_worker.TinyData(2, seed=3).ids
    tr.model.eval()
    with torch.no_grad():
        want = tr.model(x).logits

    folder = str(tmp_path / "pretrained")
    assert export_pretrained(root, folder) == 4
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]
    loaded = GPT2LMHeadModel.from_pretrained(folder).eval()
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, want)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()   # still tied

    # the command line writes the same weights (--key model: the module's own keys)
    cli_dir = str(tmp_path / "cli")
    os.makedirs(cli_dir)
    to = os.path.join(cli_dir, "model.safetensors")
    assert cli(["export", root, "--step", "4", "--to", to, "--key", "model"]) == 0
    loaded.config.save_pretrained(cli_dir)
    with torch.no_grad():
        assert torch.equal(GPT2LMHeadModel.from_pretrained(cli_dir).eval()(x).logits, want)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_stock_trainer_resumes_from_a_materialized_folder(tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    """to_hf_checkpoint writes HF's checkpoint-N/ layout; stock Trainer resumes from it to the same
    losses as an uninterrupted run (so the RNG layout is HF's own)."""
    record, want = hf_worker.loss_recorder()
    ref = hf_worker.make_trainer(str(tmp_path / "ref"), None, save_steps=100, callbacks=(record,))
    ref.train()

    root = str(tmp_path / "root")
    first = hf_worker.make_trainer(str(tmp_path / "first"), root)     # the same schedule (max_steps) as ref
    first.train()
    folder = str(tmp_path / "stock" / "checkpoint-5")
    assert to_hf_checkpoint(root, folder, tag="checkpoint-5") == 5
    assert {"model.safetensors", "config.json", "optimizer.pt", "scheduler.pt", "rng_state.pth",
            "trainer_state.json"} <= set(os.listdir(folder))
    record2, got = hf_worker.loss_recorder()
    stock = hf_worker.make_trainer(str(tmp_path / "stock"), stock=True, save_steps=100, callbacks=(record2,))
    stock.train(resume_from_checkpoint=folder)
    assert sorted(got) == list(range(6, hf_worker.MAX_STEPS + 1))
    assert got == {k: want[k] for k in got}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_enable_on_an_existing_trainer_subclass_saves_without_torch_save(tmp_path, shm_dir: str,  # noqa: ANN001
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import Trainer

    class MyTrainer(Trainer):
        custom = True

    out = str(tmp_path / "out")
    tr = hf_worker.make_trainer(out, trainer_cls=MyTrainer, max_steps=6, save_steps=3)
    assert enable(tr) is tr and isinstance(tr, MyTrainer) and tr.custom
    assert type(tr).__name__ == "NebulaMyTrainer"
    calls: list[str] = []
    real = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: (calls.append(str(f)), real(obj, f, *a, **k)))
    tr.train()
    assert calls == []                                     # no torch.save on the training thread
    # HF's checkpoint-N/ folders hold small files only: the tensors are in the tiers
    assert sorted(os.listdir(out)) == ["checkpoint-3", "checkpoint-6", "nebula"]
    assert set(os.listdir(os.path.join(out, "checkpoint-6"))) == {"trainer_state.json", "config.json",
                                                                  "nebula_checkpoint.json"}
    with nc.Checkpointer(os.path.join(out, "nebula")) as ck:
        assert ck.tags() == {"checkpoint-3": 3, "checkpoint-6": 6}
        step, tree = ck.read(tag="checkpoint-6")
    assert set(tree) >= {"model", "optimizer", "scheduler", "rng", "trainer_state", "config", "hf"}
    assert set(tree["rng"]) >= {"python", "numpy", "cpu"}
    assert json.loads(tree["trainer_state"])["global_step"] == 6
    # HF's example scripts resume with get_last_checkpoint(output_dir): the drop-in names checkpoint-6
    last = get_last_checkpoint(out)
    assert last == os.path.join(out, "checkpoint-6")
    again = enable(hf_worker.make_trainer(out, trainer_cls=MyTrainer, max_steps=7, save_strategy="no"))
    again.train(resume_from_checkpoint=last)
    assert again.nebula_restored["step"] == 6 and again.state.global_step == 7
    assert calls == []


def test_resume_true_from_a_root_that_does_not_exist_says_so_and_creates_nothing(  # noqa: ANN201
        tmp_path, shm_dir: str, caplog: pytest.LogCaptureFixture):  # noqa: ANN001
    """``resume_from_checkpoint=True`` on a mistyped root starts fresh (a first run looks the same)
    but says at WARNING that the root does not exist, naming it; resuming creates nothing there."""
    import logging

    root = str(tmp_path / "godo")
    tr = hf_worker.make_trainer(str(tmp_path / "out"), root, max_steps=1, save_strategy="no")
    caplog.set_level(logging.INFO, logger="nebula_ckpt")
    tr.train(resume_from_checkpoint=True)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and root in r.getMessage()]
    assert warned and "does not exist" in warned[0].getMessage(), caplog.text
    tr.nebula.close()
    assert not os.path.lexists(root), "the resume (or a run that never saved) created the root"
