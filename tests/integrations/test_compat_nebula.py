"""Azure ML Nebula's ``torch_nebula`` API on nebula_ckpt (issue #13, "Moving from Azure ML Nebula").

Written from Nebula's documentation ("Boost checkpoint speed and reduce cost with Nebula", Azure
ML; DeepSpeed's NebulaCheckpointEngine, which calls ``torch_nebula``), its samples adapted to a
temporary root: ``init``, ``Checkpoint(tag, num_of_files).save(name, obj)`` / ``commit()``,
``get_latest_checkpoint().load(name)``, ``list_checkpoints``, ``get_checkpoint(tag=...)``,
retention, the checkpoint histories; the errors; a SIGKILL after commit, resumed in a new process.
"""

from __future__ import annotations

import copy
import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

import nebula_ckpt as nc
import nebula_ckpt.compat.torch_nebula as tn
import warm_python
from nebula_ckpt.adapters import check_tag
from nebula_ckpt.compat import install_aliases
from proc_lines import lines

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parents[1] / "examples" / "nebula_compat.py"


@pytest.fixture(autouse=True)
def _finish() -> Iterator[None]:
    yield
    tn.shutdown()


def _training(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(i))
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _assert_same_state(a: object, b: object) -> None:
    """Bit-exact equality of nested state dicts (tensors by bytes, dtype and shape)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and _bits(a) == _bits(b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            _assert_same_state(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same_state(x, y)
    else:
        assert a == b


def test_documented_usage_save_commit_and_load_latest(root: str) -> None:
    """The PyTorch sample: init, Checkpoint(tag, n).save(...) / commit(), get_latest_checkpoint().load()."""
    tn.init(persistent_storage_path=root, persistent_time_interval=2, num_of_version_in_retention=2)
    model, opt = _training()
    for i in range(3):
        _step(model, opt, i)
    ckpt = tn.Checkpoint("global_step500", 2)
    ckpt.save("model", model)
    ckpt.save("optimizer", opt)               # the 2nd of 2 parts: committed here
    assert ckpt.committed and ckpt.tag == "global_step500"
    assert ckpt.commit() is True              # what Nebula scripts call next: confirms it
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    _step(model, opt, 99)                     # training goes on; the checkpoint keeps the committed state

    latest = tn.get_latest_checkpoint()
    assert latest is not None and latest.tag == "global_step500" and latest.step == ckpt.step
    model2, opt2 = _training(seed=1)
    model2.load_state_dict(latest.load("model"))
    opt2.load_state_dict(latest.load("optimizer", map_location="cpu"))
    _assert_same_state(model2.state_dict(), saved_model)
    _assert_same_state(opt2.state_dict(), saved_opt)

    # the docs' one-part form: Checkpoint('global_step1000') + save() commits (num_of_files defaults to 1)
    tn.Checkpoint("global_step1000").save("model", model)
    assert tn.get_latest_checkpoint().tag == "global_step1000"  # type: ignore[union-attr]
    _assert_same_state(tn.get_latest_checkpoint().load("model"), model.state_dict())  # type: ignore[union-attr]
    # untagged (the older docs' `tn.Checkpoint()`): named by its step
    c = tn.Checkpoint()
    c.save("extra", {"lr": 0.5, "t": torch.arange(3)})
    assert c.tag == f"step-{c.step}"

    listed = tn.list_checkpoints()
    json.dumps(listed)                        # DeepSpeed's test json.dumps it
    assert [e["tag"] for e in listed][-2:] == ["global_step1000", c.tag]
    got = tn.get_checkpoint(tag="global_step500")
    assert got.step == ckpt.step
    _assert_same_state(got.load("model"), saved_model)
    assert tn.get_checkpoint(tag=c.tag).load("extra")["lr"] == 0.5  # type: ignore[index]

    # a new session (as a restarted process) finds by tag what reached the persistent tier: the
    # first commit, and the newest (shutdown puts it there); global_step1000 came inside the 2 s
    # interval and lived in memory only, which a clean shutdown frees
    tn.shutdown()
    tn.init(root)
    assert [e["tag"] for e in tn.list_checkpoints()] == ["global_step500", c.tag]
    assert tn.get_latest_checkpoint().tag == c.tag  # type: ignore[union-attr]
    _assert_same_state(tn.get_checkpoint(tag="global_step500").load("optimizer"), saved_opt)


def test_docs_sample_arguments_and_deepspeed_style(root: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The docs' `persistent_storage_path="/tmp/test",` (a 1-tuple), DeepSpeed's per-part
    `Checkpoint(tag, -2)` objects committed through another one, and `import torch_nebula`."""
    persistent_storage_path = root,          # sic, as the documentation writes it
    tn.init(persistent_storage_path, persistent_time_interval=2)
    assert tn.checkpointer().root == root
    for name in ("torch_nebula", "nebulaml"):
        monkeypatch.delitem(sys.modules, name, raising=False)  # taken back after the test
    install_aliases()
    import torch_nebula  # noqa: F401  (resolves to nebula_ckpt.compat.torch_nebula)

    assert sys.modules["torch_nebula"] is tn and sys.modules["nebulaml"] is tn
    install_aliases()                           # idempotent
    model, opt = _training()
    _step(model, opt, 0)
    tag = "global_step7"
    torch_nebula.Checkpoint(tag, -2).save("mp_rank_00_model_states.pt", {"module": model.state_dict()})
    torch_nebula.Checkpoint(tag, -2).save("zero_pp_rank_0_mp_rank_00_optim_states.pt", opt.state_dict())
    assert torch_nebula.Checkpoint(tag, -2).commit() is True
    found = torch_nebula.get_checkpoint(tag=tag, persist_path=root)
    _assert_same_state(found.load("mp_rank_00_model_states.pt")["module"], model.state_dict())
    latest = torch_nebula.get_latest_checkpoint(persist_path=root)
    assert latest.tag == tag
    assert torch_nebula.flush_persistence() is True
    # get_latest_checkpoint_path: a torch.load-able export of the part
    path = tn.get_latest_checkpoint_path("zero_pp_rank_0_mp_rank_00_optim_states.pt", root)
    assert path is not None
    _assert_same_state(torch.load(path, weights_only=True), opt.state_dict())
    # another run's root, through persist_path
    assert tn.get_latest_checkpoint(persist_path=str(tmp_path / "nothing-here")) is None


@pytest.mark.parametrize("part", ["checkpoint", "é" * 120], ids=["ascii_part", "multibyte_part"])
def test_longest_tag_gets_a_latest_checkpoint_path(root: str, part: str) -> None:
    """A valid 256-character tag (the longest check_tag allows; tags are ASCII), with an ASCII or a
    multi-byte part name: get_latest_checkpoint_path's file name stays within NAME_MAX (the tag
    and name hashed into it), and two long tags sharing a head get different files."""
    tn.init(persistent_storage_path=root)
    paths = []
    for i, tag in enumerate(("t" * 255 + "1", "t" * 255 + "2")):
        check_tag(tag)  # a valid tag
        c = tn.Checkpoint(tag, 1)
        c.save(part, {"w": torch.full((3,), float(i))})
        path = tn.get_latest_checkpoint_path(part)
        assert path is not None and len(os.path.basename(path).encode()) <= 255
        assert torch.equal(torch.load(path, weights_only=True)["w"], torch.full((3,), float(i)))
        paths.append(path)
    assert paths[0] != paths[1]


def test_latest_checkpoint_paths_of_different_tags_never_share_a_file(root: str) -> None:
    """Tags and part names that read the same once made file-name safe ("a/b" and "a_b") get
    different files: a path handed out earlier keeps its content."""
    tn.init(persistent_storage_path=root)
    got = []
    for i, tag in enumerate(("a/b", "a_b")):
        c = tn.Checkpoint(tag, 1)
        c.save("checkpoint", {"w": torch.full((2,), float(i))})
        got.append(tn.get_latest_checkpoint_path())
    assert got[0] != got[1]
    assert torch.equal(torch.load(got[0], weights_only=True)["w"], torch.zeros(2))


_FORK_CHILD = """
import os, sys, torch
import nebula_ckpt.compat.torch_nebula as tn
tn.init(persistent_storage_path=sys.argv[1])
tn.Checkpoint("global_step1", 1).save("model", torch.nn.Linear(4, 2))
path = tn.get_latest_checkpoint_path("model")
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a forked helper (an evaluator, a DataLoader worker) ending normally: atexit runs
os.waitpid(pid, 0)
torch.load(path, weights_only=True)  # what load_from_checkpoint(path) does: the file is still there
tn.shutdown()
print("gone after shutdown:", not os.path.exists(path))
"""


def test_a_forked_child_exiting_leaves_the_parents_exports_and_session_alone(root: str, shm_dir: str) -> None:
    """A plain ``os.fork()`` child that exits normally runs the atexit hooks it inherited: the
    session's must leave the parent's session alone (its exported files stay until the parent's
    ``shutdown()``, which removes them)."""
    p = warm_python.run([sys.executable, "-c", _FORK_CHILD, root], capture_output=True, text=True, timeout=120,
                        env={**os.environ, "NEBULA_SHM_DIR": shm_dir})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "gone after shutdown: True" in p.stdout, p.stdout


def test_retention_and_interval(root: str) -> None:
    """num_of_version_in_retention -> keep_last of both tiers; persistent_time_interval ->
    every_seconds of the persistent tier (a commit inside the interval stays in memory, and
    shutdown puts the newest on disk)."""
    tn.init(persistent_storage_path=root, persistent_time_interval=3600, num_of_version_in_retention=2)
    model, _ = _training()
    for i in range(1, 5):
        tn.Checkpoint(f"global_step{i}").save("model", model)
        tn.flush_persistence()                 # (back to back, a busy tier would drop the older one)
    listed = tn.list_checkpoints()
    by_tag = {e["tag"]: e["tiers"] for e in listed}
    assert list(by_tag) == ["global_step1", "global_step3", "global_step4"]
    # the first one persisted, and kept in memory too: the later memory-tier steps (incremental:
    # the model did not change) refer to its bytes
    assert [t.split(":")[0] for t in by_tag["global_step1"]] == ["memory", "local"]
    assert [t.split(":")[0] for t in by_tag["global_step4"]] == ["memory"]    # the rest: inside the interval
    hist = tn.checkpoint_histories()
    assert [len(h["tiers"]) for h in hist] == [2, 1, 1, 1]
    tn.shutdown()                              # newest put on the persistent tier
    with nc.Checkpointer(root, memory_tier=False) as ck:
        assert ck.tags() == {"global_step1": 1, "global_step4": 4}


def test_histories(root: str, tmp_path: Path) -> None:
    """checkpointHistories: duration, throughput, size per save; plus tag, parts and tiers."""
    tn.init(persistent_storage_path=root)
    model, opt = _training()
    _step(model, opt, 0)
    c = tn.Checkpoint("global_step1", 2)
    c.save("model", model)
    c.save("optimizer", opt)
    tn.flush_persistence()
    (h,) = tn.checkpoint_histories()
    assert tuple(h) == tn.HISTORY_FIELDS
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + \
        sum(t.numel() * t.element_size() for st in opt.state_dict()["state"].values() for t in st.values())
    assert h["tag"] == "global_step1" and h["step"] == c.step and h["parts"] == ["model", "optimizer"]
    assert h["size_bytes"] == size and h["status"] == "ok"
    assert 0 < h["blocking_seconds"] <= h["duration_seconds"]
    assert h["throughput_bytes_per_second"] == pytest.approx(size / h["duration_seconds"])
    assert sorted(t.split(":")[0] for t in h["tiers"]) == ["local", "memory"] and h["tiers_dropped"] == []
    rows = list(csv.DictReader(open(tn.write_checkpoint_histories(str(tmp_path / "checkpointHistories.csv")))))
    assert len(rows) == 1 and rows[0]["tag"] == "global_step1" and rows[0]["parts"] == "model;optimizer"
    assert float(rows[0]["duration_seconds"]) == h["duration_seconds"]


def test_init_reads_nebulas_environment_variables(root: str, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Nebula's environment variables, read by nebula_ckpt.compat.nebula.environment (they are not knobs)."""
    monkeypatch.setenv("NEBULA_PERSISTENT_STORAGE_PATH", root)
    monkeypatch.setenv("NEBULA_PERSISTENT_TIME_INTERVAL", "3600")
    monkeypatch.setenv("NEBULA_MEMORY_BUFFER_SIZE", "1048576")
    tn.init()
    ck = tn.checkpointer()
    assert os.path.realpath(ck.root) == os.path.realpath(root)
    assert [t.every_seconds for t in ck.tiers] == [None, 3600.0]  # the persistent tier's interval
    assert "NEBULA_MEMORY_BUFFER_SIZE is ignored" in caplog.text
    tn.shutdown()
    monkeypatch.delenv("NEBULA_MEMORY_BUFFER_SIZE")
    monkeypatch.setenv("NEBULA_PERSISTENT_TIME_INTERVAL", "0")
    tn.init()
    assert [t.every_seconds for t in tn.checkpointer().tiers] == [None, None]  # 0: every commit persists
    tn.shutdown()


def test_clear_errors(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    tn.shutdown()
    with pytest.raises(nc.NebulaError, match=r"call init\(persistent_storage_path=...\) first"):
        tn.Checkpoint("a")
    monkeypatch.delenv("NEBULA_PERSISTENT_STORAGE_PATH", raising=False)
    with pytest.raises(nc.ValidationError, match="persistent_storage_path is required"):
        tn.init()
    with pytest.raises(nc.ValidationError, match=r"unknown argument\(s\) \['enable_nebula_load'\]"):
        tn.init(root, enable_nebula_load=True)
    with pytest.raises(nc.ValidationError, match="num_of_version_in_retention must be an int >= 1"):
        tn.init(root, num_of_version_in_retention=0)
    with pytest.raises(nc.ValidationError, match="persistent_time_interval must be a number"):
        tn.init(root, persistent_time_interval="soon")
    tn.init(root)
    model, opt = _training()

    c = tn.Checkpoint("global_step1", 3)       # wrong num_of_files: only two parts are saved
    c.save("model", model)
    c.save("optimizer", opt)
    with pytest.raises(nc.ValidationError, match=r"2 of its num_of_files=3 parts \(\['model', 'optimizer'\]\)"):
        c.commit()
    assert not c.committed and tn.get_latest_checkpoint() is None
    with pytest.raises(nc.ValidationError, match="already being saved with num_of_files=3"):
        tn.Checkpoint("global_step1", 2)
    with pytest.raises(nc.NotFoundError, match="tagged 'global_step1'.*not committed: commit"):
        tn.get_checkpoint(tag="global_step1")
    c.save("scheduler", {"last_epoch": 1})    # the 3rd part: now it commits
    assert c.committed

    d = tn.Checkpoint("global_step2", -2)
    d.save("model", model)
    with pytest.raises(nc.ValidationError, match="part 'model' is already saved"):
        d.save("model", model)
    assert d.commit() is True
    with pytest.raises(nc.ValidationError, match="'global_step2' is already committed .*commit\\(\\) is called once"):
        d.commit()                             # commit twice
    with pytest.raises(nc.ValidationError, match="is committed .*parts cannot be added"):
        d.save("late", 1)
    assert c.commit() is True                  # confirming the self-committed one, once
    with pytest.raises(nc.ValidationError, match="already committed"):
        c.commit()
    with pytest.raises(nc.ValidationError, match="no part to commit"):
        tn.Checkpoint("empty", -2).commit()

    with pytest.raises(nc.NotFoundError, match=r"no committed checkpoint tagged 'nope'.*tags: \['global_step1', "
                                               r"'global_step2'\]"):
        tn.get_checkpoint(tag="nope")          # unknown tag
    with pytest.raises(nc.NotFoundError, match=r"has no part 'optim'; its parts: \['model'\]"):
        tn.get_checkpoint(tag="global_step2").load("optim")
    with pytest.raises(nc.ValidationError, match="tag"):
        tn.Checkpoint("has space")
    with pytest.raises(nc.ValidationError, match="tag"):
        tn.Checkpoint(500)                     # type: ignore[arg-type]  (tags are strings)
    with pytest.raises(nc.ValidationError, match="num_of_files must be"):
        tn.Checkpoint("x", 0)
    with pytest.raises(nc.ValidationError, match="not committed"):
        tn.Checkpoint("y", 2).load("model")
    with pytest.raises(tn.UnsupportedError, match="nebula_ckpt.integrations.lightning"):
        tn.NebulaCheckpointIO()
    with pytest.raises(NotImplementedError):
        tn.NebulaCallback(every_n_epochs=5)
    with pytest.raises(nc.ValidationError, match="state key 'args'.*allow_pickle=True"):
        tn.Checkpoint("global_step3").save("args", object())   # nothing is pickled unless allow_pickle=True
    assert not tn.Checkpoint("global_step3").committed       # nothing of the failed commit is left
    assert tn.get_latest_checkpoint().tag == "global_step2"  # type: ignore[union-attr]


def _env(shm_dir: str) -> dict[str, str]:
    return dict(os.environ, NEBULA_SHM_DIR=shm_dir,
                PYTHONPATH=os.pathsep.join([str(HERE.parents[1]), str(HERE.parent), os.environ.get("PYTHONPATH", "")]))


def test_sigkill_after_commit_resumes_in_a_new_process(root: str, shm_dir: str) -> None:
    """A training process SIGKILLed after its commits resumes, in a new process, from the latest
    checkpoint (held only by the memory tier: the interval kept it off the disk), bit-exact."""
    env = _env(shm_dir)
    worker = str(HERE / "compat_nebula_worker.py")
    proc = warm_python.popen([sys.executable, "-u", worker, "train", root], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env)
    committed: dict[str, str] = {}
    out: list[str] = []
    try:
        for line in lines(proc, time.monotonic() + 90):
            out.append(line)
            if line.startswith("COMMITTED "):
                _, tag, dig = line.split()
                committed[tag] = dig
                if len(committed) == 3:
                    break
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert len(committed) == 3, "\n".join(out)
    res = warm_python.run([sys.executable, "-u", worker, "resume", root], capture_output=True, text=True, env=env,
                          timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    resumed = next(line for line in res.stdout.splitlines() if line.startswith("RESUMED"))
    _, tag, step, tier, dig = resumed.split()
    assert (tag, step, tier) == ("global_step3", "3", "memory")
    assert dig == committed["global_step3"]     # bit-exact: model and optimizer state
    assert "DONE" in res.stdout
    with nc.Checkpointer(root, memory_tier=False) as ck:  # the resumed run's checkpoint reached the disk
        assert ck.tags() == {"global_step1": 1, "global_step4": 4}


@pytest.mark.slow
@pytest.mark.crash
@pytest.mark.timeout(300)
def test_two_ranks_sigkilled_after_commit_resume_each_rank_bit_exact(tmp_path: Path, shm_dir: str) -> None:
    """The same with 2 ranks (gloo, env://), each on data of its own: both SIGKILLed after their
    commits; a new 2-rank job resumes every rank from its memory tier with its own state."""
    from dist.launch import run_ranks

    root = str(tmp_path / "root")
    procs = run_ranks(2, "../integrations/compat_nebula_worker.py", ["train-kill", root], tmp_path, shm_dir,
                      timeout=120)
    assert [p.returncode for p in procs] == [-9, -9], procs[0].stdout[-3000:] + procs[1].stdout[-3000:]
    committed = [dict(line.split()[1:3] for line in p.stdout.splitlines() if line.startswith("COMMITTED "))
                 for p in procs]
    assert [sorted(c) for c in committed] == [["global_step1", "global_step2", "global_step3"]] * 2, committed
    assert committed[0]["global_step3"] != committed[1]["global_step3"]  # each rank has a state of its own
    man = json.loads((Path(root) / "step-1" / "manifest.json").read_text())  # the one on disk (interval)
    assert man["world_size"] == 2 and man["tag"] == "global_step1", (man.get("world_size"), man.get("tag"))
    procs = run_ranks(2, "../integrations/compat_nebula_worker.py", ["resume", root], tmp_path, shm_dir, timeout=120)
    for r, p in enumerate(procs):
        assert p.returncode == 0, p.stdout[-3000:]
        _, tag, step, tier, dig = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESUMED")).split()
        assert (tag, step, tier) == ("global_step3", "3", "memory"), (r, tag, step, tier)
        assert dig == committed[r]["global_step3"], f"rank {r} did not get its own state back"
        assert "DONE" in p.stdout


def test_example_runs(tmp_path: Path, shm_dir: str) -> None:
    res = warm_python.run([sys.executable, str(EXAMPLE), "--root", str(tmp_path / "ckpt")], capture_output=True,
                          text=True, env=_env(shm_dir), timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "resumed from global_step12 (step 3): bit-exact" in res.stdout


def test_get_latest_checkpoint_is_the_one_a_restart_resumes_from(root: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint marked suspect (``nebula-ckpt mark --suspect``, or the training signal) is passed
    over, as ``load_latest`` passes it over: the newest is the one before."""
    from nebula_ckpt.cli import main

    tn.init(persistent_storage_path=root)
    model, _ = _training()
    tn.Checkpoint("global_step1").save("model", model)
    tn.Checkpoint("global_step2").save("model", model)
    newest = tn.get_latest_checkpoint()
    assert newest is not None and newest.tag == "global_step2"
    tn.shutdown()
    assert main(["mark", root, "--suspect", str(newest.step)]) == 0
    capsys.readouterr()
    tn.init(persistent_storage_path=root)
    got = tn.get_latest_checkpoint()
    assert got is not None and got.tag == "global_step1", got


def test_get_latest_checkpoint_refuses_when_every_checkpoint_is_suspect(root: str) -> None:
    """The only checkpoint is restored and the loss goes NaN right after (the training signal marks
    it suspect): the next restart is not handed it again (it would loop), it gets
    CorruptCheckpointError naming it and the command that clears a mark, as ``load_latest`` raises."""
    tn.init(persistent_storage_path=root)
    model, _ = _training()
    tn.Checkpoint("global_step1", 1).save("model", model)
    tn.shutdown()
    tn.init(persistent_storage_path=root)
    got = tn.get_latest_checkpoint()
    assert got is not None and got.tag == "global_step1"
    model.load_state_dict(got.load("model"))
    for step in (2, 3):
        tn.checkpointer().report(step, loss=float("nan"))
    tn.shutdown()
    tn.init(persistent_storage_path=root)
    with pytest.raises(nc.CorruptCheckpointError, match="marked suspect") as e:
        tn.get_latest_checkpoint()
    assert "global_step1 (step 1)" in str(e.value) and "nebula-ckpt mark" in str(e.value)
    with pytest.raises(nc.CorruptCheckpointError):
        tn.get_latest_checkpoint_path("model")
    with pytest.raises(nc.CorruptCheckpointError):
        tn.checkpointer().load_latest()
