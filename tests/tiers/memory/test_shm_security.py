"""The shared /dev/shm is hostile ground: planted folders, symlinks, stale runs, orphans, gc.

The tests run as whatever user runs the suite; "another user" is simulated by chown (as root)
or by a group/other-writable mode, which the library must refuse the same way.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import sys
import threading

import pytest
import torch

import nebula_ckpt as nc
import warm_python
from flaky_fs import SCHEME, FlakyFileSystem, hanging, raising, register
from nebula_ckpt import knobs
from nebula_ckpt.cli import main as cli_main
from nebula_ckpt.format.commit import committed_steps
from nebula_ckpt.storage.local import LocalStorage
from nebula_ckpt.storage.urls import canonical_root
from nebula_ckpt.tiers.memory import gc as memgc
from nebula_ckpt.tiers.memory import shm as memtier
from nebula_ckpt.tiers.memory.tier import memory_tier_path

IS_ROOT = os.geteuid() == 0
TESTS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _plant(root: str, *, step: int, value: float, mode: int = 0o700, uid: int | None = None) -> str:
    """Build a valid-looking memory tier for ``root`` by hand, as an attacker would."""
    src = root + "-attacker-src"
    with nc.Checkpointer(src, memory_tier=False) as ck:
        ck.save(step, {"w": torch.full((8,), value)})
    folder = memory_tier_path(root)
    os.makedirs(os.path.dirname(folder), mode=0o700, exist_ok=True)
    os.chmod(os.path.dirname(folder), 0o700)   # our own user folder: only the leaf is planted
    shutil.copytree(src, folder)
    shutil.rmtree(os.path.join(folder, "_nebula"), ignore_errors=True)
    with open(os.path.join(folder, "ROOT"), "wb") as f:
        f.write(canonical_root(root).encode())  # the pre-run-id ROOT content: path only
    for dp, dirs, files in os.walk(folder):
        for n in dirs + files:
            os.chmod(os.path.join(dp, n), mode)
            if uid is not None:
                os.chown(os.path.join(dp, n), uid, uid)
    os.chmod(folder, mode)
    if uid is not None:
        os.chown(folder, uid, uid)
    return folder


def _tiers_kinds(ck: nc.Checkpointer) -> list[str]:
    return [t.kind for t in ck.tiers]


@pytest.mark.parametrize("how", ["world-writable", "other-owner"])
def test_planted_memory_tier_is_never_restored(root: str, how: str, caplog: pytest.LogCaptureFixture) -> None:
    if how == "other-owner" and not IS_ROOT:
        pytest.skip("chown to another uid needs root")
    folder = _plant(root, step=99, value=666.0, mode=0o777 if how == "world-writable" else 0o700,
                    uid=54321 if how == "other-owner" else None)
    w = torch.zeros(8)
    with nc.Checkpointer(root) as ck:
        assert "memory" not in _tiers_kinds(ck)   # refused, loudly
        assert ck.load_latest(into={"w": w}) is None
        ck.save(1, {"w": torch.ones(8)})
    assert torch.all(w == 0)
    assert any("memory tier not used" in r.message for r in caplog.records)
    # the planted folder is left alone (not ours to delete) and was not written into
    assert sorted(os.listdir(folder)) == ["ROOT", "step-99"]


def test_user_folder_owned_by_someone_else_is_refused(root: str, shm_dir: str) -> None:
    if not IS_ROOT:
        pytest.skip("chown to another uid needs root")
    user_dir = os.path.dirname(memory_tier_path(root))
    os.makedirs(user_dir, mode=0o777)
    os.chmod(user_dir, 0o777)
    os.chown(user_dir, 54321, 54321)
    with nc.Checkpointer(root) as ck:
        assert "memory" not in _tiers_kinds(ck)
        ck.save(1, {"w": torch.ones(2)})
    assert os.listdir(user_dir) == []


def test_folder_without_root_file_is_not_claimed(root: str) -> None:
    folder = memory_tier_path(root)
    os.makedirs(os.path.join(folder, "step-5"), mode=0o700)
    os.chmod(os.path.dirname(folder), 0o700)
    with open(os.path.join(folder, "step-5", "junk"), "w") as f:
        f.write("x")
    with nc.Checkpointer(root) as ck:
        assert "memory" not in _tiers_kinds(ck)
    assert not os.path.exists(os.path.join(folder, "ROOT"))


def test_symlinked_step_folder_in_memory_tier_never_followed(root: str, tmp_path) -> None:  # noqa: ANN001
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    with nc.Checkpointer(root, tiers=[nc.MemoryTier()]) as ck:
        mem = ck.tiers[0].display_url
        ck.save(1, {"w": torch.ones(4)})
        os.symlink(str(victim), os.path.join(mem, "step-2"))
        ck.save(2, {"w": torch.full((4,), 2.0)})   # must not delete or write through the link
        assert sorted(os.listdir(victim)) == ["precious.txt"]
        assert (victim / "precious.txt").read_text() == "keep me"
        assert not os.path.islink(os.path.join(mem, "step-2"))
        assert ck.list() == [2]


def test_symlinked_shard_or_step_on_disk_is_not_read(root: str, tmp_path) -> None:  # noqa: ANN001
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, {"w": torch.ones(4)})
        ck.save(2, {"w": torch.full((4,), 2.0)})
    outside = tmp_path / "outside"
    shutil.copytree(os.path.join(root, "step-2"), outside)
    shutil.rmtree(os.path.join(root, "step-2"))
    os.symlink(str(outside), os.path.join(root, "step-2"))
    w = torch.zeros(4)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        assert ck.list() == [1]                       # a linked folder is not a checkpoint of ours
        assert ck.load_latest(into={"w": w}) == 1
    assert torch.all(w == 1)
    # the same with the shard file itself replaced by a link to a file outside the root
    shard = [n for n in os.listdir(os.path.join(root, "step-1")) if n.startswith("shard-")][0]
    p = os.path.join(root, "step-1", shard)
    shutil.copy(p, tmp_path / "elsewhere")
    os.unlink(p)
    os.symlink(str(tmp_path / "elsewhere"), p)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        with pytest.raises(nc.CorruptCheckpointError):
            ck.load_latest(into={"w": w})
    assert cli_main(["verify", root]) == 1


def _crash_after_save(root: str, shm_dir: str, step: int, value: float) -> None:
    code = f"""
import os, signal, torch, nebula_ckpt as nc
ck = nc.Checkpointer({root!r})
ck.save({step}, {{"w": torch.full((8,), {value})}})
os.kill(os.getpid(), signal.SIGKILL)
"""
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir)
    r = warm_python.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr.decode()


def test_deleted_root_new_run_never_gets_old_runs_memory(root: str, shm_dir: str) -> None:
    _crash_after_save(root, shm_dir, 50, 5.0)
    folder = memory_tier_path(root)
    assert "step-50" in os.listdir(folder)         # the crashed run's memory tier is there
    shutil.rmtree(root)                             # the operator deletes the run ...
    w = torch.zeros(8)
    with nc.Checkpointer(root) as ck:               # ... and starts a new one at the same path
        assert ck.load_latest(into={"w": w}) is None
        assert ck.list() == []
    assert torch.all(w == 0)


def test_restart_of_same_run_still_resumes_from_memory(root: str, shm_dir: str) -> None:
    _crash_after_save(root, shm_dir, 3, 3.0)
    with nc.Checkpointer(root) as ck:
        assert ck.load_latest() == 3 and ck.last_restore["tier"].startswith("memory:")


def test_a_memory_tier_once_opened_as_a_root_is_never_restored_from(root: str, shm_dir: str,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A memory-tier folder holding a root's records (``_nebula/``) was opened as a checkpoint root,
    so a step in it may be another run's: the run restores and saves without it, saying so."""
    code = f"""
import os, signal, torch, nebula_ckpt as nc
ck = nc.Checkpointer({root!r})
ck.save(3, {{"w": torch.full((8,), 3.0)}}).result()   # on every tier
os.kill(os.getpid(), signal.SIGKILL)
"""
    r = warm_python.run([sys.executable, "-c", code], env=dict(os.environ, NEBULA_SHM_DIR=shm_dir),
                        capture_output=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr.decode()
    folder = memory_tier_path(root)
    assert "step-3" in os.listdir(folder)
    shutil.copy(os.path.join(root, "_nebula", "run.json"), os.path.join(folder, "_nebula"))  # what a root leaves
    w = torch.zeros(8)
    with nc.Checkpointer(root) as ck:
        assert "memory" not in _tiers_kinds(ck)
        assert ck.load_latest(into={"w": w}) == 3 and ck.last_restore["tier"].startswith("local:")
    assert torch.all(w == 3.0)
    assert any("holds _nebula/run.json" in r.message and "gc --force" in r.message for r in caplog.records)
    assert "step-3" in os.listdir(folder)  # left for the user to remove


def _written_kinds(ck: nc.Checkpointer) -> list[str]:
    return [w.tier.kind for w in ck._saves.writers or []]


_SECOND_WRITER = """
import json, sys, torch, nebula_ckpt as nc
with nc.Checkpointer(sys.argv[1]) as second:      # may read it ...
    step = second.load_latest()
    tier = second.last_restore["tier"]
    second.save(2, {"w": torch.ones(2)})         # ... but never writes it while first holds it
    print(json.dumps([step, tier, [w.tier.kind for w in second._saves.writers or []]]))
"""


def test_second_live_writer_on_same_root_does_not_write_the_memory_tier(root: str, shm_dir: str) -> None:
    """A second live process on the root (a real one: a second Checkpointer of this very process
    takes the root over instead, tests/tiers/memory/test_two_writers_one_process.py)."""
    with nc.Checkpointer(root) as first:
        first.save(1, {"w": torch.ones(2)})
        assert "memory" in _written_kinds(first)
        p = warm_python.run([sys.executable, "-c", _SECOND_WRITER, root], capture_output=True, text=True,
                            timeout=300, env=dict(os.environ, NEBULA_SHM_DIR=shm_dir))
        assert p.returncode == 0, p.stderr[-4000:]
        step, tier, kinds = json.loads(p.stdout.strip().splitlines()[-1])
        assert step == 1 and tier.startswith("memory:") and kinds == ["local"], p.stdout
        assert "written by another live process on the same root" in p.stderr, p.stderr[-4000:]
        assert first.list(detailed=True)[first.tiers[0].name] == [1]
    with nc.Checkpointer(root) as third:           # the lock died with close()
        third.save(3, {"w": torch.ones(2)})
        assert "memory" in _written_kinds(third)


def test_a_checkpointer_that_only_reads_leaves_no_folder(root: str) -> None:
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, {"w": torch.ones(2)})
    folder = memory_tier_path(root)
    with nc.Checkpointer(root) as reader:
        assert os.path.isdir(folder)  # claimed while open
        assert reader.load_latest() == 1
    assert not os.path.exists(folder)


def test_a_reader_closing_before_a_writers_first_save_leaves_the_writer_its_tier(root: str) -> None:
    folder = memory_tier_path(root)
    reader = nc.Checkpointer(root)        # makes the folder
    writer = nc.Checkpointer(root)        # claims the same folder, has not saved yet
    reader.close()                        # removes it: nothing was ever put in
    assert not os.path.exists(folder)
    writer.save(1, {"w": torch.ones(2)})  # makes it again, and writes it
    assert "memory" in _written_kinds(writer) and os.path.isdir(folder)
    assert writer.list(detailed=True)[writer.tiers[0].name] == [1]
    with nc.Checkpointer(root) as other:  # a folder with a checkpoint is never removed by a reader
        assert other.load_latest() == 1
    assert os.path.isdir(folder)
    writer.close()


def _gc(shm_dir: str, *args: str) -> list[dict]:
    from contextlib import redirect_stdout
    from io import StringIO

    buf = StringIO()
    with redirect_stdout(buf):
        assert cli_main(["gc", "--shm-dir", shm_dir, "--json", *args]) == 0
    return json.loads(buf.getvalue())


def _job(root: str, shm_dir: str, *, persistent_every: int = 100, steps: tuple[int, ...] = (0, 7),
         resume_from: int | None = None) -> None:
    """Run a job on ``root`` (memory tier + the root's tier with cadence ``persistent_every``) that
    saves ``steps`` and dies (SIGKILL); with ``resume_from``, it first restores that step."""
    persistent = "RemoteTier" if "://" in root else "LocalTier"
    code = f"""
import os, signal, sys, torch
sys.path.insert(0, {TESTS!r})
import flaky_fs
flaky_fs.register()
import nebula_ckpt as nc
ck = nc.Checkpointer({root!r}, tiers=[nc.MemoryTier(), nc.{persistent}({root!r}, every={persistent_every})])
if {resume_from!r} is not None:
    assert ck.load_latest() == {resume_from!r}, ck.list(detailed=True)
for s in {steps!r}:
    ck.save(s, {{"w": torch.full((2,), float(s))}})
os.kill(os.getpid(), signal.SIGKILL)
"""
    r = warm_python.run([sys.executable, "-c", code], env=dict(os.environ, NEBULA_SHM_DIR=shm_dir),
                        capture_output=True, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr.decode()


def _mem_steps(folder: str) -> list[int]:
    return committed_steps(LocalStorage(folder, private=True, fsync=False))


def test_memory_tier_folder_checks_and_gc_use_one_uid(root: str, shm_dir: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A process whose real and effective uids differ (a setuid launcher): the memory tier's folder,
    the ownership checks and `gc`'s scan all name one user, the effective one (who owns what the
    process creates), so `gc` finds the tier the job made."""
    euid = os.geteuid()
    monkeypatch.setattr(os, "getuid", lambda: euid + 1)
    with nc.Checkpointer(root) as ck:
        ck.save(1, {"w": torch.ones(4)})
        assert _tiers_kinds(ck)[0] == "memory"
        folder = memory_tier_path(root)
        assert os.path.basename(os.path.dirname(folder)) == f"nebula_ckpt-{euid}" == memtier.user_dir_name()
        assert [f.folder for f in memtier.scan(shm_dir)] == [folder]
        assert committed_steps(LocalStorage(folder, private=True, fsync=False)) == [1]


def test_gc_policy(tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    gone, durable, only_mem, live = (str(tmp_path / n) for n in ("gone", "durable", "only", "live"))
    _crash_after_save(gone, shm_dir, 1, 1.0)
    shutil.rmtree(gone)
    _crash_after_save(durable, shm_dir, 2, 2.0)      # committed on memory and on disk
    _job(only_mem, shm_dir)                          # step 0 on both, step 7 only in memory
    with nc.Checkpointer(live) as holder:
        holder.save(1, {"w": torch.ones(2)})
        rows = {r["root"]: r for r in _gc(shm_dir, "--dry-run")}
        assert not rows[canonical_root(gone)]["remove"] and "gone" in rows[canonical_root(gone)]["reason"]
        assert rows[canonical_root(durable)]["remove"] and "durable" in rows[canonical_root(durable)]["reason"]
        assert not rows[canonical_root(only_mem)]["remove"]
        assert not rows[canonical_root(live)]["remove"] and rows[canonical_root(live)]["in_use"]
        assert len(memtier.scan(shm_dir)) == 4            # dry run removed nothing
        _gc(shm_dir)
        left = {f.owner.root for f in memtier.scan(shm_dir) if f.owner}
        # only the durable one goes: a gone root's tier holds the only copy of its step
        assert left == {canonical_root(gone), canonical_root(only_mem), canonical_root(live)}
        rows = {r["root"]: r for run in (gone, only_mem, live) for r in _gc(shm_dir, run, "--force")}
        assert "lost" in rows[canonical_root(gone)]["reason"] and "step 1" in rows[canonical_root(gone)]["reason"]
        assert "lost" in rows[canonical_root(only_mem)]["reason"] and "7" in rows[canonical_root(only_mem)]["reason"]
        left = {f.owner.root for f in memtier.scan(shm_dir) if f.owner}
        assert left == {canonical_root(live)}              # in use: never removed, even forced
    assert holder.list() == [1]


def test_gc_of_one_run_and_force_only_for_a_named_run(tmp_path, shm_dir: str,  # noqa: ANN001
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``gc ROOT`` decides for that run's memory tiers only; ``--force`` (which loses steps kept only
    in memory) is refused without ROOT: on an account several jobs share, every job's tier is this
    user's, and a bare --force would take their only copies too. ``gc ROOT --force`` leaves every
    other run's tier as it was, even one whose root is gone."""
    mine, theirs = str(tmp_path / "mine"), str(tmp_path / "theirs")
    _job(mine, shm_dir)                               # step 7 only in memory
    _job(theirs, shm_dir)                             # another job of this account: step 7 only in memory
    shutil.rmtree(theirs)                             # ... and its root is gone
    capsys.readouterr()
    assert cli_main(["gc", "--shm-dir", shm_dir, "--force"]) == 2
    err = capsys.readouterr().err
    assert "gc ROOT --force" in err and "name the run" in err, err
    assert sorted(f.owner.root for f in memtier.scan(shm_dir) if f.owner) == sorted(
        [canonical_root(mine), canonical_root(theirs)])              # nothing removed
    (row,) = _gc(shm_dir, mine, "--dry-run")           # one run's tiers only
    assert row["root"] == canonical_root(mine) and not row["remove"]
    (row,) = _gc(shm_dir, mine, "--force")
    assert row["root"] == canonical_root(mine) and row["removed"] and "lost" in row["reason"], row
    (left,) = memtier.scan(shm_dir)
    assert left.owner is not None and left.owner.root == canonical_root(theirs) and _mem_steps(left.folder) == [7]
    assert _gc(shm_dir, str(tmp_path / "never-saved")) == []


def test_gc_keeps_a_memory_tier_whose_local_root_cannot_be_reached(tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    """A root that is unreachable (a mount down: its path passes a file or a link loop, or an empty
    folder stands where it was) is not gone: its tier is kept, even with --force. Only a root whose
    parent lists no such name is gone, and then only --force removes the only copy, saying so."""
    mnt, away = tmp_path / "mnt", tmp_path / "mnt.away"
    root = str(mnt / "run")
    _job(root, shm_dir)                       # step 0 on disk and in memory, step 7 only in memory
    folder = memory_tier_path(root)
    assert _mem_steps(folder) == [7]
    outages = {"a path component is a file": lambda: mnt.write_bytes(b""),
               "a symlink loop": lambda: os.symlink(mnt.name, mnt),
               "an empty folder where the root was": lambda: (mnt / "run").mkdir(parents=True)}
    for outage, make in outages.items():
        os.rename(mnt, away)
        make()
        for force in ((), (root, "--force")):
            (row,) = _gc(shm_dir, *force)
            assert not row["remove"] and not row.get("removed"), (outage, force, row)
            assert "step 7" in row["reason"] and root in row["reason"], (outage, row)
            assert _mem_steps(folder) == [7], (outage, force)
        if mnt.is_dir() and not mnt.is_symlink():
            shutil.rmtree(mnt)
        else:
            os.unlink(mnt)
        os.rename(away, mnt)
    (row,) = _gc(shm_dir)                     # reachable: step 7 is only in memory
    assert not row["remove"] and "only in memory" in row["reason"]
    shutil.rmtree(mnt / "run")                # gone: its parent is there and lists no "run"
    (row,) = _gc(shm_dir)
    assert not row["remove"] and "gone" in row["reason"] and "--force" in row["reason"]
    assert _mem_steps(folder) == [7]
    (row,) = _gc(shm_dir, root, "--force")
    assert row["removed"] and "step 7" in row["reason"] and "lost" in row["reason"], row
    assert not os.path.exists(folder)


def test_gc_checks_a_remote_root_and_keeps_the_tier_while_the_store_fails(tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    """A remote root whose store errs, times out or does not answer is unknown: kept, even with
    --force. Once it answers, a tier whose newest step is durable there goes; a root the store
    says is not there is gone, and only --force removes its tier's only copy."""
    register()
    only_mem, durable = f"{SCHEME}://{tmp_path}/bucket/only", f"{SCHEME}://{tmp_path}/bucket/durable"
    _job(only_mem, shm_dir)                            # step 7 only in memory
    _job(durable, shm_dir, persistent_every=1, steps=(3,))  # step 3 in memory and on the store
    release = threading.Event()
    faults = {"I/O error": raising(OSError(errno.EIO, "connection reset by peer")),
              "timeout": raising(TimeoutError("read timed out")),
              "no answer": hanging(release)}
    try:
        with knobs.override(remote_retries=1):
            for name, fault in faults.items():
                FlakyFileSystem.fault = fault
                for force in ((), (only_mem, "--force"), (durable, "--force")):
                    rows = _gc(shm_dir, "--root-timeout", "1", *force)
                    assert len(rows) == (1 if force else 2), (name, force, rows)
                    assert not any(r["remove"] or r.get("removed") for r in rows), (name, rows)
                    assert all("cannot check" in r["reason"] for r in rows), (name, rows)
    finally:
        FlakyFileSystem.fault = None
        release.set()
    assert len(memtier.scan(shm_dir)) == 2
    rows = {r["root"]: r for r in _gc(shm_dir)}        # the store answers again
    assert rows[canonical_root(durable)]["removed"] and "durable" in rows[canonical_root(durable)]["reason"]
    assert not rows[canonical_root(only_mem)]["remove"] and "only in memory" in rows[canonical_root(only_mem)]["reason"]
    shutil.rmtree(tmp_path / "bucket")                 # the store says: nothing there
    (row,) = _gc(shm_dir)
    assert not row["remove"] and "gone" in row["reason"]
    (row,) = _gc(shm_dir, only_mem, "--force")
    assert row["removed"] and "step 7" in row["reason"] and "lost" in row["reason"], row
    assert memtier.scan(shm_dir) == []


def test_gc_decides_again_under_the_tier_lock(root: str, shm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """gc decided to remove a tier (its newest step was durable); before it removes it, the job
    restarts and saves a step only in memory. Deciding again under the lock keeps that step."""
    _crash_after_save(root, shm_dir, 1, 1.0)           # step 1 in memory and on disk
    folder = memory_tier_path(root)
    real_collect = memgc.collect

    def collect_then_job_restarts(*args: object, **kwargs: object) -> list[memgc.Decision]:
        decisions = real_collect(*args, **kwargs)      # type: ignore[arg-type]
        assert [(d.remove, "durable" in d.reason) for d in decisions] == [(True, True)], decisions
        # the interleaving: after gc decided, before it removes, the job restarts and saves steps 2
        # (its first save goes to disk too) and 3 (only in memory)
        _job(root, shm_dir, resume_from=1, steps=(2, 3))
        return decisions

    monkeypatch.setattr(memgc, "collect", collect_then_job_restarts)
    (row,) = _gc(shm_dir)
    assert not row.get("removed") and "step 3" in row["reason"] and "only in memory" in row["reason"], row
    assert _mem_steps(folder) == [3]
    monkeypatch.undo()
    with nc.Checkpointer(root, tiers=[nc.MemoryTier(), nc.LocalTier(root, every=100)]) as ck:
        assert ck.load_latest() == 3 and ck.last_restore["tier"].startswith("memory:")


def test_gc_decisions_never_touch_unsafe_folders(root: str, shm_dir: str) -> None:
    folder = _plant(root, step=1, value=1.0, mode=0o777)
    decisions = memgc.collect(shm_dir, force=True)
    assert len(decisions) == 1 and not decisions[0].remove and "not safely ours" in decisions[0].reason
    assert os.path.isdir(folder)


def test_user_folder_of_older_versions_readable_by_others_is_tightened(root: str) -> None:
    """Earlier versions created nebula_ckpt-<uid> 0755: others may read, not write. It is ours:
    used, and tightened to 0700 (a group/other-writable one is refused, see above)."""
    user_dir = os.path.dirname(memory_tier_path(root))
    os.makedirs(user_dir, mode=0o755)
    os.chmod(user_dir, 0o755)
    with nc.Checkpointer(root) as ck:
        assert "memory" in _tiers_kinds(ck)
        ck.save(1, {"w": torch.ones(2)})
    assert os.stat(user_dir).st_mode & 0o777 == 0o700
