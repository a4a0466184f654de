"""Partner choice for memory-tier replicas and the restore plan (pure functions; the transfer
itself runs on real ranks in tests/tiers/memory/dist/test_replicas.py)."""

from __future__ import annotations

import pytest

import nebula_ckpt as nc
from nebula_ckpt import knobs
from nebula_ckpt.errors import ValidationError
from nebula_ckpt.ranks.partners import choose_partners, node_id, sources_of
from nebula_ckpt.tiers.memory import recovery

LAYOUTS = [
    ["a", "a", "b", "b"],
    ["a", "b", "c"],
    ["a", "a", "a", "b", "b", "c"],            # uneven nodes
    ["x", "y", "x", "y", "z", "z", "w", "w"],  # ranks interleaved over nodes
]


@pytest.mark.parametrize("nodes", LAYOUTS)
def test_partners_are_on_other_nodes_and_never_share_one(nodes: list[str]) -> None:
    n_nodes = len(set(nodes))
    for k in range(0, n_nodes):
        partners = choose_partners(nodes, k)
        assert len(partners) == len(nodes)
        for r, ps in enumerate(partners):
            assert len(ps) == k
            where = [nodes[p] for p in ps]
            assert nodes[r] not in where, f"rank {r} has a partner on its own node: {ps}"
            assert len(set(where)) == k, f"rank {r}'s partners share a node: {ps}"
        # every copy has a holder that knows it holds it
        assert sum(len(sources_of(partners, r)) for r in range(len(nodes))) == k * len(nodes)


def test_even_nodes_spread_the_copies_evenly() -> None:
    nodes = ["a"] * 4 + ["b"] * 4 + ["c"] * 4
    partners = choose_partners(nodes, 2)
    assert all(len(sources_of(partners, r)) == 2 for r in range(len(nodes)))


@pytest.mark.parametrize("nodes,k", [(["a", "a"], 1), (["a", "b"], 2), (["a", "b", "c"], 3)])
def test_too_few_nodes_names_the_numbers(nodes: list[str], k: int) -> None:
    with pytest.raises(ValidationError) as e:
        choose_partners(nodes, k)
    msg = str(e.value)
    assert f"replicas={k}" in msg and f"at least {k + 1} nodes" in msg and f"{len(set(nodes))} node(s)" in msg


def test_bad_replica_counts_are_refused_before_anything_is_written(tmp_path) -> None:
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValidationError, match="replicas"):
            nc.Checkpointer(str(tmp_path / "r"), tiers=[nc.MemoryTier(replicas=bad), nc.LocalTier(str(tmp_path / "r"))])
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").glob("step-*"))


def test_one_process_has_no_partner_node(tmp_path, shm_dir: str) -> None:
    with pytest.raises(ValidationError, match="no partner"):
        nc.Checkpointer(str(tmp_path / "r"), tiers=[nc.MemoryTier(replicas=1), nc.LocalTier(str(tmp_path / "r"))])


def test_node_id_comes_from_the_knob() -> None:
    with knobs.override(node_id="rack7-node3"):
        assert node_id() == "rack7-node3"
    assert node_id()  # the host name otherwise


def _view(own=(), held=None, shared=(), can_pull=True):  # type: ignore[no-untyped-def]
    return {"own": list(own), "held": held or {}, "shared": list(shared), "can_pull": can_pull}


def test_target_is_the_newest_step_every_rank_can_get() -> None:
    # rank 1 lost its node: its step 5 is held by rank 0; the disk has step 2
    views = [_view(own=[(1, 5, 4)], held={1: [(1, 5, 4)]}, shared=[(1, 2, 1)]), _view(shared=[(1, 2, 1)])]
    assert recovery.choose_target(views) == (1, 5, 4)
    assert recovery.assignments(views, (1, 5, 4), {1: 0}) == {1: 0}
    assert recovery.assignments(views, (1, 5, 4), {1: 1}) == {}
    # the holder's copy failed: step 5 excluded, the disk's step 2 is next
    assert recovery.choose_target(views, excluded=[(1, 5, 4)]) == (1, 2, 1)
    # a rank that cannot receive (no memory tier) cannot use replicas
    views[1]["can_pull"] = False
    assert recovery.choose_target(views) == (1, 2, 1)
    assert recovery.assignments(views, (1, 5, 4), {1: 0}) == {}


def test_a_newer_writer_generation_wins_and_step_filters_apply() -> None:
    views = [_view(own=[(1, 9, 8), (2, 3, 0)], held={1: [(2, 3, 0)]}), _view(own=[(1, 9, 8)], held={0: [(2, 3, 0)]})]
    assert recovery.choose_target(views) == (2, 3, 0)
    assert recovery.choose_target(views, step=9) == (1, 9, 8)
    assert recovery.choose_target(views, among=[1, 2]) is None


def test_two_writes_of_one_step_are_never_mixed() -> None:
    """Step 5 saved twice (saves 3 and 4): rank 0 holds the second write, rank 1 can get only the
    first (its partner's replica, the disk): the first is the one every rank can get, and no rank
    is sent a copy of the other write."""
    views = [_view(own=[(1, 5, 4)], held={1: [(1, 5, 3)]}, shared=[(1, 5, 3)]), _view(shared=[(1, 5, 3)])]
    assert recovery.choose_target(views) == (1, 5, 3)
    assert recovery.holders(views, 1, (1, 5, 3)) == [0] and recovery.holders(views, 1, (1, 5, 4)) == []
    # without the disk's copy, only an older step every rank has
    views = [_view(own=[(1, 5, 4), (1, 4, 2)], held={1: [(1, 5, 3), (1, 4, 2)]}), _view()]
    assert recovery.choose_target(views) == (1, 4, 2)


def test_only_steps_of_this_world_size_are_offered_from_memory(tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    """A restart on another world size restores through the shared tiers (resharding), never a
    rank's part of the old layout from memory or a replica."""
    import torch

    from nebula_ckpt.tiers.memory.replica_store import of_world, writes

    folder = str(tmp_path / "tier")
    with nc.Checkpointer(folder, memory_tier=False) as ck:
        ck.save(1, {"w": torch.ones(3)}).result()
    have = writes(folder)
    assert [s for _, s, _ in have] == [1]
    assert of_world(folder, have, 1) == have
    assert of_world(folder, have, 2) == []


def test_a_full_check_of_a_copy_names_the_tensor_whose_bytes_differ(tmp_path) -> None:  # noqa: ANN001
    """The check a replica or a pulled copy passes before it becomes visible (and a rank's own
    copy before the restore trusts it): one byte flipped in any tensor is found, naming it; a
    size check alone would not see it."""
    import torch

    from nebula_ckpt.errors import CorruptCheckpointError
    from nebula_ckpt.format.names import step_dir
    from nebula_ckpt.restore.open import read_manifest
    from nebula_ckpt.storage.local import LocalStorage
    from nebula_ckpt.tiers.memory.replica_store import verify_step

    folder = str(tmp_path / "tier")
    state = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(7, dtype=torch.int64),
             "c": torch.full((64, 64), 3.0)}
    with nc.Checkpointer(folder, memory_tier=False) as ck:
        ck.save(1, state).result()
    verify_step(folder, 1, 0, 1, "full")
    st = LocalStorage(folder, private=True, fsync=False)
    man = read_manifest(st, 1)
    st.close()
    for key in ("a", "b", "c"):
        rec = man.tensors[key]
        path = tmp_path / "tier" / step_dir(1) / man.shards[rec.shard].file
        before = path.read_bytes()
        data = bytearray(before)
        data[rec.start + rec.nbytes // 2] ^= 0x01
        path.write_bytes(bytes(data))
        verify_step(folder, 1, 0, 1, "size")
        with pytest.raises(CorruptCheckpointError, match=f"'{key}'"):
            verify_step(folder, 1, 0, 1, "full")
        path.write_bytes(before)
    verify_step(folder, 1, 0, 1, "full")


@pytest.mark.parametrize("node", ["a", "host-17.example.org", "nœud-ü", "x" * 255, "y" * 4000, "a\0b"])
def test_node_ids_travel_in_fixed_size_and_keep_nodes_apart(node: str) -> None:
    from nebula_ckpt.ranks.partners import NODE_ID_BYTES, pack_node_id, unpack_node_id

    packed = pack_node_id(node)
    assert len(packed) == NODE_ID_BYTES
    back = unpack_node_id(packed)
    if len(node.encode()) < NODE_ID_BYTES and "\0" not in node:
        assert back == node  # the id itself: error messages name it
    else:
        assert back.startswith("sha256:")
    # ids that differ anywhere (past the fixed size too) stay different nodes
    assert unpack_node_id(pack_node_id(node + "2")) != back
    assert choose_partners([back, back, unpack_node_id(pack_node_id(node + "2"))], 1)[0] == [2]


def test_a_copy_checked_where_it_landed_names_the_tensor_whose_bytes_differ(tmp_path) -> None:  # noqa: ANN001
    """A received copy's checksums are taken on the mapping its bytes landed in (no second
    mapping of the file): one byte flipped there in any tensor is found, naming it; bytes that do
    not match the shard's size are left to the check through the file."""
    import mmap

    import torch

    from nebula_ckpt.errors import CorruptCheckpointError
    from nebula_ckpt.format.names import step_dir
    from nebula_ckpt.restore.open import read_manifest
    from nebula_ckpt.storage.local import LocalStorage
    from nebula_ckpt.tiers.memory.replica_store import verify_step

    folder = str(tmp_path / "tier")
    state = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(7, dtype=torch.int64),
             "c": torch.full((64, 64), 3.0)}
    with nc.Checkpointer(folder, memory_tier=False) as ck:
        ck.save(1, state).result()
    st = LocalStorage(folder, private=True, fsync=False)
    man = read_manifest(st, 1)
    st.close()
    shard = man.shards[man.tensors["a"].shard].file
    with open(tmp_path / "tier" / step_dir(1) / shard, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 0)
    try:
        landed = torch.frombuffer(mm, dtype=torch.uint8)
        verify_step(folder, 1, 0, 1, "full", landed={shard: landed})
        for key in ("a", "b", "c"):
            rec = man.tensors[key]
            flipped = landed.clone()  # the file keeps its bytes: only the landed ones differ
            flipped[rec.start + rec.nbytes // 2] ^= 0x01
            with pytest.raises(CorruptCheckpointError, match=f"'{key}'"):
                verify_step(folder, 1, 0, 1, "full", landed={shard: flipped})
            verify_step(folder, 1, 0, 1, "size", landed={shard: flipped})
        verify_step(folder, 1, 0, 1, "full", landed={shard: landed[:-1]})  # checked through the file
        landed[man.tensors["c"].start] ^= 0x01  # the file itself: a short buffer falls back to it
        with pytest.raises(CorruptCheckpointError, match="'c'"):
            verify_step(folder, 1, 0, 1, "full", landed={shard: landed[:-1]})
        landed[man.tensors["c"].start] ^= 0x01
        del landed, flipped
    finally:
        mm.close()
