"""docs/design.md draws the save path, call to commit, and the restore path, call to the live
tensors: every module a later save (a restore) crosses on its way is named there, and their number
does not grow (a ratchet: lower the limits when a path gets shorter)."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

import warm_python

REPO = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).resolve().parent / "save_path_probe.py"
#: modules on each path today, by tiers (see the probe: "whole" is the default tiers with
#: incremental saves off)
LIMITS = {("save", "local"): 11, ("save", "default"): 12, ("save", "whole"): 12, ("restore", "local"): 14}
DRAWINGS = {"save": "## The save path, call to commit", "restore": "## The restore path, call to the live tensors"}
MUST = {"save": {"nebula_ckpt.save.pipeline", "nebula_ckpt.save.writer", "nebula_ckpt.storage.local"},
        "restore": {"nebula_ckpt.restore.restorer", "nebula_ckpt.restore.open", "nebula_ckpt.storage.local"}}


def _drawn(what: str) -> set[str]:
    """The modules named in design.md's drawing of the path (``save/pipeline.py`` ->
    ``nebula_ckpt.save.pipeline``)."""
    text = (REPO / "docs" / "design.md").read_text()
    block = text.split(DRAWINGS[what], 1)[1].split("```")[1]
    return {"nebula_ckpt." + m.replace("/", ".") for m in re.findall(r"\b([a-z_/]+)\.py\b", block)}


@pytest.mark.parametrize("what,tiers", sorted(LIMITS))
def test_the_path_is_drawn_whole_and_does_not_grow(what: str, tiers: str, shm_dir: str) -> None:
    p = warm_python.run([sys.executable, str(PROBE), tiers, what], capture_output=True, text=True, timeout=120,
                        cwd=REPO, env={**os.environ, "NEBULA_SHM_DIR": shm_dir})
    assert p.returncode == 0, p.stderr[-3000:]
    path = set(json.loads(p.stdout.strip().splitlines()[-1]))
    assert MUST[what] <= path, path
    missing = sorted(path - _drawn(what))
    assert not missing, f"docs/design.md's {what} path does not name {missing}"
    assert len(path) <= LIMITS[(what, tiers)], f"the {what} path now crosses {len(path)} modules: {sorted(path)}"
