"""A checkpoint read from storage is input, never truth (issue #9, manifest part).

Every case here saves a real small checkpoint, rewrites ``step-1/manifest.json`` in a hostile
or broken way, and recomputes the ``COMMIT`` marker so the manifest checksum is *valid*. The
reader must still refuse it, naming the file and the field: at open time (so ``verify`` and
``ls`` catch it too), without a traceback from the CLI, and without allocating more than the
shard holds.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable

import crc32c
import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt.cli import main
from nebula_ckpt.errors import CorruptCheckpointError
from nebula_ckpt.format.tree import decode
from nebula_ckpt.restore.open import open_checkpoint
from nebula_ckpt.restore.select import find_and_open
from nebula_ckpt.storage.local import LocalStorage
from nebula_ckpt.tiers.local import LocalTier

Man = dict[str, Any]


def _save(root: str) -> None:
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    state = {"w": w, "w_tied": w, "b": torch.ones(4, dtype=torch.int64), "meta": {"lr": 0.5, 3: "three"}}
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, state)


def rewrite(root: str, fn: Callable[[Man], Any], step: int = 1) -> None:
    """Apply ``fn`` to the manifest of ``step`` and re-seal it: the COMMIT checksum stays valid."""
    d = os.path.join(root, f"step-{step}")
    man = json.load(open(os.path.join(d, "manifest.json")))
    fn(man)
    mb = json.dumps(man, separators=(",", ":")).encode()
    # json.dumps cannot write what json.loads cannot read: splice such nesting in as text
    mb = mb.replace(b'"__DEEP__"', b'{"t":"list","v":[' * 5000 + b'{"t":"none"}' + b']}' * 5000)
    open(os.path.join(d, "manifest.json"), "wb").write(mb)
    commit = json.load(open(os.path.join(d, "COMMIT")))
    commit.update(manifest_bytes=len(mb), manifest_crc32c=crc32c.crc32c(mb))
    open(os.path.join(d, "COMMIT"), "w").write(json.dumps(commit))


@pytest.fixture
def saved(tmp_path, shm_dir) -> str:  # noqa: ANN001
    root = str(tmp_path / "root")
    _save(root)
    return root


def _t(man: Man, key: str = "w") -> Man:
    return man["tensors"][key]


def _tree_item(man: Man, key: str) -> list[Any]:
    return next(kv for kv in man["tree"]["v"] if kv[0]["v"] == key)


def _set_leaf(node: Any) -> Callable[[Man], None]:
    def fn(man: Man) -> None:
        _tree_item(man, "meta")[1]["v"][0][1] = node
    return fn


def _nest(depth: int) -> Callable[[Man], None]:
    def fn(man: Man) -> None:
        node: Man = {"t": "none"}
        for _ in range(depth):
            node = {"t": "list", "v": [node]}
        _tree_item(man, "meta")[1] = node
    return fn


def _dup_ranges(n: int) -> Callable[[Man], None]:
    def fn(man: Man) -> None:
        for i in range(n):
            man["tensors"][f"copy{i}"] = dict(_t(man))
    return fn


# Typed leaves whose value passes a type check but not the writer's bounds, or that decode to
# something other than what they say: (id, node, text the error must contain).
HOSTILE_LEAVES: list[tuple[str, Man, str]] = [
    ("size_beyond_int64", {"t": "size", "v": [10**30]}, "int64"),
    ("size_dim_2_63", {"t": "size", "v": [3, 2**63]}, "int64"),
    ("float_overflows", {"t": "float", "v": "0x1p+99999"}, "float.hex"),
    ("complex_overflows", {"t": "complex", "v": ["0x1p+0", "-0x1.8p+5000"]}, "float.hex"),
    ("float_with_spaces", {"t": "float", "v": " 0x1p+0 "}, "float.hex"),
    # NaN bits: only on a "nan", only for a NaN other than float("nan"), 16 lowercase hex digits
    ("nan_bits_of_float_nan", {"t": "float", "v": "nan", "bits": "7ff8000000000000"}, "'bits'"),
    ("nan_bits_not_a_nan", {"t": "float", "v": "nan", "bits": "3ff0000000000000"}, "'bits'"),
    ("nan_bits_of_infinity", {"t": "float", "v": "nan", "bits": "7ff0000000000000"}, "'bits'"),
    ("nan_bits_on_a_number", {"t": "float", "v": "0x1.0000000000000p+0", "bits": "fff8000000000000"}, "'bits'"),
    ("nan_bits_upper_case", {"t": "float", "v": "nan", "bits": "FFF8000000000000"}, "'bits'"),
    ("nan_bits_short", {"t": "float", "v": "nan", "bits": "fff8"}, "'bits'"),
    ("nan_bits_not_text", {"t": "float", "v": "nan", "bits": 18444492273895866368}, "'bits'"),
    ("complex_nan_bits_both_null", {"t": "complex", "v": ["nan", "nan"], "bits": [None, None]}, "'bits'"),
    ("complex_nan_bits_one", {"t": "complex", "v": ["nan", "nan"], "bits": ["fff8000000000000"]}, "'bits'"),
    ("complex_nan_bits_on_a_number", {"t": "complex", "v": ["0x0.0p+0", "nan"], "bits": ["fff8000000000000", None]},
     "'bits'"),
    ("device_index_wraps", {"t": "device", "v": "cuda:128"}, "device string"),   # torch reads cuda:-128
    ("device_not_canonical", {"t": "device", "v": "cpu:00"}, "device string"),
    ("int_beyond_writer_bound", {"t": "int", "v": 2**5000}, "4096 bits"),
    ("dict_key_beyond_writer_bound", {"t": "dict", "v": [[{"t": "int", "v": -(2**5000)}, {"t": "none"}]]},
     "4096 bits"),
    ("npscalar_bad_base64", {"t": "npscalar", "dtype": "<f4", "v": "!!!!"}, "base64"),
    ("bytes_with_newlines", {"t": "bytes", "v": "AAAA\nAAAA"}, "base64"),
    # an array leaf over a stored tensor of another dtype (the tensor "w" is float32)
    ("ndarray_over_other_dtype", {"t": "ndarray", "dtype": "<i4", "v": {"t": "tensor", "k": "w"}}, "float32"),
]

# (id, manifest change, text the error must contain)
MANIFEST_CASES: list[tuple[str, Callable[[Man], Any], str]] = [
    ("bogus_dtype", lambda m: _t(m).update(dtype="float99"), "dtype 'float99'"),
    ("dtype_not_str", lambda m: _t(m).update(dtype=5), "dtype must be a string"),
    ("quantized_dtype", lambda m: _t(m).update(dtype="qint8"), "dtype 'qint8'"),
    ("negative_dim", lambda m: _t(m).update(shape=[-2, -3]), "shape[0]"),
    ("huge_dim", lambda m: _t(m).update(shape=[2**80, 0]), "shape[0]"),
    ("dim_beyond_int64", lambda m: _t(m).update(shape=[2**63, 0]), "shape[0] = 9223372036854775808 is out of range"),
    # an empty tensor whose shape torch cannot build: its nonzero dimensions overflow int64 on the way
    ("empty_shape_overflows_int64", lambda m: _t(m).update(shape=[2**62, 2**62, 0], offsets=[_t(m)["offsets"][0]] * 2),
     "multiply to more than 2**63-1"),
    ("empty_shape_strides_overflow", lambda m: _t(m).update(shape=[0, 2**62, 4], offsets=[_t(m)["offsets"][0]] * 2),
     "multiply to more than 2**63-1"),
    ("float_dim", lambda m: _t(m).update(shape=[2.0, 3]), "shape[0] must be an integer"),
    ("shape_mismatch", lambda m: _t(m).update(shape=[2, 4]), "needs 32"),
    ("too_many_dims", lambda m: _t(m).update(shape=[1] * 100), "dimensions"),
    ("range_outside_shard", lambda m: _t(m).update(offsets=[10**9, 10**9 + 24]), "offsets[0]"),
    ("range_reversed", lambda m: _t(m).update(offsets=[4120, 4096]), "offsets [4120, 4096)"),
    ("range_in_header", lambda m: _t(m).update(offsets=[8, 32]), "inside the header"),
    ("misaligned", lambda m: _t(m, "b").update(offsets=[m["tensors"]["b"]["offsets"][0] + 4,
                                                        m["tensors"]["b"]["offsets"][1] + 4]), "aligned"),
    ("overlap", lambda m: _t(m, "b").update(offsets=[_t(m)["offsets"][0] - 8, _t(m)["offsets"][0] + 24]), "overlap"),
    ("repeated_ranges", _dup_ranges(1000), "overlap"),
    ("offsets_not_pair", lambda m: _t(m).update(offsets=[4096]), "offsets must be [start, end]"),
    ("crc_not_int", lambda m: _t(m).update(crc32c="0x1234"), "crc32c must be an integer"),
    ("crc_too_big", lambda m: _t(m).update(crc32c=2**40), "crc32c"),
    ("missing_crc", lambda m: _t(m).pop("crc32c"), "crc32c must be an integer"),
    ("unknown_tensor_field", lambda m: _t(m).update(evil=1), "unknown field"),
    ("shard_index", lambda m: _t(m).update(shard=3), "shard = 3"),
    ("bad_device", lambda m: _t(m).update(device="tpu:0"), "device 'tpu:0'"),
    ("device_not_str", lambda m: _t(m).update(device=["cpu"]), "device must be a string"),
    ("tensors_not_object", lambda m: m.update(tensors=[1, 2]), "tensors must be a JSON object"),
    ("alias_to_missing", lambda m: m["aliases"].update(x="nope"), "no such tensor"),
    ("alias_is_tensor_key", lambda m: m["aliases"].update(w="b"), "also a stored tensor key"),
    ("alias_chain", lambda m: m["aliases"].update(x="w_tied"), "itself an alias"),
    ("alias_cycle", lambda m: m.update(aliases={"p": "q", "q": "p"}), "itself an alias"),
    ("alias_not_str", lambda m: m["aliases"].update(x=7), "must be a string"),
    ("shard_parent_dir", lambda m: m["shards"][0].update(file="../../escape.safetensors"), "not a shard name"),
    ("shard_subdir", lambda m: m["shards"][0].update(file="sub/shard-g1-r0.safetensors"), "not a shard name"),
    ("shard_absolute", lambda m: m["shards"][0].update(file="/etc/passwd"), "not a shard name"),
    ("shard_other_name", lambda m: m["shards"][0].update(file="COMMIT"), "not a shard name"),
    ("shard_twice", lambda m: m["shards"].append(dict(m["shards"][0])), "lists a file twice"),
    ("shard_bytes_type", lambda m: m["shards"][0].update(bytes="4124"), "bytes must be an integer"),
    ("stored_bytes_lie", lambda m: m["shards"][0]["storage"].update(stored_bytes=1), "stored_bytes"),
    ("zstd_bomb", lambda m: m["shards"][0]["storage"].update(compression="zstd", frames=[[2**40, 10]]),
     "cannot come from"),
    ("unknown_compression", lambda m: m["shards"][0]["storage"].update(compression="lz4"), "compression 'lz4'"),
    ("shard_refers_to_itself", lambda m: m["shards"][0].update(step=1), "not an earlier step"),
    ("shard_refers_to_later", lambda m: m["shards"][0].update(step=2**40), "not an earlier step"),
    ("shard_ref_not_int", lambda m: m["shards"][0].update(step="0"), "step must be an integer"),
    ("sha256_not_hex", lambda m: m.update(sha256={"w": "xyz"}), "64 lowercase hex"),
    ("sha256_unknown_key", lambda m: m.update(sha256={"nope": "0" * 64}), "no such stored tensor"),
    # time: a number, finite, and one a float holds (json.loads reads NaN and Infinity)
    ("time_not_number", lambda m: m.update(time="1718000000"), "time must be a number"),
    ("time_beyond_float", lambda m: m.update(time=10**400), "time = <1329-bit int> is not a finite number"),
    ("time_nan", lambda m: m.update(time=float("nan")), "time = nan is not a finite number"),
    ("time_infinite", lambda m: m.update(time=float("-inf")), "time = -inf is not a finite number"),
    ("step_mismatch", lambda m: m.update(step=7), "step is 7"),
    ("step_not_int", lambda m: m.update(step="1"), "step must be an integer"),
    ("step_beyond_int64", lambda m: m.update(step=2**63), "step = 9223372036854775808 is out of range"),
    ("shard_ref_beyond_int64", lambda m: m["shards"][0].update(step=2**63), "out of range [0, 9223372036854775807]"),
    ("newer_version", lambda m: m.update(version=5), "newer than this nebula_ckpt"),
    ("version_not_int", lambda m: m.update(version="1"), "version must be an integer"),
    ("wrong_format", lambda m: m.update(format="other"), "not a nebula_ckpt manifest"),
    ("missing_tree", lambda m: m.pop("tree"), "lacks field(s) ['tree']"),
    ("not_an_object", lambda m: (m.clear(), m.update(format="nebula_ckpt", version=1, step=1)), "lacks field"),
    # the typed tree
    ("tree_unknown_type", _set_leaf({"t": "evil", "v": 1}), "unknown node type 'evil'"),
    ("tree_missing_v", _set_leaf({"t": "int"}), "needs 'v'"),
    ("tree_int_is_str", _set_leaf({"t": "int", "v": "3"}), "needs 'v'"),
    ("tree_bad_base64", _set_leaf({"t": "bytes", "v": "!!not base64!!"}), "base64"),
    ("tree_bad_pickle_base64", _set_leaf({"t": "pickle", "v": "%%%"}), "base64"),
    ("tree_bad_hex_float", _set_leaf({"t": "float", "v": "0xZZp+1"}), "float.hex"),
    ("tree_bad_complex", _set_leaf({"t": "complex", "v": ["0x1p+0"]}), "float.hex"),
    ("tree_unknown_dtype", _set_leaf({"t": "dtype", "v": "float99"}), "dtype name"),
    ("tree_bad_device", _set_leaf({"t": "device", "v": "warp:9"}), "device string"),
    ("tree_bad_size", _set_leaf({"t": "size", "v": [2, -1]}), "non-negative"),
    ("tree_missing_tensor", _set_leaf({"t": "tensor", "k": "nope"}), "names no tensor"),
    *[(f"tree_{name}", _set_leaf(node), expect) for name, node, expect in HOSTILE_LEAVES],
    ("tree_node_not_object", _set_leaf([1, 2]), "must be a JSON object"),
    ("tree_list_not_list", _set_leaf({"t": "list", "v": {"a": 1}}), "needs 'v' as a JSON list"),
    ("tree_dict_key_float", _set_leaf({"t": "dict", "v": [[{"t": "float", "v": "0x1p+0"}, {"t": "none"}]]}),
     "str or int node"),
    ("tree_dict_key_bool", _set_leaf({"t": "dict", "v": [[{"t": "int", "v": True}, {"t": "none"}]]}),
     "str or int node"),
    ("tree_dict_item_not_pair", _set_leaf({"t": "dict", "v": [[{"t": "str", "v": "a"}]]}), "pair"),
    ("tree_stateful_no_state", _set_leaf({"t": "stateful", "cls": "x.Y"}), "needs 'state'"),
    ("tree_too_deep", _nest(300), "nested deeper than"),
    ("tree_deeper_than_json", lambda m: _tree_item(m, "meta").__setitem__(1, "__DEEP__"), "not valid JSON"),
]


@pytest.mark.parametrize("change,expect", [c[1:] for c in MANIFEST_CASES], ids=[c[0] for c in MANIFEST_CASES])
def test_malformed_manifest_is_refused_everywhere(saved: str, change: Callable[[Man], Any], expect: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    rewrite(saved, change)
    st = LocalStorage(saved)
    with pytest.raises(CorruptCheckpointError) as ei:
        open_checkpoint(st, 1, "size", "tier t step 1")
    msg = str(ei.value)
    assert "tier t step 1" in msg and "manifest.json" in msg and expect in msg, msg
    # verify, ls (full and quick) and inspect all say so, with the reason, never a traceback
    capsys.readouterr()
    assert main(["verify", saved]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED" in out and expect in out, out
    assert main(["ls", saved, "--json"]) == 1
    (row,) = json.loads(capsys.readouterr().out)
    assert row["healthy"] is False and expect in row["problem"]
    assert main(["ls", saved, "--quick"]) == 1
    assert "DAMAGED" in capsys.readouterr().out
    assert main(["inspect", saved, "--step", "1"]) == 1
    err = capsys.readouterr().err
    assert expect in err and "Traceback" not in err


def test_untouched_checkpoint_reads_back(saved: str) -> None:
    """The re-sealing helper itself leaves a valid checkpoint valid (the cases test the change)."""
    rewrite(saved, lambda m: None)
    ck = open_checkpoint(LocalStorage(saved), 1, "full", "t")
    made: dict[str, torch.Tensor] = {}

    def tensor(key: str) -> torch.Tensor:  # each stored tensor once, as a restore makes them
        real = ck.resolve(key).key
        if real not in made:
            made[real] = ck.view(key).clone()
        return made[real]

    state = decode(ck.tree, tensor, allow_pickle=False)
    assert torch.equal(state["w"], torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert state["w_tied"] is state["w"] and state["meta"] == {"lr": 0.5, 3: "three"}


def test_header_length_beyond_the_file(saved: str) -> None:
    d = os.path.join(saved, "step-1")
    with open(os.path.join(d, "shard-g1-r0.safetensors"), "r+b") as f:
        f.write((2**63).to_bytes(8, "little"))   # the shard's own header length, not the manifest
    with pytest.raises(CorruptCheckpointError, match="header claims"):
        open_checkpoint(LocalStorage(saved), 1, "size", "t")


def test_shard_name_never_opened_outside_the_step_folder(saved: str, tmp_path) -> None:  # noqa: ANN001
    """A manifest naming ../<file> is refused before anything is opened, even if the file exists."""
    outside = os.path.join(saved, "escape.safetensors")
    shard = os.path.join(saved, "step-1", "shard-g1-r0.safetensors")
    open(outside, "wb").write(open(shard, "rb").read())
    rewrite(saved, lambda m: m["shards"][0].update(file="../escape.safetensors"))
    opened: list[str] = []

    class Spy(LocalStorage):
        def read_buffer(self, rel: str, info: Any = None, **kw: Any) -> Any:
            opened.append(rel)
            return super().read_buffer(rel, info, **kw)

        def size(self, rel: str) -> int:
            opened.append(rel)
            return super().size(rel)

    with pytest.raises(CorruptCheckpointError, match="not a shard name"):
        open_checkpoint(Spy(saved), 1, "full", "t")
    assert opened == []


def test_repeated_tree_references_allocate_once(saved: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tree naming one tensor many times costs its bytes once: never more than the shard holds."""
    many = {"t": "list", "v": [{"t": "tensor", "k": "w"}] * 5000}
    rewrite(saved, lambda m: _tree_item(m, "meta").__setitem__(1, many))
    import nebula_ckpt.restore.copies as copies
    from nebula_ckpt.restore.apply import materialize

    real = copies.get_ops()
    allocated: list[int] = []

    class Counting:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def alloc(self, n: int, *args: Any, **kw: Any) -> torch.Tensor:
            allocated.append(n)
            return real.alloc(n, *args, **kw)

    monkeypatch.setattr(copies, "get_ops", lambda: Counting())
    ck = open_checkpoint(LocalStorage(saved), 1, "full", "t")
    tree = materialize(ck)
    assert len(tree["meta"]) == 5000 and all(t is tree["w"] for t in tree["meta"])
    shard_bytes = ck.manifest.shards[0].bytes
    assert sum(allocated) <= shard_bytes, (allocated, shard_bytes)


def test_repeated_ndarray_nodes_decode_one_array(tmp_path, shm_dir) -> None:  # noqa: ANN001
    """A tree naming one stored tensor from many ``ndarray`` nodes gives one array, not one owned
    copy per node: a small manifest cannot make a restore allocate more than the shard holds."""
    np = pytest.importorskip("numpy")
    root = str(tmp_path / "root")
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, {"a": np.arange(4096, dtype=np.float32), "meta": 0})
    rewrite(root, lambda m: _tree_item(m, "meta").__setitem__(1, {"t": "list", "v": [_tree_item(m, "a")[1]] * 500}))
    with nc.Checkpointer(root, read_only=True) as ck:
        _, tree = ck.read(1)
    assert len(tree["meta"]) == 500 and all(a is tree["a"] for a in tree["meta"])
    assert np.array_equal(tree["a"], np.arange(4096, dtype=np.float32))


def _pairs(root: str) -> list[Any]:
    t = LocalTier(root)
    return [(t, t.make_storage())]


def test_all_damaged_raises_listing_every_candidate(tmp_path, shm_dir, caplog) -> None:  # noqa: ANN001
    root = str(tmp_path / "root")
    with nc.Checkpointer(root, memory_tier=False, keep_last=5) as ck:
        ck.save(1, {"w": torch.ones(3)})
        ck.save(2, {"w": torch.ones(3)})
    rewrite(root, lambda m: _t(m).update(dtype="float99"), step=1)
    rewrite(root, lambda m: _t(m).update(shape=[2**70]), step=2)
    with pytest.raises(CorruptCheckpointError) as ei:
        find_and_open(_pairs(root))
    msg = str(ei.value)
    assert "step 1" in msg and "step 2" in msg and "float99" in msg and "shape[0]" in msg, msg
    assert "nebula-ckpt verify" in msg and "move it aside" in msg and "older copy" in msg
    assert "delete" not in msg  # never advise deleting what might verify
    caplog.set_level(logging.WARNING, logger="nebula_ckpt")
    assert find_and_open(_pairs(root), on_all_damaged="warn") is None
    assert "no healthy checkpoint" in caplog.text and "float99" in caplog.text


def test_no_checkpoint_at_all_is_quiet_none(tmp_path, caplog) -> None:  # noqa: ANN001
    caplog.set_level(logging.WARNING, logger="nebula_ckpt")
    assert find_and_open(_pairs(str(tmp_path / "empty"))) is None
    assert caplog.text == ""


@pytest.mark.parametrize("exc", [KeyError("k"), ValueError("v"), RuntimeError("r"), OverflowError("o"),
                                 __import__("struct").error("s"), IndexError("i"), TypeError("t")])
def test_any_exception_while_opening_is_a_skipped_candidate(tmp_path, shm_dir, exc: Exception,  # noqa: ANN001
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    root = str(tmp_path / "root")
    with nc.Checkpointer(root, memory_tier=False, keep_last=5) as ck:
        ck.save(1, {"w": torch.ones(3)})
        ck.save(2, {"w": torch.full((3,), 2.0)})
    import nebula_ckpt.restore.select as restore

    real = restore.open_checkpoint

    def flaky(storage: Any, step: int, verify: str, where: str, *rank_world: Any, **kw: Any) -> Any:
        if step == 2:
            raise exc
        return real(storage, step, verify, where, *rank_world, **kw)

    monkeypatch.setattr(restore, "open_checkpoint", flaky)
    ck = find_and_open(_pairs(root))
    assert ck is not None and ck.step == 1
    monkeypatch.setattr(restore, "open_checkpoint", lambda *a, **kw: (_ for _ in ()).throw(exc))
    with pytest.raises(CorruptCheckpointError, match=type(exc).__name__):
        find_and_open(_pairs(root))


def test_on_all_damaged_is_checked(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="on_all_damaged"):
        find_and_open(_pairs(str(tmp_path)), on_all_damaged="ignore")


def test_deepest_tree_the_writer_accepts_reads_back(tmp_path, shm_dir) -> None:  # noqa: ANN001
    """Reader and writer agree on the depth bound: the deepest state save() takes loads again."""
    from nebula_ckpt.format.tree import MAX_DEPTH
    from nebula_ckpt.save import plan

    assert getattr(plan, "MAX_DEPTH", MAX_DEPTH) == MAX_DEPTH
    state: Any = {"leaf": torch.ones(2)}
    for i in range(MAX_DEPTH - 1):
        state = {f"k{i % 3}": state} if i % 2 else [state]
    root = str(tmp_path / "root")
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, state)
        step, back = ck.read(1)
    assert step == 1
    for _ in range(MAX_DEPTH - 1):
        back = back[0] if isinstance(back, list) else next(iter(back.values()))
    assert torch.equal(back["leaf"], torch.ones(2))


@pytest.mark.parametrize("node,expect", [c[1:] for c in HOSTILE_LEAVES], ids=[c[0] for c in HOSTILE_LEAVES])
def test_a_step_with_a_hostile_leaf_is_damaged_everywhere(tmp_path, shm_dir, node: Man, expect: str,  # noqa: ANN001
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A leaf of the right type but an impossible value (a torch.Size dim beyond int64, a device
    index torch wraps around, a float that overflows) makes its step DAMAGED: the restore falls
    back to the older step, and export refuses it (exit 1, the reason named, no traceback)."""
    root = str(tmp_path / "root")
    with nc.Checkpointer(root, memory_tier=False) as ck:
        for step in (1, 2):
            ck.save(step, {"w": torch.full((3,), float(step)), "meta": {"shape": torch.Size([2, 3]), "n": step}})
    rewrite(root, lambda m: _tree_item(m, "meta")[1]["v"].__setitem__(0, [{"t": "str", "v": "shape"}, node]), step=2)
    into: dict[str, Any] = {"w": torch.zeros(3), "meta": None}
    with nc.Checkpointer(root, memory_tier=False) as ck:
        assert ck.load_latest(into=into) == 1
    assert torch.equal(into["w"], torch.ones(3)) and into["meta"] == {"shape": torch.Size([2, 3]), "n": 1}
    capsys.readouterr()
    out = str(tmp_path / "out.pt")
    assert main(["export", root, "--step", "2", "--to", out]) == 1
    err = capsys.readouterr().err
    assert expect in err and "Traceback" not in err and not os.path.exists(out), err
    assert main(["verify", root, "--step", "2"]) == 1
    assert expect in capsys.readouterr().out
    assert main(["export", root, "--step", "1", "--to", out]) == 0
    assert torch.load(out, weights_only=True)["meta"]["shape"] == torch.Size([2, 3])


def test_an_empty_tensor_whose_shape_overflows_int64_is_damaged_everywhere(tmp_path, shm_dir,  # noqa: ANN001
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A crafted zero-element record (checksums recomputed) whose shape torch cannot build (its
    nonzero dimensions overflow int64): read, export, ls and verify call the step damaged naming
    the key, and a restore falls back, never torch's bare RuntimeError."""
    root = str(tmp_path / "root")
    with nc.Checkpointer(root, memory_tier=False) as ck:
        for step in (1, 2):
            ck.save(step, {"w": torch.full((3,), float(step)), "e": torch.empty(0)})
    rewrite(root, lambda m: _t(m, "e").update(shape=[2**62, 2**62, 0]), step=2)
    expect = "tensors['e']: shape [4611686018427387904, 4611686018427387904, 0]: its nonzero dimensions multiply"
    with nc.Checkpointer(root, read_only=True) as ck:
        with pytest.raises(CorruptCheckpointError) as ei:
            ck.read(2)
        assert expect in str(ei.value), ei.value
        assert ck.load_latest(into={"w": torch.zeros(3), "e": torch.empty(0)}) == 1
    capsys.readouterr()
    out = str(tmp_path / "out.pt")
    assert main(["export", root, "--step", "2", "--to", out]) == 1
    err = capsys.readouterr().err
    assert expect in err and "Traceback" not in err and not os.path.exists(out), err
    assert main(["verify", root]) == 1
    assert "DAMAGED" in capsys.readouterr().out
    assert main(["ls", root, "--json"]) == 1
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[1]["healthy"] is True and rows[2]["healthy"] is False and expect in rows[2]["problem"]


def test_an_empty_tensor_with_int64_dimensions_reads_back(tmp_path, shm_dir) -> None:  # noqa: ANN001
    """Reader and writer agree on shapes: an empty tensor with dimensions up to 2**63-1, which torch
    builds, is saved and read back (not refused once its step had committed)."""
    root = str(tmp_path / "root")
    state = {"a": torch.empty(0, 2**62 + 1), "b": torch.empty(2**63 - 1, 0, dtype=torch.int8)}
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, state)
        _, back = ck.read(1)
    assert {k: (v.shape, v.dtype) for k, v in back.items()} == {k: (v.shape, v.dtype) for k, v in state.items()}
    assert main(["verify", root]) == 0
