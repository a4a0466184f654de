"""A LoRA model (real ``peft`` on the tiny GPT-2 of ``hf_worker``) trained through the Hugging Face
integration (``NebulaTrainer``) with incremental checkpoints, the default: the frozen base is
written once, by the first save; the later saves write the adapter, its optimizer state and the
small leaves that change (RNG, scheduler), and refer to the first save's bytes for the base. A run
SIGKILLed after two saves resumes bit for bit from the second, which refers to the first; the
resumed process (a new writer generation) starts a new base.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'nebula_ckpt[huggingface]')")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed")

from integrations.test_huggingface_engines import crash_and_resume  # noqa: E402
from nebula_ckpt.format import manifest as mf  # noqa: E402
from nebula_ckpt.restore.open import read_manifest  # noqa: E402
from nebula_ckpt.storage.local import LocalStorage  # noqa: E402


def _frozen(key: str) -> bool:
    """A tensor of the frozen base: the model's, not the adapter's (peft names it ``lora_``)."""
    return key.startswith("model/") and "lora_" not in key


def _split(man: mf.Manifest) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(records in the step's own shards, records in earlier steps' shards)`` by key."""
    own, referred = {}, {}
    for k, rec in man.tensors.items():
        (own if man.shards[rec.shard].step is None else referred)[k] = rec
    return own, referred


def _own_shard_bytes(man: mf.Manifest) -> int:
    return sum(sh.stored_bytes for sh in man.shards if sh.step is None)


@pytest.mark.slow
@pytest.mark.crash
@pytest.mark.timeout(400)
def test_lora_later_saves_write_only_the_adapter_and_resume_bit_exact(tmp_path: Path, shm_dir: str) -> None:
    crash_and_resume(tmp_path, shm_dir, "--peft", "--record-saves")   # saves 5, 10, SIGKILL at 12; resume; 15
    st = LocalStorage(str(tmp_path / "run" / "nebula"))
    mans = {s: read_manifest(st, s) for s in (5, 10, 15)}

    first_own, first_ref = _split(mans[5])
    assert not first_ref and all(sh.step is None for sh in mans[5].shards)   # the base: written whole
    frozen = {k for k in first_own if _frozen(k)}
    trained = {k for k in first_own if "lora_" in k}
    assert frozen and trained
    frozen_bytes = sum(first_own[k].nbytes for k in frozen)

    man = mans[10]
    own, referred = _split(man)
    assert {sh.step for sh in man.shards if sh.step is not None} == {5}, man.shards
    assert frozen <= set(referred), sorted(frozen - set(referred))[:5]     # never written again
    assert trained <= set(own)                                             # the adapter moved
    assert all(not _frozen(k) for k in own), sorted(k for k in own if _frozen(k))
    changed = sum(rec.nbytes for rec in own.values())
    # its own shard: the adapter, AdamW's moments, scheduler and RNG tensors, and a header
    assert _own_shard_bytes(man) <= changed + 64 * 1024, (_own_shard_bytes(man), changed)
    assert _own_shard_bytes(man) < frozen_bytes / 2
    # the resumed process is a new writer generation: its first save is a new base, written whole
    assert mans[15].generation > man.generation and all(sh.step is None for sh in mans[15].shards)

    # what the core reported for each save of the killed run (SaveMetrics.written_bytes, per tier)
    per_save = {m["step"]: m for m in json.loads((tmp_path / "crashed.json").read_text())["saves"]}
    assert set(per_save) == {5, 10}
    local = next(t for t in per_save[10]["written_bytes"] if t.startswith("local"))
    assert per_save[5]["written_bytes"][local] >= frozen_bytes
    assert per_save[10]["written_bytes"][local] <= _own_shard_bytes(mans[10])
    assert per_save[10]["written_bytes"][local] < per_save[5]["written_bytes"][local] - frozen_bytes / 2
