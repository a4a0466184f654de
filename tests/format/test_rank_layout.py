"""Format version 4's metadata functions: DTensor's grid, the ranks a region needs, rank 0's checks.

The grid (:mod:`nebula_ckpt.format.grid`) is checked against torch's own computation of a
DTensor's local shard for every rank of assorted meshes, placements and (uneven) shapes; the
lookup of the ranks holding a region against a brute-force scan of every rank's chunk.
"""

from __future__ import annotations

import itertools
import math
import random
import zlib

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from nebula_ckpt.errors import PersistError
from nebula_ckpt.format.grid import chunk_at, coordinate, holders, on_grid
from nebula_ckpt.ranks.split import split_manifest

LAYOUTS = [((8,), ["S(0)"], (4,)), ((7, 5), ["S(0)"], (4,)), ((3, 9), ["S(1)"], (4,)),
           ((10, 6), ["S(0)", "S(1)"], (2, 3)),
           ((9, 4), ["S(0)", "S(0)"], (2, 2)), ((6, 4), ["R", "S(0)"], (2, 3)), ((5, 5), ["S(1)", "R"], (3, 2)),
           ((2, 3), ["S(0)"], (5,)), ((4, 4), ["R"], (3,))]


def _torch_chunk(shape: tuple[int, ...], placements: list[str], mesh: tuple[int, ...],
                 rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    pl = [Replicate() if p == "R" else Shard(int(p[2:-1])) for p in placements]
    local, offs = _compute_local_shape_and_global_offset(shape, mesh, list(coordinate(rank, mesh)), pl)
    return tuple(offs), tuple(local)


@pytest.mark.parametrize("shape,placements,mesh", LAYOUTS)
def test_the_grid_is_where_dtensor_puts_each_ranks_chunk(shape: tuple[int, ...], placements: list[str],
                                                          mesh: tuple[int, ...]) -> None:
    world = math.prod(mesh)
    for rank in range(world):
        offs, local = _torch_chunk(shape, placements, mesh, rank)
        mine = chunk_at(shape, placements, mesh, coordinate(rank, mesh))
        assert mine[1] == local and (not math.prod(local) or mine[0] == offs), (rank, mine, offs, local)
        assert on_grid(shape, placements, mesh, rank, world, offs, local)
        assert not on_grid(shape, placements, mesh, rank, world + 1, offs, local)  # a mesh over some ranks only
        if math.prod(local) and any(p != "R" for p in placements):
            moved = (offs[0] + 1,) + offs[1:] if offs[0] + 1 + local[0] <= shape[0] else (offs[0] - 1,) + offs[1:]
            assert not on_grid(shape, placements, mesh, rank, world, moved, local) or moved == offs


@pytest.mark.parametrize("shape,placements,mesh", LAYOUTS)
def test_the_ranks_holding_a_region_are_found_by_arithmetic(shape: tuple[int, ...], placements: list[str],
                                                             mesh: tuple[int, ...]) -> None:
    rng = random.Random(7)
    world = math.prod(mesh)
    chunks = {r: chunk_at(shape, placements, mesh, coordinate(r, mesh)) for r in range(world)}
    for _ in range(40):
        lo = tuple(rng.randrange(n) for n in shape)
        size = tuple(rng.randint(1, n - a) for a, n in zip(lo, shape, strict=True))
        got = holders(shape, placements, mesh, (lo, size))
        # brute force: each distinct overlapping chunk once (replicas: the one at coordinate 0 there)
        want = {}
        for r, (o, n) in chunks.items():
            if math.prod(n) and all(a < b + m and b < a + s for a, s, b, m in zip(lo, size, o, n, strict=True)):
                want.setdefault((o, n), r)
        assert sorted((r, c) for c, r in want.items()) == got
        covered = sum(math.prod(max(0, min(a + s, b + m) - max(a, b))
                                for a, s, b, m in zip(lo, size, o, n, strict=True)) for _, (o, n) in got)
        assert covered == math.prod(size)  # the chunks found cover the region exactly


def _part(rank: int, table: dict[str, list[object]] | None) -> dict[str, object]:
    return {"step": 1, "shard": {"file": f"shard-g1-r{rank}.safetensors", "bytes": 8},
            "records": {"file": f"records-g1-r{rank}.json", "bytes": 2, "crc32c": 0}, "tree_digest": "d0",
            "tree": {"t": "dict", "v": []} if rank == 0 else None, "stats": {}, "table": table, "grid": True}


def layout_manifest(*, step: int, generation: int, parts: list[dict[str, object]],
                    owners: dict[str, int]) -> dict[str, object]:
    """Rank 0's version 4 manifest, by the commit's own builder."""
    return rank_0_writes(step=step, generation=generation, parts=parts, owners=owners)[0]


def rank_0_writes(*, step: int, generation: int, parts: list[dict[str, object]],
                  owners: dict[str, int]) -> tuple[dict[str, object], bytes]:
    """What rank 0 writes of a version 4 commit: the manifest and ranks.json."""
    return split_manifest(step=step, generation=generation, save_id="ab" * 16, parts=parts, owners=owners,
                          crc=zlib.crc32)


def test_rank_0_refuses_ranks_whose_dtensor_tables_disagree() -> None:
    a = {"w": ["float32", [8, 4], ["S(0)"], [2]], "v": ["float32", [4], ["S(0)"], [2]]}
    man = layout_manifest(step=1, generation=1, parts=[_part(0, a), _part(1, None), _part(2, {"u": a["v"]})],
                          owners={})
    assert set(man["dtensors"]) == {"w", "v", "u"} and man["grid"] is True  # the union of the distinct tables
    b = dict(a, w=["float32", [16, 4], ["S(0)"], [2]])
    with pytest.raises(PersistError, match=r"key 'w' is a DTensor .* on rank 2 but .* on rank 0"):
        layout_manifest(step=1, generation=1, parts=[_part(0, a), _part(1, None), _part(2, b)], owners={})
    off = [_part(0, a), dict(_part(1, None), grid=False)]
    assert layout_manifest(step=1, generation=1, parts=off, owners={})["grid"] is False


def test_per_rank_entries_are_all_rank_0_writes_per_rank() -> None:
    """What rank 0 writes grows by one shard and one records entry a rank, whatever the tensors."""
    table = {f"t{i}": ["float32", [64, 4], ["S(0)"], [64]] for i in range(50)}
    sizes = [sum(len(repr(x)) for x in rank_0_writes(step=1, generation=1, owners={},
                                                     parts=[_part(0, table)] + [_part(r, None) for r in range(1, n)]))
             for n in (2, 66, 130)]
    assert sizes[2] - sizes[1] == pytest.approx(sizes[1] - sizes[0], rel=0.05)
    assert (sizes[1] - sizes[0]) / 64 < 300  # bytes a rank


def test_coordinates_are_row_major() -> None:
    assert [coordinate(r, (2, 3)) for r in range(6)] == list(itertools.product(range(2), range(3)))
