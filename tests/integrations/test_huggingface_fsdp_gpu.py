"""Hugging Face ``Trainer`` + FSDP2 through accelerate, through nebula_ckpt, on GPUs: what only a
GPU shows (accelerate turns FSDP on only for accelerator devices, never for MULTI_CPU): the
Trainer's own FSDP wrapping, optimizer and scheduler, saved by ``NebulaTrainer`` on every rank,
both ranks SIGKILLed once checkpoint-10 is committed, and a new job resumed with
``resume_from_checkpoint=True`` computing the losses of an uninterrupted run bit for bit, ending
with the same weights, optimizer state and RNG state.

One rank per GPU, up to 2 (one GPU runs a world of 1: FSDP over one device, the same glue).
Marked ``gpu``: skipped without CUDA. The functions this path calls are tested on CPU ranks
with FSDP2 in ``tests/dist/test_fsdp_resume.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'nebula_ckpt[huggingface]')")
pytest.importorskip("accelerate", reason="accelerate is not installed")

from dist.launch import run_ranks  # noqa: E402
from integrations import hf_worker  # noqa: E402

pytestmark = [
    pytest.mark.gpu, pytest.mark.slow, pytest.mark.crash, pytest.mark.timeout(900),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="FSDP through accelerate needs GPUs"),
]


def test_hf_trainer_fsdp2_sigkill_then_resume_is_bit_identical(tmp_path: Path, shm_dir: str) -> None:
    world = min(2, torch.cuda.device_count())

    def job(name: str, *flags: str) -> tuple[list[Any], list[dict[str, Any]]]:
        result = tmp_path / f"{name}.json"
        paths = [result] if world == 1 else [tmp_path / f"{name}.json.r{r}" for r in range(world)]
        for p in paths:
            p.unlink(missing_ok=True)
        procs = run_ranks(world, "../integrations/hf_worker.py",
                          [str(tmp_path / "out" / name), str(tmp_path / name / "nebula"), str(result), "--fsdp",
                           *flags], tmp_path, shm_dir, timeout=800,
                          env_extra={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
        return procs, [json.loads(p.read_text()) if p.exists() else {} for p in paths]

    def tails(procs: list[Any]) -> str:
        return "\n".join(p.stdout[-3000:] for p in procs)

    procs, ref = job("ref")
    assert all(p.returncode == 0 for p in procs), tails(procs)
    want = [r["losses"] for r in ref]
    assert all(len(w) == hf_worker.MAX_STEPS for w in want)

    procs, crashed = job("run", "--kill-at", "12")
    assert [p.returncode for p in procs] == [-9] * world, tails(procs)
    for before in crashed:
        assert before["killed_at"] == 12 and before["committed"] == [5, 10]
    out = tmp_path / "out" / "run"
    assert not out.exists() or not any(p.name.startswith("checkpoint-") for p in out.iterdir())  # no torch.save
    import nebula_ckpt as nc

    with nc.Checkpointer(str(tmp_path / "run" / "nebula"), memory_tier=False, read_only=True) as ck:
        assert ck.steps() and max(ck.steps()) == 10

    procs, resumed = job("run", "--resume")
    assert all(p.returncode == 0 for p in procs), tails(procs)
    for r, after in enumerate(resumed):
        assert after["restored"]["step"] == 10 and after["restored"]["tier"].startswith("memory"), after["restored"]
        got = after["losses"]
        assert sorted(map(int, got)) == list(range(11, hf_worker.MAX_STEPS + 1))
        assert got == {k: want[r][k] for k in got}                    # float.hex: bit-identical
        assert (after["model"], after["optimizer"], after["rng"]) == (ref[r]["model"], ref[r]["optimizer"],
                                                                       ref[r]["rng"])
