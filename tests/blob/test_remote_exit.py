"""A save still uploading when the program ends reaches the blob store (Azurite and moto).

The saves are made from the script's own ``atexit`` handler, after Python has shut its
``concurrent.futures`` pools and before nebula_ckpt's exit hook, so every stage of the upload
(parts in parallel, the commit marker) runs where a pool would refuse work. The part size is
small, so each shard goes up in several parallel parts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Optional

import pytest
import torch

import nebula_ckpt as nc

from .conftest import Store

pytestmark = [pytest.mark.blob, pytest.mark.timeout(180)]

SCRIPT = """
import atexit, json, torch, nebula_ckpt as nc

def late():
    opts = json.loads({opts!r})
    remote = nc.RemoteTier({url!r}, storage_options=opts, compression={compression!r})
    ck = nc.Checkpointer({url!r}, storage_options=opts, tiers=[nc.MemoryTier(), remote])
    frozen = torch.arange(1_500_000, dtype=torch.float32)           # 6 MB: a frozen part
    for s in range(3):
        ck.save_async(s, {{"frozen": frozen, "w": torch.full((1_000_000,), float(s))}})
    # never closed: nebula_ckpt's exit hook uploads what is pending

atexit.register(late)
"""


@pytest.mark.parametrize("compression", [None, "zstd"], ids=["plain", "zstd"])
def test_saves_made_during_exit_reach_the_blob_store(blob_store: Store, shm_dir: str,
                                                     compression: Optional[str]) -> None:
    url = blob_store.url("exit-run")
    opts = dict(blob_store.storage_options)
    code = SCRIPT.format(url=url, opts=json.dumps(opts), compression=compression)
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir, NEBULA_REMOTE_PART_BYTES=str(5 << 20))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=150, env=env)
    assert r.returncode == 0, r.stderr
    assert "was not closed" in r.stderr and "failed" not in r.stderr.lower(), r.stderr
    with nc.Checkpointer(url, storage_options=opts, tiers=[nc.RemoteTier(url, storage_options=opts)]) as ck:
        assert ck.list()[-1] == 2, r.stderr
        got = {"frozen": torch.zeros(1_500_000), "w": torch.zeros(1_000_000)}
        assert ck.load_latest(into=got) == 2
    assert torch.equal(got["frozen"], torch.arange(1_500_000, dtype=torch.float32))
    assert torch.equal(got["w"], torch.full((1_000_000,), 2.0))
