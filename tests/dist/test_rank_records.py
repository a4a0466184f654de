"""Format version 4 on real ranks: each rank's self-checking records beside its shard, read only where needed.

One real 2-rank FSDP2 job (gloo on 127.0.0.1) saves through ``nebula_ckpt.Checkpointer``; each
test works on a copy of its checkpoint. The records files and ``ranks.json`` read from disk are
input, never truth: a garbled, stale, misplaced, hostile or missing one is refused with a
``CorruptCheckpointError`` naming the file, the rank and the field, before any byte of a tensor
is used.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import crc32c
import pytest
import torch

from nebula_ckpt.errors import CorruptCheckpointError
from nebula_ckpt.format.commit import references
from nebula_ckpt.format.names import MANIFEST, RANKS_FILE, SPLIT_VERSION
from nebula_ckpt.restore.open import open_checkpoint, read_main_manifest
from nebula_ckpt.storage.base import MAX_SMALL_BYTES
from nebula_ckpt.storage.local import LocalStorage
from records_view import flat_manifest, recommit, records_body, reindex, reseal, sealed

from .launch import run_ranks

pytestmark = [pytest.mark.timeout(240)]
STEP = 3


def _two_rank_job(tmp_path_factory: pytest.TempPathFactory, folder: str, role: str) -> Iterator[Path]:
    """Run ``rank_worker.py role`` on 2 real gloo ranks (no memory tier); yield its root."""
    base = tmp_path_factory.mktemp(folder)
    shm = os.path.join("/dev/shm" if os.access("/dev/shm", os.W_OK) else str(base),
                       f"nebula-test-{uuid.uuid4().hex[:10]}")
    os.makedirs(shm)
    out = base / "out"
    out.mkdir()
    try:
        done = run_ranks(2, "rank_worker.py", [role, str(base / "ckpt"), str(out)], out, shm,
                         env_extra={"TEST_MEMORY_TIER": "0"})
        assert all(p.returncode == 0 for p in done), done[0].stdout[-3000:] + done[1].stdout[-3000:]
        yield base / "ckpt"
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The root of a real 2-rank FSDP2 job's checkpoints (steps 1..3)."""
    yield from _two_rank_job(tmp_path_factory, "records", "fsdp_save")


@pytest.fixture
def root(saved: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(saved, dst)
    return dst


class CountingStorage(LocalStorage):
    """A local storage that records the small files it reads (what a restore opens)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.read: list[str] = []

    def read_small(self, rel: str, max_bytes: int = MAX_SMALL_BYTES) -> bytes:
        self.read.append(rel.rsplit("/", 1)[-1])
        return super().read_small(rel, max_bytes)


def _records(root: Path, step: int = STEP) -> list[Path]:
    return [root / f"step-{step}" / f"records-g1-r{r}.json" for r in range(2)]


def _reseal(root: Path, rank: int, fn: Callable[[dict[str, Any]], Any], step: int = STEP) -> None:
    reseal(root / f"step-{step}", rank, fn)


def _open(root: Path, rank: int = 1, world: int = 2, step: int = STEP) -> Any:
    return open_checkpoint(CountingStorage(str(root)), step, "full", "t", rank, world)


def test_manifest_holds_no_per_rank_field_and_records_seal_themselves(root: Path) -> None:
    d = root / f"step-{STEP}"
    man = json.loads((d / MANIFEST).read_text())
    assert man["version"] == SPLIT_VERSION and man["tensors"] == {} and man["aliases"] == {} and man["shards"] == []
    assert not {"ranks", "rank_tree", "records"} & set(man) and man["world_size"] == 2
    index = (d / RANKS_FILE).read_bytes()
    assert man["ranks_file"] == {"file": RANKS_FILE, "bytes": len(index), "crc32c": crc32c.crc32c(index)}
    entries = json.loads(index)["ranks"]
    assert [e["records"]["file"] for e in entries] == ["records-g1-r0.json", "records-g1-r1.json"]
    assert [e["shard"]["file"] for e in entries] == ["shard-g1-r0.safetensors", "shard-g1-r1.safetensors"]
    for r, e in enumerate(entries):
        data = (d / e["records"]["file"]).read_bytes()
        assert e["records"]["bytes"] == len(data) and e["records"]["crc32c"] == crc32c.crc32c(data)
        body, tail = data[:-21] + b"}", data[-21:]             # sealed: its own CRC32C, last
        assert tail == b',"crc32c":"%08x"}' % crc32c.crc32c(body)
        recs = json.loads(body)
        assert (recs["rank"], recs["step"], recs["world_size"], recs["save_id"]) == (r, STEP, 2, man["save_id"])
        assert recs["shard"] == e["shard"] and recs["tree"] == e["tree"] == man["tree_digests"][0]
    assert man["grid"] is True                              # fully_shard's dim-0 chunks: DTensor's own layout
    assert man["dtensors"]["model/0.weight"] == {"dtype": "float32", "shape": [32, 16], "placements": ["S(0)"],
                                                 "mesh": [2]}
    assert man["owners"] and set(man["owners"].values()) == {0}  # the small replicas (AdamW step counts)
    flat = flat_manifest(d)
    assert flat["tensors"]["r1/model/0.weight"]["dtensor"]["offsets"] == [16, 0]
    assert all(flat["aliases"][f"r1/{k}"] == f"r0/{k}" for k in man["owners"])


def test_a_rank_reads_its_own_records_and_the_owners_only(root: Path) -> None:
    ck = _open(root, rank=1)
    assert sorted(ck_storage_reads(root, 1)) == [             # never ranks.json
        "COMMIT", MANIFEST, "records-g1-r0.json", "records-g1-r1.json"]  # its own + rank 0's (owner of replicas)
    assert ck_storage_reads(root, 0) == ["COMMIT", MANIFEST, "records-g1-r0.json"]
    assert ck.view("model/0.weight").shape == (16, 16)
    _records(root)[1].unlink()
    ck0 = _open(root, rank=0)                                    # rank 0 never needs rank 1's records
    assert ck0.view("model/0.weight").shape == (16, 16)
    with pytest.raises(CorruptCheckpointError, match="records file records-g1-r1.json is missing"):
        _open(root, rank=1)


def ck_storage_reads(root: Path, rank: int) -> list[str]:
    st = CountingStorage(str(root))
    open_checkpoint(st, STEP, "full", "t", rank, 2)
    return st.read


def test_the_whole_job_read_for_resharding_checks_coverage(root: Path) -> None:
    ck = _open(root, rank=0, world=1)                           # another world size: every rank's records
    assert ck.rank is None and {k.split("/", 1)[0] for k in ck.keys()} == {"r0", "r1"}
    _reseal(root, 1, lambda r: r["tensors"]["model/0.weight"]["dtensor"].update(offsets=[0, 0]))
    with pytest.raises(CorruptCheckpointError, match="records-g1-r1.json \\(rank 1\\).*not where the grid"):
        _open(root, rank=0, world=1)


def test_a_garbled_records_file_is_refused_naming_file_and_rank(root: Path) -> None:
    path = _records(root)[1]
    data = bytearray(path.read_bytes())
    data[data.index(b'"dtype"') + 10] ^= 1                       # one flipped bit, same size
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="records-g1-r1.json \\(rank 1\\).*checksum"):
        _open(root, rank=1)


def _tensor(key: str, **kw: Any) -> Callable[[dict[str, Any]], None]:
    return lambda r: r["tensors"][key].update(kw)


HOSTILE: list[tuple[str, int, Callable[[dict[str, Any]], Any], str]] = [
    ("dtype", 1, _tensor("model/0.weight", dtype="float99"), "dtype 'float99'"),
    ("offsets_outside_shard", 1, _tensor("model/0.weight", offsets=[0, 1 << 40]), "offsets[1]"),
    ("shard_without_refs", 1, _tensor("model/0.weight", shard=1), "shard = 1 is out of range [0, 0]"),
    ("unknown_field", 1, _tensor("model/0.weight", evil=1), "unknown field"),
    ("wrong_rank", 1, lambda r: r.update(rank=0), "rank is 0, the manifest's is 1"),
    ("wrong_step", 1, lambda r: r.update(step=2), "step is 2, the manifest's is 3"),
    ("other_save_id", 1, lambda r: r.update(save_id="0" * 32), "save_id is '" + "0" * 32),
    ("other_generation", 1, lambda r: r.update(generation=7), "generation is 7"),
    ("other_world", 1, lambda r: r.update(world_size=4), "world_size is 4"),
    ("other_shard", 1, lambda r: r["shard"].update(file="shard-g1-r0.safetensors"), "is not rank 1's shard"),
    ("tree_unknown", 1, lambda r: r.update(tree="ab"), "is none of the manifest's tree_digests"),
    ("not_records", 1, lambda r: r.update(format="x"), "format / version"),
    ("dtensor_disagrees", 1, lambda r: r["tensors"]["model/0.weight"]["dtensor"].update(shape=[64, 16]),
     "disagrees with the manifest's dtensors"),
    ("dtensor_dropped", 1, lambda r: r["tensors"]["model/0.weight"].pop("dtensor"), "plain tensor on rank 1"),
    ("owner_lacks_key", 0, lambda r: r["tensors"].pop(next(k for k in r["tensors"] if k.endswith("/step"))),
     "which its records lack"),
    ("alias_to_nothing", 1, lambda r: r["aliases"].update(x="nope"), "no such tensor"),
    ("tree_key_missing", 1, lambda r: r["tensors"].pop("model/0.bias"), "rank 1"),
    # replicas (the DCP writer's: a key another rank stored for this one)
    ("replicas_not_an_object", 1, lambda r: r.update(replicas=[0]), "replicas"),
    ("replica_of_itself", 1, lambda r: r.update(replicas={"model/0.bias": 1}), "names rank 1 itself"),
    ("replica_rank_outside_job", 1, lambda r: r.update(replicas={"model/0.bias": 5}), "= 5 is out of range [0, 1]"),
    ("replica_of_a_stored_key", 1, lambda r: r.update(replicas={"model/0.bias": 0}), "stored by this rank already"),
    ("replica_the_rank_lacks", 1, lambda r: r.update(replicas={"nope": 0}), "which it does not store"),
]


@pytest.mark.parametrize("rank,change,expect", [c[1:] for c in HOSTILE], ids=[c[0] for c in HOSTILE])
def test_hostile_records_are_refused_naming_file_rank_and_field(root: Path, rank: int,
                                                                 change: Callable[[dict[str, Any]], Any],
                                                                 expect: str) -> None:
    _reseal(root, rank, change)
    with pytest.raises(CorruptCheckpointError) as e:
        _open(root, rank=1)
    assert expect in str(e.value) and ("rank 1" in str(e.value) or "rank 0" in str(e.value)), str(e.value)


def test_hostile_main_manifest_fields_are_refused(root: Path) -> None:
    d = root / f"step-{STEP}"
    st = LocalStorage(str(root))
    for change, expect in [(lambda m: m.update(save_id="xyz"), "save_id 'xyz' is not 16 to 64"),
                           (lambda m: m.update(ranks=[0, 1]), "holds no per-rank field"),
                           (lambda m: m.update(records=[]), "holds no per-rank field"),
                           (lambda m: m["ranks_file"].update(file="../ranks.json"), "ranks_file names '../ranks.json'"),
                           (lambda m: m["ranks_file"].update(bytes=3), "ranks.json: size or checksum differs"),
                           (lambda m: m["tree_digests"].append("x"), "tree_digests lists 2 distinct digest(s) for 1"),
                           (lambda m: m.update(references=[STEP]), "references[]"),
                           (lambda m: m.update(world_size=1), "world_size = 1"),
                           (lambda m: m["owners"].update(x=5), "owners['x'] = 5"),
                           (lambda m: m.update(grid="yes"), "grid must be true or false"),
                           (lambda m: m["tensors"].update(
                               {"r0/x": {"dtype": "float32", "shape": [0], "offsets": [8, 8], "crc32c": 0}}),
                            "tensors['r0/x']"),
                           (lambda m: m["dtensors"]["model/0.weight"].update(placements=["P"]), "placement 'P'")]:
        shutil.copy(d / MANIFEST, d / "keep")
        shutil.copy(d / "COMMIT", d / "keep2")
        man = json.loads((d / MANIFEST).read_text())
        change(man)
        recommit(d, man)
        with pytest.raises(CorruptCheckpointError, match=re.escape(expect)):
            read_main_manifest(st, STEP)
        shutil.move(d / "keep", d / MANIFEST)
        shutil.move(d / "keep2", d / "COMMIT")
    assert torch.is_tensor(_open(root, rank=1).view("model/0.weight"))


HOSTILE_INDEX: list[tuple[str, Callable[[dict[str, Any]], Any], str]] = [
    ("fewer_ranks", lambda i: i["ranks"].pop(), "lists 1 rank(s) for a 2-rank job"),
    ("other_save_id", lambda i: i.update(save_id="1" * 32), "save_id is '" + "1" * 32),
    ("other_step", lambda i: i.update(step=2), "step is 2"),
    ("records_of_another_rank", lambda i: i["ranks"][1]["records"].update(file="records-g1-r0.json"),
     "ranks[1]: records file 'records-g1-r0.json' is not records-g1-r1.json"),
    ("shard_of_another_rank", lambda i: i["ranks"][1]["shard"].update(file="shard-g1-r0.safetensors"),
     "ranks[1]: shard 'shard-g1-r0.safetensors' is not rank 1's shard"),
    ("path_outside", lambda i: i["ranks"][0]["shard"].update(file="../../etc/passwd"), "ranks[0]"),
    ("records_size", lambda i: i["ranks"][1]["records"].update(bytes=5),
     "records-g1-r1.json (rank 1): size or checksum differs from ranks.json's"),
    ("shard_size", lambda i: i["ranks"][1]["shard"].update(bytes=i["ranks"][1]["shard"]["bytes"] + 8, storage=None),
     "records-g1-r1.json (rank 1): its shard entry"),
    ("tree_unknown", lambda i: i["ranks"][1].update(tree="00"), "ranks[1]: tree digest '00' is none"),
    ("unknown_field", lambda i: i["ranks"][1].update(evil=1), "ranks[1]"),
    ("ref_not_referenced", lambda i: i["refs"].append({"file": "shard-g1-r0.safetensors", "bytes": 8, "step": 1}),
     "ranks.json: refs[0]: (shard-g1-r0.safetensors) refers to step 1, which is not among the manifest's references"),
]


@pytest.mark.parametrize("change,expect", [c[1:] for c in HOSTILE_INDEX], ids=[c[0] for c in HOSTILE_INDEX])
def test_a_hostile_ranks_json_is_refused_naming_rank_and_field(root: Path, change: Callable[[dict[str, Any]], Any],
                                                               expect: str) -> None:
    """What ``ls``, ``verify``, ``export`` and a reshard off the grid read; its checksum valid, its content lying."""
    reindex(root / f"step-{STEP}", change)
    with pytest.raises(CorruptCheckpointError) as e:
        _open(root, rank=0, world=1)                             # another world size: the whole job, via ranks.json
    assert expect in str(e.value), str(e.value)
    assert torch.is_tensor(_open(root, rank=1).view("model/0.weight"))  # a same-size restore never reads it


def test_a_records_file_of_another_rank_or_attempt_is_refused(root: Path) -> None:
    """Another rank's records file renamed into place, one left by an aborted attempt of the same
    step (another save id, its embedded checksum valid) and a missing one: each refused, naming it."""
    own, other = _records(root)[1], _records(root)[0]
    keep = own.read_bytes()
    shutil.copy(other, own)
    with pytest.raises(CorruptCheckpointError, match=re.escape("records-g1-r1.json (rank 1): rank is 0")):
        _open(root, rank=1)
    recs = json.loads(keep[:-21] + b"}")
    own.write_bytes(sealed(dict(recs, save_id="f" * 32)))
    with pytest.raises(CorruptCheckpointError, match=re.escape("records-g1-r1.json (rank 1): save_id is 'fff")):
        _open(root, rank=1)
    own.write_bytes(keep[:-3] + b'0"}' if not keep.endswith(b'0"}') else keep[:-3] + b'1"}')
    with pytest.raises(CorruptCheckpointError, match=re.escape("records-g1-r1.json (rank 1): crc32c")):
        _open(root, rank=1)
    own.unlink()
    with pytest.raises(CorruptCheckpointError, match="records file records-g1-r1.json is missing"):
        _open(root, rank=1)


def test_a_restore_falls_back_to_the_previous_step_when_a_records_file_is_damaged(root: Path) -> None:
    from nebula_ckpt.restore.select import find_and_open
    from nebula_ckpt.tiers.local import LocalTier

    path = _records(root)[1]
    path.write_bytes(sealed(dict(records_body(path), save_id="e" * 32)))  # a stale attempt's, well sealed
    tier = LocalTier(str(root))
    ck = find_and_open([(tier, tier.make_storage())], verify="full", on_all_damaged="warn", rank=1, world=2)
    assert ck is not None and ck.step == STEP - 1 and torch.is_tensor(ck.view("model/0.weight"))


def test_a_replica_stored_by_a_rank_that_does_not_own_it_is_refused(root: Path) -> None:
    man = json.loads((root / f"step-{STEP}" / MANIFEST).read_text())
    key = next(iter(man["owners"]))
    empty = {"dtype": "float32", "shape": [0], "offsets": [0, 0], "crc32c": 0, "device": "cpu"}
    _reseal(root, 1, lambda r: r["tensors"].update({key: empty}))
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"'{key}' is stored by rank 1 but owned by rank 0")):
        _open(root, rank=1)


# An incremental chain (steps 1..4 of a DDP model with a large frozen parameter and a per-rank
# tensor that never changes): steps 2..4 refer to step 1's shards from each rank's records file.
CHAIN = 4


@pytest.fixture(scope="module")
def chain_saved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The root of a real 2-rank job's incremental chain (steps 1..4)."""
    yield from _two_rank_job(tmp_path_factory, "chain", "frozen_save")


@pytest.fixture
def chain(chain_saved: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "chain"
    shutil.copytree(chain_saved, dst)
    return dst


def test_incremental_references_live_in_each_ranks_records_and_in_ranks_json(chain: Path) -> None:
    d = chain / f"step-{CHAIN}"
    man = json.loads((d / MANIFEST).read_text())
    assert man["version"] == SPLIT_VERSION and "sha256" not in man and man["tensors"] == {} and man["shards"] == []
    assert man["references"] == [1]                              # retention knows the steps from the manifest alone
    refs = [(s["step"], s["file"]) for s in json.loads((d / RANKS_FILE).read_text())["refs"]]  # once each
    assert refs == [(1, "shard-g1-r0.safetensors"), (1, "shard-g1-r1.safetensors")]
    assert references(read_main_manifest(LocalStorage(str(chain)), CHAIN, index=False)) == {1}
    base = json.loads((chain / "step-1" / RANKS_FILE).read_text())
    for r in range(2):
        recs = records_body(_records(chain, CHAIN)[r])
        assert [dict(x) for x in recs["refs"]] == [dict(base["ranks"][r]["shard"], step=1)]  # its own base shard only
        assert recs["tensors"]["still"]["shard"] == 1                              # lies in refs[0]
        assert "still" in recs["sha256"] and set(recs["sha256"]) <= set(recs["tensors"])  # the unchanged ones
        step1 = records_body(_records(chain, 1)[r])
        assert recs["sha256"]["still"] == step1["sha256"]["still"]
        assert "refs" not in step1 and all("shard" not in t for t in step1["tensors"].values())
    st = CountingStorage(str(chain))
    ck = open_checkpoint(st, CHAIN, "full", "t", 1, 2)           # reads step 1's shard of rank 1
    assert RANKS_FILE not in st.read                             # nor step 1's: its rank 1 records say where
    held = ck.manifest.shards[ck.manifest.resolve("still", 1).shard]
    assert (held.file, held.step) == ("shard-g1-r1.safetensors", 1)
    assert ck.manifest.hashes["r1/still"] == recs["sha256"]["still"]
    assert torch.equal(ck.view("still"), torch.full((8192,), 1.0))
    whole = open_checkpoint(st, CHAIN, "full", "t", 0, 1)        # the whole job: ranks.json's numbering
    assert whole.manifest.resolve("still", 1).shard == 3


def _ref(**kw: Any) -> Callable[[dict[str, Any]], None]:
    return lambda r: r["refs"][0].update(kw)


HOSTILE_REFS: list[tuple[str, Callable[[dict[str, Any]], Any], str]] = [
    ("ref_step_not_earlier", _ref(step=CHAIN), f"refers to step {CHAIN}, not an earlier step"),
    ("ref_step_later", _ref(step=CHAIN + 5), "not an earlier step"),
    ("ref_without_step", lambda r: r["refs"][0].pop("step"), "refers to step None"),
    ("ref_not_in_manifest", _ref(file="shard-g1-r0.safetensors", step=2), "is not among the manifest's references"),
    ("ref_other_size", _ref(bytes=9000, storage={"stored_bytes": 9000}), "is out of range [0, 9000]"),
    ("ref_bad_name", _ref(file="../x.safetensors"), "file"),
    ("shard_out_of_range", _tensor("still", shard=2), "shard = 2 is out of range [0, 1]"),
    ("shard_negative", _tensor("still", shard=-1), "shard = -1 is out of range"),
    ("shard_into_ref_past_its_end", _tensor("still", shard=1, offsets=[1 << 30, (1 << 30) + 32768]), "offsets"),
    ("sha256_bad_hex", lambda r: r["sha256"].update(still="Z" * 64), "is not 64 lowercase hex digits"),
    ("sha256_short", lambda r: r["sha256"].update(still="ab"), "is not 64 lowercase hex digits"),
    ("sha256_not_stored", lambda r: r["sha256"].update(nope="0" * 64), "no such stored tensor"),
    ("sha256_not_object", lambda r: r.update(sha256=[1]), "sha256"),
    ("refs_not_list", lambda r: r.update(refs={"a": 1}), "refs"),
]


@pytest.mark.parametrize("change,expect", [c[1:] for c in HOSTILE_REFS], ids=[c[0] for c in HOSTILE_REFS])
def test_hostile_references_in_records_are_refused(chain: Path, change: Callable[[dict[str, Any]], Any],
                                                   expect: str) -> None:
    _reseal(chain, 1, change, step=CHAIN)
    with pytest.raises(CorruptCheckpointError) as e:
        _open(chain, rank=1, step=CHAIN)
    assert expect in str(e.value) and "records-g1-r1.json (rank 1)" in str(e.value), str(e.value)


def test_a_ranks_json_listing_a_reference_among_the_own_shards_is_refused(chain: Path) -> None:
    def swap(i: dict[str, Any]) -> None:
        i["ranks"][1]["shard"], i["refs"][0] = i["refs"][0], i["ranks"][1]["shard"]

    reindex(chain / f"step-{CHAIN}", swap)
    with pytest.raises(CorruptCheckpointError,
                       match=re.escape("ranks[1]: shard 'shard-g1-r0.safetensors' is not rank 1's")):
        read_main_manifest(LocalStorage(str(chain)), CHAIN)
