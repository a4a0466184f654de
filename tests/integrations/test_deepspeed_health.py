"""DeepSpeed's "the newest" (``load_checkpoint(save_dir)`` without a tag, ``restore_pointers``)
means the newest checkpoint not marked suspect (docs/health.md), so a job whose loss went bad
after a restore does not restore the same state on every restart; a tag given by name is loaded
whatever its mark. Real DeepSpeed engines on the CPU (``ds_health_worker.py``), the marks written
by the Checkpointer's own monitor from the NaN losses the job reports."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from typing import Any

import pytest

import warm_python

HERE = os.path.dirname(os.path.abspath(__file__))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                       reason="deepspeed is not installed (pip install 'nebula_ckpt[deepspeed]', DS_BUILD_OPS=0)"),
]


def _phases(tmp_path: Any, shm_dir: str, *phases: str) -> tuple[list[dict[str, Any]], str]:
    """Run ``phases`` in one new process (each a new engine: a restart); their results and the log."""
    out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}.json"
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(HERE)), os.environ.get("PYTHONPATH", "")]))
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    r = warm_python.run([sys.executable, os.path.join(HERE, "ds_health_worker.py"), str(tmp_path / "root"),
                        str(tmp_path / "ds"), str(out), *phases], env=env, capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, f"worker failed (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return json.loads(out.read_text()), r.stdout + r.stderr


@pytest.mark.timeout(240)
def test_load_without_a_tag_passes_over_a_suspect_step_and_refuses_when_all_are(tmp_path, shm_dir) -> None:  # noqa: ANN001
    """Checkpoints global_step3 (healthy) and global_step6; a restart from `latest` (global_step6)
    goes NaN, so step 6 is marked suspect. The next restart without a tag loads global_step3 (a
    WARNING names both), with the tag global_step6 it loads that one (the documented rule), and a
    lost save_dir is rebuilt for global_step3. Once global_step3 went bad too, a load without a
    tag and restore_pointers raise CorruptCheckpointError naming both and the command that clears
    a mark, instead of restoring a diverged state again (a restart loop)."""
    (_, bad), _ = _phases(tmp_path, shm_dir, "train:6:3", "diverge:-")
    assert bad["step"] == 6 and bad["restore"]["step"] == 6 and bad["loss"] != bad["loss"], bad

    (fallback, named, lost, bad3, again, lost_again), log = _phases(
        tmp_path, shm_dir, "load:-", "load:global_step6", "lost", "diverge:-", "load:-", "lost")
    assert "error" not in fallback and fallback["step"] == 3, fallback
    assert fallback["path"].endswith(os.path.join("global_step3", "mp_rank_00_model_states.pt"))
    assert fallback["restore"]["health"] == "healthy", fallback
    assert "names DeepSpeed checkpoint 'global_step6' (step 6), which a restart does not resume" in log, log[-4000:]
    assert "loading 'global_step3' (step 3), the newest checkpoint not marked suspect" in log, log[-4000:]
    assert named["step"] == 6 and named["restore"]["health"] == "suspect", named  # asked for by name
    assert lost["restored_tag"] == "global_step3" and lost["step"] == 3, lost
    assert lost["path"].endswith(os.path.join("global_step3", "mp_rank_00_model_states.pt")), lost
    assert bad3["restore"]["step"] == 3 and bad3["loss"] != bad3["loss"], bad3

    for res in (again, lost_again):
        assert res.get("error", "").startswith("CorruptCheckpointError: DeepSpeed: no checkpoint of "), res
        assert "global_step3 (step 3), global_step6 (step 6)" in res["error"], res
        assert "nebula-ckpt mark " in res["error"] and "--healthy STEP" in res["error"], res
        assert "step" not in res, res
