"""Health records on blob stores (Azurite, moto S3): one object per record, created create-only
(no append on a blob store), read back by a restore on a fresh machine; a torn object is ignored."""

from __future__ import annotations

import contextlib
import io
import json
import math
from typing import Any

import fsspec
import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt import knobs
from nebula_ckpt.cli import main as cli

from .conftest import Store

pytestmark = [pytest.mark.blob, pytest.mark.timeout(300)]


def _ck(url: str, opts: dict[str, Any]) -> nc.Checkpointer:
    return nc.Checkpointer(url, storage_options=opts, memory_tier=False)


def _ls(url: str, opts: dict[str, Any]) -> dict[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli(["ls", url, "--json", "--storage-options", json.dumps(opts)]) == 0
    return {r["step"]: r["health"] for r in json.loads(buf.getvalue())}


def test_marks_live_on_the_blob_root_and_steer_a_restore_on_a_fresh_machine(blob_store: Store, tmp_path: Any) -> None:
    url, opts = blob_store.url("run"), blob_store.storage_options
    with knobs.override(shm_dir=str(tmp_path)):
        with _ck(url, opts) as ck:                      # 0 and 5 saved, each confirmed by two finite steps
            for step in range(8):
                ck.report(step, loss=1.0)
                if step % 5 == 0:
                    ck.save(step, {"w": torch.full((8,), float(step)), "step": step})
        assert _ls(url, opts) == {0: "healthy", 5: "healthy"}
        with _ck(url, opts) as ck:                      # restored 5, NaN at once
            assert ck.load_latest(into={"w": torch.zeros(8), "step": -1}) == 5
            ck.report(6, loss=math.nan)
        fs = fsspec.filesystem(url.split("://")[0], **opts)
        folder = url.split("://", 1)[1] + "/_nebula/health/step-5"
        names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(folder, detail=False))
        assert len(names) == 2 and all(n.startswith("g1-t") and n.endswith("-r0.json") for n in names), names
        fs.pipe_file(f"{folder}/g1-t9999999999999999999-r0.json", b'{"format": "nebula_ckpt.health", "vers')  # torn
        with _ck(url, opts) as ck:
            assert ck.load_latest(into={"w": torch.zeros(8), "step": -1}) == 0
            assert ck.last_restore is not None and ck.last_restore["skipped"][0]["step"] == 5
        assert _ls(url, opts) == {0: "healthy", 5: "suspect"}
        assert cli(["mark", url, "--healthy", "5", "--storage-options", json.dumps(opts)]) == 0
        with _ck(url, opts) as ck:
            assert ck.load_latest(into={"w": torch.zeros(8), "step": -1}) == 5
