"""A partner makes an incremental replica whole from its replica of the base only when that replica
is the very write the step was built on (``stats.write_id``), never by step and generation alone:
the same step saved twice in one writer generation is told apart whatever its checksums."""

from __future__ import annotations

import json
import os

import torch

import nebula_ckpt as nc
from nebula_ckpt import knobs
from nebula_ckpt.format.commit import read_commit
from nebula_ckpt.storage.local import LocalStorage
from nebula_ckpt.tiers.memory.replica_whole import holds_base, step_base


def _manifest(root: str, step: int) -> dict:
    with open(os.path.join(root, f"step-{step}", "manifest.json")) as f:
        return json.load(f)


def test_a_base_is_held_only_as_the_very_write_the_step_built_on(tmp_path) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    frozen = torch.randn(256, 256, generator=torch.Generator().manual_seed(3))
    with knobs.override(incremental_full_every=10), nc.Checkpointer(root, memory_tier=False, keep_last=5) as ck:
        ck.save(1, {"frozen": frozen, "t": torch.zeros(8)})
        first = _manifest(root, 1)["stats"]["write_id"]
        ck.save(1, {"frozen": frozen, "t": torch.ones(8)})  # step 1 again, same generation: another write
        second = _manifest(root, 1)["stats"]["write_id"]
        ck.save(2, {"frozen": frozen, "t": torch.ones(8)})
    assert isinstance(first, str) and len(first) == 32 and first != second
    need = step_base(root, 2, {1: _gen(root, 1), 2: _gen(root, 2)})
    assert need is not None and need["base"] == 1 and need["write"] == second
    assert holds_base(root, need)  # this folder holds that very write of step 1
    assert not holds_base(root, dict(need, write=first))  # an earlier write of step 1 is not the base
    assert not holds_base(root, dict(need, write=None))  # a base that names no write is never taken as held
    assert not holds_base(root, dict(need, gen=need["gen"] + 1))


def _gen(root: str, step: int) -> int:
    return read_commit(LocalStorage(root), step, f"step {step}").generation
