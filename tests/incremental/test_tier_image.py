"""The stage that decides what a tier writes for a snapshot (``save/tier_image.py``), on a real
disk tier's committed base: unchanged tensors become references to the base's shard, changed
ones are written, and a base whose shard is gone makes the image whole (and tells the writer to
forget it), never a step that refers to missing bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import nebula_ckpt as nc
from nebula_ckpt.format.manifest import Manifest
from nebula_ckpt.save.tier_image import Staged, tier_image
from nebula_ckpt.storage.local import LocalStorage


def _base(root: str) -> tuple[Manifest, bytes, LocalStorage]:
    """Step 1 committed on a disk tier, its manifest and its shard's bytes (a staged snapshot of
    the same layout)."""
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, {"a": torch.arange(1000.0), "b": torch.ones(3000), "c": torch.zeros(2000)}).result()
    m = Manifest.parse(Path(root, "step-1", "manifest.json").read_bytes(), "test", 1)
    return m, Path(root, "step-1", m.shards[0].file).read_bytes(), LocalStorage(root)


def _staged(m: Manifest, data: bytes, hashes: dict[str, str]) -> Staged:
    index: dict[str, dict[str, Any]] = {k: r.to_json() for k, r in m.tensors.items()}
    return Staged(2, m.generation, index, hashes, memoryview(data))


def test_unchanged_tensors_are_references_and_changed_ones_are_written(root: str) -> None:
    m, data, st = _base(root)
    same = tier_image(_staged(m, data, dict(m.hashes)), m, st, "t", nbytes=len(data))
    assert same.base == 1 and same.write == () and not same.full and not same.lost_base
    assert [r.file for r in same.refs] == [m.shards[0].file] and same.reused_bytes == 24000
    assert all(rec["shard"] == 1 for rec in same.records.values())  # every record points at the base's shard
    one = tier_image(_staged(m, data, {**m.hashes, "a": "0" * 64}), m, st, "t", nbytes=len(data))
    assert one.write == ("a",) and one.base == 1 and one.reused_bytes == 20000
    assert "shard" not in one.records["a"] and one.records["b"]["shard"] == 1
    assert one.parts is not None and one.nbytes < len(data)  # the own shard holds only "a"
    assert bytes(b"".join(bytes(p) for p in one.parts)).endswith(bytes(torch.arange(1000.0).numpy().data))


def test_most_bytes_changed_or_no_base_is_whole(root: str) -> None:
    m, data, st = _base(root)
    changed = {**m.hashes, "b": "0" * 64, "c": "0" * 64}  # more than half the bytes changed
    for image in (tier_image(_staged(m, data, changed), m, st, "t", nbytes=len(data)),
                  tier_image(_staged(m, data, dict(m.hashes)), None, st, "t", nbytes=len(data))):
        assert image.full and image.base is None and image.parts is None and image.nbytes == len(data)
        assert not image.lost_base


def test_a_base_whose_shard_is_gone_makes_the_image_whole_and_is_forgotten(root: str) -> None:
    m, data, st = _base(root)
    Path(root, "step-1", m.shards[0].file).unlink()  # deleted by hand
    image = tier_image(_staged(m, data, dict(m.hashes)), m, st, "t", nbytes=len(data))
    assert image.full and image.parts is None and image.lost_base
