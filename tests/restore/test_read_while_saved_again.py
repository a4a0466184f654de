"""A restore beside a job that saves the step it reads again (a resumed job saving that step once
more): the new write's marker replaces the old one, then the old write's files go. The step is
whole throughout (the old write, then the new), so the restore never takes it for damaged, nor
passes it over for an older step: it starts over once and reads the new write.

No race: the second save runs in another process at a named point of the restore, from inside the
storage the restore reads (a hook on :class:`LocalStorage`), on real files.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt.storage.local import LocalStorage

N = 1 << 16

#: a resumed job (a new writer generation) that saves one step again, with other bytes
RESAVE = r"""
import sys, torch, nebula_ckpt as nc
with nc.Checkpointer(sys.argv[1], memory_tier=False, incremental=False) as ck:
    ck.save(int(sys.argv[2]), {"w": torch.full((int(sys.argv[4]),), float(sys.argv[3]))})
"""


def _saved(root: str, *steps: int) -> None:
    with nc.Checkpointer(root, memory_tier=False, incremental=False) as ck:
        for s in steps:
            ck.save(s, {"w": torch.full((N,), float(s))})


def _saved_again_when_read(monkeypatch: pytest.MonkeyPatch, root: str, shm_dir: str, step: int, value: float,
                           method: str = "read_buffer") -> list[str]:
    """Make the first ``method`` call on a shard of ``step`` (after the restore read its marker and
    manifest) run a job that saves ``step`` again; the shards it fired on."""
    fired: list[str] = []
    original = getattr(LocalStorage, method)
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir)

    def hooked(self: LocalStorage, rel: str, *args: Any, **kwargs: Any) -> Any:
        if not fired and rel.startswith(f"step-{step}/shard-"):
            fired.append(rel)
            subprocess.run([sys.executable, "-c", RESAVE, root, str(step), str(value), str(N)], env=env,
                           check=True, timeout=300, capture_output=True)
        return original(self, rel, *args, **kwargs)

    monkeypatch.setattr(LocalStorage, method, hooked)
    return fired


def test_the_only_step_saved_again_while_it_is_restored_is_restored_not_damaged(
        root: str, shm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _saved(root, 5)
    fired = _saved_again_when_read(monkeypatch, root, shm_dir, 5, 50.0)
    into = {"w": torch.zeros(N)}
    with nc.Checkpointer(root, read_only=True) as ck:
        assert ck.load_latest(into=into) == 5  # not "all 1 committed candidate(s) are damaged"
    assert fired and float(into["w"][0]) == 50.0  # the new write


def test_a_step_saved_again_while_it_is_read_is_not_passed_over_for_an_older_one(
        root: str, shm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _saved(root, 4, 5)
    fired = _saved_again_when_read(monkeypatch, root, shm_dir, 5, 50.0)
    with nc.Checkpointer(root, read_only=True) as ck:
        step, state = ck.read()
    assert fired and (step, float(state["w"][0])) == (5, 50.0)


def test_latest_names_a_step_saved_again_while_it_is_checked(
        root: str, shm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _saved(root, 4, 5)
    fired = _saved_again_when_read(monkeypatch, root, shm_dir, 5, 50.0, method="size")
    with nc.Checkpointer(root, read_only=True) as ck:
        assert ck.latest() == (5, None)
    assert fired


def test_a_step_damaged_while_it_is_read_is_still_passed_over(root: str) -> None:
    """Its marker stays the same: damage, not a second save (the older step is restored)."""
    _saved(root, 4, 5)
    d = os.path.join(root, "step-5")
    shard = next(f for f in os.listdir(d) if f.endswith(".safetensors"))
    os.truncate(os.path.join(d, shard), 100)
    with nc.Checkpointer(root, read_only=True) as ck:
        step, state = ck.read()
    assert (step, float(state["w"][0])) == (4, 4.0)
