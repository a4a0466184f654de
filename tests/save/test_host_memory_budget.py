"""The host-memory budget holds: staging plus the memory tier's RAM never exceed it.

Real training processes (tests/save/budget_child.py) save a 40 MB state several times under a budget
smaller than two states, with the default tiers (memory tier + disk), and sample what
checkpointing holds by the kernel's counts (anonymous RSS above the start, and the RAM of the
memory tier's files), independently of the library's own accounting. Both ``on_full`` policies;
a budget too small for one state; the memory tier alone (which needs two).
"""

from __future__ import annotations

import gc
import glob
import json
import os
import sys
from typing import Any

import pytest
import torch

import nebula_ckpt as nc
import warm_python
from nebula_ckpt.save.budget import HostMemoryBudget, machine_memory
from nebula_ckpt.storage.local import LocalStorage
from proc_lines import json_child

CHILD = os.path.join(os.path.dirname(__file__), "budget_child.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(CHILD)))
MB = 40
STATE = MB << 20
#: what the process may hold beyond checkpointing's own memory: the interpreter's and torch's small
#: allocations during saves (manifests, thread stacks, a training step's temporaries of 2 rows)
SLACK = 12 << 20


def _run(root: str, shm_dir: str, budget: Any, on_full: str, saves: int = 4) -> dict[str, Any]:
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir,
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    spec = {"root": root, "budget": budget, "on_full": on_full, "saves": saves, "mb": MB}
    r = warm_python.run([sys.executable, CHILD, json.dumps(spec)], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    out["log"] = r.stderr
    return out


@pytest.mark.parametrize("on_full", ["wait", "skip"])
def test_budget_smaller_than_two_states_holds(tmp_path, shm_dir, on_full: str) -> None:  # noqa: ANN001
    budget = int(STATE * 1.5)
    out = _run(str(tmp_path / "ck"), shm_dir, budget, on_full)
    assert out["error"] is None, out["log"][-3000:]
    peak = out["peak"]
    # by the kernel's counts: the memory tier's files and the process's anonymous memory
    assert peak["shm"] > STATE * 0.9, peak  # the memory tier did hold a checkpoint
    assert peak["total"] <= budget + SLACK, (peak, out["log"][-3000:])
    disk_tier = next(k for k in out["committed"] if not k.startswith("memory"))
    disk = [int(s) for s, tiers in out["written"].items() if disk_tier in tiers]
    mem = next(v for k, v in out["committed"].items() if k.startswith("memory"))
    if on_full == "wait":
        assert disk == [0, 1, 2, 3] and out["skipped"] == {}  # every save waited, none was lost
        assert "waits (on_full='wait')" in out["log"] and "host_memory_budget 60.0 MiB" in out["log"]
    else:
        assert out["skipped"], "a save beyond the budget is skipped"
        assert all("host_memory_budget 60.0 MiB" in why for why in out["skipped"].values())
        assert "skipped (on_full='skip')" in out["log"]
        assert 0 in disk and set(disk) | {int(s) for s in out["skipped"]} == {0, 1, 2, 3}
    assert mem == [max(disk)]  # the newest step is back in the memory tier once it is in
    assert out["committed"][disk_tier][-1] == max(disk)


def test_budget_too_small_for_one_state(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    state = {"w": torch.zeros(STATE // 4)}
    with nc.Checkpointer(root, host_memory_budget=STATE // 2) as ck:
        with pytest.raises(nc.ValidationError) as e:
            ck.save_async(1, state)
        msg = str(e.value)
        assert "host_memory_budget 20.0 MiB" in msg and "40.0 MiB" in msg, msg  # the budget and the state
        assert "nothing was written" in msg and "larger host_memory_budget" in msg, msg  # and the fix
        assert ck.list() == [] and ck.stats()["host_memory_bytes"] == 0
    assert not os.path.exists(root)  # refused before anything was written: not even the new root


def test_memory_tier_alone_needs_room_for_two_states(tmp_path, shm_dir) -> None:  # noqa: ANN001
    state = {"w": torch.zeros(1 << 20)}  # 4 MiB
    with nc.Checkpointer(str(tmp_path / "ck"), tiers=[nc.MemoryTier()], host_memory_budget=6 << 20) as ck:
        with pytest.raises(nc.ValidationError, match="memory tier as the only tier") as e:
            ck.save_async(1, state)
        assert "host_memory_budget 6.0 MiB" in str(e.value) and "8.0 MiB" in str(e.value)
        assert ck.list() == []
    with nc.Checkpointer(str(tmp_path / "ck2"), tiers=[nc.MemoryTier()], host_memory_budget=9 << 20) as ck:
        for s in range(3):
            ck.save_async(s, state).result()
        assert ck.list()[-1] == 2  # the newest step is in (an incremental base may stay beside it)


def test_default_budget_is_what_is_free_less_a_reserve() -> None:
    total, avail = machine_memory()
    b = HostMemoryBudget(None)
    reserve = max(total // 10, 1 << 30)
    got = b.limit(123)
    # MemAvailable moves between the two reads: compare within 256 MiB
    assert abs(got - (123 + max(0, avail - reserve))) < 256 << 20
    assert HostMemoryBudget(0.5).limit(10**15) == int(0.5 * total)
    assert HostMemoryBudget(1 << 30).limit(0) == 1 << 30


#: a training process that saves step 5, saves it again with new bytes (only the memory tier takes
#: that save: the disk takes every second one), then saves step 6, whose state grew, under a budget
#: that holds one state of the memory tier beside one staging buffer, never two states; it dies
#: without close() (a crash: close() would put the memory tier's newest step on the disk anyway)
_RESAVE_CHILD = """
import json, logging, os, sys
import torch
import nebula_ckpt as nc
logging.basicConfig(level=logging.INFO)
MB = 1 << 20
root, on_full = sys.argv[1], sys.argv[2]
ck = nc.Checkpointer(root, tiers=[nc.MemoryTier(), nc.LocalTier(root, every=2)], host_memory_budget=9 * MB,
                     incremental=False, on_full=on_full)
ck.save(5, {"w": torch.full((MB,), 5.0)})
ck.save(5, {"w": torch.full((MB,), 50.0)})
h = ck.save_async(6, {"w": torch.full((MB,), 6.0), "exp_avg": torch.zeros(MB // 2)})
h.wait()
print(json.dumps({"skipped": h.skipped, "written": h.tiers_written, "listed": ck.list(detailed=True),
                  "held": ck.stats()["host_memory_bytes"]}), flush=True)
os._exit(0)
"""


def _resave_then_crash(root: str, shm_dir: str, on_full: str) -> dict[str, Any]:
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir,
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    return json_child([sys.executable, "-c", _RESAVE_CHILD, root, on_full], env,
                      f"on_full={on_full!r}: the save of step 6")


@pytest.mark.parametrize("on_full", ["wait", "skip"])
def test_a_step_saved_again_is_given_up_only_once_the_disk_holds_that_write(tmp_path, shm_dir,  # noqa: ANN001
                                                                            on_full: str) -> None:
    # The disk holds only the first write of step 5, so the second one lives in the memory tier
    # alone: it may make room for step 6 only once the disk holds it too (put there, as close()
    # does, since no save is in flight that could free memory instead), never by giving it up for
    # the older write, and the save neither waits for ever nor is skipped for want of room.
    root = str(tmp_path / "ck")
    out = _resave_then_crash(root, shm_dir, on_full)
    assert out["skipped"] is None and len(out["written"]) == 2, out  # step 6 went ahead on both tiers
    assert out["held"] <= 9 << 20, out
    # the crash left the disk's steps and the memory tier's: every step reads back as its newest write
    with nc.Checkpointer(root, tiers=[nc.MemoryTier(), nc.LocalTier(root, every=2)]) as ck:
        state = {"w": torch.zeros(1 << 20), "exp_avg": torch.ones(1 << 19)}
        assert ck.load_latest(state) == 6 and float(state["w"][0]) == 6.0
        assert float(ck.read(5)[1]["w"][0]) == 50.0
    with nc.Checkpointer(root, tiers=[nc.LocalTier(root)]) as disk:  # the disk alone: the newest write too
        assert float(disk.read(5)[1]["w"][0]) == 50.0
    assert "put the newest step 5 on" in out["log"], out["log"][-3000:]


def test_a_slot_file_only_garbage_still_maps_is_staged_in_again(tmp_path, shm_dir) -> None:  # noqa: ANN001
    # A save short of the budget puts the memory tier's newest step on the disk, which maps the
    # step's shard (a staging slot file), then gives the step up. A reference cycle can keep that
    # mapping alive until the collector runs (a remote tier's caught FileNotFoundError of a listing
    # holds the copy's frames): the slot file, linked by no checkpoint any more, is staged in by the
    # next save, never counted as memory nothing can free (refused after 2 s).
    root = str(tmp_path / "ck")
    mem = nc.MemoryTier(keep_last=2)
    tiers = [mem, nc.LocalTier(root, keep_last=2, every=3)]
    gc.disable()  # the collector running on its own would free the mapping by chance
    try:
        with nc.Checkpointer(root, tiers=tiers, host_memory_budget=int(1.5 * (1 << 20)), on_full="wait") as ck:
            ck.save_async(3, {"w": torch.full((1 << 18,), 3.0)}).result()
            ck.save_async(5, {"w": torch.full((1 << 18,), 5.0)}).result()
            assert mem.path is not None
            (shard,) = glob.glob(os.path.join(mem.path, "step-5", "shard-*"))
            reader = LocalStorage(mem.path, private=True, fsync=False, hold_reads=True)
            cycle: list[Any] = [reader.read_buffer(os.path.relpath(shard, mem.path))]  # as the copy maps it
            cycle.append(cycle)
            del cycle
            h = ck.save_async(7, {"w": torch.full((1 << 18,), 7.0)})
            h.result()
            assert h.tiers_written == [f"memory:{mem.path}"] and ck.list() == [3, 5, 7]
            assert ck.stats()["host_memory_bytes"] <= 1.5 * (1 << 20)
        with nc.Checkpointer(root, tiers=[nc.LocalTier(root)]) as disk:  # step 5 went to the disk first
            assert float(disk.read(5)[1]["w"][0]) == 5.0
    finally:
        gc.enable()


def test_a_memory_step_whose_disk_copy_is_damaged_is_given_up_only_once_the_disk_holds_it_whole(tmp_path,  # noqa: ANN001
                                                                                              shm_dir) -> None:
    """A job died with steps 1 and 2 on its memory tier and the disk; the disk's shard of step 2 was
    then cut short (a partial upload, a lost object), its commit marker left. A restarted job under a
    budget restores step 2 from the memory tier; its next save makes room. The memory tier's step 2,
    the only whole copy, is given up only after a whole copy of that write is on the disk: step 2
    restores from the disk alone, byte for byte."""
    n, root = 1 << 18, str(tmp_path / "ck")
    job = (f"import os, torch, nebula_ckpt as nc\n"
           f"ck = nc.Checkpointer({root!r}, tiers=[nc.MemoryTier(keep_last=2), nc.LocalTier({root!r}, keep_last=3)], "
           f"incremental=False)\n"
           f"for s in (1, 2):\n"
           f"    ck.save(s, {{'w': torch.full(({n},), float(s))}}).result()\n"
           f"os._exit(0)\n")
    warm_python.run([sys.executable, "-c", job], check=True, timeout=300, env={**os.environ, "NEBULA_SHM_DIR": shm_dir})
    shard = glob.glob(os.path.join(root, "step-2", "shard-*"))[0]
    os.truncate(shard, os.path.getsize(shard) // 2)
    tiers = [nc.MemoryTier(keep_last=2), nc.LocalTier(root, keep_last=3, every=2)]
    with nc.Checkpointer(root, tiers=tiers, incremental=False, host_memory_budget=int(n * 4 * 1.5),
                         on_full="wait") as ck:
        state = {"w": torch.zeros(n)}
        assert ck.load_latest(into=state) == 2 and float(state["w"][0]) == 2.0
        ck.save(3, {"w": torch.full((n,), 3.0)})
        mem = next(v for k, v in ck.list(detailed=True).items() if k.startswith("memory"))
    with nc.Checkpointer(root, tiers=[nc.LocalTier(root)], read_only=True) as disk:
        got = {"w": torch.zeros(n)}
        assert disk.load(2, into=got) == 2, f"the disk's step 2 does not restore (memory tier held {mem})"
        assert torch.equal(got["w"], torch.full((n,), 2.0))
