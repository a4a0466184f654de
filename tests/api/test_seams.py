"""The seams ranks and frameworks plug into: coordinator, rank-aware names, cadence, ownership."""

from __future__ import annotations

import os
from typing import Any, Sequence

import pytest
import torch

import nebula_ckpt as nc
from memory_paths import memory_tier_path
from nebula_ckpt.format.names import shard_name, shard_owner
from nebula_ckpt.ranks.coordinator import PHASE_DIGEST, PHASE_DURABLE, PHASE_INDEX, PHASE_VERDICT, LocalCoordinator
from nebula_ckpt.storage.local import LocalStorage


class RankCoordinator(LocalCoordinator):
    """One process acting as rank ``rank`` of a one-rank job (it commits alone)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    @property
    def is_coordinator(self) -> bool:
        return True


class FailingPeer(LocalCoordinator):
    """Rank 0 of a two-rank job whose (simulated) rank 1 fails its shard of the steps ``fail``
    (a fault injected at the "durable" round; the real protocol runs in tests/dist/)."""

    world_size = 2

    def __init__(self, fail: Sequence[int]) -> None:
        self.fail = set(fail)
        self.rounds: list[tuple[str, int, int]] = []

    def round(self, tier: str, index: int, phase: int, payload: Any) -> list[Any]:
        self.rounds.append((tier, index, phase))
        if phase in (PHASE_DIGEST, PHASE_INDEX):
            return [payload, payload]
        if phase == PHASE_DURABLE:
            return [payload, {"error": "OSError: [Errno 28] No space left on device"}]
        return [payload]


def test_shard_names_and_memory_folder_carry_the_rank(root: str) -> None:
    coord = RankCoordinator(rank=3)
    with nc.Checkpointer(root, coordinator=coord) as ck:
        ck.save(1, {"w": torch.ones(4)})
        mem = ck.tiers[0].display_url
        assert mem == memory_tier_path(root, 3) != memory_tier_path(root, 0)
        assert [n for n in os.listdir(os.path.join(root, "step-1")) if n.startswith("shard-")] == \
            ["shard-g1-r3.safetensors"]
    with nc.Checkpointer(root, memory_tier=False) as reader:
        assert reader.load_latest() == 1


def test_no_commit_unless_every_rank_reports_its_shard_durable(root: str) -> None:
    coord = FailingPeer(fail=[2])
    with nc.Checkpointer(root, memory_tier=False, coordinator=coord) as ck:
        with pytest.raises(nc.PersistError, match=r"failed on rank\(s\) \[1\].*No space left"):
            ck.save(2, {"w": torch.full((4,), 2.0)})
        assert ck.list() == []
        assert not os.path.exists(os.path.join(root, "step-2"))   # our shard went with it
        assert [p for _, i, p in coord.rounds if i == 0] == [PHASE_DIGEST, PHASE_INDEX, PHASE_DURABLE, PHASE_VERDICT]


def test_cleanup_never_deletes_a_peer_ranks_shard_of_this_generation(root: str) -> None:
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, {"w": torch.ones(4)})
        gen = int(shard_owner(next(n for n in os.listdir(os.path.join(root, "step-1"))
                                      if n.startswith("shard-")))[0])
        st = LocalStorage(root)
        # a peer rank's shard of the same generation, in flight for step 2, and an old crash's file
        st.write_small(f"step-2/{shard_name(gen, 1)}", b"peer")
        st.write_small(f"step-3/{shard_name(gen - 1, 0) if gen > 1 else 'x.tmp'}", b"old")
        ck.save(2, {"w": torch.full((4,), 2.0)})
        ck.save(4, {"w": torch.full((4,), 4.0)})
        assert shard_name(gen, 1) in os.listdir(os.path.join(root, "step-2"))  # kept: not ours
        assert not os.path.exists(os.path.join(root, "step-3"))                   # crash leftover: gone


def test_a_skipped_save_does_not_use_up_the_every_seconds_window(tmp_path) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    hourly = nc.LocalTier(root, every_seconds=3600)
    ck = nc.Checkpointer(root, tiers=[hourly], on_full="skip")
    state = {"w": torch.ones(1024)}
    (writer,) = ck._saves.start()
    held = ck._saves.pool.acquire(1 << 20, False)            # every staging buffer is busy ...
    assert held is not None
    h = ck.save_async(1, state)
    assert h.skipped is not None and "staging" in h.skipped   # ... so this save is skipped
    ck._saves.pool.release(held)
    h = ck.save_async(2, state)                         # the hour has not started: the tier takes it
    assert h.result() == [hourly.name]
    assert ck.save_async(3, state).skipped is not None  # now it has
    ck.close()
    assert ck.list() == [2]


class CountingLocalTier(nc.LocalTier):
    closed: list[str] = []

    def make_storage(self) -> LocalStorage:
        outer = self

        class Counting(LocalStorage):
            def close(self) -> None:
                outer.closed.append(self.root)

        return Counting(self.path)


def test_every_storage_is_closed_also_when_only_loading(tmp_path) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, {"w": torch.ones(2)})
    CountingLocalTier.closed.clear()
    with nc.Checkpointer(root, tiers=[CountingLocalTier(root)]) as loader:
        assert loader.load_latest() == 1
    assert CountingLocalTier.closed == [os.path.abspath(root)]


def test_slot_goes_back_when_the_copy_cannot_be_enqueued(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from nebula_ckpt import native

    with nc.Checkpointer(root) as ck:
        def broken(*a: object, **k: object) -> object:
            raise RuntimeError("injected: enqueue failed")
        for name in ("enqueue_copy", "enqueue_sources"):  # a state's tensors as a list, or as a planned SourceSet
            monkeypatch.setattr(native.get_ops(), name, broken)
        with pytest.raises(RuntimeError, match="injected"):
            ck.save_async(1, {"w": torch.ones(4)})
        monkeypatch.undo()
        assert all(not s.in_use for s in ck._saves.pool._slots)
        ck.save(2, {"w": torch.ones(4)})            # nothing left in flight: the next save works
        assert ck.list() == [2]

