"""Multi-rank checkpoints on real torch.distributed ranks (gloo on 127.0.0.1, spawned processes).

Each test launches a job of N ranks of ``rank_worker.py`` (as torchrun would: env://), which
trains a tiny model with AdamW (DDP replicated, or FSDP2 ``fully_shard`` on CPU), saves steps
1..3 through ``nebula_ckpt.Checkpointer(root)`` and reports digests of its state; a second job
restores and reports what it got. Every comparison is bit-exact.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from memory_paths import memory_tier_path
from nebula_ckpt import knobs
from nebula_ckpt.format.names import COMMIT, MANIFEST, SPLIT_VERSION, step_dir
from records_view import flat_manifest

from .launch import reports, run_ranks

pytestmark = [pytest.mark.timeout(240)]


def _job(world: int, scenario: str, root: str, out: Path, shm_dir: str, **env: str) -> list[dict[str, Any]]:
    done = run_ranks(world, "rank_worker.py", [scenario, root, str(out)], out, shm_dir, env_extra=env)
    for r, p in enumerate(done):
        expect_dead = scenario == "kill" and r == world - 1
        assert (p.returncode == -9) if expect_dead else (p.returncode == 0), f"rank {r}:\n{p.stdout[-4000:]}"
    return [] if scenario == "kill" else reports(out, scenario, world)


def _manifest(root: str, step: int) -> dict[str, Any]:
    return flat_manifest(Path(root, step_dir(step)))


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_ranks_write_each_byte_once_and_restore_bit_exact(world: int, root: str, shm_dir: str,
                                                             job_dir: Path) -> None:
    # every replica of this small model is under 64 KiB: spread them all, as large ones are
    saved = _job(world, "ddp_save", root, job_dir, shm_dir, TEST_SMALL_REPLICA_BYTES="0")
    man = _manifest(root, 3)
    ranks = list(range(world))
    assert man["version"] == SPLIT_VERSION and man["world_size"] == world and man["ranks"] == ranks
    assert len(man["tree"]["v"]) == 1 and man["rank_tree"] == {str(r): 0 for r in ranks}  # one tree for all
    shards = sorted(n for n in os.listdir(Path(root, "step-3")) if n.startswith("shard-"))
    assert shards == [f"shard-g1-r{r}.safetensors" for r in ranks]
    # replicated state is stored once: every key is an alias or stored by one rank only
    stored = {k.split("/", 1)[1] for k in man["tensors"] if not k.endswith("/mine")}
    assert len(stored) == len(man["tensors"]) - world                           # no replica twice
    assert all(a.startswith(tuple(f"r{r}/" for r in ranks)) for a in man["aliases"])
    for r in ranks:                                                             # spread over ranks
        assert [k for k in man["tensors"] if k.startswith(f"r{r}/") and not k.endswith("/mine")], r
    sizes = [s["bytes"] for s in man["shards"]]
    assert max(sizes) < 2.0 * min(sizes), sizes                                 # balanced
    assert all(saved[r]["digest3"] == saved[0]["digest3"] for r in ranks)      # DDP: replicated
    assert all(f"r{r}/mine" in man["tensors"] for r in ranks)                  # differs: all stored
    loaded = _job(world, "ddp_load", root, job_dir, shm_dir)
    for r in ranks:
        assert loaded[r]["step"] == 3 and loaded[r]["saved_step"] == 3
        assert loaded[r]["digest"] == saved[r]["digest3"] and loaded[r]["mine"] == [float(r)] * 3


def test_incremental_chain_each_rank_writes_only_its_changed_share(root: str, shm_dir: str, job_dir: Path) -> None:
    """Two ranks save steps 1..4 of a DDP model with a large frozen parameter and a per-rank
    tensor that never changes: step 1 is full, steps 2..4 write only what changed and refer to
    step 1's shards (each rank for its own share); a new job restores step 4 bit-exact."""
    saved = _job(2, "frozen_save", root, job_dir, shm_dir, TEST_MEMORY_TIER="0")
    full = _manifest(root, 1)
    assert all("step" not in s for s in full["shards"]) and len(full["sha256"]) == len(full["tensors"])
    for step in (2, 3, 4):
        man = _manifest(root, step)
        own, refs = man["shards"][:2], man["shards"][2:]
        assert [s["file"] for s in own] == ["shard-g1-r0.safetensors", "shard-g1-r1.safetensors"]
        assert sorted((s["step"], s["file"]) for s in refs) == [(1, "shard-g1-r0.safetensors"),
                                                               (1, "shard-g1-r1.safetensors")], refs
        for r in range(2):  # each rank's own "still" lies in its step-1 shard
            rec = man["tensors"][f"r{r}/still"]
            assert man["shards"][rec["shard"]] == dict(full["shards"][r], step=1)
    for r in range(2):
        written = [next(iter(w.values())) for w in saved[r]["written_bytes"]]
        assert all(n < written[0] / 2 for n in written[1:]), written
    loaded = _job(2, "frozen_load", root, job_dir, shm_dir, TEST_MEMORY_TIER="0")
    for r in range(2):
        assert loaded[r]["step"] == 4 and loaded[r]["digest"] == saved[r]["digest4"]
        assert loaded[r]["still"] == [float(r)] * 8192 and loaded[r]["mine"] == [float(r)] * 3


def test_fsdp2_four_ranks_round_trip_with_their_own_shards(root: str, shm_dir: str, job_dir: Path) -> None:
    saved = _job(4, "fsdp_save", root, job_dir, shm_dir)
    man = _manifest(root, 3)
    steps = [k for k in man["tensors"] if k.endswith("/step")]
    assert steps and all(k.startswith("r0/") for k in steps)    # small replicas: rank 0 writes them
    rec = man["tensors"]["r2/model/0.weight"]
    assert rec["dtensor"] == {"shape": [32, 16], "offsets": [16, 0], "placements": ["S(0)"], "mesh": [4]}
    assert rec["shape"] == [8, 16] and rec["shard"] == 2
    assert saved[0]["digest3"] != saved[1]["digest3"]                           # sharded: differ
    loaded = _job(4, "fsdp_load", root, job_dir, shm_dir)
    for r in range(4):
        assert loaded[r]["step"] == 3 and loaded[r]["digest"] == saved[r]["digest3"], f"rank {r}"
    # The same checkpoint into 2 ranks, through load_latest: resharded by DCP's planner. Rank q
    # of 2 holds the rows of ranks 2q and 2q+1 of 4 (every dim-0 shard here splits evenly).
    two = _job(2, "fsdp_load", root, job_dir, shm_dir)
    for q in range(2):
        assert two[q]["step"] == 3 and two[q]["saved_step"] == 3
        assert set(two[q]["digest"]) == set(saved[0]["digest3"])
        for k, got in two[q]["digest"].items():
            a, b = saved[2 * q]["digest3"][k], saved[2 * q + 1]["digest3"][k]
            assert got == (a if a == b and len(a) == 1 else a + b), (q, k)   # "step" counts: replicated


def test_a_rank_killed_during_a_save_means_no_commit(root: str, shm_dir: str, job_dir: Path) -> None:
    _job(2, "kill", root, job_dir, shm_dir, TEST_MEMORY_TIER="0")
    survivor = json.loads((job_dir / "kill-r0.json").read_text())
    assert survivor["step3"].startswith("PersistError") and "step 3" in survivor["step3"]
    assert not Path(root, "step-3", COMMIT).exists() and not Path(root, "step-3", MANIFEST).exists()
    assert survivor["list"] == {f"local:{root}": [1, 2]}
    loaded = _job(2, "load", root, job_dir, shm_dir, TEST_MEMORY_TIER="0")
    for r in range(2):
        assert loaded[r]["step"] == 2 and loaded[r]["restored_from"]["tier"] == f"local:{root}"
        assert loaded[r]["digest"] == survivor["digest2"]                        # DDP: the same on every rank


def test_a_rank_lost_between_saves_is_named_with_the_step(root: str, shm_dir: str, job_dir: Path) -> None:
    """A rank lost after step 3: the survivor's step 4 fails naming step 4 (not the save's index,
    3) and the rank lost with its host, which gloo's closed connection tells."""
    done = run_ranks(2, "lost_rank_worker.py", [root, str(job_dir)], job_dir, shm_dir,
                     env_extra={"NEBULA_COMMIT_TIMEOUT_S": "60"})
    assert done[1].returncode == -9 and done[0].returncode == 0, done[0].stdout[-4000:]
    got = json.loads((job_dir / "lost-r0.json").read_text())["step4"]
    assert "step 4 was not committed there: rank 1 (host " in got and "died or left" in got, got
    assert "save 3" not in got, got
    assert not Path(root, "step-4", COMMIT).exists()


def test_restart_agrees_on_a_step_every_rank_has(root: str, shm_dir: str, job_dir: Path) -> None:
    """The killed job left step 3 in each rank's memory tier (memory commits first, per rank)
    but not on the shared root. A restart restores step 3 from memory on every rank; once one
    rank's memory tier has lost it, every rank agrees on step 2 instead."""
    _job(2, "kill", root, job_dir, shm_dir)
    survivor = json.loads((job_dir / "kill-r0.json").read_text())
    assert not Path(root, "step-3", COMMIT).exists()
    with knobs.override(shm_dir=shm_dir):
        mems = [memory_tier_path(root, r) for r in range(2)]
    assert all(Path(m, "step-3", COMMIT).exists() for m in mems)
    backup = Path(job_dir, "mem1-step-3")
    shutil.copytree(Path(mems[1], "step-3"), backup)
    loaded = _job(2, "load", root, job_dir, shm_dir)
    for r in range(2):
        assert loaded[r]["step"] == 3 and loaded[r]["restored_from"]["tier"].startswith("memory:")
        assert loaded[r]["digest"] == survivor["digest3"]
    # rank 1's memory tier loses step 3 (a rebooted node): rank 0 alone still has it
    shutil.rmtree(Path(mems[1], "step-3"), ignore_errors=True)
    assert Path(mems[0], "step-3", COMMIT).exists()
    loaded = _job(2, "load", root, job_dir, shm_dir)
    for r in range(2):
        assert loaded[r]["step"] == 2 and loaded[r]["digest"] == survivor["digest2"], loaded[r]["restored_from"]


def test_ranks_that_save_a_different_number_of_times_get_a_clear_error(root: str, shm_dir: str,
                                                                       job_dir: Path) -> None:
    got = _job(2, "mismatch", root, job_dir, shm_dir, TEST_MEMORY_TIER="0", NEBULA_COMMIT_TIMEOUT_S="60")
    assert got[1] == dict(got[1], step1="committed", step2="committed")
    assert got[0]["step1"] == got[0]["step2"] == "committed"
    assert "closed their Checkpointer after 2 save(s)" in got[0]["step3"], got[0]["step3"]
    assert "died" not in got[0]["step3"], got[0]["step3"]  # no rank died: the message names the calls that differ
    assert got[0]["list"] == {f"local:{root}": [1, 2]}


def test_a_root_that_is_not_shared_between_ranks_is_refused(root: str, shm_dir: str, job_dir: Path) -> None:
    got = _job(2, "split_root", root, job_dir, shm_dir)
    for r in range(2):
        assert got[r]["error"] and "is not the same place for every rank" in got[r]["error"]
        assert not Path(f"{root}-node{r}", "step-0").exists()


def test_fsdp2_state_dicts_from_get_state_dict_round_trip_and_reshard(root: str, shm_dir: str,
                                                                      job_dir: Path) -> None:
    """The DCP-style path: save get_state_dict(model, opt), restore into get_state_dict templates
    and set_state_dict, on the same 2 ranks and (resharded) on 4."""
    saved = _job(2, "sdict_write", root, job_dir, shm_dir)
    assert saved[0]["full"] == saved[1]["full"]
    man = _manifest(root, 1)
    assert any("dtensor" in rec for rec in man["tensors"].values())
    for world in (2, 4):
        got = _job(world, "sdict_read", root, job_dir, shm_dir)
        for r in range(world):
            assert got[r]["step"] == 1 and got[r]["full"] == saved[0]["full"], (world, r)
