"""Golden test: the on-disk format of a tiny checkpoint is locked.

If this fails, the format changed: bump ``manifest.VERSION``, keep reading the old version, and
update the golden values deliberately.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import pytest
import torch
from safetensors import safe_open

import nebula_ckpt as nc
from nebula_ckpt.format import manifest as mf
from nebula_ckpt.format.checks import only_fields
from nebula_ckpt.format.dtypes import DTYPES, SAFETENSORS_CODES, TENSOR_DTYPES, dtype_name
from nebula_ckpt.format.names import SINGLE_VERSION, VERSION, is_shard_name, parse_step_dir, shard_generation
from nebula_ckpt.format.records import ShardRecord, TensorRecord

GOLDEN_SHARD_SHA256 = "fa43f29431b5101ea2571d7dc18c0227709cfc8ecbaa39a7ded399d815be2515"
GOLDEN_TREE = {"t": "dict", "v": [
    [{"t": "str", "v": "w"}, {"t": "tensor", "k": "w"}],
    [{"t": "str", "v": "h"}, {"t": "tensor", "k": "h"}],
    [{"t": "str", "v": "meta"}, {"t": "tuple", "v": [{"t": "int", "v": 3}, {"t": "float", "v": "-0x0.0p+0"},
                                                    {"t": "float", "v": "inf"}, {"t": "none"}]}],
]}


def _state() -> dict[str, object]:
    return {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "h": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
            "meta": (3, -0.0, float("inf"), None)}


def test_golden_tiny_checkpoint(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(12, _state())
    d = os.path.join(root, "step-12")
    assert sorted(os.listdir(d)) == ["COMMIT", "manifest.json", "shard-g1-r0.safetensors"]
    shard = os.path.join(d, "shard-g1-r0.safetensors")
    data = open(shard, "rb").read()
    assert hashlib.sha256(data).hexdigest() == GOLDEN_SHARD_SHA256
    assert len(data) == 4096 + 24 + 4  # header padded to 4 KiB, then f32 data, then bf16 data
    man = json.load(open(os.path.join(d, "manifest.json")))
    assert man["format"] == "nebula_ckpt" and man["version"] == SINGLE_VERSION == 1 and VERSION == 2
    assert man["step"] == 12 and man["generation"] == 1 and man["checksum"] == "crc32c"
    assert man["tree"] == GOLDEN_TREE
    assert man["tensors"] == {
        "w": {"dtype": "float32", "shape": [2, 3], "offsets": [4096, 4120], "crc32c": man["tensors"]["w"]["crc32c"],
              "device": "cpu"},
        "h": {"dtype": "bfloat16", "shape": [2], "offsets": [4120, 4124], "crc32c": man["tensors"]["h"]["crc32c"],
              "device": "cpu"},
    }
    import crc32c
    assert man["tensors"]["w"]["crc32c"] == crc32c.crc32c(data[4096:4120])
    assert man["shards"] == [{"file": "shard-g1-r0.safetensors", "bytes": len(data),
                              "storage": {"stored_bytes": len(data)}}]
    commit = json.load(open(os.path.join(d, "COMMIT")))
    mbytes = open(os.path.join(d, "manifest.json"), "rb").read()
    assert commit["manifest_bytes"] == len(mbytes) and commit["manifest_crc32c"] == crc32c.crc32c(mbytes)
    with safe_open(shard, "pt") as f:   # any safetensors tool can read the shard
        assert torch.equal(f.get_tensor("w"), _state()["w"])
        assert torch.equal(f.get_tensor("h"), _state()["h"])
        assert f.metadata()["writer"] == "nebula_ckpt"


def test_golden_manifest_parses_to_typed_records_and_back(tmp_path, shm_dir) -> None:  # noqa: ANN001
    """What the writer produces is read by the strict parser, and to_json() gives the same JSON."""
    root = str(tmp_path / "ck")
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(12, _state())
    raw = open(os.path.join(root, "step-12", "manifest.json"), "rb").read()
    man = mf.Manifest.parse(raw, "golden", step=12)
    assert man.step == 12 and man.generation == 1 and man.version == 1
    assert man.tensors["w"] == TensorRecord("w", "float32", (2, 3), 4096, 4120,
                                               man.tensors["w"].crc32c, "cpu", 0)
    assert man.tensors["h"].torch_dtype == torch.bfloat16 and man.tensors["h"].nbytes == 4
    assert man.shards == (ShardRecord("shard-g1-r0.safetensors", 4124, {"stored_bytes": 4124}),)
    assert man.to_json() == json.loads(raw)
    assert mf.Manifest.parse(raw, "golden").to_json() == json.loads(raw)


def test_one_dtype_table() -> None:
    """The format module's dtype table covers what the writer stores (plan.py's copy must agree)."""
    from nebula_ckpt.save import plan

    assert getattr(plan, "_ST_DTYPES", SAFETENSORS_CODES) == SAFETENSORS_CODES
    for d in SAFETENSORS_CODES:
        assert TENSOR_DTYPES[dtype_name(d)] is d
    assert "qint8" in DTYPES and "qint8" not in TENSOR_DTYPES


def test_names_are_strict() -> None:
    assert parse_step_dir("step-42") == 42 and parse_step_dir("step-0") == 0
    for bad in ("step-042", "step-4x", "step--1", "step-\u0661\u0662", "xstep-1", "step-1/.."):
        assert parse_step_dir(bad) is None, bad
    assert shard_generation("shard-g3-r0.safetensors") == 3 and is_shard_name("shard-g3-r0.safetensors")
    for bad in ("shard-g3-r0.safetensors.tmp", "../shard-g3-r0.safetensors", "shard-g03-r0.safetensors",
                "shard-g\u0663-r0.safetensors", "a/shard-g3-r0.safetensors", ""):
        assert not is_shard_name(bad), bad


def test_golden_incremental_manifest(tmp_path, shm_dir) -> None:  # noqa: ANN001
    """A save that changed only ``h`` writes a shard of ``h`` and refers to step 12's shard for ``w``."""
    root = str(tmp_path / "ck")
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(12, _state())
        state = _state()
        state["h"] = torch.tensor([0.5, 4.0], dtype=torch.bfloat16)
        ck.save(13, state)
    d = os.path.join(root, "step-13")
    man = json.load(open(os.path.join(d, "manifest.json")))
    base = json.load(open(os.path.join(root, "step-12", "manifest.json")))
    own = os.path.getsize(os.path.join(d, "shard-g1-r0.safetensors"))
    assert own == 4096 + 4  # the header, then h alone
    assert man["shards"] == [{"file": "shard-g1-r0.safetensors", "bytes": own, "storage": {"stored_bytes": own}},
                             {"file": "shard-g1-r0.safetensors", "bytes": 4124, "storage": {"stored_bytes": 4124},
                              "step": 12}]
    assert man["tensors"]["w"] == dict(base["tensors"]["w"], shard=1)  # the base's record, in shard 1
    assert man["tensors"]["h"] == {"dtype": "bfloat16", "shape": [2], "offsets": [4096, 4100],
                                   "crc32c": man["tensors"]["h"]["crc32c"], "device": "cpu"}
    assert man["sha256"]["w"] == base["sha256"]["w"] == hashlib.sha256(
        _state()["w"].numpy().tobytes()).hexdigest()
    assert man["version"] == SINGLE_VERSION
    parsed = mf.Manifest.parse(json.dumps(man), "golden", step=13)
    assert parsed.shards[1] == ShardRecord("shard-g1-r0.safetensors", 4124, {"stored_bytes": 4124}, 12)
    assert parsed.to_json() == man
    # a reader that knows no references (its shard entry has these fields) refuses it, never misreads it
    with pytest.raises(nc.CorruptCheckpointError, match="step"):
        only_fields(man["shards"][1], ("file", "bytes", "storage"), "old reader", "the shard entry")


def test_version_3_is_refused_naming_the_versions_read_and_the_fix() -> None:
    """Version 3 (a multi-rank layout of the development before 0.1.0, never released) is not
    read: its manifest is refused as damaged, naming the versions read and the fix, never misread."""
    tree = {"t": "dict", "v": [[{"t": "str", "v": "w"}, {"t": "tensor", "k": "w"}]]}
    v3 = {"format": "nebula_ckpt", "version": 3, "step": 12, "generation": 1, "time": 0.0, "checksum": "crc32c",
          "shards": [{"file": f"shard-g1-r{r}.safetensors", "bytes": 4120} for r in range(2)], "tensors": {},
          "aliases": {}, "tree": {"t": "list", "v": [tree]}, "stats": {}, "world_size": 2, "ranks": [0, 1],
          "rank_tree": {"0": 0, "1": 0}, "owners": {}, "dtensors": {}, "grid": True,
          "records": [{"file": f"records-g1-r{r}.json", "bytes": 100, "crc32c": 7} for r in range(2)]}
    with pytest.raises(nc.CorruptCheckpointError,
                       match=r"golden: manifest.json: version 3 is a layout of nebula_ckpt's development before "
                             r"0\.1\.0.*reads versions \[1, 2, 4\]\); load it with the nebula_ckpt that wrote it"):
        mf.Manifest.parse(json.dumps(v3), "golden", step=12)
    for version in (1, 2, 4):  # the versions read are not refused for their number
        with pytest.raises(nc.CorruptCheckpointError) as e:
            mf.Manifest.parse(json.dumps(dict(v3, version=version)), "golden", step=12)
        assert "development" not in str(e.value)


def test_golden_version_4_manifest_ranks_file_and_sealed_records() -> None:
    """Format version 4 (multi-rank on a shared tier): rank 0's manifest holds no per-rank field
    (owners, DTensor table, the distinct trees by digest, save id, ranks.json's size and CRC32C);
    ranks.json lists each rank's shard and records file; each rank's records file carries its
    shard, its tree's digest and the save id, sealed with its own CRC32C. Built by the writers'
    own builders, parsed back by the readers'."""
    import crc32c

    from nebula_ckpt.format.names import SPLIT_VERSION
    from nebula_ckpt.format.split_records import load_split, with_index
    from nebula_ckpt.ranks.split import split_manifest, split_payload

    def rec(off: int, rank: int) -> dict[str, object]:
        return {"dtype": "float32", "shape": [2, 3], "offsets": [off, off + 24], "crc32c": 7 + rank, "device": "cpu",
                "dtensor": {"shape": [4, 3], "offsets": [2 * rank, 0], "placements": ["S(0)"], "mesh": [2]}}

    tree = {"t": "dict", "v": [[{"t": "str", "v": "w"}, {"t": "tensor", "k": "w"}],
                               [{"t": "str", "v": "n"}, {"t": "tensor", "k": "n"}]]}
    sid = "0123456789abcdef" * 2
    files, parts = {}, []
    for r in range(2):
        tensors = {"w": rec(4096, r), "n": {"dtype": "int64", "shape": [], "offsets": [4120, 4128], "crc32c": 5,
                                            "device": "cpu"}}
        index = tensors if r == 0 else {"w": tensors["w"]}
        name, data, payload = split_payload(
            step=12, generation=1, rank=r, world=2, save_id=sid,
            shard={"file": f"shard-g1-r{r}.safetensors", "bytes": 4128}, index=index, aliases={},
            meta={"tensors": tensors, "tree": tree, "stats": {"tensor_bytes": 32}}, send_tree=r == 0,
            send_table=r == 0, crc=crc32c.crc32c, tree_digest="d" * 32)
        files[name] = data
        parts.append(payload)
    body = (b'{"format":"nebula_ckpt.records","version":4,"step":12,"generation":1,"rank":1,"world_size":2,'
            b'"save_id":"' + sid.encode() + b'","shard":{"file":"shard-g1-r1.safetensors","bytes":4128},"tree":"'
            + b"d" * 32 + b'","tensors":{"w":{"dtype":"float32","shape":[2,3],"offsets":[4096,4120],"crc32c":8,'
            b'"device":"cpu","dtensor":{"shape":[4,3],"offsets":[2,0],"placements":["S(0)"],"mesh":[2]}}},'
            b'"aliases":{}}')
    assert files["records-g1-r1.json"] == body[:-1] + b',"crc32c":"%08x"}' % crc32c.crc32c(body)
    man, ranks_json = split_manifest(step=12, generation=1, save_id=sid, parts=parts, owners={"n": 0},
                                     crc=crc32c.crc32c)
    assert man["version"] == SPLIT_VERSION == 4 and man["tensors"] == {} and man["shards"] == []
    assert not {"ranks", "rank_tree", "records"} & set(man) and man["world_size"] == 2 and man["save_id"] == sid
    assert man["tree_digests"] == ["d" * 32] and man["tree"] == {"t": "list", "v": [tree]}
    assert man["owners"] == {"n": 0} and man["grid"] is True and man["references"] == []
    assert man["ranks_file"] == {"file": "ranks.json", "bytes": len(ranks_json), "crc32c": crc32c.crc32c(ranks_json)}
    assert json.loads(ranks_json) == {
        "format": "nebula_ckpt.ranks", "version": 4, "step": 12, "generation": 1, "save_id": sid, "world_size": 2,
        "ranks": [{"shard": {"file": f"shard-g1-r{r}.safetensors", "bytes": 4128},
                   "records": {"file": n, "bytes": len(d), "crc32c": crc32c.crc32c(d)}, "tree": "d" * 32}
                  for r, (n, d) in enumerate(files.items())], "refs": []}
    parsed = mf.Manifest.parse(json.dumps(man), "golden", step=12)
    assert parsed.to_json() == json.loads(json.dumps(man)) and not parsed.tensors and not parsed.shards
    one = load_split(parsed, files.__getitem__, crc32c.crc32c, [1], "golden")   # rank 1 and the owner, rank 0
    assert one.resolve("n", 1) == one.tensors["r0/n"] and one.resolve("w", 1).dtensor.offsets == (2, 0)
    assert one.shards[one.resolve("w", 1).shard].file == "shard-g1-r1.safetensors" and one.rank_tree == {0: 0, 1: 0}
    whole = load_split(with_index(parsed, ranks_json, crc32c.crc32c, "golden"), files.__getitem__, crc32c.crc32c,
                       [0, 1], "golden")
    assert [s.file for s in whole.shards] == ["shard-g1-r0.safetensors", "shard-g1-r1.safetensors"]
    assert whole.resolve("w", 1).shard == 1 and whole.layout.loaded == frozenset({0, 1})


def test_golden_root_records(tmp_path) -> None:  # noqa: ANN001
    """A persistent root's run record and writer generation record, byte for byte as a run writes
    them (``_nebula/run.json``, ``_nebula/writers/g-<G>.json``), parsed back by the readers'."""
    from nebula_ckpt.format.root_records import (
        WriterRecord,
        encode_run_record,
        encode_writer_record,
        parse_run_record,
        parse_writer_record,
    )

    run = encode_run_record("5f1c", "node-1", 1700000000.5)
    assert run == b'{"run_id": "5f1c", "host": "node-1", "time": 1700000000.5}'
    assert parse_run_record(run, "golden") == "5f1c"
    writer = encode_writer_record(WriterRecord("node-1", 4242, 1700000000.5))
    assert writer == b'{"host": "node-1", "pid": 4242, "time": 1700000000.5}'
    assert parse_writer_record(writer, "golden") == WriterRecord("node-1", 4242, 1700000000.5)
    root = str(tmp_path / "ck")
    with nc.Checkpointer(root, memory_tier=False) as ck:  # a run writes both, and reads its own back
        ck.save(1, {"w": torch.ones(2)})
        with open(os.path.join(root, "_nebula", "run.json"), "rb") as f:
            assert parse_run_record(f.read(), "run.json") == ck.run_id
        with open(os.path.join(root, "_nebula", "writers", "g-1.json"), "rb") as f:
            assert parse_writer_record(f.read(), "g-1.json").pid == os.getpid()


@pytest.mark.parametrize("raw", [b"", b"{", b"\xff\xfe", b"[]", b'"x"', b"{}", b'{"run_id": 7}', b'{"run_id": null}',
                                 b"[" * 100000 + b"]" * 100000])
def test_a_hostile_run_record_is_refused_naming_the_file_and_the_fix(raw: bytes) -> None:
    from nebula_ckpt.format.root_records import parse_run_record, read_run_id_or_none

    with pytest.raises(nc.CorruptCheckpointError, match=r"^root:/x: _nebula/run\.json: .*; remove it if no job"):
        parse_run_record(raw, "root:/x: _nebula/run.json")
    assert read_run_id_or_none(raw, "root:/x: _nebula/run.json") is None


@pytest.mark.parametrize("raw", [b"nope", b"[1]", b'{"host": "h", "pid": true, "time": 1}',
                                 b'{"host": "h", "pid": 1.0, "time": 1}', b'{"host": 3, "pid": 1, "time": 1}',
                                 b'{"host": "h", "pid": -1, "time": 1}', b'{"host": "h", "pid": 1, "time": "1"}',
                                 b'{"host": "h", "pid": 1}'])
def test_a_hostile_writer_record_is_refused_naming_the_file(raw: bytes) -> None:
    from nebula_ckpt.format.root_records import parse_writer_record

    with pytest.raises(nc.CorruptCheckpointError, match=r"^root:/x: _nebula/writers/g-3\.json: "):
        parse_writer_record(raw, "root:/x: _nebula/writers/g-3.json")


def test_the_job_tree_merges_the_ranks_trees_dict_by_dict_lowest_rank_first() -> None:
    from nebula_ckpt.format.tree import merged

    def d(*items: tuple[str, Any]) -> dict[str, Any]:
        return {"t": "dict", "v": [[{"t": "str", "v": k}, v] for k, v in items]}

    def leaf(k: str) -> dict[str, Any]:
        return {"t": "tensor", "k": k}

    r0 = d(("model", d(("a", leaf("model/a")))), ("rng", {"t": "int", "v": 0}), ("x", leaf("x")))
    r1 = d(("model", d(("b", leaf("model/b")))), ("rng", {"t": "int", "v": 1}), ("y", {"t": "list", "v": []}))
    got = merged([r0, r1])
    assert got == d(("model", d(("a", leaf("model/a")), ("b", leaf("model/b")))), ("rng", {"t": "int", "v": 0}),
                    ("x", leaf("x")), ("y", {"t": "list", "v": []}))
    assert merged([r0]) is r0 and merged([leaf("x"), r0]) == leaf("x")   # not dicts: the first tree's


def test_nan_leaves_are_written_with_their_bits_and_older_nan_nodes_still_read() -> None:
    """``float.hex`` writes every NaN as ``"nan"``: a NaN other than ``float("nan")`` (a sign bit, a
    payload) also gets its IEEE 754 bits, 16 lowercase hex digits, most significant first; a tree
    without them (``float("nan")``, or written before they were) reads as ``float("nan")``."""
    import struct

    from nebula_ckpt.format.tree import check_tree, decode, encode_leaf

    def bits(x: float) -> str:
        return struct.pack(">d", x).hex()

    neg = -float("nan")
    payload = struct.unpack(">d", bytes.fromhex("7ff0000000000001"))[0]  # signalling, with a payload
    assert encode_leaf(neg, "x", False) == {"t": "float", "v": "nan", "bits": "fff8000000000000"}
    assert encode_leaf(float("nan"), "x", False) == {"t": "float", "v": "nan"}
    assert encode_leaf(complex(1.0, payload), "x", False) == {
        "t": "complex", "v": ["0x1.0000000000000p+0", "nan"], "bits": [None, "7ff0000000000001"]}
    tree = {"t": "list", "v": [encode_leaf(v, "x", False) for v in (neg, payload, complex(neg, neg))]
            + [{"t": "float", "v": "nan"}, {"t": "complex", "v": ["nan", "-0x0.0p+0"]}]}
    check_tree(json.loads(json.dumps(tree)), {}, "test")
    a, b, c, old, old_c = decode(json.loads(json.dumps(tree)), lambda k: None, False)
    assert (bits(a), bits(b), bits(c.real), bits(c.imag)) == ("fff8000000000000", "7ff0000000000001",
                                                             "fff8000000000000", "fff8000000000000")
    assert bits(old) == bits(float("nan")) and (bits(old_c.real), bits(old_c.imag)) == (bits(float("nan")),
                                                                                       bits(-0.0))
