"""One step number saved twice ("replacing existing checkpoint"): two writes, never taken for one.

The commit marker names which write of a step it commits (writer generation, step, save number),
so wherever two copies of one step are compared (a tier against another, the memory tier against
the root), the second write is never taken for the first: a clean ``close()`` leaves the second
on the persistent tier, and ``gc`` never calls a memory tier holding it safe to free because the
root holds the first.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import torch

import nebula_ckpt as nc
import warm_python
from nebula_ckpt.tiers.memory import gc

REPO = Path(__file__).resolve().parents[3]
FIRST, SECOND = torch.full((1000,), 1.0), torch.full((1000,), 2.0)


def _save_twice(root: str) -> nc.Checkpointer:
    """Step 5 saved twice: the first write on both tiers, the second in memory only (every 2nd save)."""
    ck = nc.Checkpointer(root, tiers=[nc.MemoryTier(), nc.LocalTier(root, every=2)])
    ck.save(5, {"w": FIRST}).result()
    ck.save(5, {"w": SECOND}).result()
    return ck


def _restored(root: str) -> torch.Tensor:
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
        state = {"w": torch.zeros(1000)}
        assert ck.load_latest(state) == 5
        return state["w"]


def test_a_clean_close_keeps_the_second_write_on_the_persistent_tier(root: str, shm_dir: str) -> None:
    _save_twice(root).close()
    assert torch.equal(_restored(root), SECOND)
    assert json.loads(Path(root, "step-5", "COMMIT").read_text())["save"] == 1  # the second save's number


def test_gc_keeps_a_memory_tier_whose_write_the_root_lacks(root: str, shm_dir: str) -> None:
    """The job dies with the second write only in memory: the root holds step 5, but the first
    write; ``gc`` keeps the tier, and ``persist-memory`` puts the second write there, replacing
    the first as a save of the step does (docs/format.md, "A step saved again")."""
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(REPO / 'tests')!r})
        from tiers.memory.test_written_twice import _save_twice
        _save_twice({root!r})
        os._exit(0)
    """)
    warm_python.run([sys.executable, "-c", code], env=dict(os.environ, NEBULA_SHM_DIR=shm_dir, PYTHONPATH=str(REPO)),
                    check=True, timeout=120)
    decisions = [d for d in gc.collect() if d.found.owner is not None and d.found.owner.root == root]
    assert len(decisions) == 1 and not decisions[0].remove, decisions[0].reason
    from nebula_ckpt.tiers.memory.epilogue import persist_memory

    assert persist_memory(root)["copied"]
    assert torch.equal(_restored(root), SECOND)
    assert json.loads(Path(root, "step-5", "COMMIT").read_text())["save"] == 1  # the second write, as it was made
