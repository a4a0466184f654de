"""Multi-rank manifests (format version 2) read from disk are input, never truth.

A rank's own checkpoint is written by a real ``Checkpointer`` acting as rank 0 of a 2-rank job
(its memory tier commits alone, no other rank needed); each case then changes one field of its
manifest and re-seals it with a valid checksum. Opening must refuse it with a
``CorruptCheckpointError`` naming the field, never crash or read outside the shard.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt import knobs, ranks
from nebula_ckpt import manifest as mf
from nebula_ckpt.coordinator import LocalCoordinator
from nebula_ckpt.errors import CorruptCheckpointError
from nebula_ckpt.restore import NotThisLayout, open_checkpoint
from nebula_ckpt.storage.local import LocalStorage
from test_hostile_manifest import Man, rewrite


class RankZeroOfTwo(LocalCoordinator):
    """Rank 0 of a 2-rank job, alone: enough for a rank's own (memory) tier, which needs no rounds."""

    world_size = 2


@pytest.fixture
def mem(tmp_path, shm_dir) -> str:  # noqa: ANN001
    path = os.path.join(shm_dir, "tier")
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4), "n": 3}
    with nc.Checkpointer(str(tmp_path / "root"), tiers=[nc.MemoryTier(path)], coordinator=RankZeroOfTwo()) as ck:
        ck.save(1, state)
        ck._runtimes[0].close = lambda *_: None  # type: ignore[method-assign]  # keep it for the test
    return path


def _open(path: str, rank: int = 0, world: int = 2) -> Any:
    return open_checkpoint(LocalStorage(path), 1, "full", "t", rank, world)


def test_a_ranks_own_checkpoint_is_version_2_and_reads_back(mem: str) -> None:
    man = json.load(open(os.path.join(mem, "step-1", mf.MANIFEST)))
    assert man["version"] == 2 and man["world_size"] == 2 and man["ranks"] == [0]
    assert set(man["tensors"]) == {"r0/w", "r0/b"} and man["rank_tree"] == {"0": 0}
    ck = _open(mem)
    assert torch.equal(ck.view("w"), torch.arange(6, dtype=torch.float32).reshape(2, 3))
    with pytest.raises(NotThisLayout, match="rank 1 of 2"):
        _open(mem, rank=1)          # rank 1 never restores rank 0's own tier
    with pytest.raises(NotThisLayout):
        _open(mem, rank=0, world=1)  # nor does one process: it holds only part of the job


def _dt(**kw: Any) -> Callable[[Man], None]:
    def fn(m: Man) -> None:
        rec = {"shape": [4, 3], "offsets": [2, 0], "placements": ["S(0)"], "mesh": [2]}
        rec.update(kw)
        m["tensors"]["r0/w"]["dtensor"] = rec
    return fn


CASES: list[tuple[str, Callable[[Man], Any], str]] = [
    ("world_zero", lambda m: m.update(world_size=0), "world_size = 0"),
    ("world_huge", lambda m: m.update(world_size=2**40), "world_size"),
    ("world_v1", lambda m: m.update(version=1), "needs format version 2"),
    ("ranks_missing", lambda m: m.pop("ranks"), "ranks must be a JSON list"),
    ("rank_out_of_world", lambda m: m.update(ranks=[5]), "ranks[]"),
    ("rank_twice", lambda m: m.update(ranks=[0, 0]), "distinct ranks"),
    ("ranks_in_one_process", lambda m: m.update(world_size=1), "one-process checkpoint"),
    ("tree_not_list", lambda m: m.update(tree=m["tree"]["v"][0]), "list node"),
    ("rank_tree_index", lambda m: m.update(rank_tree={"0": 7}), "rank_tree[0]"),
    ("rank_tree_extra", lambda m: m["rank_tree"].update({"1": 0}), "rank_tree names 2"),
    ("key_without_prefix", lambda m: m["tensors"].update(w=m["tensors"].pop("r0/w")), "prefix"),
    ("key_of_other_rank", lambda m: m["tensors"].update({"r1/w": m["tensors"].pop("r0/w")}), "prefix"),
    ("tree_names_missing_key", lambda m: m["tensors"].pop("r0/b"), "names no tensor"),
    ("dtensor_outside", _dt(offsets=[3, 0]), "outside the global size"),
    ("dtensor_rank_mismatch", _dt(shape=[4]), "dimensions"),
    ("dtensor_placement", _dt(placements=["P"]), "placement 'P'"),
    ("dtensor_shard_dim", _dt(placements=["S(5)"]), "placement 'S(5)'"),
    ("dtensor_mesh", _dt(mesh=[2, 2]), "placements for a mesh"),
    ("dtensor_mesh_zero", _dt(mesh=[0]), "dtensor.mesh[]"),
    ("dtensor_field", _dt(evil=1), "unknown field"),
]


@pytest.mark.parametrize("change,expect", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_multi_rank_manifest_is_refused(mem: str, change: Callable[[Man], Any], expect: str) -> None:
    rewrite(mem, change)
    with pytest.raises(CorruptCheckpointError) as e:
        _open(mem)
    assert expect in str(e.value)


def test_replicas_are_assigned_alike_on_every_rank_and_balanced() -> None:
    mb = knobs.get("small_replica_bytes")
    a = {"w": (4 * mb, 1, "float32", (mb,)), "b": (40, 2, "float32", (10,)),
         "v": (4 * mb, 3, "float32", (mb,)), "own": (8, 4, "float32", (2,))}
    b = dict(a, own=(8, 5, "float32", (2,)))                  # differs: not a replica
    owners = ranks.assign([a, b])
    assert owners == ranks.assign([dict(reversed(list(a.items()))), b])   # order-independent
    assert "own" not in owners and set(owners) == {"w", "b", "v"}
    assert owners["w"] != owners["v"]                                     # the two big ones split
    assert owners["b"] == 0                        # a small replica: rank 0's, not spread
    assert ranks.assign([a]) == {}
    # rank 1 writes 100 MB of sharded state anyway: the big replicas go to rank 0
    assert set(ranks.assign([a, a], base=[0, 100 * mb]).values()) == {0}
    # four ranks: the two big ones on two ranks, every small one on rank 0
    four = ranks.assign([a, a, a, a])
    assert len({four["w"], four["v"]}) == 2 and four["b"] == 0


def test_summary_holds_only_replicable_tensors_and_digests_ignore_order() -> None:
    idx = {"w": {"offsets": [0, 8], "crc32c": 1, "dtype": "float32", "shape": [2]},
           "s": {"offsets": [8, 16], "crc32c": 2, "dtype": "float32", "shape": [2],
                 "dtensor": {"placements": ["S(0)"]}},
           "r": {"offsets": [16, 24], "crc32c": 3, "dtype": "float32", "shape": [2],
                 "dtensor": {"placements": ["R"]}}}
    rep, sharded = ranks.summary(idx)
    assert set(rep) == {"w", "r"} and sharded == 8
    assert ranks.digest(rep) == ranks.digest(dict(reversed(list(rep.items()))))
    assert ranks.digest(rep) != ranks.digest(dict(rep, w=(8, 9, "float32", (2,))))
