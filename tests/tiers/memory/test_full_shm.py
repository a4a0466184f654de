"""A memory tier on a real tmpfs that fills up (``mount -t tmpfs -o size=8m``, skipped where
mounting is not permitted): a save that does not fit goes to the other tiers only (the memory
tier stands aside, tests/tiers/memory/test_shm_room.py), or, written incremental beside its staged copy,
whole; every step saved before stays restorable bit-exact, the disk tier still gets the save,
nothing partial is visible, and a later save that fits is on the memory tier again. Fault
injection at named stages (faults.py, flaky_fs.py) stays beside this: here the file system is
really full.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import sys
from typing import Any, Callable

import pytest
import torch

import nebula_ckpt as nc
import warm_python
from nebula_ckpt import knobs
from nebula_ckpt.cli import main
from nebula_ckpt.errors import PersistError

MiB = 1 << 20
#: MiB of trained bytes per step: steps 1 and 2 keep their shapes (step 2 is incremental), step 3
#: grows, step 4 cannot fit beside step 3 (nor alone), step 5 is step 3's shape again, step 6 step 1's
SIZES = {1: 0.5, 2: 0.5, 3: 1.5, 4: 7.0, 5: 1.5, 6: 0.5}
STEPS = [1, 2, 3, 4, 5]  # the steps of one run (step 6: the restart's)
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _state(step: int) -> dict[str, Any]:
    """Step ``step``'s state: a frozen 2 MiB that never changes, and ``SIZES[step]`` MiB trained."""
    frozen = torch.randn(MiB // 2, generator=torch.Generator().manual_seed(7))
    w = torch.randn(int(SIZES[step] * MiB) // 4, generator=torch.Generator().manual_seed(step))
    return {"frozen": frozen, "w": w, "step": step}


def _blank(step: int) -> dict[str, Any]:
    return {"frozen": torch.zeros(MiB // 2), "w": torch.zeros(int(SIZES[step] * MiB) // 4), "step": -1}


def _tier_files(folder: str) -> dict[str, list[str]]:
    """Every entry of the memory tier's folder (step folders with their files)."""
    out: dict[str, list[str]] = {}
    for name in sorted(os.listdir(folder)):
        p = os.path.join(folder, name)
        out[name] = sorted(os.listdir(p)) if os.path.isdir(p) and name.startswith("step-") else []
    return out


def _nothing_partial(folder: str) -> dict[str, list[str]]:
    """The memory tier's folder holds committed, whole steps and its own files only: no temp
    file, no step folder without its commit marker, no incoming folder."""
    files = _tier_files(folder)
    for name, inside in files.items():
        assert name in ("ROOT", "LOCK", ".slots", "_nebula") or name.startswith("step-"), files
        if name.startswith("step-"):
            assert "COMMIT" in inside and "manifest.json" in inside, files
            assert all(f in ("COMMIT", "manifest.json") or f.endswith(".safetensors") for f in inside), files
    return files


def _refers_to(folder: str, step: int) -> list[int]:
    """The earlier steps the memory tier's ``step`` refers to (an incremental step's bases)."""
    with open(os.path.join(folder, f"step-{step}", "manifest.json")) as f:
        return [s["step"] for s in json.load(f)["shards"] if s.get("step") is not None]


def _check_restores(ck: nc.Checkpointer, steps: list[int], on_memory: set[int]) -> None:
    """Each of ``steps`` restores bit-exact, from the memory tier for those of ``on_memory``."""
    mem, disk = ck.tiers[0].name, ck.tiers[1].name
    for step in steps:
        into, want = _blank(step), _state(step)
        assert ck.load(step, into=into) == step
        assert ck.last_restore["tier"] == (mem if step in on_memory else disk), (step, ck.last_restore)
        assert torch.equal(into["frozen"], want["frozen"]) and torch.equal(into["w"], want["w"]), step
        assert into["step"] == step


def _check_cli(root: str, shm: str, capsys: pytest.CaptureFixture[str], want: set[tuple[str, int]]) -> None:
    """``nebula-ckpt verify`` finds every checkpoint healthy; ``gc`` finds nothing wrong."""
    capsys.readouterr()
    assert main(["verify", root, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert all(r["healthy"] for r in rows), rows
    assert {(r["tier"], r["step"]) for r in rows} >= want, rows
    assert main(["gc", "--shm-dir", shm, "--json"]) == 0
    decisions = json.loads(capsys.readouterr().out)
    assert decisions and all(d.get("problem") is None for d in decisions), decisions


@pytest.mark.parametrize("incremental", [True, False])
def test_a_save_the_full_tmpfs_cannot_hold_goes_to_the_other_tiers_only(
        tmp_path, small_tmpfs: Callable[[str], str], incremental: bool,  # noqa: ANN001
        capsys: pytest.CaptureFixture[str]) -> None:
    """Step 4 grew past the tmpfs (9 MiB on 8): the memory tier stands aside for it (no error, the
    disk tier takes it), and takes step 5, which fits again."""
    shm = small_tmpfs("8m")
    root = str(tmp_path / "ckpt")
    written: dict[int, list[str]] = {}
    failed: dict[int, PersistError] = {}
    with knobs.override(shm_dir=shm):
        tiers = [nc.MemoryTier(), nc.LocalTier(root, keep_last=10)]
        with nc.Checkpointer(root, tiers=tiers, incremental=incremental) as ck:
            mem, disk = ck.tiers[0].name, ck.tiers[1].name
            folder = ck.tiers[0].path
            assert folder is not None and folder.startswith(shm)
            for step in STEPS:
                h = ck.save_async(step, _state(step))
                try:
                    written[step] = h.result()
                except PersistError as e:
                    failed[step] = e
                    written[step] = list(h.tiers_written)
                files = _nothing_partial(folder)
                if step == 2:  # an incremental step refers to the frozen bytes of step 1
                    assert _refers_to(folder, 2) == ([1] if incremental else [])
                if step == 4:  # the step the memory tier held stays, whole; step 4 left no trace
                    assert [n for n in files if n.startswith("step-")] == ["step-3"], files
            assert failed == {}, {s: str(e) for s, e in failed.items()}  # no error: the tier stood aside
            for step in (1, 2, 3, 5):
                assert sorted(written[step]) == sorted([mem, disk]), (step, written[step])
            assert written[4] == [disk]  # the disk tier still got it
            # a save that fits is on the memory tier again: incremental on step 3, which the tier
            # kept (it wrote nothing at step 4), or whole; retention keeps what step 5 needs
            steps_held = sorted(n for n in _tier_files(folder) if n.startswith("step-"))
            assert steps_held == (["step-3", "step-5"] if incremental else ["step-5"]), steps_held
            assert _refers_to(folder, 5) == ([3] if incremental else [])
            _check_restores(ck, STEPS, {3, 5} if incremental else {5})
            _check_cli(root, shm, capsys, {(mem, 5), (disk, 4)})
    capsys.readouterr()
    assert main(["gc", "--shm-dir", shm, "--json"]) == 0


# argv: root; saves steps 1..4 (step 4 does not fit the memory tier: it stands aside), reports, is SIGKILLed
_CRASHING_SAVER = r"""
import json, os, signal, sys
import nebula_ckpt as nc
from tiers.memory.test_full_shm import SIZES, _state
root = sys.argv[1]
ck = nc.Checkpointer(root, tiers=[nc.MemoryTier(), nc.LocalTier(root, keep_last=10)])
out = {}
for step in range(1, 5):
    h = ck.save_async(step, _state(step))
    try:
        out[step] = h.result()
    except nc.PersistError as e:
        out[step] = {"error": str(e), "written": list(h.tiers_written)}
print(json.dumps(out), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_restart_after_a_save_the_full_tmpfs_refused(
        tmp_path, small_tmpfs: Callable[[str], str], capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    """A real process saves into the full tmpfs and is SIGKILLed: the restarted one finds only
    whole committed steps, restores the newest step from the disk tier and the one before from
    the memory tier, bit-exact. Its first save, incremental on the memory tier's step 3, finds no
    room for the changed bytes beside its staged copy and is written whole there instead (its
    staged file linked); the next one, smaller, is on the memory tier too."""
    shm = small_tmpfs("8m")
    root = str(tmp_path / "ckpt")
    env = dict(os.environ, NEBULA_SHM_DIR=shm,
               PYTHONPATH=os.pathsep.join([_REPO, os.path.join(_REPO, "tests"), os.environ.get("PYTHONPATH", "")]))
    r = warm_python.run([sys.executable, "-c", _CRASHING_SAVER, root], env=env, capture_output=True, text=True,
                        timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    report = json.loads(r.stdout.splitlines()[-1])
    assert [w.split(":")[0] for w in report["4"]] == ["local"], report["4"]  # the memory tier stood aside
    with knobs.override(shm_dir=shm):
        with nc.Checkpointer(root, tiers=[nc.MemoryTier(), nc.LocalTier(root, keep_last=10)]) as ck:
            mem, disk = ck.tiers[0].name, ck.tiers[1].name
            folder = ck.tiers[0].path
            assert folder is not None
            files = _nothing_partial(folder)
            assert [n for n in files if n.startswith("step-")] == ["step-3"], files
            into = _blank(4)
            assert ck.load_latest(into=into) == 4 and ck.last_restore["tier"] == disk
            assert torch.equal(into["w"], _state(4)["w"])
            _check_restores(ck, [1, 2, 3, 4], {3})
            h5 = ck.save_async(5, _state(5))
            assert sorted(h5.result()) == sorted([mem, disk])  # whole on the memory tier
            assert ck.stats()["memory_tier_whole_fallbacks"] == 1
            assert [n for n in _nothing_partial(folder) if n.startswith("step-")] == ["step-5"]
            assert _refers_to(folder, 5) == []
            # step 3, restored from the memory tier above, is deleted now: no mapping of it may
            # still hold its tmpfs pages (tests/tiers/memory/test_restore_release.py)
            assert sorted(ck.save(6, _state(6)).tiers_written) == sorted([mem, disk])
            assert [n for n in _nothing_partial(folder) if n.startswith("step-")] == ["step-6"]
            _check_restores(ck, [3, 4, 5, 6], {6})
            _check_cli(root, shm, capsys, {(mem, 6), (disk, 5)})


def _big(step: int, frozen_mib: float, w_mib: float) -> dict[str, Any]:
    """A state of ``frozen_mib`` MiB that never changes and ``w_mib`` MiB that each step changes."""
    frozen = torch.randn(int(frozen_mib * MiB) // 4, generator=torch.Generator().manual_seed(7))
    w = torch.randn(int(w_mib * MiB) // 4, generator=torch.Generator().manual_seed(step))
    return {"frozen": frozen, "w": w}


def test_an_incremental_step_without_room_beside_its_staged_copy_is_written_whole(
        tmp_path, small_tmpfs: Callable[[str], str], caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    """Step 5 builds on step 3 (same shapes, only ``w`` changed): its changed 1.5 MiB do not fit
    the 8 MiB tmpfs beside step 3 and its own staged copy (3.5 MiB each), but the whole step does,
    as its staged file linked. The memory tier writes it whole (one INFO line saying why,
    ``stats()`` counts it) instead of failing; every step restores bit-exact."""
    shm = small_tmpfs("8m")
    root = str(tmp_path / "ckpt")
    with knobs.override(shm_dir=shm):
        with nc.Checkpointer(root, tiers=[nc.MemoryTier(), nc.LocalTier(root, keep_last=10)]) as ck:
            mem, disk = ck.tiers[0].name, ck.tiers[1].name
            folder = ck.tiers[0].path
            assert folder is not None
            assert sorted(ck.save(3, _state(3)).tiers_written) == sorted([mem, disk])
            assert ck.stats()["memory_tier_whole_fallbacks"] == 0
            with caplog.at_level(logging.DEBUG, logger="nebula_ckpt"):
                h = ck.save_async(5, _state(5))
                assert sorted(h.result()) == sorted([mem, disk])
            said = [r for r in caplog.records if "written whole instead" in r.getMessage()]
            assert len(said) == 1 and said[0].levelno == logging.INFO, [r.getMessage() for r in said]
            assert "No space left" in said[0].getMessage() and "step-5" in said[0].getMessage()
            assert ck.stats()["memory_tier_whole_fallbacks"] == 1
            assert [n for n in _nothing_partial(folder) if n.startswith("step-")] == ["step-5"]
            assert _refers_to(folder, 5) == []  # whole: it refers to no other step
            _check_restores(ck, [3, 5], {5})
            # the next save builds on the whole step 5 and, without room again, is whole again
            assert sorted(ck.save(7, _state(5) | {"w": _state(3)["w"]}).tiers_written) == sorted([mem, disk])
            assert ck.stats()["memory_tier_whole_fallbacks"] == 2
            assert len([r for r in caplog.records if "written whole instead" in r.getMessage()]) == 1
            into = _blank(5)
            assert ck.load(7, into=into) == 7 and ck.last_restore["tier"] == mem
            assert torch.equal(into["w"], _state(3)["w"]) and torch.equal(into["frozen"], _state(3)["frozen"])


def test_a_state_whose_step_cannot_sit_beside_the_next_makes_the_tier_stand_aside(
        tmp_path, small_tmpfs: Callable[[str], str], caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    """A 6 MiB state on an 8 MiB tmpfs: one step fits, but not beside the next one, so every save but
    the first would fail there. The memory tier stands aside from the first save on, said once
    with the fix; no save raises, the disk tier has every step, and each restores bit-exact."""
    shm = small_tmpfs("8m")
    root = str(tmp_path / "ckpt")
    with knobs.override(shm_dir=shm), caplog.at_level(logging.INFO, logger="nebula_ckpt"):
        with nc.Checkpointer(root, tiers=[nc.MemoryTier(), nc.LocalTier(root, keep_last=10)]) as ck:
            disk = ck.tiers[1].name
            for step in (1, 2, 3):
                assert ck.save(step, _big(step, 3.5, 2.5)).tiers_written == [disk]
            for step in (1, 2, 3):
                into = {"frozen": torch.zeros(int(3.5 * MiB) // 4), "w": torch.zeros(int(2.5 * MiB) // 4)}
                assert ck.load(step, into=into) == step and ck.last_restore["tier"] == disk
                want = _big(step, 3.5, 2.5)
                assert torch.equal(into["frozen"], want["frozen"]) and torch.equal(into["w"], want["w"])
    said = [r.getMessage() for r in caplog.records if "stands aside" in r.getMessage()]
    assert len(said) == 1 and "from step 1 on" in said[0], said
    for fix in ("docker run --shm-size=", "emptyDir", "medium: Memory", "NEBULA_SHM_DIR"):
        assert fix in said[0], said[0]


def test_a_shard_write_the_full_tmpfs_cannot_take_names_the_tier_the_file_and_the_fix(
        small_tmpfs: Callable[[str], str]) -> None:
    """The memory tier's storage turns a full tmpfs (``ENOSPC``) on a shard write, whole or in
    parts, into an error naming the tier, the file, the bytes it needed and what to do; the file
    is not there afterwards."""
    from nebula_ckpt.tiers.memory.runtime import MemoryStorage

    shm = small_tmpfs("1m")
    st = MemoryStorage(shm, "memory:full")
    big = memoryview(bytearray(2 * MiB))
    writes = {"whole.safetensors": lambda rel: st.write_buffer(rel, big),
              "parts.safetensors": lambda rel: st.write_parts(rel, [big[:MiB], big[MiB:]])}
    for name, write in writes.items():
        rel = f"step-1/{name}"
        with pytest.raises(OSError) as caught:
            write(rel)
        e = caught.value
        assert e.errno == errno.ENOSPC, e
        text = e.strerror or ""
        assert text.startswith("memory tier memory:full: no room on its tmpfs for " + os.path.join(shm, rel)), text
        assert f"it needs {2 * MiB} bytes" in text and "NEBULA_SHM_DIR" in text and "keep fewer steps" in text, text
