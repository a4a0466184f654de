"""``persist_memory`` / ``nebula-ckpt persist-memory``: the memory tier's newest step onto the
persistent root when the job will not be restarted (a real process that ends without closing)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import nebula_ckpt as nc
import warm_python
from incremental.test_chain_edges import _DAMAGE as CHAIN_DAMAGE
from incremental.test_chain_edges import _frozen as chain_frozen
from incremental.test_chain_edges import _mem_folder as chain_mem_folder
from incremental.test_chain_edges import _state as chain_state
from nebula_ckpt import knobs
from nebula_ckpt.errors import CorruptCheckpointError, NebulaError, ValidationError
from nebula_ckpt.tiers.memory.epilogue import persist_memory
from nebula_ckpt.tiers.memory.tier import memory_tier_path

REPO = Path(__file__).resolve().parents[3]


def _job_that_dies(root: str, shm_dir: str, steps: int = 3) -> None:
    """Saves steps 1..steps (the disk tier only every 10th save: step 1), then ends unclosed."""
    code = textwrap.dedent(f"""
        import os, torch, nebula_ckpt as nc
        ck = nc.Checkpointer({root!r}, tiers=[nc.MemoryTier(), nc.LocalTier({root!r}, every=10)])
        for s in range(1, {steps} + 1):
            ck.save(s, {{"w": torch.arange(1000, dtype=torch.float32) * s, "step": s}}).result()
        os._exit(0)
    """)
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir, PYTHONPATH=str(REPO))
    warm_python.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


def test_the_newest_memory_step_reaches_the_root(root: str, shm_dir: str) -> None:
    _job_that_dies(root, shm_dir)
    assert sorted(p.name for p in Path(root).glob("step-*")) == ["step-1"]
    got = persist_memory(root)
    assert got["copied"] and got["step"] == 3
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
        state = {"w": torch.zeros(1000), "step": 0}
        assert ck.load_latest(state) == 3
        assert torch.equal(state["w"], torch.arange(1000, dtype=torch.float32) * 3) and state["step"] == 3
    again = persist_memory(root)  # idempotent
    assert not again["copied"] and "already" in again["why"]


def test_a_damaged_memory_step_is_not_copied(root: str, shm_dir: str) -> None:
    _job_that_dies(root, shm_dir)
    shard = next(Path(memory_tier_path(root)).glob("step-3/shard-*"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError):
        persist_memory(root)
    assert not Path(root, "step-3").exists()


def test_a_live_writer_is_left_alone(root: str, shm_dir: str) -> None:
    with nc.Checkpointer(root, tiers=[nc.MemoryTier(), nc.LocalTier(root, every=10)]) as ck:
        ck.save(1, {"w": torch.ones(4)}).result()
        ck.save(2, {"w": torch.ones(4) * 2}).result()
        with pytest.raises(ValidationError, match="live process"):
            persist_memory(root)
        assert not Path(root, "step-2").exists()


def test_nothing_to_do(tmp_path: Path, shm_dir: str) -> None:
    assert persist_memory(str(tmp_path / "never"))["step"] is None


def test_the_command(root: str, shm_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    from nebula_ckpt.cli import main

    _job_that_dies(root, shm_dir)
    assert main(["persist-memory", root, "--json"]) == 0
    assert '"copied": true' in capsys.readouterr().out
    assert Path(root, "step-3", "COMMIT").exists()
    assert main(["persist-memory", root]) == 0
    assert "nothing to copy" in capsys.readouterr().out
    with nc.Checkpointer(root, tiers=[nc.MemoryTier(), nc.LocalTier(root, every=10)]) as ck:
        ck.save(4, {"w": torch.ones(4)}).result()   # on both tiers
        ck.save(5, {"w": torch.ones(4)}).result()   # in memory only
        assert main(["persist-memory", root]) == 2    # a live writer holds the memory tier
        assert "live process" in capsys.readouterr().err


def _job(root: str, shm_dir: str, steps: list[int], disk: str, resume: bool = False) -> None:
    """A real process: ``steps`` saved to ``[MemoryTier(), LocalTier(root, <disk>)]`` (resuming
    first when asked), then it ends unclosed (its newest step stays in the memory tier)."""
    code = textwrap.dedent(f"""
        import os, torch, nebula_ckpt as nc
        ck = nc.Checkpointer({root!r}, tiers=[nc.MemoryTier(), nc.LocalTier({root!r}, {disk})])
        state = {{"w": torch.zeros(1000), "step": -1}}
        if {resume!r}:
            ck.load_latest(state)
        for s in {steps!r}:
            state = {{"w": torch.arange(1000, dtype=torch.float32) * s, "step": s}}
            ck.save(s, state).result()
        os._exit(0)
    """)
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir, PYTHONPATH=str(REPO))
    warm_python.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


def _steps(root: str) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in Path(root).glob("step-*/COMMIT"))


def test_persist_memory_deletes_no_committed_step(root: str, shm_dir: str) -> None:
    """The disk tier keeps 100 steps (every 2nd save): the epilogue adds the memory tier's newest
    step and deletes nothing, whatever its own defaults are."""
    _job(root, shm_dir, list(range(10)), "every=2, keep_last=100")
    assert _steps(root) == [0, 2, 4, 6, 8]
    got = persist_memory(root)
    assert got["copied"] and got["step"] == 9
    assert _steps(root) == [0, 2, 4, 6, 8, 9]


def test_persist_memory_never_fences_a_live_job_nor_hides_its_step(root: str, shm_dir: str,
                                                                      tmp_path: Path) -> None:
    """A job left step 10 only in this node's RAM; its requeued job runs elsewhere (no memory tier
    here), resumed the disk's step 6 and committed step 9. The epilogue here then writes nothing
    (the live job's steps supersede step 10), takes no writer generation, and the live job's next
    save commits; a restart resumes the live job's step, never the dead job's step 10."""
    _job(root, shm_dir, list(range(1, 11)), "every=5")                      # disk: steps 1 and 6
    assert _steps(root) == [1, 6]
    live = nc.Checkpointer(root, tiers=[nc.LocalTier(root, keep_last=100)])  # elsewhere: no memory tier here
    try:
        state = {"w": torch.zeros(1000), "step": -1}
        assert live.load_latest(state) == 6
        for s in (7, 8, 9):
            live.save(s, {"w": torch.full((1000,), float(s)), "step": s}).result()
        writers = sorted(p.name for p in Path(root, "_nebula", "writers").iterdir())
        got = persist_memory(root)
        assert not got["copied"] and "newer" in got["why"], got
        assert sorted(p.name for p in Path(root, "_nebula", "writers").iterdir()) == writers  # no generation taken
        assert _steps(root) == [1, 6, 7, 8, 9]
        live.save(11, {"w": torch.full((1000,), 11.0), "step": 11}).result()  # not fenced
    finally:
        live.close()
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
        state = {"w": torch.zeros(1000), "step": -1}
        assert ck.load_latest(state) == 11 and state["step"] == 11


def test_persist_memory_before_a_new_job_commits_writes_under_the_old_generation(root: str, shm_dir: str) -> None:
    """The requeued job took a writer generation but committed nothing yet: the epilogue writes the
    dead job's step 10 under the generation that made it (the new job is not fenced), so the new
    job's first commit, of an older step number, still outranks it at restore."""
    _job(root, shm_dir, list(range(1, 11)), "every=5")
    live = nc.Checkpointer(root, tiers=[nc.LocalTier(root, keep_last=100)])
    try:
        live.save(7, {"w": torch.full((1000,), 7.0), "step": 7}).result()     # its generation is taken
        live.remove(7)
        assert _steps(root) == [1, 6]
        got = persist_memory(root)
        assert got["copied"] and got["step"] == 10, got
        with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
            state = {"w": torch.zeros(1000), "step": -1}
            assert ck.load_latest(state) == 10                                # the newest state there is
            assert torch.equal(state["w"], torch.arange(1000, dtype=torch.float32) * 10)
        live.save(8, {"w": torch.full((1000,), 8.0), "step": 8}).result()     # not fenced
    finally:
        live.close()
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
        state = {"w": torch.zeros(1000), "step": -1}
        assert ck.load_latest(state) == 8 and state["step"] == 8             # the live job's timeline wins


# -- the step a restart restores, when the newest is marked suspect (gc and persist-memory) -------------


def _killed_job(root: str, shm_dir: str, last: int, disk: str, size: int = 1000) -> None:
    """A real process saving steps 1..``last`` to ``[MemoryTier(keep_last=2), LocalTier(root, <disk>)]``,
    then SIGKILLed (the memory tier keeps the last two steps)."""
    code = textwrap.dedent(f"""
        import os, signal, torch, nebula_ckpt as nc
        ck = nc.Checkpointer({root!r}, tiers=[nc.MemoryTier(keep_last=2), nc.LocalTier({root!r}, {disk})])
        for s in range(1, {last} + 1):
            ck.save(s, {{"w": torch.arange({size}, dtype=torch.float32) * s, "step": s}}).result()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir, PYTHONPATH=str(REPO))
    r = warm_python.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr


def _cli(*args: str) -> tuple[int, str]:
    """``nebula-ckpt ARGS`` in this process: its exit code and stdout."""
    from contextlib import redirect_stdout
    from io import StringIO

    from nebula_ckpt.cli import main

    buf = StringIO()
    with redirect_stdout(buf):
        rc = main(list(args))
    return rc, buf.getvalue()


def _restored(root: str, memory: bool = False) -> int:
    """The step ``load_latest`` restores (from the root alone unless ``memory``), checked bit-exact."""
    with nc.Checkpointer(root, memory_tier=memory, read_only=True) as ck:
        state = {"w": torch.zeros(1000), "step": -1}
        step = ck.load_latest(state)
        assert step is not None and state["step"] == step
        assert torch.equal(state["w"], torch.arange(1000, dtype=torch.float32) * step)
        return step


def test_the_epilogue_keeps_the_step_a_restart_restores_when_the_newest_is_suspect(root: str, shm_dir: str) -> None:
    """Memory holds steps 9 and 10, the disk 7 and 10; step 10 is marked suspect, so a restart
    restores step 9, only in memory. gc keeps the tier (--force says step 9 is lost), persist-memory
    puts step 9 on the root, and gc then frees the tier: a restart still resumes from step 9."""
    _killed_job(root, shm_dir, 10, "every=3, keep_last=2")
    assert _steps(root) == [7, 10]
    assert _cli("mark", root, "--suspect", "10", "--reason", "loss went NaN")[0] == 0
    assert _restored(root, memory=True) == 9
    rc, out = _cli("gc", root, "--shm-dir", shm_dir, "--json")
    (kept,) = json.loads(out)
    assert rc == 0 and not kept["remove"] and "restores step 9" in kept["reason"], kept
    rc, out = _cli("gc", root, "--shm-dir", shm_dir, "--json", "--force", "--dry-run")
    (forced,) = json.loads(out)
    assert forced["remove"] and "step 9, only in memory, lost" in forced["reason"], forced
    assert _restored(root, memory=True) == 9                     # gc removed nothing

    rc, out = _cli("persist-memory", root, "--json")
    got = json.loads(out)
    assert rc == 0 and got["copied"] and got["step"] == 9, got
    assert _steps(root) == [7, 9, 10]
    assert _cli("persist-memory", root)[1].startswith("nothing to copy")   # run again: nothing to do
    rc, out = _cli("gc", root, "--shm-dir", shm_dir, "--json")
    (freed,) = json.loads(out)
    assert rc == 0 and freed["removed"], freed
    assert _restored(root) == 9


def test_persist_memory_writes_the_restored_step_before_a_suspect_newest(root: str, shm_dir: str) -> None:
    """Memory holds steps 8 and 9, the disk 1, 4 and 7; step 9 (only in memory) is marked suspect:
    persist-memory puts step 8, the one a restart restores, on the root, then step 9 as it always
    did, and gc frees the tier."""
    _killed_job(root, shm_dir, 9, "every=3, keep_last=100")
    assert _steps(root) == [1, 4, 7]
    assert _cli("mark", root, "--suspect", "9")[0] == 0
    rc, out = _cli("gc", root, "--shm-dir", shm_dir, "--json")
    assert rc == 0 and not json.loads(out)[0]["remove"]
    got = persist_memory(root)
    assert got["copied"] and got["step"] == 8 and "step 9" in got["why"], got
    assert _steps(root) == [1, 4, 7, 8, 9]
    rc, out = _cli("gc", root, "--shm-dir", shm_dir, "--json")
    assert rc == 0 and json.loads(out)[0]["removed"]
    assert _restored(root) == 8


def test_gc_and_persist_memory_are_unchanged_without_suspect_marks(root: str, shm_dir: str) -> None:
    """No step is marked: the memory tier's newest step decides, as always (step 9, only in memory
    of steps 9 and 10 with the disk holding 7 and 10, goes with the tier)."""
    _killed_job(root, shm_dir, 10, "every=3, keep_last=2")
    got = persist_memory(root)
    assert not got["copied"] and "already" in got["why"], got
    rc, out = _cli("gc", root, "--shm-dir", shm_dir, "--json")
    assert rc == 0 and json.loads(out)[0]["removed"]
    assert _restored(root) == 10


def test_overlapping_persist_memory_runs_both_succeed(root: str, shm_dir: str, tmp_path: Path) -> None:
    """Two persist-memory runs on one host (the job's epilogue and a node agent) overlap after the
    job was SIGKILLed: the second waits for the first, finds the step on the root and exits 0 (a
    live job is what exit 2 means)."""
    _killed_job(root, shm_dir, 2, "every=2")
    assert _steps(root) == [1]
    ready, go = tmp_path / "ready", tmp_path / "go"
    first = textwrap.dedent(f"""
        import pathlib, time
        from nebula_ckpt.tiers.memory.epilogue import persist_memory

        def part(rank, nbytes):  # the step is written: hold on, as a long copy would
            pathlib.Path({str(ready)!r}).touch()
            while not pathlib.Path({str(go)!r}).exists():
                time.sleep(0.05)

        print(persist_memory({root!r}, on_part=part)["copied"])
    """)
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir, PYTHONPATH=str(REPO))
    a = warm_python.popen([sys.executable, "-c", first], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
    try:
        for _ in range(1200):
            if ready.exists() or a.poll() is not None:
                break
            time.sleep(0.05)
        assert ready.exists(), a.communicate()
        b = warm_python.popen([sys.executable, "-m", "nebula_ckpt.cli", "-v", "persist-memory", root], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert b.stderr is not None
        said = []
        for line in b.stderr:  # it waits for the first run (not "a live process")
            said.append(line)
            if "waiting for another persist-memory run" in line:
                break
        go.touch()
        out_b, err_b = b.communicate(timeout=120)
        err_b = "".join(said) + err_b
        assert "waiting for another persist-memory run" in err_b, err_b
        out_a, err_a = a.communicate(timeout=120)
    finally:
        go.touch()
        a.kill()
    assert a.returncode == 0 and out_a.strip() == "True", err_a
    assert b.returncode == 0 and out_b.startswith("nothing to copy") and "already" in out_b, (out_b, err_b)
    assert _steps(root) == [1, 2]


def _damage(shard: Path, how: str) -> None:
    """A shard cut short (a torn or partial upload) or lost (an object gone from the bucket)."""
    if how == "delete":
        shard.unlink()
    else:
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size - 8)


@pytest.mark.parametrize("how", ["truncate", "delete"])
def test_persist_memory_replaces_the_roots_damaged_copy_of_the_newest_step(root: str, shm_dir: str,
                                                                           how: str) -> None:
    """A job died with step 2 committed on the root and in its memory tier; the root's shard of
    step 2 is then damaged. The root's marker does not make step 2 durable: persist-memory puts
    the memory copy in the damaged one's place (as a save of the step replaces a write), and the
    root alone then restores step 2's bytes."""
    code = textwrap.dedent(f"""
        import os, torch, nebula_ckpt as nc
        ck = nc.Checkpointer({root!r}, incremental=False)
        for s in (1, 2):
            ck.save(s, {{"w": torch.full((1024,), float(s))}}).result()
        os._exit(0)
    """)
    warm_python.run([sys.executable, "-c", code], env=dict(os.environ, NEBULA_SHM_DIR=shm_dir, PYTHONPATH=str(REPO)),
                    check=True, timeout=120)
    damaged = next(Path(root, "step-2").glob("shard-*"))
    _damage(damaged, how)
    got = persist_memory(root)
    assert got["copied"] and got["step"] == 2 and "cannot be restored" in got["why"], got
    assert not damaged.exists() and len(list(Path(root, "step-2").glob("shard-*"))) == 1
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
        state = {"w": torch.zeros(1024)}
        assert ck.load_latest(state) == 2
        assert torch.equal(state["w"], torch.full((1024,), 2.0))
    again = persist_memory(root)  # whole now: nothing to do
    assert not again["copied"] and "already" in again["why"], again


def test_persist_memory_refuses_a_multi_rank_step_the_root_holds_damaged(tmp_path: Path) -> None:
    """Two ranks on one node saved steps 1..3 to the memory tier and the root; the root's shard of
    rank 1 of step 3 is then cut short. A drain's parts cannot replace a committed step: the
    command says the step cannot be restored there and keeps the memory copies (exit 1), and gc
    keeps them too."""
    from nebula_ckpt.cli import main
    from tests.dist.launch import run_ranks

    root, shm, out = str(tmp_path / "root"), tmp_path / "shm", tmp_path / "out"
    out.mkdir()
    worker = str(REPO / "tests" / "tiers" / "memory" / "dist" / "drain_worker.py")
    done = run_ranks(2, worker, ["save", root, str(out), str(shm), "0,0", "0", "1", "3"], out, str(shm), timeout=200)
    assert all(p.returncode == 0 for p in done), [p.stdout[-2000:] for p in done]
    _damage(next(Path(root, "step-3").glob("shard-*-r1.*")), "truncate")
    with knobs.override(shm_dir=str(shm / "n0")):
        with pytest.raises(NebulaError, match=r"step 3 .*cannot be restored there.*memory copies are kept"):
            persist_memory(root)
        assert main(["persist-memory", root]) == 1
        assert main(["gc", root]) == 0
    assert list(shm.glob("n0/nebula_ckpt-*/*/step-3/COMMIT")), "the memory copies of step 3 are kept"


@pytest.mark.parametrize("damage", ["referenced last byte flipped", "shard truncated", "COMMIT deleted"])
def test_persist_memory_of_a_chain_whose_base_is_damaged_writes_nothing(tmp_path, shm_dir, damage: str) -> None:  # noqa: ANN001
    """(The chain and its damage are those of tests/incremental/test_chain_edges.py.)"""
    root = str(tmp_path / "ck")
    frozen, train = chain_frozen(), torch.zeros(64)
    with knobs.override(incremental_full_every=10), \
            nc.Checkpointer(root, tiers=[nc.MemoryTier(keep_last=20)]) as ck:  # type: ignore[arg-type]
        folder = chain_mem_folder(ck)
        for step in range(3):
            train += 1
            ck.save(step, chain_state(frozen, train, step))
    CHAIN_DAMAGE[damage](os.path.join(folder, "step-0"))
    with pytest.raises(nc.NebulaError) as e:
        persist_memory(root)
    assert "step 0" in str(e.value) or "step-0" in str(e.value), str(e.value)
    assert not os.path.isdir(root) or not any(n.startswith("step-") for n in os.listdir(root)), os.listdir(root)
