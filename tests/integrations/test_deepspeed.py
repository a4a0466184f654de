"""DeepSpeed's own ``save_checkpoint`` / ``load_checkpoint`` through :mod:`nebula_ckpt.integrations.deepspeed`.

Real DeepSpeed (one rank, gloo, CPU), each job in a subprocess (``ds_worker.py``) so DeepSpeed's
process-wide state (its communication backend, accelerator, logging) never reaches other tests:

* ZeRO stages 0, 1, 2 and 3: a checkpoint saved by one engine and loaded into a fresh one (other
  seed) restores the model, the optimizer (ZeRO's fp32 partitions and the base optimizer's state),
  the LR scheduler, the step counters and the client state bit for bit, from the memory tier; the
  next step's loss is the same; the tag folders hold pointer files, ``latest`` is DeepSpeed's own;
  ``materialize`` turns a tag back into ``torch.save`` files DeepSpeed's stock loader reads. The
  same with two ranks (ZeRO-2): each restores its own partition from its own memory tier.
* The engine's edges without DeepSpeed's engine (pointers, files outside a tag folder, plain
  ``torch.save`` files, retention, bad tags), and the example script (save, SIGKILL, resume).
* A training process SIGKILLed right after a checkpoint and resumed in a new process with
  ``load_checkpoint`` computes the same per-step losses (float.hex) as an uninterrupted run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
from typing import Any, Optional

import pytest

import warm_python

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "ds_worker.py")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                       reason="deepspeed is not installed (pip install 'nebula_ckpt[deepspeed]', DS_BUILD_OPS=0)"),
]


_STARTED: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def _reap() -> Any:
    """No worker outlives its test (a rank left waiting for a failed peer, a test timed out)."""
    yield
    while _STARTED:
        p = _STARTED.pop()
        if p.poll() is None:
            p.kill()
            p.wait()


def _env(shm_dir: str, rank_env: Optional[dict[str, str]] = None) -> dict[str, str]:
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(HERE)), os.environ.get("PYTHONPATH", "")]))
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)  # the worker is rank 0 of 1 unless told otherwise
    env.update(rank_env or {})
    return env


def _start(args: list[Any], shm_dir: str, rank_env: Optional[dict[str, str]] = None) -> subprocess.Popen[str]:
    p = warm_python.popen([sys.executable, WORKER, *map(str, args)], env=_env(shm_dir, rank_env),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _STARTED.append(p)
    return p


def _finish(proc: subprocess.Popen[str], timeout: float = 90) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"DeepSpeed worker timed out:\n{out[-4000:]}")
    return proc.returncode, out


def _run(args: list[Any], shm_dir: str) -> None:
    rc, out = _finish(_start(args, shm_dir))
    assert rc == 0, f"worker {args[0]} failed (rc {rc}):\n{out[-6000:]}"


@pytest.mark.timeout(90)
def test_engine_contract(tmp_path, shm_dir) -> None:  # noqa: ANN001
    """Pointers, parts of a tag, files outside a tag folder, plain torch.save files, retention, a lost
    save_dir (restore_pointers), bad input."""
    out = tmp_path / "units.json"
    _run(["units", 0, tmp_path / "root", tmp_path / "ds", out], shm_dir)
    r = json.loads(out.read_text())
    assert r["pointer"] == [True, "a", "m.pt", 0]
    assert r["nested_key"] == "sub/z.pt"
    assert r["outside_is_torch_save"] is True  # save_16bit_model's files stay torch.save files
    assert r["load"] == [True, 1] and r["load_again"] is True
    assert r["torch_save_file"] is True
    assert r["steps"] == [1]
    assert r["find_roots"] == [[os.path.realpath(tmp_path / "root")]] * 2  # nebula-ckpt ls <save_dir> finds it
    assert r["tag_folders"] == ["b"]  # keep_last=1 dropped "a": its tag folder went with it
    assert r["default_keeps"] == [[0, 1, 2, 3, 4], ["k1", "k2", "k3", "k4", "k5"]]
    assert "no longer held" in r["retention"] and "'b'" in r["retention"]
    assert r["restore_pointers"] == "b" and r["latest"] == "b" and r["after_restore"] is True
    assert "has space" in r["errors"]["bad_tag"]
    assert "root itself" in r["errors"]["root_is_save_dir"]


@pytest.mark.timeout(110)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_save_load_bit_exact(tmp_path, shm_dir, stage: int) -> None:  # noqa: ANN001
    save_dir = tmp_path / "ds"
    out = tmp_path / "roundtrip.json"
    _run(["roundtrip", stage, tmp_path / "root", save_dir, out], shm_dir)
    r = json.loads(out.read_text())
    assert r["optimizer_type"] == ["AdamW", "DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer",
                                   "DeepSpeedZeroOptimizer_Stage3"][stage]
    assert r["tag"] == "global_step5" and r["tags"] == {"first": 3, "global_step5": 5}
    model = ("zero_pp_rank_0_" if stage == 3 else "") + "mp_rank_00_model_states.pt"  # ZeRO-3: partitioned
    parts = [model] + ([] if stage == 0 else ["zero_pp_rank_0_mp_rank_00_optim_states.pt"])
    assert r["pointers"] == {f"{tag}/{p}": p for tag in ("first", "global_step5") for p in parts}
    assert r["load_path"] == str(save_dir / "global_step5" / model)
    assert r["differed_before"] > 0  # the fresh engine really started elsewhere
    assert r["mismatches"] == []
    assert r["client_ok"] is True
    assert r["restored_from"]["step"] == 5 and r["restored_from"]["tier"].startswith("memory:")
    assert r["next_loss"][0] == r["next_loss"][1]
    assert r["materialized"] == [f"first/{p}" for p in parts] and r["real"] == [3]
    assert r["fp32_mismatch"] == ([] if stage > 0 else "not run")  # zero_to_fp32 reads the pointer files


@pytest.mark.timeout(60)
def test_a_tag_saved_again_keeps_one_copy_as_stock(tmp_path, shm_dir) -> None:  # noqa: ANN001
    """``save_checkpoint(dir, tag="last")`` again and again: stock DeepSpeed overwrites ``dir/last``,
    and the engine keeps one step per tag too (the older ones removed once the newer is durable),
    not one full checkpoint per save; the tag loads the newest, bit for bit."""
    out = tmp_path / "same_tag.json"
    _run(["same_tag", 1, tmp_path / "root", tmp_path / "ds", out], shm_dir)
    r = json.loads(out.read_text())
    assert r["nebula"] == r["stock"]  # the same files in the tag folder, `latest` the same
    assert sorted(r["steps"].values()) == ["keep", "last"]  # one step per tag, the other tag untouched
    newest = max(int(s) for s, t in r["steps"].items() if t == "last")
    disk = next(v for t, v in r["per_tier"].items() if t.startswith("local:"))
    assert disk == sorted(int(s) for s in r["steps"]) and newest in disk
    assert r["load"] == [3, []]  # the last save's client state, every tensor bit-exact
    after = r["after_resume"]  # a later process saving the tag again removes the step an earlier one saved
    assert sorted(after.values()) == ["keep", "last"] and max(int(s) for s in after) > newest


@pytest.mark.timeout(200)
def test_a_tag_saved_again_on_two_ranks_keeps_one_copy_as_stock(tmp_path, shm_dir) -> None:  # noqa: ANN001
    """The same on two gloo ranks (ZeRO-2: each rank saves its partition): every rank's tag folder
    holds what stock DeepSpeed's does, the tag loads the newest save bit for bit on each rank, and
    once the job is over the root and the memory tiers keep one step per tag, the later process's."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [_start(["same_tag", 2, tmp_path / "root", tmp_path / "ds", tmp_path / f"r{r}.json"], shm_dir,
                    dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                         LOCAL_WORLD_SIZE="2")) for r in range(2)]
    results = [_finish(p, timeout=180) for p in procs]
    for r, (rc, out) in enumerate(results):
        assert rc == 0, f"rank {r} failed (rc {rc}):\n{out[-6000:]}"
    for r in range(2):
        res = json.loads((tmp_path / f"r{r}.json").read_text())
        assert res["nebula"] == res["stock"], r
        # the shared tier's older steps are the coordinator's to remove: another rank may still list one
        newest = max(int(s) for s, t in res["steps"].items() if t == "last")
        mem = [v for t, v in res["per_tier"].items() if t.startswith("memory:")]
        assert mem == [[newest]], (r, res["per_tier"])  # each rank's own tier: the newest only
        assert res["load"] == [3, []], r
    steps = sorted(p.name for p in (tmp_path / "root").iterdir() if p.name.startswith("step-"))
    later = max(int(s) for s in json.loads((tmp_path / "r0.json").read_text())["after_resume"])
    assert steps == ["step-0", f"step-{later}"]  # "keep", and the later process's "last" alone


@pytest.mark.timeout(300)
def test_zero2_two_ranks_each_restores_its_partition(tmp_path, shm_dir) -> None:  # noqa: ANN001
    """Two gloo ranks: each rank's checkpoint holds its ZeRO partition and the model states (stored
    once on the shared root), and each restores bit-exact from its own memory tier. DeepSpeed's
    ``zero_to_fp32`` reads every rank's partition: refused on the pointer files, naming
    ``materialize``; on the materialized files it gives the saved weights."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [_start(["roundtrip", 2, tmp_path / "root", tmp_path / "ds", tmp_path / f"r{r}.json"], shm_dir,
                    dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                         LOCAL_WORLD_SIZE="2")) for r in range(2)]
    results = [_finish(p, timeout=240) for p in procs]  # a hang guard (2 ranks, 2 engines each, busy cores)
    for r, (rc, out) in enumerate(results):
        assert rc == 0, f"rank {r} failed (rc {rc}):\n{out[-6000:]}"
    for r in range(2):
        res = json.loads((tmp_path / f"r{r}.json").read_text())
        zero = [f"zero_pp_rank_{i}_mp_rank_00_optim_states.pt" for i in range(2)]
        assert sorted(res["pointers"].values()) == sorted(["mp_rank_00_model_states.pt"] * 2 + zero * 2)
        assert res["mismatches"] == [] and res["client_ok"] is True
        assert res["restored_from"]["step"] == 5 and res["restored_from"]["tier"].startswith("memory:")
        assert res["next_loss"][0] == res["next_loss"][1]
        assert res["materialized"] == ["first/mp_rank_00_model_states.pt", f"first/{zero[r]}"]
        # zero_to_fp32 in a rank reads every rank's partition: refused naming the fix (a torch.load
        # of a pointer file reads alone), then, materialized on every rank, it reads them all
        assert res["fp32_refused"].startswith("NotFoundError: "), res["fp32_refused"]
        assert "materialize(save_dir, tag) on every rank" in res["fp32_refused"]
        assert res["fp32_first"] == []


@pytest.mark.timeout(150)
@pytest.mark.parametrize("where", ["0", "memory"])
def test_a_pointer_read_on_one_rank_never_waits_for_the_other_ranks(tmp_path, shm_dir, where: str) -> None:  # noqa: ANN001
    """DeepSpeed ``torch.load``-s on one rank or on all, as it likes (ZeRO-3's ``load_checkpoint``
    without optimizer states runs ``zero_to_fp32`` on every rank; ``zero_to_fp32.py`` runs in one
    process): a ``torch.load`` of a pointer file of a multi-rank save, on rank 0 alone, in the job
    and after it, is refused at once naming the file and the fix, never a wait for rank 1. The
    same refusal (``NotFoundError``, never "damaged") when the save is on the ranks' memory tiers
    only (``where="memory"``: each holds its own rank's part, as while the disk write goes on)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [_start(["pointer_alone", where, tmp_path / "root", tmp_path / "ds", tmp_path / f"r{r}.json"], shm_dir,
                    dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                         LOCAL_WORLD_SIZE="2")) for r in range(2)]
    results = [_finish(p, timeout=120) for p in procs]
    for r, (rc, out) in enumerate(results):
        assert rc == 0, f"rank {r} failed (rc {rc}):\n{out[-6000:]}"
    res = json.loads((tmp_path / "r0.json").read_text())
    pointer = str(tmp_path / "ds" / "t" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    for when in ("in_job", "alone"):
        assert res.get(when, "").startswith("NotFoundError: "), (when, res)
        assert pointer in res[when] and "materialize(save_dir, tag) on every rank" in res[when], (when, res)
    # a refusal of another kind is not taken for a save by several ranks
    assert res["bad_tag"].startswith("ValidationError: ") and "'bad tag'" in res["bad_tag"], res
    assert "several ranks" not in res["bad_tag"] and "materialize" not in res["bad_tag"], res


def _losses(path: str) -> tuple[dict[int, str], list[dict[str, Any]]]:
    recs = [json.loads(line) for line in open(path)]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}, recs


@pytest.mark.crash
@pytest.mark.timeout(120)
def test_sigkill_then_resume_gives_identical_losses(tmp_path, shm_dir) -> None:  # noqa: ANN001
    """ZeRO-2, dropout, warm-up LR: checkpoints every 3 steps, SIGKILL right after the one of step 6
    returned (the disk tier may still be writing it), resume in a new process: steps 7-10 give the
    losses of an uninterrupted run, bit for bit."""
    steps, every, kill_at = 10, 3, 6
    ref_out, run_out = str(tmp_path / "ref.jsonl"), str(tmp_path / "run.jsonl")
    ref = _start(["train", 2, tmp_path / "ref_root", tmp_path / "ref_ds", ref_out, steps, every], shm_dir)
    crash = _start(["train", 2, tmp_path / "root", tmp_path / "ds", run_out, steps, every, kill_at], shm_dir)
    rc, out = _finish(crash)
    assert rc == -signal.SIGKILL, f"the training process was not killed (rc {rc}):\n{out[-6000:]}"
    before, recs = _losses(run_out)
    assert max(before) == kill_at and {"saved": kill_at} in recs
    assert (tmp_path / "ds" / "latest").read_text().strip() == f"global_step{kill_at}"

    _run(["train", 2, tmp_path / "root", tmp_path / "ds", run_out, steps, every, -1, "resume"], shm_dir)
    rc, out = _finish(ref)
    assert rc == 0, f"reference run failed:\n{out[-6000:]}"
    reference, _ = _losses(ref_out)
    after, recs = _losses(run_out)
    resumed = [r for r in recs if "resumed" in r]
    assert len(resumed) == 1 and resumed[0]["resumed"] == kill_at, recs
    assert resumed[0]["tier"]["step"] == kill_at and resumed[0]["tier"]["tier"].startswith("memory:"), recs
    assert sorted(reference) == list(range(1, steps + 1))
    assert {s: before[s] for s in range(1, kill_at + 1)} == {s: reference[s] for s in range(1, kill_at + 1)}
    # the records after the resume line are the resumed run's
    resumed_losses = {r["step"]: r["loss"] for r in recs[recs.index(resumed[0]) + 1:] if "loss" in r}
    assert resumed_losses == {s: reference[s] for s in range(kill_at + 1, steps + 1)}


@pytest.mark.crash
@pytest.mark.timeout(150)
@pytest.mark.parametrize("how", ["cp"])  # "mv": the same pointers, tests/integrations/test_lightning.py
def test_run_folder_moved_or_copied_resumes_identical(tmp_path, shm_dir, how: str) -> None:  # noqa: ANN001
    """A run folder holding the nebula_ckpt root and DeepSpeed's save folder, SIGKILLed right after
    the checkpoint of step 6 is durable, then moved (``mv``) or copied (``cp -r``): DeepSpeed's
    ``load_checkpoint`` in the new place reads the root beside it (the pointers name it relative to
    themselves) and steps 7-10 give an uninterrupted run's losses, bit for bit."""
    import shutil

    steps, every, kill_at = 10, 3, 6
    ref_out = str(tmp_path / "ref.jsonl")
    ref = _start(["train", 2, tmp_path / "ref_root", tmp_path / "ref_ds", ref_out, steps, every], shm_dir)
    old, new = tmp_path / "run", tmp_path / "elsewhere" / "run2"
    rc, out = _finish(_start(["train", 2, old / "root", old / "ds", tmp_path / "crash.jsonl", steps, every, kill_at,
                              "-", "durable_all"], shm_dir))
    assert rc == -signal.SIGKILL, f"the training process was not killed (rc {rc}):\n{out[-6000:]}"
    new.parent.mkdir()
    if how == "mv":
        shutil.move(str(old), str(new))
    else:
        shutil.copytree(str(old), str(new), symlinks=True)
    run_out = str(tmp_path / "resume.jsonl")
    _run(["train", 2, new / "root", new / "ds", run_out, steps, every, -1, "resume"], shm_dir)
    rc, out = _finish(ref)
    assert rc == 0, f"reference run failed:\n{out[-6000:]}"
    reference, _ = _losses(ref_out)
    after, recs = _losses(run_out)
    resumed = [r for r in recs if "resumed" in r]
    assert len(resumed) == 1 and resumed[0]["resumed"] == kill_at, recs
    assert resumed[0]["tier"]["tier"] == f"local:{os.path.realpath(new / 'root')}", resumed
    assert after == {s: reference[s] for s in range(kill_at + 1, steps + 1)}
    if how == "cp":  # the original is untouched
        assert (old / "ds" / "latest").read_text().strip() == f"global_step{kill_at}"


@pytest.mark.timeout(110)
def test_example_trains_saves_and_resumes(tmp_path, shm_dir) -> None:  # noqa: ANN001
    example = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "deepspeed_train.py")
    args = ["--save-dir", tmp_path / "ds", "--root", tmp_path / "root", "--every", "5"]

    def run(*extra: Any) -> str:
        proc = warm_python.run([sys.executable, example, *map(str, args + list(extra))], env=_env(shm_dir), text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=100)
        assert proc.returncode in (0, -signal.SIGKILL), proc.stdout[-6000:]
        return proc.stdout

    assert "rank 0: fresh start" in run("--steps", 10)
    out = run("--steps", 20, "--crash-at", 16)  # saves step 15, killed after step 16
    assert "resumed from step 10 (local:" in out and "step 15 loss" in out and "SIGKILL after step 16" in out
    out = run("--steps", 20)
    assert "resumed from step 15 (memory:" in out and "done at step 20" in out
    assert (tmp_path / "ds" / "latest").read_text() == "global_step20"
