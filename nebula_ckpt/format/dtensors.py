"""The ranks' records of each DTensor, checked across ranks: alike, and covering the tensor exactly.

A multi-rank checkpoint stores each rank's local shard of a DTensor with a ``dtensor`` record
(global shape, offsets, placements, mesh). :func:`check_dtensors` (run when a manifest is parsed)
refuses records that disagree between ranks and, when the manifest holds every rank of its job,
chunks that leave a hole or overlap (:func:`tiles`, with a bounded amount of work).
:func:`logical_groups` and :func:`dtensor_chunks` are what readers (DCP's planner) use too.
"""

from __future__ import annotations

import itertools
import math
from typing import Mapping

from nebula_ckpt.format.checks import bad
from nebula_ckpt.format.records import ShardRecord, TensorRecord

#: Work the exact coverage check of one tensor may do, per chunk: 2**6 (six dimensions split in a
#: layout nothing cancels); the grids DTensor writes take a few steps per chunk whatever their size.
TILING_WORK_PER_CHUNK = 64

Chunks = list[tuple[tuple[int, ...], TensorRecord]]


def logical_groups(tensors: Mapping[str, TensorRecord], aliases: Mapping[str, str],
                   multi_rank: bool) -> dict[str, list[tuple[int, str, TensorRecord]]]:
    """Logical key (no ``r<R>/`` prefix) -> ``(rank, manifest key, stored record)`` of every rank
    holding it, lowest rank first (aliases resolved). A one-process manifest gives each key once, as
    rank 0. Keys must be those of a parsed manifest (every key starts with a held rank's prefix)."""
    groups: dict[str, list[tuple[int, str, TensorRecord]]] = {}
    for full in itertools.chain(tensors, aliases):
        rec = tensors[aliases.get(full, full)]
        if multi_rank:
            head, _, key = full.partition("/")
            rank = int(head[1:])
        else:
            rank, key = 0, full
        groups.setdefault(key, []).append((rank, full, rec))
    for holders in groups.values():
        holders.sort(key=lambda x: x[0])
    return groups


def dtensor_chunks(key: str, holders: list[tuple[int, TensorRecord]], shards: tuple[ShardRecord, ...],
                   where: str) -> tuple[tuple[int, ...], Chunks]:
    """Global shape and the distinct non-empty chunks ``[(offsets, record)]`` (sorted by offsets) of
    logical tensor ``key``, of which ``holders`` are ``(rank, record)``, lowest rank first, the first
    a DTensor record. Replicas (same offsets and shape on several ranks) count once: the lowest rank's.

    Raises:
        CorruptCheckpointError: the ranks' records disagree: a plain tensor on one rank, a DTensor
            on another; other global shapes or dtypes; two chunks at the same offsets of other shapes.
    """
    first_rank, first = holders[0]
    assert first.dtensor is not None
    shape = first.dtensor.shape
    by_offsets: dict[tuple[int, ...], TensorRecord] = {}
    for rank, rec in holders:
        info = rec.dtensor
        if info is None or info.shape != shape or rec.dtype != first.dtype:
            what = "a plain tensor" if info is None else f"{rec.dtype} of global shape {list(info.shape)}"
            raise bad(where, f"key '{key}' is {what} on rank {rank} but {first.dtype} of global shape "
                       f"{list(shape)} on rank {first_rank}: the ranks' records disagree")
        if not math.prod(rec.shape):
            continue  # an empty shard (uneven sharding) holds no element
        have = by_offsets.setdefault(info.offsets, rec)
        if have.shape != rec.shape:
            raise bad(where, f"key '{key}': two shards start at {list(info.offsets)} with different shapes "
                       f"({list(have.shape)} in {shards[have.shard].file}, {list(rec.shape)} in "
                       f"{shards[rec.shard].file})")
    return shape, sorted(by_offsets.items())


def check_dtensors(tensors: Mapping[str, TensorRecord], aliases: Mapping[str, str],
                    shards: tuple[ShardRecord, ...], world: int, complete: bool, where: str) -> None:
    """The ranks' records of each DTensor agree (:func:`dtensor_chunks`) and, when the manifest holds
    every rank of its job (``complete``), their chunks cover the global tensor exactly: every
    element in exactly one chunk (a hole would be read as whatever memory held; an overlap hides one)."""
    for key, held in logical_groups(tensors, aliases, world > 1).items():
        if all(rec.dtensor is None for _, _, rec in held):
            continue
        holders = [(r, rec) for r, _, rec in held]
        if holders[0][1].dtensor is None:
            rank = next(r for r, rec in holders if rec.dtensor is not None)
            raise bad(where, f"key '{key}' is a plain tensor on rank {holders[0][0]} but a DTensor on rank "
                       f"{rank}: the ranks' records disagree")
        shape, chunks = dtensor_chunks(key, holders, shards, where)
        if complete:
            _check_coverage(key, shape, chunks, where)


def _check_coverage(key: str, shape: tuple[int, ...], chunks: Chunks, where: str) -> None:
    """Raise unless ``chunks`` (inside ``shape``, checked by :meth:`DTensorInfo.parse`) tile it."""
    numel = math.prod(shape)
    if not numel:
        return  # an empty tensor: nothing to cover
    covered = sum(math.prod(rec.shape) for _, rec in chunks)
    if covered == numel and tiles(shape, [tuple(zip(o, (a + n for a, n in zip(o, rec.shape, strict=True)),
                                                     strict=True)) for o, rec in chunks], key, where):
        return
    how = "overlap and leave a hole" if covered == numel else "leave a hole" if covered < numel else "overlap"
    raise bad(where, f"key '{key}': the ranks' shards ({len(chunks)} distinct) cover {covered} elements of a "
               f"global tensor of {numel} {list(shape)} and {how}: a shard is missing or misplaced")


Box = tuple[tuple[int, int], ...]


def tiles(shape: tuple[int, ...], boxes: list[Box], key: str, where: str) -> bool:
    """Whether the non-empty ``boxes`` (``(start, end)`` per dimension) cover ``[0, shape)`` with
    every point in exactly one, exactly, for any number of boxes.

    The sum of the boxes' indicator functions minus the global box's must vanish. Along one
    dimension, that function is zero iff its finite difference is, at every coordinate where a box
    starts or ends: there the difference is the signed sum of the boxes' faces, a problem of one
    dimension less. Equal faces of opposite signs cancel first (in a grid, every inner face), so a
    DTensor grid costs a few steps per chunk; the work is bounded all the same (a layout beyond it
    is refused as too irregular to check, which no writer produces).
    """
    budget = TILING_WORK_PER_CHUNK * (len(boxes) + 1)

    def vanishes(items: list[tuple[int, Box]]) -> bool:
        nonlocal budget
        acc: dict[Box, int] = {}
        for sign, box in items:
            acc[box] = acc.get(box, 0) + sign
        live = [(sign, box) for box, sign in acc.items() if sign]
        if len(live) <= 1:
            return not live  # one distinct non-empty box, a non-zero number of times: not zero
        budget -= len(live)
        if budget < 0:
            raise bad(where, f"key '{key}': the ranks' {len(boxes)} shards form a layout too irregular to "
                       "check for exact coverage")
        head = live[0][1]
        dim = next(d for d in range(len(head)) if any(box[d] != head[d] for _, box in live))
        faces: dict[int, list[tuple[int, Box]]] = {}
        for sign, box in live:
            rest = box[:dim] + box[dim + 1:]
            faces.setdefault(box[dim][0], []).append((sign, rest))
            faces.setdefault(box[dim][1], []).append((-sign, rest))
        return all(vanishes(f) for f in faces.values())

    whole: Box = tuple((0, n) for n in shape)
    return vanishes([(1, b) for b in boxes] + [(-1, whole)])
