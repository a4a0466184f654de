"""The transfers of a pull from a replica at restore (nebula_ckpt/tiers/memory/replica_pull.py):
the order both sides compute from the files' sizes. The pull itself runs on real ranks in
tests/tiers/memory/dist/test_replicas.py and tests/tiers/memory/dist/test_replicas_full.py."""

from __future__ import annotations

import mmap

import pytest

from nebula_ckpt.tiers.memory import replica_pull
from nebula_ckpt.tiers.memory.replica_pull import chunk_bytes, pull_order

FILES = [("COMMIT", 90), ("manifest.json", 3_000), ("r0.json", 0), ("shard-g1-r0.safetensors", 20_000_123)]


@pytest.mark.parametrize("chunk", [4096, 1 << 20, 8 << 20, 64 << 20])
def test_every_byte_moves_once_small_files_first(chunk: int) -> None:
    order = pull_order(FILES, chunk)
    covered: dict[int, list[tuple[int, int]]] = {}
    for i, lo, hi in order:
        assert 0 < hi - lo <= chunk
        covered.setdefault(i, []).append((lo, hi))
    for i, (_, size) in enumerate(FILES):
        spans = covered.get(i, [])
        assert [lo for lo, _ in spans] == list(range(0, size, chunk))  # in order, contiguous
        assert (spans[-1][1] if spans else 0) == size
    # the smallest files first, each whole before the next begins: the shard's chunks come last
    assert [i for i, _, _ in order][:2] == [0, 1]
    assert {i for i, _, _ in order[2:]} == {3}
    assert order == pull_order(list(FILES), chunk)  # the same on both sides


def test_the_chunk_size_is_whole_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    assert chunk_bytes() == 8 << 20
    monkeypatch.setattr(replica_pull, "PULL_CHUNK_BYTES", 5000)
    assert chunk_bytes() == mmap.PAGESIZE
    monkeypatch.setattr(replica_pull, "PULL_CHUNK_BYTES", 1)
    assert chunk_bytes() == mmap.PAGESIZE
