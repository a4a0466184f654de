"""A step a compressing remote tier wrote into a folder (a ``file://`` ``RemoteTier``, or a bucket
copied to disk with ``aws s3 sync`` / ``azcopy``) reads from that folder as a local root: the
shard's storage info (its zstd frame table) decides the decoding, whichever backend reads it."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import nebula_ckpt as nc
import warm_python
from nebula_ckpt.tiers import RemoteTier

CLI = os.path.join(os.path.dirname(sys.executable), "nebula-ckpt")


def _state(i: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4096,), float(i)), "frozen": torch.arange(8192.0)}


@pytest.mark.parametrize("incremental", [False, True], ids=["whole", "incremental"])
def test_a_compressed_step_reads_from_its_folder_as_a_local_root(tmp_path, shm_dir: str,  # noqa: ANN001
                                                                  incremental: bool) -> None:
    folder = str(tmp_path / "root")
    with nc.Checkpointer("file://" + folder, tiers=[RemoteTier("file://" + folder, compression="zstd")],
                         memory_tier=False, incremental=incremental) as ck:
        for i in (1, 2, 3):
            ck.save(i, _state(i))
    for root in (folder, "file://" + folder):
        r = warm_python.run([CLI, "verify", root], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "NEBULA_SHM_DIR": shm_dir})
        assert r.returncode == 0 and r.stdout.count("OK") == 3, r.stdout + r.stderr
    with nc.Checkpointer(folder, read_only=True, memory_tier=False) as ck:
        for i in (1, 2, 3):
            got = ck.read(i)[1]
            assert torch.equal(got["w"], _state(i)["w"]) and torch.equal(got["frozen"], _state(i)["frozen"])
        into = {"w": torch.zeros(4096), "frozen": torch.zeros(8192)}
        assert ck.load_latest(into) == 3 and torch.equal(into["w"], _state(3)["w"])


def test_a_compressed_shard_that_was_damaged_on_disk_is_named_and_skipped(tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    folder = str(tmp_path / "root")
    with nc.Checkpointer("file://" + folder, tiers=[RemoteTier("file://" + folder, compression="zstd")],
                         memory_tier=False, incremental=False) as ck:
        ck.save(1, _state(1))
        ck.save(2, _state(2))
    shard = next(os.path.join(dp, f) for dp, _, fs in os.walk(os.path.join(folder, "step-2"))
                 for f in fs if f.endswith(".safetensors"))
    with open(shard, "r+b") as f:  # garble the middle of the one zstd frame
        f.seek(os.path.getsize(shard) // 2)
        f.write(b"\xff" * 16)
    into = {"w": torch.zeros(4096), "frozen": torch.zeros(8192)}
    with nc.Checkpointer(folder, read_only=True, memory_tier=False) as ck:
        assert ck.load_latest(into) == 1  # step 2 is skipped as damaged, naming its shard (logged)
    assert torch.equal(into["w"], _state(1)["w"])
