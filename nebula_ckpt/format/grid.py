"""Where DTensor's own layout puts each rank's chunk, and which ranks hold a region of a tensor.

A DTensor placed on a device mesh that spans every rank of the job in order (what
``init_device_mesh`` builds) has its local shard at a position the placements alone determine:
along each mesh dimension sharding tensor dimension ``d`` (``S(d)``), the current extent is cut in
chunks of ``ceil(n / mesh_size)`` elements and the rank's coordinate picks one (the last chunks
may be shorter, or empty). A checkpoint whose every DTensor record sits at that position is *on
the grid* (format version 4, :mod:`nebula_ckpt.format.rank_records`): its chunks tile each
tensor exactly by construction, and a resharding reader finds the ranks holding any region by
arithmetic (:func:`holders`), without reading every rank's records. Other layouts (a mesh over
some ranks only, ``_StridedShard``, a custom rank order) are valid all the same: they are just
not on the grid, and readers then read every rank's records.
"""

from __future__ import annotations

import math
from typing import Sequence

Region = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape)


def coordinate(rank: int, mesh: Sequence[int]) -> tuple[int, ...]:
    """``rank``'s coordinate in a mesh of shape ``mesh`` laid over ranks ``0..prod(mesh)-1`` row-major."""
    out = []
    for n in reversed(mesh):
        out.append(rank % n)
        rank //= n
    return tuple(reversed(out))


def _cut(size: int, parts: int, c: int) -> tuple[int, int]:
    """``(start, length)`` of chunk ``c`` of ``parts`` of an extent of ``size`` (DTensor's uneven split)."""
    step = -(-size // parts) if parts else size
    start = step * c
    if start >= size:
        return size, 0
    return start, min(size, start + step) - start


def chunk_at(shape: Sequence[int], placements: Sequence[str], mesh: Sequence[int],
             coord: Sequence[int]) -> Region:
    """The ``(offsets, shape)`` of the chunk at mesh coordinate ``coord``."""
    offs, size = [0] * len(shape), list(shape)
    for i, p in enumerate(placements):
        if p == "R":
            continue
        d = int(p[2:-1])
        start, size[d] = _cut(size[d], mesh[i], coord[i])
        offs[d] += start
    return tuple(offs), tuple(size)


def on_grid(shape: Sequence[int], placements: Sequence[str], mesh: Sequence[int], rank: int, world: int,
            offsets: Sequence[int], local: Sequence[int]) -> bool:
    """Whether ``rank``'s chunk (``offsets``, ``local``) sits where :func:`chunk_at` puts it
    (an empty chunk anywhere counts), on a mesh spanning the ``world`` ranks."""
    if math.prod(mesh) != world:
        return False
    want_offs, want_shape = chunk_at(shape, placements, mesh, coordinate(rank, mesh))
    if tuple(local) != want_shape:
        return False
    return not math.prod(local) or tuple(offsets) == want_offs


def holders(shape: Sequence[int], placements: Sequence[str], mesh: Sequence[int],
            region: Region) -> list[tuple[int, Region]]:
    """``(rank, chunk)`` of the grid chunks overlapping ``region`` (one replica of each: coordinate
    0 on replicated mesh dimensions), in rank order. The work is the number of chunks returned
    times the mesh dimensions, whatever the number of ranks."""
    lo, n = region
    hi = [a + b for a, b in zip(lo, n, strict=True)]
    cands: list[tuple[tuple[int, ...], list[int], list[int]]] = [((), [0] * len(shape), list(shape))]
    for i, p in enumerate(placements):
        nxt = []
        for coord, offs, size in cands:
            if p == "R":
                nxt.append((coord + (0,), offs, size))
                continue
            d = int(p[2:-1])
            step = max(1, -(-size[d] // mesh[i]))
            first = max(0, (lo[d] - offs[d]) // step)
            last = min(mesh[i] - 1, (hi[d] - 1 - offs[d]) // step)
            for c in range(first, last + 1):
                start, length = _cut(size[d], mesh[i], c)
                if length:
                    o, s = list(offs), list(size)
                    o[d], s[d] = offs[d] + start, length
                    nxt.append((coord + (c,), o, s))
        cands = nxt
    out = []
    for coord, offs, size in cands:
        rank = 0
        for c, m in zip(coord, mesh, strict=True):
            rank = rank * m + c
        out.append((rank, (tuple(offs), tuple(size))))
    return sorted(out)
