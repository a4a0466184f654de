"""docs/design.md draws the save path, call to commit: every module a later save crosses on its way
to the disk is named there, and their number does not grow (a ratchet: lower the limits when the
path gets shorter)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).resolve().parent / "save_path_probe.py"
#: modules on the path today, by tiers (see the probe)
LIMITS = {"local": 14, "default": 16}


def _drawn() -> set[str]:
    """The modules named in design.md's drawing of the save path (``save/pipeline.py`` ->
    ``nebula_ckpt.save.pipeline``)."""
    text = (REPO / "docs" / "design.md").read_text()
    block = text.split("## The save path, call to commit", 1)[1].split("```")[1]
    return {"nebula_ckpt." + m.replace("/", ".") for m in re.findall(r"\b([a-z_/]+)\.py\b", block)}


@pytest.mark.parametrize("tiers", ["local", "default"])
def test_the_save_path_is_drawn_whole_and_does_not_grow(tiers: str, shm_dir: str) -> None:
    p = subprocess.run([sys.executable, str(PROBE), tiers], capture_output=True, text=True, timeout=120,
                       cwd=REPO, env={**os.environ, "NEBULA_SHM_DIR": shm_dir})
    assert p.returncode == 0, p.stderr[-3000:]
    path = set(json.loads(p.stdout.strip().splitlines()[-1]))
    assert {"nebula_ckpt.save.pipeline", "nebula_ckpt.save.writer", "nebula_ckpt.storage.local"} <= path, path
    missing = sorted(path - _drawn())
    assert not missing, f"docs/design.md's save path does not name {missing}"
    assert len(path) <= LIMITS[tiers], f"the save path now crosses {len(path)} modules: {sorted(path)}"
