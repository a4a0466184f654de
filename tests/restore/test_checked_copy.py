"""A copy the replicas' recover round checked in full is not checked twice by the restore, and
only that copy: same tier, same writer generation, same step (see ``restore.select.Checked``).

The recover round (tests/tiers/memory/dist/test_replicas.py runs it on real ranks) checks every checksum of
each rank's memory-tier copy of the agreed step, own or pulled, before anything of ``into``
changes; the restore then opens that copy checking sizes only. Here a copy with flipped bytes
shows which copies skip the second check: one named exactly, and no other.
"""

from __future__ import annotations

from pathlib import Path

import torch

import nebula_ckpt as nc
from nebula_ckpt.format.commit import read_commit
from nebula_ckpt.restore.select import find_and_open
from nebula_ckpt.tiers.local import LocalTier


def test_only_the_copy_named_checked_skips_its_checksums(tmp_path: Path, shm_dir: str) -> None:
    root = str(tmp_path / "root")
    with nc.Checkpointer(root, memory_tier=False, keep_last=5) as ck:
        ck.save(1, {"w": torch.ones(4096)})
        ck.save(2, {"w": torch.full((4096,), 2.0)})
    shard = next(Path(root, "step-2").glob("shard-*"))
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF  # tensor bytes: sizes and manifest intact
    shard.write_bytes(bytes(data))
    tier = LocalTier(root)
    pairs = [(tier, tier.make_storage())]
    gen, _, save = read_commit(pairs[0][1], 2, "step 2").write

    ck2 = find_and_open(pairs)  # the damaged step is skipped
    assert ck2 is not None and ck2.step == 1
    for other in [(tier.name, gen + 1, 2, save), ("memory:elsewhere", gen, 2, save), (tier.name, gen, 1, save),
                  (tier.name, gen, 2, save + 1)]:
        ck2 = find_and_open(pairs, checked=other)
        assert ck2 is not None and ck2.step == 1, other  # still checked in full, still skipped
    ck2 = find_and_open(pairs, checked=(tier.name, gen, 2, save))  # checked moments ago: sizes only
    assert ck2 is not None and ck2.step == 2
