"""Hugging Face ``Trainer`` through nebula_ckpt with DeepSpeed and with PEFT (LoRA), against the
real frameworks: a run SIGKILLed once a checkpoint committed and resumed in a new process with
``resume_from_checkpoint=True`` computes the losses of an uninterrupted run bit for bit, and ends
with the same weights, optimizer state and RNG state.

DeepSpeed runs on the CPU (``DS_ACCELERATOR=cpu``, one gloo rank, no op built), each job in a
subprocess (``hf_worker.py --deepspeed STAGE``) so DeepSpeed's process-wide state stays there.
FSDP with the real Trainer is not here: accelerate turns FSDP on only for accelerator devices
(MULTI_GPU and kin), never for MULTI_CPU. The functions the FSDP path calls run on 2 CPU ranks
with FSDP2 in ``tests/dist/test_fsdp_resume.py``; the Trainer + accelerate run needs a GPU
(``test_huggingface_fsdp_gpu.py``). FSDP on XLA, which has no path, is refused here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from typing import Any

import pytest

import warm_python

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'nebula_ckpt[huggingface]')")

from integrations import hf_worker  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="deepspeed is not installed (pip install 'nebula_ckpt[deepspeed]')")
needs_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                                reason="peft is not installed (pip install peft)")


def _worker(tmp_path: Any, shm_dir: str, name: str, result: str, *flags: str) -> dict[str, Any]:
    """One run of hf_worker.py on ``<tmp>/<name>`` (root ``<tmp>/<name>/nebula``) in a fresh process;
    its result (JSON) and return code."""
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE)),
                                           os.environ.get("PYTHONPATH", "")]))
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    out = str(tmp_path / name)
    p = warm_python.run([sys.executable, os.path.join(HERE, "hf_worker.py"), out, os.path.join(out, "nebula"),
                        str(tmp_path / result), *flags], env=env, capture_output=True, text=True, timeout=300)
    got = json.loads((tmp_path / result).read_text()) if (tmp_path / result).exists() else {}
    got["rc"] = p.returncode
    got["tail"] = p.stdout[-2000:] + p.stderr[-4000:]
    return got


def crash_and_resume(tmp_path: Any, shm_dir: str, *flags: str) -> None:
    """Uninterrupted run; a run SIGKILLed at step 12 (checkpoint-10 committed); its resume: the
    resumed losses, final weights, optimizer and RNG states equal the uninterrupted run's."""
    ref = _worker(tmp_path, shm_dir, "ref", "ref.json", *flags)
    assert ref["rc"] == 0, ref["tail"]
    want = ref["losses"]
    assert len(want) == hf_worker.MAX_STEPS

    crashed = _worker(tmp_path, shm_dir, "run", "crashed.json", "--kill-at", "12", *flags)
    assert crashed["rc"] == -9, crashed["tail"]
    assert crashed["killed_at"] == 12 and crashed["committed"] == [5, 10]
    assert all(crashed["losses"][k] == want[k] for k in crashed["losses"])
    # no global_step folders; HF's checkpoint-N/ only for committed checkpoints, without weights
    entries = set(os.listdir(tmp_path / "run"))
    assert "nebula" in entries and entries - {"nebula"} <= {"checkpoint-5", "checkpoint-10"}
    assert not [f for d in entries - {"nebula"} for f in os.listdir(tmp_path / "run" / d)
                if f.startswith("global_step") or f.endswith((".bin", ".pt", ".pth", ".safetensors"))]

    after = _worker(tmp_path, shm_dir, "run", "resumed.json", "--resume", *flags)
    assert after["rc"] == 0, after["tail"]
    assert after["restored"]["step"] == 10 and after["restored"]["tier"].startswith("memory"), after["restored"]
    got = after["losses"]
    assert sorted(map(int, got)) == list(range(11, hf_worker.MAX_STEPS + 1))
    assert got == {k: want[k] for k in got}                       # float.hex: bit-identical
    assert (after["model"], after["optimizer"], after["rng"]) == (ref["model"], ref["optimizer"], ref["rng"])


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.crash
@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [1, 3])  # every stage without HF's Trainer: tests/integrations/test_deepspeed.py
def test_deepspeed_sigkill_then_resume_is_bit_identical(tmp_path, shm_dir: str, stage: int) -> None:  # noqa: ANN001
    """HF Trainer + DeepSpeed ZeRO-1 and ZeRO-3: checkpoints hold the engine's own files (no torch.save,
    no folders), and a resume hands them back to engine.load_checkpoint."""
    crash_and_resume(tmp_path, shm_dir, "--deepspeed", str(stage))
    import nebula_ckpt as nc

    with nc.Checkpointer(str(tmp_path / "run" / "nebula"), allow_pickle=True, memory_tier=False) as ck:
        _, tree = ck.read(tag="checkpoint-16")
    parts = tree["deepspeed"]["parts"]
    assert tree["deepspeed"]["tag"] == "global_step16"
    assert any(k.endswith("mp_rank_00_model_states.pt") for k in parts), sorted(parts)  # zero_pp_rank_0_... on ZeRO-3
    assert any(k.startswith("zero_pp_rank_0_") and k.endswith("optim_states.pt") for k in parts), sorted(parts)


@needs_peft
@pytest.mark.slow
@pytest.mark.crash
@pytest.mark.timeout(400)
def test_peft_lora_sigkill_then_resume_is_bit_identical(tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    """A LoRA adapter (peft) on the tiny GPT-2: the whole model state (frozen base too), the
    optimizer of the adapter's weights and the RNG states come back exactly."""
    crash_and_resume(tmp_path, shm_dir, "--peft")


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.crash
@pytest.mark.timeout(600)
def test_deepspeed_two_ranks_sigkill_then_resume_is_bit_identical(tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    """ZeRO-2 on 2 gloo ranks: each rank's checkpoint part holds its own optimizer partition; both
    ranks SIGKILLed at step 12 (checkpoint-10 committed on both), a new 2-rank job resumes each
    rank from its memory tier, and every later loss equals an uninterrupted 2-rank run's."""
    from dist.launch import run_ranks

    def job(name: str, *flags: str) -> tuple[list[Any], list[dict[str, Any]]]:
        result = tmp_path / f"{name}.json"
        for r in range(2):
            (tmp_path / f"{name}.json.r{r}").unlink(missing_ok=True)
        procs = run_ranks(2, "../integrations/hf_worker.py",
                          [str(tmp_path / "out" / name), str(tmp_path / name / "nebula"), str(result),
                           "--deepspeed", "2", *flags], tmp_path, shm_dir, timeout=500,
                          env_extra={"DS_ACCELERATOR": "cpu"})
        paths = [tmp_path / f"{name}.json.r{r}" for r in range(2)]
        return procs, [json.loads(p.read_text()) if p.exists() else {} for p in paths]

    procs, ref = job("ref")
    assert all(p.returncode == 0 for p in procs), procs[0].stdout[-3000:] + procs[1].stdout[-3000:]
    want = ref[0]["losses"]
    assert len(want) == hf_worker.MAX_STEPS and ref[1]["losses"] == want

    procs, crashed = job("run", "--kill-at", "12")
    assert [p.returncode for p in procs] == [-9, -9], procs[0].stdout[-3000:] + procs[1].stdout[-3000:]
    for before in crashed:
        assert before["killed_at"] == 12 and before["committed"] == [5, 10]
    man = json.loads((tmp_path / "run" / "nebula" / "step-10" / "manifest.json").read_text())
    assert man["world_size"] == 2, man.get("world_size")

    procs, resumed = job("run", "--resume")
    assert all(p.returncode == 0 for p in procs), procs[0].stdout[-3000:] + procs[1].stdout[-3000:]
    for r, after in enumerate(resumed):
        assert after["restored"]["step"] == 10 and after["restored"]["tier"].startswith("memory"), after["restored"]
        got = after["losses"]
        assert sorted(map(int, got)) == list(range(11, hf_worker.MAX_STEPS + 1))
        assert got == {k: want[k] for k in got}   # float.hex: bit-identical
        assert (after["model"], after["optimizer"], after["rng"]) == (ref[r]["model"], ref[r]["optimizer"],
                                                                      ref[r]["rng"])


def test_fsdp_on_xla_is_refused_with_a_clear_error(tmp_path) -> None:  # noqa: ANN001
    """A Trainer with FSDP on XLA (no path through nebula_ckpt) is refused when it is built,
    naming the engine and what is handled instead; nothing is written."""
    import nebula_ckpt as nc

    with pytest.raises(nc.NebulaError, match=r"does not handle FSDP-XLA training.*Train with FSDP \(torch"):
        hf_worker.make_trainer(str(tmp_path / "out"), str(tmp_path / "nebula"), fsdp=True, fsdp_config={"xla": True})
    assert not (tmp_path / "nebula").exists()


# (id, the "deepspeed" part a checkpoint holds, text the refusal names): a tag or part names that
# would make the resume's placeholder files land outside its temporary folder
HOSTILE_PARTS: list[tuple[str, dict[str, Any], str]] = [
    ("absolute_tag", {"tag": "{victim}", "parts": {"precious.txt": 0, "created/by/checkpoint": 0}}, "DeepSpeed tag"),
    ("dotdot_tag", {"tag": "../" * 40 + "{relative}", "parts": {"precious.txt": 0}}, "DeepSpeed tag"),
    ("dotdot_key", {"tag": "global_step6", "parts": {"../" * 40 + "{relative}/precious.txt": 0}}, "part '../"),
    ("absolute_key", {"tag": "global_step6", "parts": {"{victim}/precious.txt": 0}}, "part '/"),
    ("backslash_key", {"tag": "global_step6", "parts": {"..\\x": 0}}, "part '..\\\\x'"),
    ("empty_key", {"tag": "global_step6", "parts": {"": 0}}, "part ''"),
]


@pytest.mark.parametrize("part,expect", [c[1:] for c in HOSTILE_PARTS], ids=[c[0] for c in HOSTILE_PARTS])
def test_deepspeed_resume_writes_nothing_outside_its_folder(tmp_path, shm_dir: str, part: dict[str, Any],  # noqa: ANN001
                                                            expect: str) -> None:
    """A checkpoint (an ordinary save) whose DeepSpeed tag or part names leave the tag folder is
    refused by the resume, naming the tag or part, before any placeholder file is written: no
    file outside is created or truncated. DeepSpeed's engine is never reached (a stand-in here)."""
    import types

    import torch

    import nebula_ckpt as nc
    from nebula_ckpt.integrations.huggingface import engines

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("user data\n")
    fill = {"victim": str(victim), "relative": str(victim).lstrip("/")}  # '../' * 40 + relative: the victim
    saved = {"tag": part["tag"].format(**fill),
             "parts": {k.format(**fill): {"x": torch.zeros(1)} for k in part["parts"]}}
    root = str(tmp_path / "root")
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(6, {"deepspeed": saved})
    with nc.Checkpointer(root, read_only=True) as ck:
        _, tree = ck.read(step=6)
    engine = types.SimpleNamespace(checkpoint_engine=None, load_checkpoint=lambda *a, **k: ("loaded", None))
    trainer = types.SimpleNamespace(model_wrapped=engine, model=torch.nn.Linear(1, 1))
    with pytest.raises(nc.ValidationError, match="resume from another checkpoint") as e:
        engines.load_deepspeed(trainer, tree["deepspeed"])
    assert expect in str(e.value), str(e.value)
    assert (victim / "precious.txt").read_text() == "user data\n"
    assert sorted(os.listdir(victim)) == ["precious.txt"] and engine.checkpoint_engine is None


def test_deepspeed_placeholders_of_a_saved_checkpoint_stay_in_the_tag_folder(tmp_path) -> None:  # noqa: ANN001
    """The names NebulaTrainer saves (DeepSpeed's files, some in sub-folders) pass the check, each
    placeholder inside the tag folder, at the path DeepSpeed joins for it."""
    from nebula_ckpt.integrations.huggingface import engines

    keys = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "sub/expert_0.pt"]
    tag_dir, paths = engines.placeholders(str(tmp_path), {"tag": "global_step10", "parts": dict.fromkeys(keys)})
    assert tag_dir == os.path.join(str(tmp_path), "global_step10")
    assert paths == {k: os.path.join(tag_dir, *k.split("/")) for k in keys}
    assert os.listdir(tmp_path) == []
