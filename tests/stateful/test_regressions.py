"""Defects the stateful test found, each as a plain test (tests/stateful/README.md).

All three come from one meeting of features: a step saved again (allowed: the new save replaces
the checkpoint of that step) while the disk tier's cadence (``every=2``) skipped that save. The
memory tier then holds the newest save of the step and the disk tier an older save of the same
step number; what decides by step number alone takes the older one for the newer one.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

import nebula_ckpt as nc
import warm_python
from nebula_ckpt import knobs
from nebula_ckpt.cli import main as cli
from stateful.states import blank_state, decode, make_state

HERE = Path(__file__).resolve().parent


def _tiers(root: str) -> list[nc.Tier]:
    return [nc.MemoryTier(keep_last=2), nc.LocalTier(root, keep_last=2, every=2)]


def _saved_twice(root: str, crash: bool) -> None:
    """Save step 5 (save #1: memory and disk), then step 5 again (save #2: the memory tier only, the
    disk tier's cadence skips it); then close (``crash=False``) or end like a crash, in a child."""
    if not crash:
        with nc.Checkpointer(root, tiers=_tiers(root)) as ck:
            assert len(ck.save(5, make_state(1, 1, 0)).tiers_written) == 2
            assert len(ck.save(5, make_state(2, 1, 0)).tiers_written) == 1
        return
    code = ("import os, sys; sys.path[:0] = [%r, %r]\n"
            "import nebula_ckpt as nc\n"
            "from stateful.states import make_state\n"
            "from stateful.test_regressions import _tiers\n"
            "ck = nc.Checkpointer(%r, tiers=_tiers(%r))\n"
            "assert len(ck.save(5, make_state(1, 1, 0)).tiers_written) == 2\n"
            "assert len(ck.save(5, make_state(2, 1, 0)).tiers_written) == 1\n"
            "os._exit(0)\n") % (str(HERE.parent), str(HERE.parents[1]), root, root)
    env = dict(os.environ, NEBULA_SHM_DIR=knobs.get("shm_dir"))  # the test's memory-tier folder
    warm_python.run([sys.executable, "-c", code], check=True, env=env, timeout=300)


def _restored(root: str, **kw: Any) -> dict[str, Any]:
    st = blank_state(0)
    with nc.Checkpointer(root, tiers=_tiers(root), **kw) as ck:
        assert ck.load_latest(into=st) == 5
    return decode(st, 0)


def test_close_keeps_the_newest_save_of_a_step_saved_again(root: str) -> None:
    _saved_twice(root, crash=False)
    assert _restored(root)["meta.sid"] == 2


def test_gc_keeps_a_memory_tier_whose_newest_save_is_not_on_the_root(root: str, shm_dir: str) -> None:
    _saved_twice(root, crash=True)
    assert cli(["gc", "--shm-dir", shm_dir, "--json"]) == 0
    assert _restored(root)["meta.sid"] == 2


def test_a_restore_never_hands_over_the_only_copy_of_a_save(root: str) -> None:
    _saved_twice(root, crash=True)
    assert _restored(root)["meta.sid"] == 2  # the restarted job got the newest save, and ...
    with nc.Checkpointer(root, tiers=_tiers(root), read_only=True) as ck:  # ... the tiers still hold it
        st = blank_state(0)
        assert ck.load_latest(into=st) == 5
        assert decode(st, 0)["meta.sid"] == 2


def test_a_second_checkpointer_under_a_budget_saves_while_the_first_is_open(root: str) -> None:
    """A framework re-creates its plugin while the first stays open (handed over at the second's
    first write), under a host-memory budget smaller than two states (memory tier ``keep_last=1``,
    disk ``every=1``): the second's save must go ahead, as it does once the first is closed. Found by
    the stateful machine (``reopen`` twice under a budget): refused with ``ValidationError`` saying
    the memory tier holds "step(s) []", its 1 MiB being the first Checkpointer's idle staging slot
    file, which the second now frees (``save.slots.idle_elsewhere``)."""
    def open_one() -> nc.Checkpointer:
        return nc.Checkpointer(root, tiers=[nc.MemoryTier(keep_last=1), nc.LocalTier(root, every=1)],
                               host_memory_budget=int(1.5 * (1 << 20)), on_full="wait")

    first = open_one()
    try:
        first.save_async(1, {"w": torch.full((1 << 18,), 1.0)}).result()
        with open_one() as second:
            second.save_async(2, {"w": torch.full((1 << 18,), 2.0)}).result()
            assert 2 in second.list()
    finally:
        first.close()


def test_a_budget_with_a_remote_persistent_tier_saves_after_making_room(root: str) -> None:
    """A host-memory budget of one state and a half (``on_full="wait"``), the memory tier
    (``keep_last=2``) and a ``file://`` ``RemoteTier`` on the root (``every=3``): the third save must
    go ahead once make-room put the second on the remote tier and gave both up, as it does with a
    ``LocalTier``. Found by the stateful machine (``toggle_zstd`` under a budget): refused with
    ``ValidationError`` saying the memory tier holds "step(s) []", its 1 MiB an idle staging slot file
    that the copy of the second step to the remote tier still mapped, kept by a reference cycle (the
    remote tier's caught ``FileNotFoundError`` of a listing holds the copy's frames) until the collector runs."""
    tiers = [nc.MemoryTier(keep_last=2), nc.RemoteTier("file://" + os.path.abspath(root), keep_last=2, every=3)]
    with nc.Checkpointer(root, tiers=tiers, host_memory_budget=int(1.5 * (1 << 20)), on_full="wait") as ck:
        for i, step in enumerate((3, 5, 7)):
            ck.save_async(step, {"w": torch.full((1 << 18,), float(i))}).result()
        assert 7 in ck.list()


def test_a_handed_over_checkpointer_puts_nothing_on_disk_at_close(root: str) -> None:
    """A framework re-creates its plugin while the first stays open: the second saves step 1
    (memory and disk), saves it again (the disk's cadence skips it), and a NaN loss marks that
    newest write suspect. Closed, the second puts no copy of it on the disk; nor may the first,
    handed over at the second's first write, which does not know the mark. Found by the stateful
    machine (seed 4152043821): the first's close replaced the disk's write of step 1 with the
    suspect one."""
    def open_one() -> nc.Checkpointer:
        return nc.Checkpointer(root, tiers=[nc.MemoryTier(keep_last=2), nc.LocalTier(root, keep_last=3, every=2)])

    first = open_one()
    try:
        first.save(0, {"w": torch.full((8,), 0.0)})
        with open_one() as second:
            assert second.load_latest(into={"w": torch.zeros(8)}) == 0
            assert len(second.save(1, {"w": torch.full((8,), 1.0)}).tiers_written) == 2
            assert len(second.save(1, {"w": torch.full((8,), -1.0)}).tiers_written) == 1
            second.report(2, loss=float("nan"))
    finally:
        first.close()
    with nc.Checkpointer(root, tiers=[nc.LocalTier(root)], memory_tier=False, read_only=True) as disk:
        _, state = disk.read(1)
    assert float(state["w"][0]) == 1.0, "a handed-over Checkpointer's close put the suspect write on the disk tier"


def test_close_keeps_or_repairs_the_only_whole_copy_of_a_step_damaged_on_the_root(root: str) -> None:
    """A job saved steps 1 and 2 (memory and disk tier); the disk tier's shard of step 2 was then cut
    short (a partial upload, a lost object), its commit marker left. ``gc`` and ``persist-memory``
    would keep or copy the memory tier's whole copy; ``close()`` must not lose it either: a restart
    restores step 2, from the memory tier kept or from the disk tier's copy replaced."""
    tiers = [nc.MemoryTier(keep_last=2), nc.LocalTier(root, keep_last=2)]
    ck = nc.Checkpointer(root, tiers=tiers)
    for sid in (1, 2):
        assert len(ck.save(sid, make_state(sid, 1, 0)).tiers_written) == 2
    shard = next(Path(root, "step-2").glob("shard-*"))
    os.truncate(shard, shard.stat().st_size // 2)
    ck.close()
    st = blank_state(0)
    with nc.Checkpointer(root, tiers=[nc.MemoryTier(keep_last=2), nc.LocalTier(root, keep_last=2)]) as ck2:
        assert ck2.load_latest(into=st, on_damaged="warn") == 2
    assert decode(st, 0)["meta.sid"] == 2
