"""A restore beside a job that saves the step it reads again (a resumed job saving that step once
more): the new write's marker replaces the old one, then the old write's files go. The step is
whole throughout (the old write, then the new), so the restore never takes it for damaged, nor
passes it over for an older step: it starts over once and reads the new write.

No race: the second save runs in another process at a named point of the restore, from inside the
storage the restore reads (a hook on :class:`LocalStorage`), on real files.
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
            warm_python.run([sys.executable, "-c", RESAVE, root, str(step), str(value), str(N)], env=env,
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


# -- a restore beside a job whose retention removes the step it reads -------------------------------

#: a job saving the next step with keep_last=1: it commits ``step``, then its retention removes the older steps
RETAIN = r"""
import sys, torch, nebula_ckpt as nc
with nc.Checkpointer(sys.argv[1], memory_tier=False, incremental=False, keep_last=1) as ck:
    ck.save(int(sys.argv[2]), {"w": torch.full((int(sys.argv[4]),), float(sys.argv[3]))})
"""


def _on_first_read(monkeypatch: pytest.MonkeyPatch, step: int, stage: str, hook: Any) -> list[str]:
    """Run ``hook()`` the first time the restore reads ``step``'s commit marker (``stage="marker"``)
    or another of its files (``"files"``: its manifest, once the marker named the write); what it fired on."""
    fired: list[str] = []
    small, buffer = LocalStorage.read_small, LocalStorage.read_buffer

    def maybe(rel: str) -> None:
        if not fired and rel.startswith(f"step-{step}/") and rel.endswith("/COMMIT") == (stage == "marker"):
            fired.append(rel)
            hook()

    def read_small(self: LocalStorage, rel: str, *args: Any, **kwargs: Any) -> Any:
        maybe(rel)
        return small(self, rel, *args, **kwargs)

    def read_buffer(self: LocalStorage, rel: str, *args: Any, **kwargs: Any) -> Any:
        maybe(rel)
        return buffer(self, rel, *args, **kwargs)

    monkeypatch.setattr(LocalStorage, "read_small", read_small)
    monkeypatch.setattr(LocalStorage, "read_buffer", read_buffer)
    return fired


@pytest.mark.parametrize("stage", ["marker", "files"])
def test_a_step_removed_by_retention_while_it_is_restored_gives_the_step_that_replaced_it(
        root: str, tmp_path, stage: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """The restore listed step 1 alone; before it read it (its marker, or its files once the marker
    named them), the next save committed step 2 and retention (keep_last=1) removed step 1. Not
    "nothing committed" (None): the tiers are listed again and step 2 is restored."""
    from nebula_ckpt.format.commit import delete_checkpoint

    _saved(root, 1, 2)
    aside = str(tmp_path / "step-2")
    os.rename(os.path.join(root, "step-2"), aside)

    def next_save_and_retention() -> None:
        os.rename(aside, os.path.join(root, "step-2"))
        delete_checkpoint(LocalStorage(root), 1)  # the library's own deletion: the marker first

    fired = _on_first_read(monkeypatch, 1, stage, next_save_and_retention)
    into = {"w": torch.zeros(N)}
    with nc.Checkpointer(root, read_only=True) as ck:
        assert ck.load_latest(into=into) == 2
    assert fired and float(into["w"][0]) == 2.0


def test_a_restore_beside_a_live_job_whose_retention_removes_the_step_listed_restores_its_next_step(
        root: str, shm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes: while the restarted job reads step 3's files, the old job, still alive, saves
    step 4 and its retention (keep_last=1) removes step 3."""
    _saved(root, 3)
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir)
    fired = _on_first_read(monkeypatch, 3, "files", lambda: warm_python.run(
        [sys.executable, "-c", RETAIN, root, "4", "40", str(N)], env=env, check=True, timeout=300,
        capture_output=True))
    into = {"w": torch.zeros(N)}
    with nc.Checkpointer(root, memory_tier=False) as ck:
        assert ck.load_latest(into=into) == 4  # not None, which a script takes for a fresh start
    assert fired and float(into["w"][0]) == 40.0
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-4"]


def test_when_every_step_is_removed_while_it_is_read_the_restore_says_so_never_none(
        root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Listed again, the step that was there is gone each time: an error naming the other job's
    retention, never None (nothing committed) nor damage."""
    from nebula_ckpt.format.commit import delete_checkpoint

    _saved(root, 1)
    fired = _on_first_read(monkeypatch, 1, "files", lambda: delete_checkpoint(LocalStorage(root), 1))
    with nc.Checkpointer(root, read_only=True) as ck:
        with pytest.raises(nc.NebulaError, match="step 1 was removed .*while it was read") as e:
            ck.load_latest(into={"w": torch.zeros(N)})
    assert fired and "retention" in str(e.value)
    assert not isinstance(e.value, nc.CorruptCheckpointError)


@pytest.mark.parametrize("stage", ["marker", "files"])
def test_latest_beside_retention_names_the_step_that_replaced_the_one_listed(
        root: str, tmp_path, stage: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """``latest()`` as ``load_latest``: the step it listed removed while it was checked, the tiers
    are listed again and the next step is named; removed each time, an error, never None."""
    from nebula_ckpt.format.commit import delete_checkpoint

    _saved(root, 1, 2)
    aside = str(tmp_path / "step-2")
    os.rename(os.path.join(root, "step-2"), aside)

    def next_save_and_retention() -> None:
        os.rename(aside, os.path.join(root, "step-2"))
        delete_checkpoint(LocalStorage(root), 1)

    fired = _on_first_read(monkeypatch, 1, stage, next_save_and_retention)
    with nc.Checkpointer(root, read_only=True) as ck:
        assert ck.latest() == (2, None)
    assert fired
    if stage == "marker":
        return  # a folder whose marker is gone before it is read, then the folder: an empty root (None)
    fired = _on_first_read(monkeypatch, 2, stage, lambda: delete_checkpoint(LocalStorage(root), 2))
    with nc.Checkpointer(root, read_only=True) as ck:
        with pytest.raises(nc.NebulaError, match="step 2 was removed .*while it was read"):
            ck.latest()
    assert fired
