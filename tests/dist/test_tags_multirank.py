"""Tags, remove() and NumPy leaves in a multi-rank job (gloo ranks on 127.0.0.1, issue #13)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nebula_ckpt.format.names import MANIFEST, step_dir

from .launch import reports, run_ok

pytestmark = [pytest.mark.timeout(240)]


def test_two_ranks_tag_load_by_tag_and_remove(root: str, shm_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    run_ok(2, "tags_worker.py", [root, str(out)], out, shm_dir)
    got = reports(out, "tags", 2)
    man = json.loads(Path(root, step_dir(1), MANIFEST).read_text())
    assert man["world_size"] == 2 and man["tag"] == "a"               # the shared tier's one manifest
    for r in range(2):
        assert got[r]["tags"] == {"a": 1, "b": 3}
        assert got[r]["loaded"] == 1 and got[r]["rng_ok"]               # each rank its own RNG state
        # rank 0 deletes from the shared root (2 and 3) and its memory tier, rank 1 from its memory
        # tier only (which keeps one step: 3)
        assert got[r]["removed"] == ([2, 3] if r == 0 else [3])
        assert got[r]["after"] == [1] and got[r]["tags_after"] == {"a": 1}
        # the Checkpointer's own gloo groups came and went with it, without a garbage collection
        assert got[r]["gloo_open"] > got[r]["gloo_before"] > 0, got[r]
        assert got[r]["gloo_closed"] == got[r]["gloo_before"], got[r]
    assert sorted(p.name for p in Path(root).iterdir() if p.name.startswith("step-")) == ["step-1"]
