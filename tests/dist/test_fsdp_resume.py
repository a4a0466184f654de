"""FSDP2 through the Hugging Face integration's FSDP functions, on 2 real gloo ranks: both ranks
SIGKILLed after a committed save, a new job resumes bit-identically (every later loss, the whole
model and optimizer state), from the memory tier and, the memory tier gone, from disk; a model
of another shape, or a job of another size, is refused before anything is loaded; the CLI exports the whole weights.

The ranks run ``tests/dist/fsdp_worker.py``, which calls what ``NebulaTrainer`` calls under FSDP
(``integrations.huggingface.fsdp``: ``sharded_state``, ``read_sharded``, ``load_sharded``; and
``rng``). The Trainer + accelerate glue itself needs GPUs (accelerate turns FSDP on only for
accelerator devices): ``tests/integrations/test_huggingface_fsdp_gpu.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from .launch import run_ranks

pytest.importorskip("transformers", reason="the Hugging Face integration needs transformers")

pytestmark = [pytest.mark.timeout(400), pytest.mark.crash, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _job(tmp: Path, name: str, mode: str, root: Path, shm: Path, *extra: str,
         world: int = 2) -> tuple[list[int], list[dict[str, Any]]]:
    out = tmp / name
    out.mkdir()
    shm.mkdir(exist_ok=True)
    done = run_ranks(world, "fsdp_worker.py", [mode, str(root), str(out), *extra], out, str(shm), timeout=300)
    files = [out / f"{mode}-r{r}.json" for r in range(world)]
    reports = [json.loads(f.read_text()) if f.exists() else {"tail": done[r].stdout[-3000:]}
               for r, f in enumerate(files)]
    return [p.returncode for p in done], reports


def test_fsdp2_two_ranks_sigkill_then_resume_is_bit_identical(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    rcs, ref = _job(tmp_path, "ref", "run", tmp_path / "ref-root", shm)
    assert rcs == [0, 0], ref
    assert all(len(r["losses"]) == 10 for r in ref)

    rcs, crashed = _job(tmp_path, "crashed", "run", tmp_path / "root", shm, "7")
    assert rcs == [-9, -9], crashed                       # both ranks SIGKILLed at the end of step 7
    for r, before in enumerate(crashed):
        assert before["committed"] == [3, 6]
        assert before["losses"] == {k: ref[r]["losses"][k] for k in before["losses"]}
    shutil.copytree(tmp_path / "root", tmp_path / "moved")  # the run as a new node finds it: no memory tier

    for name, root, shm_dir, tier in (("resumed", "root", shm, "memory"),
                                      ("from-disk", "moved", tmp_path / "empty-shm", "local")):
        rcs, resumed = _job(tmp_path, name, "resume", tmp_path / root, shm_dir)
        assert rcs == [0, 0], resumed
        for r, after in enumerate(resumed):
            assert after["restored"] == 6 and after["tier"]["tier"].startswith(tier), after["tier"]
            assert after["restored_digest"] == ref[r]["saved"]["6"]  # params + optimizer state, unsharded
            assert sorted(map(int, after["losses"])) == [7, 8, 9, 10]
            assert after["losses"] == {k: ref[r]["losses"][k] for k in after["losses"]}   # float.hex
            assert after["final"] == ref[r]["final"]


def test_fsdp2_checkpoint_exports_the_whole_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``nebula-ckpt export --key fsdp/model`` gathers the ranks' shards into the whole weights."""
    import torch
    from safetensors.torch import load_file

    from nebula_ckpt.cli import main as cli

    rcs, _ = _job(tmp_path, "saved", "run", tmp_path / "root", tmp_path / "shm")
    assert rcs == [0, 0]
    dest = tmp_path / "weights"
    dest.mkdir()
    assert cli(["export", str(tmp_path / "root"), "--step", "6", "--key", "fsdp/model", "--to", str(dest)]) == 0
    got = load_file(str(dest / "model.safetensors"))
    want = torch.load(tmp_path / "saved" / "full-6.pt", weights_only=True)
    assert sorted(got) == sorted(want) == ["0.bias", "0.weight", "3.bias", "3.weight"]
    for k in want:
        assert torch.equal(got[k], want[k]), k
    import nebula_ckpt as nc
    from nebula_ckpt.integrations.huggingface import export_pretrained

    with pytest.raises(nc.ValidationError, match="nebula-ckpt export"):   # one rank's shards are no model
        export_pretrained(str(tmp_path / "root"), str(tmp_path / "hf"), step=6)


def test_fsdp2_resume_into_another_model_or_world_size_is_refused_before_loading(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    rcs, _ = _job(tmp_path, "saved", "run", tmp_path / "root", shm)
    assert rcs == [0, 0]
    rcs, got = _job(tmp_path, "mismatch", "mismatch", tmp_path / "root", shm)
    assert rcs == [0, 0], got
    for r in got:
        assert "'fsdp/model/0.weight'" in r["error"] and "(32, 16)" in r["error"] and "(40, 16)" in r["error"], r
        assert r["before"] == r["after"]                   # nothing was loaded
    rcs, got = _job(tmp_path, "one-rank", "mismatch", tmp_path / "root", shm, world=1)
    assert rcs == [0], got
    assert "no 'fsdp' state this job of 1 rank(s) can resume" in got[0]["error"], got
    assert "with the world size it was saved with" in got[0]["error"]
