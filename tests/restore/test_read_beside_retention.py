"""A restore beside a job whose retention removes the steps the restore listed, after a newer save.

The restore lists the steps (0, 1, 2), then reads the newest one's marker; meanwhile a job saves
step 3 and removes steps 2 and 1 (its retention: each marker goes first). The steps listed are
stale: the newest step there now is 3, and the restore finds it by listing again; it never falls
back to step 0, which is older than the step that was whole when it began (found by the stateful
test, seed 1644859860, a reader held at a marker while a job saved on with ``keep_last=1``).

No race: the job runs in another process at a named point of the restore, from inside the storage
the restore reads (a hook on :class:`LocalStorage`), on real files.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch

import nebula_ckpt as nc
import warm_python
from nebula_ckpt.storage.local import LocalStorage

N = 1 << 12

#: a job (a new writer) that saves step 3, then removes steps 2 and 1 as its retention would
SAVE_AND_PRUNE = r"""
import sys, torch, nebula_ckpt as nc
with nc.Checkpointer(sys.argv[1], tiers=[nc.LocalTier(sys.argv[1], keep_last=10)], incremental=False) as ck:
    ck.save(3, {"w": torch.full((int(sys.argv[2]),), 3.0)})
    ck.remove(2)
    ck.remove(1)
"""


def _pruned_when_read(monkeypatch: pytest.MonkeyPatch, root: str, shm_dir: str) -> list[str]:
    """Make the restore's first read of step 2's marker run the job above first; what it fired on."""
    fired: list[str] = []
    original = LocalStorage.read_small
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir)

    def hooked(self: LocalStorage, rel: str, *args: Any, **kwargs: Any) -> Any:
        if not fired and rel == "step-2/COMMIT":
            fired.append(rel)
            warm_python.run([sys.executable, "-c", SAVE_AND_PRUNE, root, str(N)], env=env, check=True,
                            timeout=300, capture_output=True)
        return original(self, rel, *args, **kwargs)

    monkeypatch.setattr(LocalStorage, "read_small", hooked)
    return fired


@pytest.mark.parametrize("how", ["load_latest", "latest"])
def test_steps_removed_after_a_newer_save_while_listed_give_the_newer_step_not_an_older_one(
        root: str, shm_dir: str, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    with nc.Checkpointer(root, tiers=[nc.LocalTier(root, keep_last=10)], incremental=False) as ck:
        for s in (0, 1, 2):
            ck.save(s, {"w": torch.full((N,), float(s))})
    fired = _pruned_when_read(monkeypatch, root, shm_dir)
    into = {"w": torch.zeros(N)}
    with nc.Checkpointer(root, tiers=[nc.LocalTier(root)], read_only=True) as reader:
        got = reader.load_latest(into=into) if how == "load_latest" else reader.latest()
    assert fired == ["step-2/COMMIT"]
    steps = {n for n in os.listdir(root) if n.startswith("step-")}
    assert steps == {"step-0", "step-3"}, steps  # step 0 is still there to fall back to, and is older
    if how == "load_latest":
        assert got == 3 and torch.equal(into["w"], torch.full((N,), 3.0)), (got, into["w"][:4])
    else:
        assert got == (3, None), got
