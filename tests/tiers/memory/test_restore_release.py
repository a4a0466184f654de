"""A restore from the memory tier lets go of the tier's files as soon as nothing uses them.

A restore maps the memory tier's shard files (shared, or copy-on-write for a base other steps
refer to). Once the restore returned and the caller dropped what it returned, no mapping may
remain: a mapping kept alive by a reference cycle holds the tmpfs pages of a step that retention
has deleted until some later garbage collection, and a full ``/dev/shm`` refuses the next save.
The program here runs with the garbage collector off, so only reference counting frees anything.
"""

from __future__ import annotations

import json
import os
import sys

import warm_python

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_CHILD = r"""
import gc, json, os, sys
import torch
import nebula_ckpt as nc
from nebula_ckpt import knobs

shm, root, phase = sys.argv[1:4]
def mapped():
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if shm in line)
tiers = lambda: [nc.MemoryTier(), nc.LocalTier(root)]
with knobs.override(shm_dir=shm):
    if phase == "save":  # steps 1-3 (2 and 3 refer to 1's frozen bytes), then a crash
        ck = nc.Checkpointer(root, tiers=tiers())
        st = {"frozen": torch.arange(1 << 20, dtype=torch.float32), "w": torch.ones(1 << 18)}
        for step in (1, 2, 3):
            ck.save(step, st)
            st["w"] += 1
        os._exit(0)
    gc.disable()
    out = {}
    with nc.Checkpointer(root, tiers=tiers()) as ck:
        into = {"frozen": torch.zeros(1 << 20), "w": torch.zeros(1 << 18)}
        ck.load(3, into=into)
        out["load"] = [ck.last_restore["tier"].split(":")[0], bool(torch.equal(into["w"], torch.full((1 << 18,), 3.0))),
                       mapped()]
        del into
        out["load_dropped"] = mapped()
        _, got = ck.read(3)  # owned tensors
        out["read"] = [ck.last_restore["tier"].split(":")[0], bool(torch.equal(got["w"], torch.full((1 << 18,), 3.0))),
                       mapped()]
        del got
        out["read_dropped"] = mapped()
    print(json.dumps(out))
"""


def test_a_memory_tier_restore_keeps_no_mapping_once_its_result_is_dropped(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    root = str(tmp_path / "ck")
    env = dict(os.environ, PYTHONPATH=_REPO)
    for phase in ("save", "load"):
        r = warm_python.run([sys.executable, "-c", _CHILD, str(shm), root, phase], env=env, capture_output=True,
                            text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["load"][:2] == ["memory", True], out
    # copied into ``into``: nothing of the tier stays mapped, even before ``into`` goes
    assert out["load"][2] == 0 and out["load_dropped"] == 0, out
    assert out["read"][:2] == ["memory", True], out
    assert out["read_dropped"] == 0, out
