"""Multi-rank checkpoints with the remote tier on Azurite, shared by every rank.

Two real ranks (gloo on 127.0.0.1) save to ``az://<container>/run`` (their memory tiers are their
own); rank 0 commits one manifest for both shards on the blob store; a new job restores from it
after the memory tiers are gone.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Iterator

import fsspec
import pytest

from dist.launch import reports, run_ranks  # tests/dist (pytest puts tests/ on sys.path)
from nebula_ckpt.format.names import COMMIT, MANIFEST

from .conftest import Store, _store

pytestmark = [pytest.mark.blob, pytest.mark.timeout(300)]


@pytest.fixture
def azure(request: pytest.FixtureRequest) -> Iterator[Store]:
    yield from _store(request, "azure")


def _job(scenario: str, url: str, store: Store, out: Path, shm_dir: str) -> list[dict[str, Any]]:
    done = run_ranks(2, "rank_worker.py", [scenario, url, str(out)], out, shm_dir,
                     env_extra={"TEST_STORAGE_OPTIONS": json.dumps(store.storage_options)})
    for r, p in enumerate(done):
        assert p.returncode == 0, f"rank {r}:\n{p.stdout[-4000:]}"
    return reports(out, scenario, 2)


def test_two_ranks_share_the_remote_tier_on_azurite(azure: Store, shm_dir: str, tmp_path: Path) -> None:
    url = azure.url("run")
    saved = _job("ddp_save", url, azure, tmp_path, shm_dir)
    for r in range(2):
        assert saved[r]["written"][-1][-1] == f"remote:{url}"          # committed there for every rank
    fs = fsspec.filesystem("az", **azure.storage_options)
    path = url.removeprefix("az://")
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{path}/step-3", detail=False))
    assert names == [COMMIT, MANIFEST, "ranks.json", "records-g1-r0.json", "records-g1-r1.json",
                     "shard-g1-r0.safetensors", "shard-g1-r1.safetensors"]  # each rank's records beside its shard
    man = json.loads(fs.cat_file(f"{path}/step-3/{MANIFEST}"))
    assert man["world_size"] == 2 and "ranks" not in man and man["version"] == 4
    shutil.rmtree(shm_dir)  # the memory tiers are gone (a new node): the blob store must do
    Path(shm_dir).mkdir()
    loaded = _job("ddp_load", url, azure, tmp_path, shm_dir)
    for r in range(2):
        assert loaded[r]["step"] == 3 and loaded[r]["restored_from"]["tier"] == f"remote:{url}"
        assert loaded[r]["digest"] == saved[r]["digest3"]
