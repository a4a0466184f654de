"""A restart adopts the memory tier's pages instead of copying them (nebula_ckpt/tiers/memory/adopt.py).

Each test crashes a real saving process (SIGKILL after the save is durable), restarts in this
process, and checks what was promised: the restored state is bit-exact, the optimizer's tensors
are views of the tier's (now unnamed) shard file, the tier no longer offers that step, nothing the
checkpointer writes later ever lands in the adopted pages, and every case where adoption is not
safe copies instead (the tier keeps its checkpoint).
"""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
from typing import Any, Callable, Optional

import pytest
import torch

import nebula_ckpt as nc
import warm_python
from nebula_ckpt import knobs
from nebula_ckpt.tiers.memory.tier import memory_tier_path

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs a tmpfs memory tier")

_SAVER = r"""
import os, signal, sys, torch, nebula_ckpt as nc
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for _ in range(3):
    model(torch.randn(4, 64)).square().mean().backward(); opt.step(); opt.zero_grad()
ck = nc.Checkpointer(sys.argv[1])
ck.save(7, {"model": model, "optim": opt, "step": 7})
torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, sys.argv[2])
if sys.argv[3] == "memory-only":   # as if the crash came before the disk tier committed it
    import shutil; shutil.rmtree(os.path.join(sys.argv[1], "step-7"))
os.kill(os.getpid(), signal.SIGKILL)
"""


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _crash(root: str, shm_dir: str, ref: str, mode: str = "durable") -> dict[str, Any]:
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir)
    r = warm_python.run([sys.executable, "-c", _SAVER, root, ref, mode], env=env, capture_output=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr.decode()[-3000:]
    return torch.load(ref, weights_only=True)


def _same(model: torch.nn.Module, opt: torch.optim.Optimizer, want: dict[str, Any]) -> bool:
    got_m, got_o = model.state_dict(), opt.state_dict()
    if any(not torch.equal(got_m[k], v) for k, v in want["model"].items()):
        return False
    for i, st in want["optim"]["state"].items():
        for k, v in st.items():
            if not torch.equal(got_o["state"][i][k], v):
                return False
    return True


def _adopted_mappings(folder: str) -> list[str]:
    """Lines of /proc/self/maps for files of the memory tier that no longer have a name."""
    with open("/proc/self/maps") as f:
        return [line for line in f if folder in line and line.rstrip().endswith("(deleted)")]


def _opt_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def test_restart_adopts_the_pages_and_the_tier_gives_the_step_up(root: str, shm_dir: str, tmp_path) -> None:  # noqa: ANN001
    want = _crash(root, shm_dir, str(tmp_path / "ref.pt"))
    folder = memory_tier_path(root)
    model, opt = _model()
    with nc.Checkpointer(root) as ck:
        assert ck.load_latest(into={"model": model, "optim": opt, "step": 0}) == 7
        assert ck.last_restore["tier"].startswith("memory:")
        assert _same(model, opt, want)
        assert _adopted_mappings(folder), "the optimizer state is not a view of the tier's shard file"
        assert ck.last_restore["adopted_bytes"] == sum(t.numel() * t.element_size() for t in _opt_tensors(opt))
        mem = ck.tiers[0].name
        assert ck.list(detailed=True)[mem] == []          # the tier gave step 7 up ...
        assert 7 in ck.list(detailed=True)[ck.tiers[1].name]  # ... which stays on disk
        # the adopted tensors are ordinary tensors: torch.save writes their bytes alone
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        state_bytes = sum(t.numel() * t.element_size() for t in _opt_tensors(opt))
        assert len(buf.getvalue()) < state_bytes + (64 << 10)
    with nc.Checkpointer(root) as again:  # a second restart finds step 7 on disk
        m2, o2 = _model()
        assert again.load_latest(into={"model": m2, "optim": o2, "step": 0}) == 7
        assert again.last_restore["tier"].startswith("local:") and _same(m2, o2, want)
        assert again.last_restore["adopted_bytes"] == 0


def test_a_process_that_only_restores_does_not_keep_the_tier_from_a_restarted_job(root: str, shm_dir: str,
                                                                                   tmp_path, caplog) -> None:  # noqa: ANN001
    """An evaluation script restores (and adopts) right after the crash and stays open; the job,
    restarted beside it, still writes the memory tier (the lock was given back after the hand-over)."""
    want = _crash(root, shm_dir, str(tmp_path / "ref.pt"))
    model, opt = _model()
    with nc.Checkpointer(root) as reader:
        assert reader.load_latest(into={"model": model, "optim": opt, "step": 0}) == 7
        assert reader.last_restore["adopted_bytes"] > 0 and _same(model, opt, want)
        m2, o2 = _model()
        with caplog.at_level(logging.WARNING, logger="nebula_ckpt"), nc.Checkpointer(root) as job:
            assert job.load_latest(into={"model": m2, "optim": o2, "step": 0}) == 7  # from disk now
            assert job.last_restore["tier"].startswith("local:") and _same(m2, o2, want)
            job.save(8, {"model": m2, "optim": o2, "step": 8})
            assert job.list(detailed=True)[job.tiers[0].name] == [8], "the restarted job could not write the tier"
        assert not [r for r in caplog.records if "another live process" in r.getMessage()]
        assert _same(model, opt, want)  # the reader's adopted state is untouched by the job's save


def test_training_and_saving_after_adoption_never_write_the_adopted_pages(root: str, shm_dir: str, tmp_path) -> None:  # noqa: ANN001
    _crash(root, shm_dir, str(tmp_path / "ref.pt"))
    model, opt = _model()
    with nc.Checkpointer(root, keep_last=2) as ck:
        assert ck.load_latest(into={"model": model, "optim": opt, "step": 0}) == 7
        assert _adopted_mappings(memory_tier_path(root))
        saved: dict[int, list[torch.Tensor]] = {}
        for step in range(8, 14):  # slot files are made, linked, retired and reused meanwhile
            model(torch.randn(4, 64)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            before = [t.clone() for t in _opt_tensors(opt)]
            ck.save_async(step, {"model": model, "optim": opt, "step": step}).result()
            assert all(torch.equal(a, b) for a, b in zip(before, _opt_tensors(opt), strict=True)), \
                f"save {step} changed the live optimizer state"
            saved[step] = before
        for step in (12, 13):  # what each tier holds is what was live at that save
            _, got = ck.read(step)
            flat = [v for st in got["optim"]["state"].values() for v in st.values() if isinstance(v, torch.Tensor)]
            assert all(torch.equal(a, b) for a, b in zip(saved[step], flat, strict=True)), step


def test_a_step_only_the_memory_tier_holds_is_copied_and_kept(root: str, shm_dir: str, tmp_path) -> None:  # noqa: ANN001
    want = _crash(root, shm_dir, str(tmp_path / "ref.pt"), mode="memory-only")
    folder = memory_tier_path(root)
    model, opt = _model()
    with nc.Checkpointer(root) as ck:
        assert ck.load_latest(into={"model": model, "optim": opt, "step": 0}) == 7
        assert ck.last_restore["tier"].startswith("memory:") and _same(model, opt, want)
        assert not _adopted_mappings(folder) and ck.last_restore["adopted_bytes"] == 0
        assert ck.list(detailed=True)[ck.tiers[0].name] == [7]  # its only copy is kept


def test_knob_off_copies(root: str, shm_dir: str, tmp_path) -> None:  # noqa: ANN001
    want = _crash(root, shm_dir, str(tmp_path / "ref.pt"))
    model, opt = _model()
    with knobs.override(adopt_memory_tier=False), nc.Checkpointer(root) as ck:
        assert ck.load_latest(into={"model": model, "optim": opt, "step": 0}) == 7
        assert _same(model, opt, want) and not _adopted_mappings(memory_tier_path(root))
        assert ck.list(detailed=True)[ck.tiers[0].name] == [7]


def test_another_live_writer_of_the_tier_means_a_copy(root: str) -> None:
    model, opt = _model()
    model(torch.randn(4, 64)).square().mean().backward()
    opt.step()
    with nc.Checkpointer(root) as writer:
        writer.save(3, {"model": model, "optim": opt})  # holds the memory tier's lock
        m2, o2 = _model()
        with nc.Checkpointer(root) as reader:
            assert reader.load_latest(into={"model": m2, "optim": o2}) == 3
            assert reader.last_restore["tier"].startswith("memory:")
            assert not _adopted_mappings(memory_tier_path(root)) and reader.last_restore["adopted_bytes"] == 0
        assert writer.list(detailed=True)[writer.tiers[0].name] == [3]
        # the writer's own restore never adopts its own slot files either
        m3, o3 = _model()
        assert writer.load_latest(into={"model": m3, "optim": o3}) == 3
        assert not _adopted_mappings(memory_tier_path(root))
        assert writer.list(detailed=True)[writer.tiers[0].name] == [3]


def test_damaged_adopted_bytes_fall_back_and_leave_into_alone(root: str, shm_dir: str, tmp_path) -> None:  # noqa: ANN001
    want = _crash(root, shm_dir, str(tmp_path / "ref.pt"))
    folder = memory_tier_path(root)
    man = json.load(open(os.path.join(folder, "step-7", "manifest.json")))
    key = next(k for k in man["tensors"] if "exp_avg_sq" in k)
    shard = os.path.join(folder, "step-7", man["shards"][man["tensors"][key].get("shard", 0)]["file"])
    with open(shard, "r+b") as f:  # one flipped bit in an optimizer tensor adoption would hand out
        f.seek(man["tensors"][key]["offsets"][0])
        b = f.read(1)
        f.seek(man["tensors"][key]["offsets"][0])
        f.write(bytes([b[0] ^ 1]))
    model, opt = _model()
    with nc.Checkpointer(root) as ck:
        assert ck.load_latest(into={"model": model, "optim": opt, "step": 0}) == 7
        assert ck.last_restore["tier"].startswith("local:") and _same(model, opt, want)
        assert not _adopted_mappings(folder)


def test_a_truncated_disk_copy_is_not_durable_enough_to_give_the_memory_copy_up(root: str, shm_dir: str,
                                                                               tmp_path) -> None:  # noqa: ANN001
    want = _crash(root, shm_dir, str(tmp_path / "ref.pt"))
    step_dir = os.path.join(root, "step-7")
    shard = next(os.path.join(step_dir, n) for n in os.listdir(step_dir) if n.endswith(".safetensors"))
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    model, opt = _model()
    with nc.Checkpointer(root) as ck:
        assert ck.load_latest(into={"model": model, "optim": opt, "step": 0}) == 7
        assert ck.last_restore["tier"].startswith("memory:") and _same(model, opt, want)
        assert not _adopted_mappings(memory_tier_path(root))
        assert ck.list(detailed=True)[ck.tiers[0].name] == [7]  # the only good copy stays


def test_a_mismatched_into_adopts_nothing_and_the_tier_keeps_the_step(root: str, shm_dir: str, tmp_path) -> None:  # noqa: ANN001
    """A restore into a model of another shape is refused before anything changes: no page is
    handed over, the tier still offers the step, and a correct restore afterwards adopts it."""
    want = _crash(root, shm_dir, str(tmp_path / "ref.pt"))
    torch.manual_seed(1)
    wrong = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    wrong_opt = torch.optim.AdamW(wrong.parameters(), lr=1e-2)
    before = {k: v.clone() for k, v in wrong.state_dict().items()}
    with nc.Checkpointer(root) as ck:
        with pytest.raises(nc.ValidationError, match="shape"):
            ck.load_latest(into={"model": wrong, "optim": wrong_opt, "step": 0})
        assert all(torch.equal(before[k], v) for k, v in wrong.state_dict().items()) and not wrong_opt.state
        assert not _adopted_mappings(memory_tier_path(root))
        assert ck.list(detailed=True)[ck.tiers[0].name] == [7]
        model, opt = _model()
        assert ck.load_latest(into={"model": model, "optim": opt, "step": 0}) == 7
        assert ck.last_restore["tier"].startswith("memory:") and ck.last_restore["adopted_bytes"] > 0
        assert _same(model, opt, want)


# A restorer whose restore pauses at a named point: it signals `opened-<me>` once it holds the
# memory tier's checkpoint (adopting: staged, its tensors views of the tier's file, right before
# the hand-over; copying: staged, the model's bytes still to be copied) and waits for the gate
# `turn-<me>`; after the restore it waits for `mutate-<me>`, adds <me>+1 to every optimizer
# tensor (what an optimizer step does to adopted pages), signals `mutated-<me>`, waits for `check`
# and reports whether its tensors hold exactly the checkpoint plus its own change.
_RESTORER = r"""
import json, os, sys, time, torch, nebula_ckpt as nc
import threading
from nebula_ckpt import knobs
from nebula_ckpt.tiers.memory import adopt
from nebula_ckpt.restore import apply as restore
root, gates, ref, me, mode = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]

def gate(name):
    path = os.path.join(gates, name)
    t0 = time.time()
    while not os.path.exists(path):
        if time.time() - t0 > 120:
            raise SystemExit(f"restorer {me}: gate {name} never opened")
        time.sleep(0.005)

def signal(name):
    open(os.path.join(gates, name), "w").close()

def pause():
    signal(f"opened-{me}")
    gate(f"turn-{me}")

if mode == "adopt":  # staged, its tensors views of the tier's file: right before the hand-over
    give_up = adopt.Adoption.give_up
    def paused_give_up(self):
        pause()
        return give_up(self)
    adopt.Adoption.give_up = paused_give_up
else:  # staged (read, verified, owned copies made); what is copied into the model comes next
    staged = restore.stage_apply
    def stage_apply(ck, *a, **kw):
        go = staged(ck, *a, **kw)
        if ck.tier_name.startswith("memory:"):
            pause()
        return go
    restore.stage_apply = stage_apply

torch.manual_seed(1)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
want = torch.load(ref, weights_only=True)
with knobs.override(adopt_memory_tier=mode == "adopt"):
    ck = nc.Checkpointer(root)
    step = ck.load_latest(into={"model": model, "optim": opt, "step": 0})
info = dict(step=step, tier=ck.last_restore["tier"], adopted=ck.last_restore["adopted_bytes"])
for t in threading.enumerate():  # pages given back to the tmpfs are given back before the next goes on
    if t.name == "nebula-adopt-free":
        t.join()
signal(f"restored-{me}")
gate(f"mutate-{me}")
with torch.no_grad():
    for st in opt.state.values():
        for v in st.values():
            v.add_(me + 1)
signal(f"mutated-{me}")
gate("check")
got_m = model.state_dict()
info["model_ok"] = all(torch.equal(got_m[k], v) for k, v in want["model"].items())
bad = 0
for i, st in want["optim"]["state"].items():
    for k, v in st.items():
        bad += not torch.equal(opt.state_dict()["state"][i][k], v + (me + 1))
info["optim_changed_by_others"] = bad
print("RESULT " + json.dumps(info), flush=True)
ck.close()
"""


def _gate(gates: str, name: str) -> None:
    open(os.path.join(gates, name), "w").close()


def _await(gates: str, name: str, procs: list[subprocess.Popen]) -> None:
    import time

    t0 = time.time()
    while not os.path.exists(os.path.join(gates, name)):
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"a restorer exited early waiting for {name}: {p.stderr.read()[-3000:]}")
        assert time.time() - t0 < 180, f"{name} never came"
        time.sleep(0.01)


def _restore_pinned(root: str, shm_dir: str, ref: str, gates: str, modes: list[str],
                    meanwhile: Optional[Callable[[], None]] = None) -> list[dict[str, Any]]:
    """Run one restorer per mode; all open the memory tier's step before any goes on (then
    ``meanwhile`` runs), then each restores in turn (0, 1, ...) to the end, then each changes its
    optimizer state in turn, then all check theirs."""
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir)
    procs = [warm_python.popen([sys.executable, "-c", _RESTORER, root, gates, ref, str(i), m], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, m in enumerate(modes)]
    try:
        for i in range(len(modes)):
            _await(gates, f"opened-{i}", procs)
        if meanwhile is not None:
            meanwhile()
        for i in range(len(modes)):
            _gate(gates, f"turn-{i}")
            _await(gates, f"restored-{i}", procs)
        for i in range(len(modes)):
            _gate(gates, f"mutate-{i}")
            _await(gates, f"mutated-{i}", procs)
        _gate(gates, "check")
        out = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=120)
            assert p.returncode == 0, stderr[-3000:]
            out.append(json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:]))
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.parametrize("modes", [["adopt", "adopt", "adopt"], ["adopt", "copy", "adopt"]])
def test_restarts_at_once_never_share_the_pages(root: str, shm_dir: str, tmp_path, modes: list[str]) -> None:  # noqa: ANN001
    """Several processes restore the same step from the memory tier at once (pinned: every one has
    it open before the first goes on). At most one may hold the file's pages; every other one
    copies, and none of them ever sees another's changes (optimizer steps, freed pages)."""
    ref = str(tmp_path / "ref.pt")
    _crash(root, shm_dir, ref)
    gates = tmp_path / "gates"
    gates.mkdir()
    results = _restore_pinned(root, shm_dir, ref, str(gates), modes)
    assert all(r["step"] == 7 for r in results), results
    assert sum(r["adopted"] > 0 for r in results) <= 1, f"two processes were handed the same pages: {results}"
    for i, r in enumerate(results):
        assert r["model_ok"], f"restorer {i}'s model is not the checkpoint's: {results}"
        assert r["optim_changed_by_others"] == 0, f"restorer {i}'s optimizer state was written by another: {results}"


def test_a_live_writer_never_reuses_a_file_another_process_restores_from(root: str, shm_dir: str, tmp_path) -> None:  # noqa: ANN001
    """A restorer (an evaluation script) has staged step 1 from the memory tier of a job that goes
    on saving (pinned: staged, the model's bytes still to be copied). Retention drops step 1 and the
    job's next saves take staging slot files again: never the one the restorer still reads."""
    model, opt = _model()
    ref = str(tmp_path / "ref.pt")
    gates = tmp_path / "gates"
    gates.mkdir()

    def train() -> None:
        model(torch.randn(4, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    train()
    with nc.Checkpointer(root) as job:
        job.save(1, {"model": model, "optim": opt, "step": 1})
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, ref)

        def saves_on() -> None:  # step 1 leaves the memory tier; its slot file is free to stage in again
            for step in (2, 3, 4):
                train()
                job.save(step, {"model": model, "optim": opt, "step": step})
            assert job.list(detailed=True)[job.tiers[0].name] == [4]

        results = _restore_pinned(root, shm_dir, ref, str(gates), ["copy"], meanwhile=saves_on)
    r = results[0]
    assert r["step"] == 1 and r["tier"].startswith("memory:"), results
    assert r["model_ok"], f"the job's saves wrote the file the restorer read: {results}"
    assert r["optim_changed_by_others"] == 0, results
