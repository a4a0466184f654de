"""Multi-rank manifests (format version 2) read from disk are input, never truth.

A rank's own checkpoint is written by a real ``Checkpointer`` acting as rank 0 of a 2-rank job
(its memory tier commits alone, no other rank needed); each case then changes one field of its
manifest and re-seals it with a valid checksum. Opening must refuse it with a
``CorruptCheckpointError`` naming the field, never crash or read outside the shard.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt.cli import main as cli
from nebula_ckpt.dcp import NebulaStorageReader
from nebula_ckpt.errors import CorruptCheckpointError
from nebula_ckpt.format import manifest as mf
from nebula_ckpt.format.commit import Commit
from nebula_ckpt.format.dtensors import tiles
from nebula_ckpt.format.multi_rank import digest
from nebula_ckpt.format.names import COMMIT, MANIFEST, shard_name, step_dir
from nebula_ckpt.ranks import shards as ranks
from nebula_ckpt.ranks.coordinator import LocalCoordinator
from nebula_ckpt.restore.open import NotThisLayout, open_checkpoint
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
    man = json.load(open(os.path.join(mem, "step-1", MANIFEST)))
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
    # str.isdigit() takes both of these digits, int() only the second: only ASCII digits name a rank
    ("key_superscript_rank", lambda m: m["tensors"].update({"r\u00b2/w": m["tensors"].pop("r0/w")}), "'r\u00b2/w'"),
    ("key_arabic_indic_rank", lambda m: m["tensors"].update({"r\u0660/w": m["tensors"].pop("r0/w")}), "prefix"),
    ("key_zero_padded_rank", lambda m: m["tensors"].update({"r00/w": m["tensors"].pop("r0/w")}), "prefix"),
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
    mb = ranks.SMALL_REPLICA_BYTES
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


def test_replicas_go_to_a_bounded_block_of_owner_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A DDP job of 300 ranks and 100 big replicas: with ``REPLICA_OWNER_RANKS`` 8 every replica is
    owned by ranks 0..7 (a restoring rank reads at most 8 records files of owners), balanced
    among them; with 0 they spread over 100 ranks (one each), as many files to read."""
    mb = ranks.SMALL_REPLICA_BYTES
    rep = {f"w{i}": (4 * mb, i, "float32", (mb,)) for i in range(100)}
    monkeypatch.setattr(ranks, "REPLICA_OWNER_RANKS", 8)
    block = ranks.assign([rep] * 300)
    monkeypatch.setattr(ranks, "REPLICA_OWNER_RANKS", 0)
    spread = ranks.assign([rep] * 300)
    assert set(block.values()) == set(range(8))
    per = [sum(1 for r in block.values() if r == o) for o in range(8)]
    assert max(per) - min(per) <= 1                                      # 12 or 13 replicas each
    assert len(set(spread.values())) == 100


def test_summary_holds_only_replicable_tensors_and_digests_ignore_order() -> None:
    idx = {"w": {"offsets": [0, 8], "crc32c": 1, "dtype": "float32", "shape": [2]},
           "s": {"offsets": [8, 16], "crc32c": 2, "dtype": "float32", "shape": [2],
                 "dtensor": {"placements": ["S(0)"]}},
           "r": {"offsets": [16, 24], "crc32c": 3, "dtype": "float32", "shape": [2],
                 "dtensor": {"placements": ["R"]}}}
    rep, sharded = ranks.summary(idx)
    assert set(rep) == {"w", "r"} and sharded == 8
    assert digest(rep) == digest(dict(reversed(list(rep.items()))))
    assert digest(rep) != digest(dict(rep, w=(8, 9, "float32", (2,))))


# -- the ranks' DTensor records of a whole job: one validation point for every reader ----------------

def write_multi_rank(root: Path, step: int, world: int, pieces: dict[int, dict[str, Any]],
                     aliases: Optional[dict[str, str]] = None) -> None:
    """A multi-rank checkpoint written by hand: ``pieces[rank][key] = (tensor, dtensor-json or None)``;
    every rank saved the tree ``{key: tensor}`` of the same keys (aliases: ``"r1/k" -> "r0/k"``)."""
    from nebula_ckpt.format.header import safetensors_header
    from nebula_ckpt.native import get_ops

    aliases = aliases or {}
    d = root / step_dir(step)
    d.mkdir(parents=True)
    shards, tensors = [], {}
    for rank in sorted(pieces):
        items = [(f"r{rank}/{k}", t.contiguous()) for k, (t, _) in pieces[rank].items()]
        head, spans = safetensors_header([(k, t.dtype, tuple(t.shape), t.numel() * t.element_size()) for k, t in items])
        data = b"".join(t.numpy().tobytes() for _, t in items)
        name = shard_name(1, rank)
        (d / name).write_bytes(head + data)
        shards.append({"file": name, "bytes": len(head) + len(data)})
        for (k, t), (a, b), (_, info) in zip(items, spans, pieces[rank].values(), strict=True):
            raw = t.numpy().tobytes()
            tensors[k] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                          "offsets": [len(head) + a, len(head) + b], "crc32c": get_ops().crc32c_bytes(raw),
                          "shard": len(shards) - 1, **({"dtensor": info} if info else {})}
    keys = sorted({k for p in pieces.values() for k in p} | {a.split("/", 1)[1] for a in aliases})
    tree = {"t": "dict", "v": [[{"t": "str", "v": k}, {"t": "tensor", "k": k}] for k in keys]}
    man = mf.build_manifest(step=step, generation=1, shards=shards, tensors=tensors, aliases=aliases,
                            tree={"t": "list", "v": [tree]}, stats={},
                            ranks={"world_size": world, "ranks": list(range(world)),
                                   "rank_tree": {str(r): 0 for r in range(world)}})
    mb = json.dumps(man).encode()
    (d / MANIFEST).write_bytes(mb)
    (d / COMMIT).write_bytes(Commit(step, 1, len(mb), get_ops().crc32c_bytes(mb)).to_bytes())


W = torch.arange(12, dtype=torch.float32).reshape(4, 3)


def _rows(a: int, b: int, at: Optional[int] = None, shape: Any = (4, 3), **kw: Any) -> tuple[torch.Tensor, Man]:
    """Rows ``a:b`` of ``W`` as a rank's DTensor shard (offset ``at``, default ``a``) of global ``shape``."""
    info = {"shape": list(shape), "offsets": [a if at is None else at, 0], "placements": ["S(0)"], "mesh": [2]}
    info.update(kw)
    return W[a:b], info


def _two_ranks(r0: Any = None, r1: Any = None) -> dict[int, dict[str, Any]]:
    return {0: {"w": r0 or _rows(0, 2), "b": (torch.zeros(3), None)},
            1: {"w": r1 or _rows(2, 4), "b": (torch.ones(3), None)}}


# (id, rank 0's and rank 1's piece of "w", text the error names)
INCONSISTENT: list[tuple[str, dict[int, dict[str, Any]], str]] = [
    ("overlap_and_hole", _two_ranks(r1=_rows(2, 4, at=1)), "cover 12 elements of a global tensor of 12 [4, 3] and "
                                                            "overlap and leave a hole"),
    ("hole", _two_ranks(_rows(0, 2, shape=(5, 3)), _rows(2, 4, shape=(5, 3))),
     "cover 12 elements of a global tensor of 15 [5, 3] and leave a hole"),
    ("overlap", _two_ranks(_rows(0, 3)), "cover 15 elements of a global tensor of 12 [4, 3] and overlap"),
    ("global_shapes_differ", _two_ranks(r1=_rows(2, 4, shape=(6, 3))), "float32 of global shape [6, 3] on rank 1 "
                                                                        "but float32 of global shape [4, 3] on rank 0"),
    ("dtypes_differ", _two_ranks(r1=(W[2:].double(), _rows(2, 4)[1])), "float64 of global shape [4, 3] on rank 1"),
    ("plain_on_rank_1", _two_ranks(r1=(W[2:], None)), "'w' is a plain tensor on rank 1 but"),
    ("plain_on_rank_0", _two_ranks(r0=(W[:2], None)), "'w' is a plain tensor on rank 0 but a DTensor on rank 1"),
    ("same_offsets_other_shapes", _two_ranks(r1=_rows(2, 3, at=0)), "two shards start at [0, 0] with different"),
    ("replica_not_whole", _two_ranks(r1=_rows(2, 4, placements=["R"])), "replicated"),
]


def _damaged_everywhere(root: Path, step: int, expect: str, into: dict[str, Any], older: int,
                        capsys: pytest.CaptureFixture[str]) -> None:
    """Step ``step`` is DAMAGED for every reader (naming ``expect``); a restore falls back to ``older``."""
    with nc.Checkpointer(str(root), memory_tier=False) as ck:   # one process: the resharding restore
        assert ck.load_latest(into=into) == older
    with pytest.raises(CorruptCheckpointError) as ei:
        NebulaStorageReader(str(root), step)
    assert expect in str(ei.value)
    assert NebulaStorageReader(str(root)).step == older                 # the DCP reader skips it too
    capsys.readouterr()
    assert cli(["ls", str(root), "--json"]) == 1
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[step]["healthy"] is False and expect in rows[step]["problem"] and rows[older]["healthy"]
    assert cli(["verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert f"DAMAGED local:{root} step {step}" in out or ("DAMAGED" in out and expect in out), out
    assert cli(["inspect", str(root), "--step", str(step)]) == 1
    assert expect in capsys.readouterr().err
    dest = root.parent / "export.pt"
    assert cli(["export", str(root), "--step", str(step), "--to", str(dest)]) == 1
    err = capsys.readouterr().err
    assert expect in err and "Traceback" not in err and not dest.exists(), err


@pytest.mark.parametrize("pieces,expect", [c[1:] for c in INCONSISTENT], ids=[c[0] for c in INCONSISTENT])
def test_inconsistent_dtensor_records_make_the_step_damaged_everywhere(tmp_path: Path, pieces: dict[int, Any],
                                                                       expect: str,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Well-formed records that disagree across ranks: restore (one process, resharded) falls back
    to the older healthy step instead of raising; ls, verify, inspect, export and the DCP reader
    all call the step DAMAGED, naming the key."""
    root = tmp_path / "root"
    write_multi_rank(root, 1, 2, _two_ranks())
    write_multi_rank(root, 2, 2, pieces)
    into = {"w": torch.zeros(4, 3), "b": torch.full((3,), 7.0)}
    _damaged_everywhere(root, 2, expect, into, 1, capsys)
    assert torch.equal(into["w"], W) and torch.equal(into["b"], torch.zeros(3))


def _two_rows_per_rank(n: int, moved: bool = False) -> dict[int, dict[str, Any]]:
    """``n`` ranks, rank i holding rows ``2i, 2i + 1`` of a ``2n x 2`` DTensor (``moved``: the last
    rank's one row up: it overlaps its neighbour there and leaves the last row a hole, the element
    count unchanged)."""
    full = torch.arange(4 * n, dtype=torch.float32).reshape(2 * n, 2)
    out = {}
    for i in range(n):
        at = 2 * i - (moved and i == n - 1)
        out[i] = {"w": (full[2 * i:2 * i + 2], {"shape": [2 * n, 2], "offsets": [at, 0], "placements": ["S(0)"],
                                                "mesh": [n]})}
    return out


def test_more_than_64_chunks_that_overlap_and_leave_a_hole_are_damaged(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """70 ranks' shards of one tensor, one moved onto its neighbour: the element count still
    matches, so only an exact coverage check sees the hole (export would fill it from
    uninitialised memory)."""
    root = tmp_path / "root"
    write_multi_rank(root, 1, 70, _two_rows_per_rank(70))
    write_multi_rank(root, 2, 70, _two_rows_per_rank(70, moved=True))
    into = {"w": torch.zeros(140, 2)}
    _damaged_everywhere(root, 2, "cover 280 elements of a global tensor of 280 [140, 2] and overlap and leave a "
                        "hole", into, 1, capsys)
    assert torch.equal(into["w"], torch.arange(280, dtype=torch.float32).reshape(140, 2))
    dest = tmp_path / "one.pt"
    assert cli(["export", str(root), "--step", "1", "--to", str(dest)]) == 0
    assert torch.equal(torch.load(dest, weights_only=True)["w"], into["w"])


def _layout_manifest(shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> Man:
    """The manifest of a job with one rank per box ``(offsets, sizes)`` of a float32 DTensor of
    ``shape`` (each in a shard of its own): what Manifest.parse checks, no file needed."""
    shards, tensors = [], {}
    for r, (offs, sizes) in enumerate(boxes):
        n = 4 * math.prod(sizes)
        shards.append({"file": shard_name(1, r), "bytes": 8 + n})
        tensors[f"r{r}/w"] = {"dtype": "float32", "shape": list(sizes), "offsets": [8, 8 + n], "crc32c": 0,
                              "shard": r, "dtensor": {"shape": list(shape), "offsets": list(offs),
                                                      "placements": ["S(0)", "S(1)"], "mesh": [len(boxes), 1]}}
    tree = {"t": "dict", "v": [[{"t": "str", "v": "w"}, {"t": "tensor", "k": "w"}]]}
    world = len(boxes)
    return mf.build_manifest(step=1, generation=1, shards=shards, tensors=tensors, aliases={},
                             tree={"t": "list", "v": [tree]}, stats={},
                             ranks={"world_size": world, "ranks": list(range(world)),
                                    "rank_tree": {str(r): 0 for r in range(world)}})


def _grid(rows: int, cols: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """A ``rows x cols`` grid of uneven blocks over a ``(3 * rows - 1) x (2 * cols + 1)`` tensor."""
    r_cuts = [0] + [3 * i + 2 for i in range(rows - 1)] + [3 * rows - 1]
    c_cuts = [0] + [2 * j + 3 for j in range(cols - 1)] + [2 * cols + 1]
    return [((r_cuts[i], c_cuts[j]), (r_cuts[i + 1] - r_cuts[i], c_cuts[j + 1] - c_cuts[j]))
            for i in range(rows) for j in range(cols)]


def _bricks(rows: int, cols: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """A brick wall over ``rows x 2 * cols``: every other row shifted by one column (no grid)."""
    out = []
    for r in range(rows):
        cuts = list(range(0, 2 * cols + 1, 2)) if r % 2 == 0 else [0, *range(1, 2 * cols, 2), 2 * cols]
        out.extend(((r, a), (1, b - a)) for a, b in itertools.pairwise(cuts))
    return out


@pytest.mark.parametrize("layout", ["grid", "bricks"])
def test_thousands_of_chunks_that_tile_exactly_are_healthy_and_one_moved_is_not(layout: str) -> None:
    """Exact coverage for any number of chunks, without pairwise comparisons: a 100 x 100 grid of
    uneven blocks (10,000 ranks) and a brick wall (5,025 ranks, no grid) parse; the same with one
    chunk moved onto its neighbour (same element count: an overlap and a hole) is refused."""
    shape, boxes = ((299, 201), _grid(100, 100)) if layout == "grid" else ((50, 200), _bricks(50, 100))
    man = mf.Manifest.parse(_layout_manifest(shape, boxes), "t")
    assert len(man.tensors) == len(boxes) >= 5000
    (row, col), sizes = boxes[-1]
    moved = boxes[:-1] + [((row, col - 1) if layout == "bricks" else (row - 1, col), sizes)]
    with pytest.raises(CorruptCheckpointError, match="overlap and leave a hole"):
        mf.Manifest.parse(_layout_manifest(shape, moved), "t")


def _guillotine(rng: Any, lo: list[int], hi: list[int], out: list[Any], depth: int = 0) -> None:
    """Cut the box ``[lo, hi)`` at random, recursively: an exact tiling (no grid in general)."""
    dims = [d for d in range(len(lo)) if hi[d] - lo[d] > 1]
    if not dims or depth > 5 or rng.random() < 0.2:
        out.append(tuple(zip(lo, hi, strict=True)))
        return
    d = rng.choice(dims)
    cut = rng.randrange(lo[d] + 1, hi[d])
    _guillotine(rng, lo, [*hi[:d], cut, *hi[d + 1:]], out, depth + 1)
    _guillotine(rng, [*lo[:d], cut, *lo[d + 1:]], hi, out, depth + 1)


def test_exact_coverage_agrees_with_counting_every_element() -> None:
    """The coverage check against brute force (count how many boxes hold each element) on random
    exact tilings of 1-4 dimensions and on the same with one box moved, grown or dropped."""
    import random

    rng = random.Random(7)
    seen = {True: 0, False: 0}
    for _ in range(400):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 4)))
        boxes: list[Any] = []
        _guillotine(rng, [0] * len(shape), list(shape), boxes)
        change = rng.choice(["none", "move", "grow", "drop"])
        i = rng.randrange(len(boxes))
        lo, hi = [a for a, _ in boxes[i]], [b for _, b in boxes[i]]
        d = rng.randrange(len(shape))
        if change == "move" and lo[d] > 0:
            lo[d], hi[d] = lo[d] - 1, hi[d] - 1
        elif change == "grow" and hi[d] < shape[d]:
            hi[d] += 1
        boxes[i] = tuple(zip(lo, hi, strict=True))
        if change == "drop" and len(boxes) > 1:
            boxes.pop(i)
        count = torch.zeros(shape, dtype=torch.int64)
        for box in boxes:
            count[tuple(slice(a, b) for a, b in box)] += 1
        exact = bool((count == 1).all())
        assert tiles(shape, boxes, "w", "t") is exact, (shape, boxes)
        seen[exact] += 1
    assert min(seen.values()) > 50   # both outcomes were exercised


def test_a_layout_beyond_the_work_bound_is_refused_not_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("nebula_ckpt.format.dtensors.TILING_WORK_PER_CHUNK", 0)
    with pytest.raises(CorruptCheckpointError, match="too irregular to check"):
        mf.Manifest.parse(_layout_manifest((50, 200), _bricks(50, 100)), "t")
