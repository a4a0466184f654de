"""A new per-rank tier kind is one file plus its factory entry: a toy node-local "nvme" tier.

The kind below is all a new tier needs: its settings (a :class:`~nebula_ckpt.tiers.base.Tier` that
declares its :class:`~nebula_ckpt.tiers.base.Capabilities`: each rank its own folder, nothing
else) and, when it does something of its own, a runtime registered in
:data:`nebula_ckpt.tiers.factory.RUNTIMES`. It is per rank and does not survive a reboot, like the
memory tier, and it is *not* the memory tier: a save to it and a restore from it work, and
nothing memory-specific is done to it (no byte compare against a base in RAM: it hashes; no
adoption of its pages by a restart; no replicas' pulled copy read in its place).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt.restore import restorer
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.storage.buffers import BufferStorage
from nebula_ckpt.storage.local import LocalStorage
from nebula_ckpt.tiers import factory
from nebula_ckpt.tiers.base import Capabilities, Tier
from nebula_ckpt.tiers.runtime import TierRuntime


@dataclass
class NvmeTier(Tier):
    """A node-local scratch folder, one per rank, wiped when the job's nodes are given back."""

    path: str = ""

    def __init__(self, path: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.kind = "nvme"
        self.path = path

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(per_rank=True)

    @property
    def persistent(self) -> bool:
        return False

    @property
    def display_url(self) -> str:
        return os.path.abspath(self.path)

    def make_storage(self) -> Storage:
        return LocalStorage(self.path)


class NvmeRuntime(TierRuntime):
    """Its runtime: a class of its own (the factory entry), which writes as a plain tier does: the
    tier writer writes to its storage directly."""


@pytest.fixture
def nvme_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """The new kind's factory entry."""
    monkeypatch.setitem(factory.RUNTIMES, NvmeTier, NvmeRuntime)


def _manifest(folder: str, step: int) -> dict[str, Any]:
    with open(os.path.join(folder, f"step-{step}", "manifest.json")) as f:
        return json.load(f)


def _state(step: int) -> dict[str, torch.Tensor]:
    frozen = torch.randn(256, 256, generator=torch.Generator().manual_seed(3))
    return {"frozen": frozen, "w": torch.full((64,), float(step))}


def test_a_per_rank_tier_of_a_new_kind_saves_restores_and_is_not_the_memory_tier(
        tmp_path, shm_dir, nvme_kind) -> None:  # noqa: ANN001
    root, nvme = str(tmp_path / "root"), str(tmp_path / "nvme")
    tiers = lambda: [NvmeTier(nvme, keep_last=5)]  # noqa: E731  (its own hashes: no other tier's to reuse)
    with nc.Checkpointer(root, tiers=tiers()) as ck:
        rt = factory.runtime_for(ck.tiers[0], ck.tiers[0].make_storage())
        assert type(rt) is NvmeRuntime and not ck.tiers[0].shared  # the factory entry; per rank
        rt.release()
        ck.save(1, _state(1))
        ck.save(2, _state(2))
    # step 2 builds on step 1 (the frozen tensor is referred to, not written again), known
    # unchanged by its SHA-256 like any tier that hashes, not by a byte compare with a base in RAM
    man = _manifest(nvme, 2)
    assert [s.get("step") for s in man["shards"]] == [None, 1]
    assert "frozen" in man.get("sha256", {})  # the tensor found unchanged: by its SHA-256
    w, frozen = torch.zeros(64), torch.zeros(256, 256)
    with nc.Checkpointer(root, tiers=tiers()) as ck:
        assert ck.load_latest(into={"frozen": frozen, "w": w}) == 2
        assert ck.last_restore["tier"] == f"nvme:{os.path.abspath(nvme)}"
        assert ck.last_restore["adopted_bytes"] == 0 and ck.last_restore["copy_on_write_bytes"] == 0
        assert ck.list() == [1, 2]
    assert torch.equal(w, _state(2)["w"]) and torch.equal(frozen, _state(2)["frozen"])
    # not adopted: a restart takes the memory tier's pages and that tier gives its step up; this
    # tier keeps both steps and their files
    assert os.path.exists(os.path.join(nvme, "step-2", "COMMIT")) and _manifest(nvme, 1)["shards"]


def test_the_replicas_pulled_copy_stands_in_for_the_tier_with_replicas_only(tmp_path) -> None:  # noqa: ANN001
    """A rank that pulled its memory-tier step from a partner reads it in place of that tier, never
    in place of another per-rank tier's files."""
    nvme, mem = NvmeTier(str(tmp_path / "nvme")), nc.MemoryTier(str(tmp_path / "mem"), replicas=1)
    pairs: list[tuple[Tier, Storage]] = [(nvme, nvme.make_storage()), (mem, mem.make_storage())]
    rec = {"pulled": {"step-3/shard.safetensors": torch.zeros(1, dtype=torch.uint8)}, "step": 3, "sources": ["r1"]}
    got = restorer._with_pulled(pairs, rec, 0)
    assert got[0] == pairs[0]
    assert got[1][0] is mem and isinstance(got[1][1], BufferStorage)
    assert nvme.capabilities == Capabilities(per_rank=True) and not nvme.capabilities.has_replicas
    assert mem.capabilities.has_replicas and mem.capabilities.keeps_base_in_ram
