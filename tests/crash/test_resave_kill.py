"""Real crashes while a committed step is saved again: SIGKILL at each point of the replacement.

A worker commits step 5 (old bytes) and step 6 (incremental on 5), then saves step 5 again (new
bytes). The test kills it at each named point of the replacement (the new shard, its manifest, the
replaced marker, the removal of step 6's files (it refers to the old write: its marker went before
the switch), the manifest renamed back to ``manifest.json``, the removal of the old files) and
then, in fresh processes:
step 5 restores whole, bit for bit, as the old write or the new one (never neither); every step
listed restores (step 6 is unlisted before the marker names the new write); and the next writer's sweep
leaves in the folder only the files of the write its marker commits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import nebula_ckpt as nc
import warm_python
from proc_lines import lines, reap

#: the points of a replacement, in order (DEBUG lines ``phase=<name>``)
POINTS = ["shard", "manifest", "replace", "unlisted", "settle", "replaced"]
N = 4 * 1024 * 1024  # 16 MiB of float32: a shard write long enough to be killed inside

WORKER = textwrap.dedent("""
    import logging, sys, torch
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(message)s"))
    lg = logging.getLogger("nebula_ckpt")
    lg.addHandler(h)
    lg.setLevel(logging.DEBUG)
    import nebula_ckpt as nc
    n = int(sys.argv[2])
    frozen = torch.arange(n, dtype=torch.float32)
    ck = nc.Checkpointer(sys.argv[1], keep_last=5, memory_tier=False)
    ck.save(5, {"frozen": frozen, "w": torch.full((1000,), 5.0)})
    ck.save(6, {"frozen": frozen, "w": torch.full((1000,), 6.0)})
    print("RESAVE", flush=True)
    ck.save(5, {"frozen": frozen + 1, "w": torch.full((1000,), 50.0)})
    print("FINISHED", flush=True)
    ck.close()
""")


def _restore_5(root: str) -> float:
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
        assert 5 in ck.list()
        _, got = ck.read(5)
    w = float(got["w"][0])
    want = torch.arange(N, dtype=torch.float32) + (1 if w == 50.0 else 0)
    assert w in (5.0, 50.0) and torch.equal(got["frozen"], want) and torch.equal(got["w"], torch.full((1000,), w))
    return w


@pytest.mark.crash
@pytest.mark.parametrize("point", POINTS)
def test_a_kill_while_a_step_is_replaced_leaves_the_old_or_the_new_whole(tmp_path, shm_dir, point) -> None:  # noqa: ANN001
    outcomes = set()
    for delay in (0.0, 0.0005, 0.003):
        root = str(tmp_path / f"ck-{delay}")
        env = dict(os.environ, NEBULA_SHM_DIR=shm_dir)
        proc = warm_python.popen([sys.executable, "-u", "-c", WORKER, root, str(N)], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, env=env)
        resaving, killed = False, False
        try:
            for line in lines(proc, time.monotonic() + 120):
                if line.startswith("RESAVE"):
                    resaving = True
                elif resaving and f"phase={point} " in line + " ":
                    time.sleep(delay)
                    proc.send_signal(signal.SIGKILL)
                    killed = True
                    break
                elif line.startswith("FINISHED"):
                    break
        finally:
            reap(proc)
        assert killed, f"the worker never reached phase={point} of the replacement"
        w = _restore_5(root)
        outcomes.add(w)
        # the next writer (a newer generation) sweeps what the killed one left in step 5's folder
        with nc.Checkpointer(root, keep_last=5, memory_tier=False) as ck:
            ck.save(7, {"frozen": torch.zeros(4), "w": torch.zeros(4)})
        assert _restore_5(root) == w
        folder = os.path.join(root, "step-5")
        with open(os.path.join(folder, "COMMIT")) as f:
            manifest = json.load(f).get("manifest", "manifest.json")
        with open(os.path.join(folder, manifest)) as f:
            shard = json.load(f)["shards"][0]["file"]
        assert shard == "shard-g1-r0.safetensors" if w == 5.0 else shard.startswith("shard-g1-r0-v"), shard
        assert sorted(os.listdir(folder)) == sorted(["COMMIT", manifest, shard]), (point, delay)
        with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
            if 6 in ck.list():  # killed before step 6 (the old 5's referrer) went: so before the switch
                assert w == 5.0 and float(ck.read(6)[1]["w"][0]) == 6.0, (point, delay)
    # Before the switch the kill lands while the process goes on (the manifest and the marker are
    # small writes it may finish first): the old or the new, each whole, as checked above. A kill
    # in the 16 MiB shard write keeps the old one.
    if point == "shard":
        assert 5.0 in outcomes, outcomes
    if point in ("unlisted", "settle", "replaced"):
        assert outcomes == {50.0}, outcomes


#: the worker above, held (a logging handler sleeps) once the new write of step 5 is committed and
#: before the old write's files go: the test checks the root there, then SIGKILLs it
HELD_WORKER = WORKER.replace("lg.setLevel(logging.DEBUG)", """lg.setLevel(logging.DEBUG)
import time
resaving = False
class Hold(logging.Handler):
    def emit(self, record):
        if resaving and record.getMessage().startswith("nebula_ckpt: step 5 committed"):
            print("SWITCHED", flush=True)
            time.sleep(120)
lg.addHandler(Hold())""").replace('print("RESAVE", flush=True)', 'print("RESAVE", flush=True)\nresaving = True') \
    .replace('"frozen": frozen + 1', '"frozen": frozen')  # the same frozen bytes: the new write hashes them


def _verify(root: str) -> None:
    v = warm_python.run([sys.executable, "-m", "nebula_ckpt.cli", "verify", root], capture_output=True, text=True,
                        timeout=120)
    assert v.returncode == 0, v.stdout + v.stderr


@pytest.mark.crash
def test_the_steps_that_referred_to_the_old_write_go_before_the_marker_switch(tmp_path, shm_dir) -> None:  # noqa: ANN001
    """Once the new write of step 5 is committed, step 6 (which refers to the old write's shard)
    is gone already: ``verify`` beside the live job, and every reader after a SIGKILL there, find
    only steps that restore (the old files are still in the folder). The next writer removes the
    old files and keeps the step it saved on the new step 5 (it refers only to the files that
    write keeps)."""
    root = str(tmp_path / "ck")
    proc = warm_python.popen([sys.executable, "-u", "-c", HELD_WORKER, root, str(N)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=dict(os.environ, NEBULA_SHM_DIR=shm_dir))
    held, out = False, []
    try:
        for line in lines(proc, time.monotonic() + 120):
            out.append(line)
            if line.startswith("SWITCHED"):
                held = True
                assert not os.path.exists(os.path.join(root, "step-6", "COMMIT"))  # unlisted before the switch
                assert "shard-g1-r0.safetensors" in os.listdir(os.path.join(root, "step-5"))  # the old files stay
                _verify(root)  # beside the live job: nothing DAMAGED
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        reap(proc)
    assert held, "\n".join(out[-30:])
    frozen = torch.arange(N, dtype=torch.float32)
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
        assert ck.list() == [5]
    _verify(root)
    assert os.path.exists(os.path.join(root, "step-6"))  # its files: a leftover, which the next writer removes
    state = {"frozen": torch.zeros(N), "w": torch.zeros(1000)}
    with nc.Checkpointer(root, keep_last=5, memory_tier=False) as ck:
        assert ck.load_latest(state) == 5
        assert torch.equal(state["frozen"], frozen) and float(state["w"][0]) == 50.0  # the new write
        state["w"] += 1.0
        ck.save(7, state)  # on the new step 5; then the first deletion pass
    with open(os.path.join(root, "step-7", "manifest.json")) as f:
        refs = [sh for sh in json.load(f)["shards"] if "step" in sh]
    assert [sh["step"] for sh in refs] == [5] and refs[0]["file"].startswith("shard-g1-r0-v"), refs
    assert "shard-g1-r0.safetensors" not in os.listdir(os.path.join(root, "step-5"))
    assert not os.path.exists(os.path.join(root, "step-6"))
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
        assert ck.list() == [5, 7]
        _, got = ck.read(7)
    assert torch.equal(got["frozen"], frozen) and float(got["w"][0]) == 51.0
    _verify(root)
