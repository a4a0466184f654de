"""A DCP save whose ranks hold different, partly shared state commits format version 4, and reads back.

DCP stores an item several ranks hold once (its dedup), whichever ranks those are: all of them,
the ranks of one pipeline stage, or the replicas of one chunk of an HSDP-sharded DTensor (a
different rank for each chunk). The writer records such an item on every other rank holding it
as a *replica* of the rank that stored it, in that rank's records file; one real 4-rank job (gloo
on 127.0.0.1, :mod:`dcp_replicas_worker`) saves such state, and each rank loads its own state back
bit for bit with DCP and with ``Checkpointer.load_latest``; one process reads the whole of it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed.checkpoint as dcp

from nebula_ckpt.cli import main as cli
from nebula_ckpt.dcp import NebulaStorageReader
from nebula_ckpt.errors import CorruptCheckpointError, ValidationError
from nebula_ckpt.format.commit import committed_steps
from nebula_ckpt.format.names import MANIFEST, SPLIT_VERSION
from nebula_ckpt.restore.open import read_manifest
from nebula_ckpt.storage.local import LocalStorage
from records_view import records_body, reseal

from .launch import reports, run_ranks, shm_folder

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
WORLD = 4


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The root and the reports folder of the 4-rank job (the root's step 1)."""
    base = tmp_path_factory.mktemp("dcp-replicas")
    (base / "out").mkdir()
    with shm_folder(base) as shm:
        done = run_ranks(WORLD, "dcp_replicas_worker.py", [str(base / "root"), str(base / "out")], base / "out", shm,
                         timeout=240)
        for r, p in enumerate(done):
            assert p.returncode == 0, f"rank {r}:\n{p.stdout[-4000:]}"
    yield base


def _records(root: Path) -> list[dict[str, Any]]:
    return [records_body(root / "step-1" / f"records-g1-r{r}.json") for r in range(WORLD)]


def test_every_rank_loads_its_own_state_back_with_dcp_and_the_checkpointer(job: Path) -> None:
    for rep in reports(job / "out", "job", WORLD):
        assert rep["dcp_load"] and rep["dcp_tied"], rep
        assert rep["latest"] == 1 and rep["checkpointer_load"], rep


def test_a_commit_failing_after_the_records_files_leaves_nothing_of_the_step(job: Path) -> None:
    for rep in reports(job / "out", "job", WORLD):
        assert "injected: manifest write failed" in rep["step2"] and rep["after2"] is None, rep
    assert committed_steps(LocalStorage(str(job / "root"))) == [1]


def test_an_item_stored_once_for_some_ranks_is_a_replica_on_the_others(job: Path) -> None:
    root = job / "root"
    assert json.loads((root / "step-1" / MANIFEST).read_text())["version"] == SPLIT_VERSION
    recs = _records(root)
    holders = {"common": [0, 1, 2, 3], "stage0/w": [0, 1], "stage1/w": [2, 3]}
    for key, ranks in holders.items():
        stored = [r for r in ranks if key in recs[r]["tensors"] or key in recs[r]["aliases"]]
        assert len(stored) == 1, (key, stored)
        for r in ranks:  # every other holder names the rank that stored it; nobody else does
            assert recs[r].get("replicas", {}).get(key) == (None if r in stored else stored[0]), (key, r)
        for r in set(range(WORLD)) - set(ranks):
            assert key not in recs[r].get("replicas", {}) and key not in recs[r]["tensors"]
    # HSDP: each chunk stored by one of its two holders, each holder of the other chunk untouched
    for pair in ([0, 2], [1, 3]):
        stored = [r for r in pair if "hsdp/w" in recs[r]["tensors"]]
        assert len(stored) == 1
        other = next(r for r in pair if r != stored[0])
        assert recs[other]["replicas"]["hsdp/w"] == stored[0]
    # the tied keys: a replica may name a key its rank stored under another name (its tie)
    for r in range(WORLD):
        for key, q in recs[r].get("replicas", {}).items():
            assert key in recs[q]["tensors"] or recs[q]["aliases"].get(key) in recs[q]["tensors"], (r, key, q)


def test_one_process_reads_the_whole_job_bit_exact(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def full(seed: int, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))

    want = {"common": full(1, 7), "stage0/w": full(10, 3, 3), "stage1/w": full(11, 3, 3), "hsdp.w": full(20, 6, 2),
            "emb": full(3, 5, 4), "head": full(3, 5, 4)}
    got: dict[str, Any] = {k: torch.zeros_like(v) for k, v in want.items() if k != "hsdp.w"}
    got.update(hsdp={"w": torch.zeros(6, 2)}, step=-1)
    with NebulaStorageReader(str(job / "root"), 1) as reader:
        dcp.load(got, storage_reader=reader, no_dist=True)
    got["hsdp.w"] = got.pop("hsdp")["w"]
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    assert got["step"] == 1
    man = read_manifest(LocalStorage(str(job / "root")), 1)
    assert man.world_size == WORLD and {k.partition("/")[2] for k in man.aliases} >= {"stage0/w", "hsdp/w"}
    assert all(v in man.tensors for v in man.aliases.values())
    assert cli(["verify", str(job / "root")]) == 0
    assert "OK " in capsys.readouterr().out


def test_export_and_inspect_hold_what_only_some_ranks_hold(job: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`nebula-ckpt export` gathers the whole job: every stage's keys, not rank 0's alone."""
    assert cli(["export", str(job / "root"), "--step", "1", "--to", str(tmp_path / "all.pt")]) == 0
    got = torch.load(tmp_path / "all.pt", weights_only=True)

    def full(seed: int, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))

    assert sorted(got) == ["common", "emb", "head", "hsdp", "stage0/w", "stage1/w", "step"]
    assert torch.equal(got["stage0/w"], full(10, 3, 3)) and torch.equal(got["stage1/w"], full(11, 3, 3))
    assert torch.equal(got["hsdp"]["w"], full(20, 6, 2)) and got["step"] == 1
    capsys.readouterr()
    assert cli(["inspect", str(job / "root"), "--step", "1"]) == 0
    listed = capsys.readouterr().out
    assert "stage0/w" in listed and "stage1/w" in listed


def test_one_process_restores_one_stage_resharded_without_the_other_stages_keys(job: Path) -> None:
    """A restore at another world size of a job whose ranks saved different state (pipeline
    stages) takes what ``into`` holds, wherever it was saved; another stage's keys are not asked
    of ``into``, the keys every rank saved are (strict)."""
    import nebula_ckpt as nc

    def full(seed: int, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))

    into: dict[str, Any] = {"stage1/w": torch.zeros(3, 3), "common": torch.zeros(7), "hsdp": {"w": torch.zeros(6, 2)},
                            "emb": torch.zeros(5, 4), "head": torch.zeros(5, 4), "step": -1}
    with nc.Checkpointer(str(job / "root"), memory_tier=False) as ck:
        assert ck.load_latest(into) == 1
        assert torch.equal(into["stage1/w"], full(11, 3, 3)) and torch.equal(into["common"], full(1, 7))
        assert torch.equal(into["hsdp"]["w"], full(20, 6, 2)) and into["step"] == 1 and "stage0/w" not in into
        lacking = {k: v for k, v in into.items() if k != "common"}
        with pytest.raises(ValidationError) as e:
            ck.load_latest(lacking)
    assert "['common']" in str(e.value) and "stage0/w" not in str(e.value)


def test_a_replica_naming_a_rank_that_does_not_store_it_is_refused(job: Path, tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(job / "root", root)
    recs = _records(root)
    r, key = next((r, k) for r in range(WORLD) for k in recs[r].get("replicas", {}) if k == "hsdp/w")
    wrong = next(q for q in range(WORLD) if q != r and "hsdp/w" not in recs[q]["tensors"])
    reseal(root / "step-1", r, lambda d: d["replicas"].update({key: wrong}))
    with pytest.raises(CorruptCheckpointError) as e:
        NebulaStorageReader(str(root), 1)
    assert f"records-g1-r{wrong}.json (rank {wrong})" in str(e.value), str(e.value)
    assert f"rank {r}'s replicas names rank {wrong} for 'hsdp/w'" in str(e.value), str(e.value)


def test_a_replica_of_a_key_its_rank_tied_to_another_reads_the_stored_bytes(job: Path, tmp_path: Path) -> None:
    """DCP may store two tied keys on one rank (one copy, the other key tied to it): the ranks for
    whom it stored the tied key name that key; the reader follows the tie on the storing rank."""
    root = tmp_path / "root"
    shutil.copytree(job / "root", root)
    recs = _records(root)
    s = next(r for r in range(WORLD) if "emb" in recs[r]["tensors"])          # stores emb (tied to head)
    other = next(r for r in range(WORLD) if r != s and recs[r].get("replicas", {}).get("head") is not None)
    reseal(root / "step-1", s, lambda d: (d["replicas"].pop("head", None), d["aliases"].update(head="emb")))
    reseal(root / "step-1", other, lambda d: d["replicas"].update(head=s))
    man = read_manifest(LocalStorage(str(root)), 1)
    assert man.aliases[f"r{other}/head"] == man.aliases[f"r{s}/head"] == f"r{s}/emb"
    got = {"head": torch.zeros(5, 4)}
    with NebulaStorageReader(str(root), 1) as reader:
        dcp.load(got, storage_reader=reader, no_dist=True)
    assert torch.equal(got["head"], torch.randn(5, 4, generator=torch.Generator().manual_seed(3)))


def test_a_replica_of_another_chunk_of_a_sharded_tensor_is_refused(job: Path, tmp_path: Path) -> None:
    """On the grid, a rank's replica of a DTensor chunk must be the chunk the grid gives that rank:
    a records file naming the rank that stored the other chunk is refused, naming both."""
    root = tmp_path / "root"
    shutil.copytree(job / "root", root)
    recs = _records(root)
    r = next(r for r in range(WORLD) if "hsdp/w" in recs[r].get("replicas", {}))
    other_chunk = next(q for q in range(WORLD) if "hsdp/w" in recs[q]["tensors"] and q % 2 != r % 2)
    reseal(root / "step-1", r, lambda d: d["replicas"].update({"hsdp/w": other_chunk}))
    with pytest.raises(CorruptCheckpointError) as e:
        NebulaStorageReader(str(root), 1)
    assert f"records-g1-r{r}.json (rank {r})" in str(e.value), str(e.value)
    assert f"rank {other_chunk}'s chunk [3, 2] at" in str(e.value) and f"gives rank {r}" in str(e.value)
