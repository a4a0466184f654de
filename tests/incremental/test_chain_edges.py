"""Incremental checkpoints attacked like a hostile user and an unlucky operator would.

A step of an incremental chain refers to an earlier step's shard for its unchanged tensors. Each
case here saves a real chain on a real tier (local disk, the memory tier in a tmpfs folder),
then rewrites a manifest (re-sealing its ``COMMIT``, so only the references are wrong), deletes,
truncates, replaces or re-links what a step refers to, or saves states that change in awkward
ways, and asserts the promise: every step restores bit-exact, or is refused with an error naming
the step, the file or the key, and a restore falls back to an older healthy step.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable

import crc32c
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import nebula_ckpt as nc
from nebula_ckpt import knobs
from nebula_ckpt.cli import main
from nebula_ckpt.errors import CorruptCheckpointError

Man = dict[str, Any]
SHARD = "shard-g1-r0.safetensors"


def _frozen(seed: int = 1) -> torch.Tensor:
    return torch.randn(256, 256, generator=torch.Generator().manual_seed(seed))  # 256 KiB


def _state(frozen: torch.Tensor, train: torch.Tensor, step: int) -> dict[str, Any]:
    return {"frozen": frozen, "train": train, "step": step}


def _chain(root: str, steps: int = 3, full_every: int = 10, frozen: torch.Tensor | None = None,
           **kw: Any) -> dict[int, dict[str, torch.Tensor]]:
    """Save ``steps`` steps of a frozen tensor and a trained one on the local tier of ``root``;
    the states as saved."""
    frozen = _frozen() if frozen is None else frozen
    train = torch.zeros(64)
    want = {}
    kw.setdefault("memory_tier", False)
    with knobs.override(incremental_full_every=full_every), nc.Checkpointer(root, keep_last=20, **kw) as ck:
        for step in range(steps):
            train += 1
            ck.save(step, _state(frozen, train, step))
            want[step] = {"frozen": frozen.clone(), "train": train.clone()}
    return want


def _man(root: str, step: int) -> Man:
    with open(os.path.join(root, f"step-{step}", "manifest.json")) as f:
        return json.load(f)


def _reseal(root: str, step: int, fn: Callable[[Man], Any]) -> None:
    """Apply ``fn`` to the manifest of ``step`` and re-seal it: its COMMIT checksum stays valid."""
    d = os.path.join(root, f"step-{step}")
    man = _man(root, step)
    fn(man)
    mb = json.dumps(man, separators=(",", ":")).encode()
    with open(os.path.join(d, "manifest.json"), "wb") as f:
        f.write(mb)
    with open(os.path.join(d, "COMMIT")) as f:
        commit = json.load(f)
    commit.update(manifest_bytes=len(mb), manifest_crc32c=crc32c.crc32c(mb))
    with open(os.path.join(d, "COMMIT"), "w") as f:
        f.write(json.dumps(commit))


def _read(root: str, step: int, verify: str = "full") -> dict[str, Any]:
    with nc.Checkpointer(root, tiers=[nc.LocalTier(root, verify=verify)], read_only=True) as ck:
        got, state = ck.read(step)
    assert got == step
    return state


def _assert_refused(root: str, step: int, *needles: str, verify: str = "full") -> str:
    """``step`` is refused by read(), by ``verify`` and by ``ls`` of the CLI, each naming ``needles``."""
    with pytest.raises(CorruptCheckpointError) as e:
        _read(root, step, verify)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))
    return str(e.value)


def _verify_rows(capsys: pytest.CaptureFixture[str], root: str) -> tuple[int, dict[int, Man]]:
    capsys.readouterr()
    rc = main(["verify", root, "--json"])
    return rc, {r["step"]: r for r in json.loads(capsys.readouterr().out)}


# --- hostile references in a re-sealed manifest -------------------------------------------------

def _ref(value: Any, field: str = "step") -> Callable[[Man], None]:
    def fn(man: Man) -> None:
        man["shards"][1][field] = value
    return fn


@pytest.mark.parametrize("value, expect", [
    (2, "shards lists a file twice"),                             # itself: its own shard again
    (5, "refers to step 5, not an earlier step than 2"),          # a newer step
    (-1, "step = -1 is out of range"),
    (10 ** 30, "is out of range"),
    ("0", "step must be an integer, got str"),
    (0.0, "step must be an integer, got float"),
    (True, "step must be an integer, got bool"),
    (None, "step must be an integer, got NoneType"),
    ([0], "step must be an integer, got list"),
])
def test_a_reference_to_a_step_that_is_not_earlier_or_not_an_int_is_refused(
        tmp_path, shm_dir, capsys: pytest.CaptureFixture[str], value: Any, expect: str) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    want = _chain(root)
    _reseal(root, 2, _ref(value))
    _assert_refused(root, 2, "step 2", expect)
    rc, rows = _verify_rows(capsys, root)
    assert rc == 1 and not rows[2]["healthy"] and expect in rows[2]["problem"]
    assert rows[0]["healthy"] and rows[1]["healthy"]
    with nc.Checkpointer(root, memory_tier=False) as ck:  # the newest healthy step loads instead
        into = {"frozen": torch.zeros(256, 256), "train": torch.zeros(64), "step": -1}
        assert ck.load_latest(into=into) == 1
    assert torch.equal(into["frozen"], want[1]["frozen"]) and torch.equal(into["train"], want[1]["train"])


@pytest.mark.parametrize("name", ["../step-0/" + SHARD, "step-0/" + SHARD, "/etc/passwd", SHARD + "/..",
                                  "shard-g1-r0.safetensors\x00", ".."])
def test_a_reference_to_a_path_outside_the_referenced_folder_is_refused(tmp_path, shm_dir, name: str) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    _chain(root)
    _reseal(root, 2, _ref(name, "file"))
    _assert_refused(root, 2, "shards[1]", "is not a shard name")


def test_a_reference_to_a_step_that_does_not_hold_the_file_is_refused(tmp_path, shm_dir) -> None:  # noqa: ANN001
    """Step 2 refers to step 1 (incremental itself: its own shard holds only what changed there)
    for the bytes step 0 holds: a chain A -> B -> C where only direct references are allowed."""
    root = str(tmp_path / "ck")
    _chain(root)
    assert _man(root, 2)["shards"][1]["step"] == 0
    _reseal(root, 2, _ref(1))
    _assert_refused(root, 2, "step 2", "refers to step 1", SHARD)


def test_a_reference_to_a_step_of_another_generation_is_refused(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    frozen = _frozen()
    _chain(root, frozen=frozen)  # generation 1: steps 0, 1, 2 (1 and 2 refer to step 0)
    with nc.Checkpointer(root, memory_tier=False, keep_last=20) as ck:  # generation 2 beside them
        ck.save(10, _state(frozen, torch.zeros(64), 10))
        ck.save(11, _state(frozen, torch.ones(64), 11))
    man = _man(root, 11)
    assert [s.get("step") for s in man["shards"]] == [None, 10]
    assert man["shards"][1]["file"] == "shard-g2-r0.safetensors"
    _reseal(root, 11, _ref(0))  # step 0 exists, but holds generation 1's shard
    _assert_refused(root, 11, "step 11", "refers to step 0", "shard-g2-r0.safetensors", "no such shard")


def test_a_reference_renamed_to_a_shard_of_another_generation_with_the_same_size_is_refused(
        tmp_path, shm_dir) -> None:  # noqa: ANN001
    """Step 11 (generation 2) is made to take its unchanged tensors from generation 1's step 0:
    same size, same storage info, same offsets, other bytes. Even a restore that checks sizes
    only refuses it: a referenced tensor's record must be the base's own record of it."""
    root = str(tmp_path / "ck")
    _chain(root)
    with nc.Checkpointer(root, memory_tier=False, keep_last=20) as ck:
        ck.save(10, _state(_frozen(2), torch.zeros(64), 10))
        ck.save(11, _state(_frozen(2), torch.ones(64), 11))
    s0, s10 = _man(root, 0)["shards"][0], _man(root, 10)["shards"][0]
    assert s0["bytes"] == s10["bytes"] and s0.get("storage") == s10.get("storage")

    def redirect(man: Man) -> None:
        man["shards"][1].update(step=0, file=SHARD)

    _reseal(root, 11, redirect)
    for verify in ("full", "size"):
        _assert_refused(root, 11, "step 11", "refers to step 0", "'frozen'", verify=verify)


# --- the base damaged or replaced by an unlucky operator ------------------------------------------

def _copy_step_from_another_run(tmp_path, root: str, step: int) -> None:  # noqa: ANN001
    """Replace ``root``'s ``step`` by the same step of another run (same model, generation,
    sizes; other values): what an operator copying folders between runs does."""
    other = str(tmp_path / "other")
    _chain(other, steps=step + 1, frozen=_frozen(7))
    shutil.rmtree(os.path.join(root, f"step-{step}"))
    shutil.copytree(os.path.join(other, f"step-{step}"), os.path.join(root, f"step-{step}"))


@pytest.mark.parametrize("verify", ["full", "size"])
def test_a_base_replaced_by_another_runs_step_of_the_same_size_is_refused(
        tmp_path, shm_dir, capsys: pytest.CaptureFixture[str], verify: str) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    want = _chain(root)
    _copy_step_from_another_run(tmp_path, root, 0)
    assert _man(root, 0)["shards"][0]["bytes"] == _man(root, 2)["shards"][1]["bytes"]
    _assert_refused(root, 2, "step 2", "'frozen'", "step 0", verify=verify)
    _assert_refused(root, 1, "step 1", "'frozen'", verify=verify)
    for argv in (["ls", root, "--quick", "--json"], ["verify", root, "--json"]):
        capsys.readouterr()
        assert main(argv) == 1
        rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
        assert rows[0]["healthy"] and not rows[1]["healthy"] and not rows[2]["healthy"], rows
        assert "'frozen'" in rows[2]["problem"] and "step 0" in rows[2]["problem"], rows[2]
    # the step itself is healthy: it is another run's, and reads back as that run saved it
    assert not torch.equal(_read(root, 0, verify)["frozen"], want[0]["frozen"])


def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1)


def _symlink_same_bytes(path: str) -> None:
    """Replace ``path`` by a symlink to a copy of its bytes (outside the step folder)."""
    outside = path + ".outside"
    shutil.move(path, outside)
    os.symlink(outside, path)


def _symlink_other_bytes(path: str) -> None:
    """Replace ``path`` by a symlink to a file of the same size with other bytes."""
    outside = path + ".outside"
    with open(path, "rb") as f:
        data = bytearray(f.read())
    data[-1] ^= 0xFF
    with open(outside, "wb") as f:
        f.write(bytes(data))
    os.remove(path)
    os.symlink(outside, path)


def _flip_last_frozen_byte(folder: str) -> None:
    """Flip the last byte of the tensor ``frozen`` (the one later steps refer to) in ``folder``'s shard."""
    with open(os.path.join(folder, "manifest.json")) as f:
        end = json.load(f)["tensors"]["frozen"]["offsets"][1]
    with open(os.path.join(folder, SHARD), "r+b") as f:
        f.seek(end - 1)
        b = f.read(1)
        f.seek(end - 1)
        f.write(bytes([b[0] ^ 1]))


_DAMAGE: dict[str, Callable[[str], None]] = {
    "folder deleted": lambda d: shutil.rmtree(d),
    "COMMIT deleted": lambda d: os.remove(os.path.join(d, "COMMIT")),
    "manifest deleted": lambda d: os.remove(os.path.join(d, "manifest.json")),
    "shard deleted": lambda d: os.remove(os.path.join(d, SHARD)),
    "shard truncated": lambda d: _truncate(os.path.join(d, SHARD)),
    "shard emptied": lambda d: open(os.path.join(d, SHARD), "wb").close(),
    "shard symlink, same bytes": lambda d: _symlink_same_bytes(os.path.join(d, SHARD)),
    "shard symlink, other bytes": lambda d: _symlink_other_bytes(os.path.join(d, SHARD)),
    "referenced last byte flipped": _flip_last_frozen_byte,
    "folder symlink, same files": lambda d: (shutil.move(d, d + ".outside"), os.symlink(d + ".outside", d)),
}


@pytest.mark.parametrize("damage", list(_DAMAGE))
def test_a_damaged_base_on_disk_falls_back_to_an_older_whole_step(
        tmp_path, shm_dir, capsys: pytest.CaptureFixture[str], damage: str) -> None:  # noqa: ANN001
    """Steps 0 (full), 1 -> 0, 2 (full), 3 -> 2: step 2 damaged takes step 3 with it; step 1 loads,
    bit-exact; ``verify`` names step 3, the step it refers to and the file."""
    root = str(tmp_path / "ck")
    want = _chain(root, steps=4, full_every=2)
    assert [s.get("step") for s in _man(root, 3)["shards"]] == [None, 2]
    _DAMAGE[damage](os.path.join(root, "step-2"))
    _assert_refused(root, 3, "step 3")
    with nc.Checkpointer(root, memory_tier=False) as ck:
        into = {"frozen": torch.zeros(256, 256), "train": torch.zeros(64), "step": -1}
        assert ck.load_latest(into=into) == 1
    assert torch.equal(into["frozen"], want[1]["frozen"]) and torch.equal(into["train"], want[1]["train"])
    rc, rows = _verify_rows(capsys, root)
    assert rc == 1 and rows[0]["healthy"] and rows[1]["healthy"] and not rows[3]["healthy"]
    assert "step 2" in rows[3]["problem"] or "step-2" in rows[3]["problem"], rows[3]
    if not damage.startswith("folder") and "COMMIT" not in damage and "manifest" not in damage:
        assert f"step-2/{SHARD}" in rows[3]["problem"], rows[3]


@pytest.mark.parametrize("damage", ["folder deleted", "COMMIT deleted", "manifest deleted", "shard deleted",
                                    "shard truncated", "shard emptied"])
def test_latest_passes_over_a_step_whose_base_a_restore_refuses_by_its_files(tmp_path, shm_dir, damage: str) -> None:  # noqa: ANN001
    """Steps 0 (full), 1 -> 0, 2 (full), 3 -> 2, and a file of step 2 gone or cut short: ``latest()``
    (which reads no shard byte) names the step ``load_latest`` restores, step 1, not step 3, whose
    own files are whole but whose base no restore opens (a base without its manifest or marker too)."""
    root = str(tmp_path / "ck")
    _chain(root, steps=4, full_every=2)
    _DAMAGE[damage](os.path.join(root, "step-2"))
    with nc.Checkpointer(root, memory_tier=False) as ck:
        named = ck.latest()
        into = {"frozen": torch.zeros(256, 256), "train": torch.zeros(64), "step": -1}
        restored = ck.load_latest(into=into)
    assert (named, restored) == ((1, None), 1)


def _mem_folder(ck: nc.Checkpointer) -> str:
    path = next(t for t in ck.tiers if t.kind == "memory").path  # type: ignore[attr-defined]
    assert path is not None
    return str(path)


@pytest.mark.parametrize("damage", ["COMMIT deleted", "shard truncated", "shard symlink, other bytes",
                                    "referenced last byte flipped", "folder deleted", "shard deleted"])
def test_a_damaged_memory_tier_base_is_never_restored_and_the_disk_copy_loads(
        tmp_path, shm_dir, damage: str) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    frozen, train = _frozen(), torch.zeros(64)
    with knobs.override(incremental_full_every=10), \
            nc.Checkpointer(root, tiers=[nc.MemoryTier(keep_last=20), nc.LocalTier(root)], keep_last=20) as ck:
        folder = _mem_folder(ck)
        for step in range(3):
            train += 1
            ck.save(step, _state(frozen, train, step))
        assert [s.get("step") for s in _man(folder, 2)["shards"]] == [None, 0]
        _DAMAGE[damage](os.path.join(folder, "step-0"))
        into = {"frozen": torch.zeros(256, 256), "train": torch.zeros(64), "step": -1}
        assert ck.load_latest(into=into) == 2
        assert ck.last_restore is not None and ck.last_restore["tier"].startswith("local"), ck.last_restore
        assert torch.equal(into["frozen"], frozen) and torch.equal(into["train"], train)
        got_step, got = ck.read(1)
        assert got_step == 1 and torch.equal(got["frozen"], frozen)


# --- removal, retention, gc, a second writer -------------------------------------------------------

def test_a_second_writer_with_short_retention_keeps_the_first_writers_referenced_base(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    want = _chain(root)  # generation 1: 1 and 2 refer to 0
    with nc.Checkpointer(root, memory_tier=False, keep_last=2) as ck:  # generation 2, no restore
        ck.save(3, _state(_frozen(), torch.full((64,), 9.0), 3))
        assert 0 in ck.list() and 2 in ck.list() and 3 in ck.list()
    got = _read(root, 2)
    assert torch.equal(got["frozen"], want[2]["frozen"]) and torch.equal(got["train"], want[2]["train"])


def test_retention_on_a_long_chain_keeps_exactly_the_kept_steps_and_their_bases(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    frozen, train = _frozen(), torch.zeros(64)
    want = {}
    with knobs.override(incremental_full_every=3), nc.Checkpointer(root, memory_tier=False, keep_last=2) as ck:
        for step in range(8):
            train += 1
            ck.save(step, _state(frozen, train, step))
            want[step] = train.clone()
            kept = ck.list()
            last = {step - 1, step} - {-1}
            assert kept == sorted(last | {s - s % 3 for s in last}), (step, kept)  # every 3rd is full
            on_disk = sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step-"))
            assert on_disk == kept, (step, on_disk, kept)
            for s in kept:  # every step retention kept restores, bit-exact
                got = _read(root, s)
                assert torch.equal(got["frozen"], frozen) and torch.equal(got["train"], want[s]), s


def _remove_all(root: str) -> nc.Checkpointer:
    ck = nc.Checkpointer(root, memory_tier=False, keep_last=20)
    assert ck.remove(step=0) == [0] and 0 in ck.list()  # referred to: kept while 1 and 2 exist
    assert torch.equal(_read(root, 2)["frozen"], _frozen())
    assert ck.remove(step=2) == [2] and ck.remove(step=1) == [1]
    return ck


def test_a_removed_base_goes_with_the_next_save_once_nothing_refers_to_it(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    _chain(root, steps=3)
    with _remove_all(root) as ck:
        ck.save(5, _state(_frozen(), torch.zeros(64), 5))
        assert ck.list() == [5]
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-5"]


def test_a_removed_base_goes_once_its_referrers_are_removed_without_another_save(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    _chain(root, steps=3)
    _remove_all(root).close()
    assert not any(n.startswith("step-") for n in os.listdir(root)), os.listdir(root)


@pytest.mark.parametrize("value", [0, -1, -10])
def test_a_full_save_cadence_below_one_is_a_clear_error_before_anything_is_written(
        tmp_path, shm_dir, value: int) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    with knobs.override(incremental_full_every=value):
        with pytest.raises((nc.ValidationError, ValueError), match="incremental_full_every|FULL_EVERY"):
            with nc.Checkpointer(root, memory_tier=False) as ck:
                ck.save(0, _state(_frozen(), torch.zeros(64), 0))
    assert not os.path.exists(root) or not any(n.startswith("step-") for n in os.listdir(root))


def test_a_full_save_cadence_below_one_from_the_environment_names_the_variable(
        tmp_path, shm_dir, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("NEBULA_INCREMENTAL_FULL_EVERY", "0")
    with pytest.raises(ValueError, match="NEBULA_INCREMENTAL_FULL_EVERY='0'.*>= 1"):
        nc.Checkpointer(str(tmp_path / "ck"), memory_tier=False)
    assert not (tmp_path / "ck").exists() or not any(n.startswith("step-") for n in os.listdir(tmp_path / "ck"))


def test_a_full_save_cadence_of_one_writes_every_save_whole(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    want = _chain(root, steps=3, full_every=1)
    for step in range(3):
        assert len(_man(root, step)["shards"]) == 1
        assert torch.equal(_read(root, step)["train"], want[step]["train"])


# --- export, inspect, safe_open ------------------------------------------------------------------

def test_export_and_inspect_of_an_incremental_step_equal_those_of_a_full_step(
        tmp_path, shm_dir, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    inc, full = str(tmp_path / "inc"), str(tmp_path / "full")
    _chain(inc)
    _chain(full, incremental=False)
    assert len(_man(inc, 2)["shards"]) == 2 and len(_man(full, 2)["shards"]) == 1
    out = {}
    for root in (inc, full):
        dest = str(tmp_path / f"{os.path.basename(root)}.safetensors")
        assert main(["export", root, "--step", "2", "--to", dest]) == 0
        with open(dest, "rb") as f:
            out[root] = f.read()
    assert out[inc] == out[full]
    again = str(tmp_path / "again.safetensors")
    assert main(["export", inc, "--step", "2", "--to", again]) == 0
    with open(again, "rb") as f:
        assert f.read() == out[inc]  # the same step exported twice: the same bytes
    assert torch.equal(load_file(str(tmp_path / "inc.safetensors"))["frozen"], _frozen())
    capsys.readouterr()
    shown = {}
    for root in (inc, full):
        assert main(["inspect", root, "--step", "2", "--json"]) == 0
        info = json.loads(capsys.readouterr().out)
        tensors = {k: {f: v for f, v in r.items() if f not in ("offsets", "shard")} for k, r in info["tensors"].items()}
        shown[root] = (tensors, info["tree"], info["aliases"], info["step"], info["tag"])
        assert main(["inspect", root, "--step", "2", "--full"]) == 0
        rows = [ln.rsplit(None, 2)[0] for ln in capsys.readouterr().out.splitlines()[2:4]]
        shown[root] += (rows,)
    assert shown[inc] == shown[full]


def test_safe_open_on_an_incremental_shard_and_the_referenced_one_gives_every_tensor(tmp_path, shm_dir) -> None:  # noqa: ANN001
    """The recipe of docs/format.md: the own shard holds what changed; a shard entry with ``step``
    names ``step-<step>/<file>``, which holds the rest under the same keys."""
    root = str(tmp_path / "ck")
    want = _chain(root)
    man = _man(root, 2)
    got: dict[str, torch.Tensor] = {}
    for i, sh in enumerate(man["shards"]):
        path = os.path.join(root, f"step-{sh.get('step', 2)}", sh["file"])
        keys = [k for k, r in man["tensors"].items() if r.get("shard", 0) == i]
        with safe_open(path, "pt") as f:
            for k in keys:
                got[k] = f.get_tensor(k)
    assert set(got) == {"frozen", "train"}
    assert torch.equal(got["frozen"], want[2]["frozen"]) and torch.equal(got["train"], want[2]["train"])


# --- awkward changes between saves ----------------------------------------------------------------

def _saves(root: str, states: list[dict[str, Any]], mem: bool) -> list[int]:
    """Save ``states`` as steps 0, 1, ... (memory tier only, or local disk only); the number of
    shards of each step's manifest."""
    tiers = [nc.MemoryTier(keep_last=20)] if mem else [nc.LocalTier(root)]
    with knobs.override(incremental_full_every=100), \
            nc.Checkpointer(root, tiers=tiers, keep_last=20) as ck:  # type: ignore[arg-type]
        folder = _mem_folder(ck) if mem else root
        for step, st in enumerate(states):
            ck.save(step, st)
        for step, st in enumerate(states):
            got_step, got = ck.read(step)
            assert got_step == step
            _assert_same(got, st, f"step {step}")
        return [len(_man(folder, s)["shards"]) for s in range(len(states))]


def _assert_same(got: Any, want: Any, where: str) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape, where
        assert got.contiguous().view(torch.uint8).reshape(-1).tolist() == \
            want.contiguous().view(torch.uint8).reshape(-1).tolist() if want.numel() else True, where
    elif isinstance(want, dict):
        assert set(got) == set(want), (where, set(got), set(want))
        for k in want:
            _assert_same(got[k], want[k], f"{where}/{k}")
    else:
        assert got == want, where


@pytest.fixture(params=["disk", "memory"])
def mem(request: pytest.FixtureRequest) -> bool:
    return bool(request.param == "memory")


def test_a_change_of_dtype_shape_or_keys_between_saves_restores_every_step(tmp_path, shm_dir, mem: bool) -> None:  # noqa: ANN001
    big = _frozen()
    small = torch.arange(64, dtype=torch.float32)
    states = [
        {"big": big, "small": small},
        {"big": big, "small": small.to(torch.float64)},            # dtype changed
        {"big": big, "small": small.to(torch.float64).reshape(8, 8)},  # shape changed, same bytes
        {"big": big, "small": small.to(torch.float64).reshape(8, 8), "new": torch.ones(3)},  # key added
        {"big": big, "new": torch.ones(3)},                          # key removed
        {"big": big.to(torch.bfloat16), "new": torch.ones(3)},       # the big one's dtype
        {"big": big.to(torch.bfloat16).view(torch.int16), "new": torch.ones(3)},  # same bytes, other dtype
    ]
    _saves(str(tmp_path / "ck"), states, mem)


def test_aliases_zero_size_views_and_a_last_byte_change_restore_every_step(tmp_path, shm_dir, mem: bool) -> None:  # noqa: ANN001
    big = _frozen()
    base = torch.arange(4096, dtype=torch.float32)
    last = big.clone()
    last.view(torch.uint8).reshape(-1)[-1] ^= 1                        # differs in its very last byte
    states = [
        {"big": big, "tied": big, "empty": torch.zeros(0, 5), "view": base[::2], "t": base},
        {"big": big, "tied": big, "empty": torch.zeros(0, 5), "view": base[1::2], "t": base},
        {"big": last, "tied": last, "empty": torch.zeros(0, 5), "view": base[1::2], "t": base},
        {"big": last, "tied": big, "empty": torch.zeros(0, 5), "view": base[1::2], "t": base},   # untied
        {"big": last, "tied": big, "empty": torch.empty(0, 5, dtype=torch.int8), "view": base[1::2], "t": base},
        {"big": big.t(), "tied": big, "empty": torch.zeros(0), "view": base[1::2], "t": base},  # a transposed view
    ]
    shards = _saves(str(tmp_path / "ck"), states, mem)
    assert shards[1] == 2, shards  # the big tensor, unchanged, is referred to


def test_a_change_only_in_the_last_byte_of_a_large_tensor_is_written(tmp_path, shm_dir, mem: bool) -> None:  # noqa: ANN001
    big = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    small = torch.zeros(1 << 20, dtype=torch.uint8)
    states: list[dict[str, Any]] = [{"big": big.clone(), "small": small.clone()}]
    for i in range(1, 4):
        small[-1] = i
        states.append({"big": big.clone(), "small": small.clone()})
    big[-1] ^= 0x80
    states.append({"big": big.clone(), "small": small.clone()})
    shards = _saves(str(tmp_path / "ck"), states, mem)
    assert shards[1:4] == [2, 2, 2], shards


@pytest.mark.parametrize("verify", [True, False])
def test_the_dcp_reader_given_a_manifest_refuses_a_replaced_base(tmp_path, shm_dir, verify: bool) -> None:  # noqa: ANN001
    """A reader handed the manifest (as a resharding restore does) still checks what the step
    refers to: the referenced step's own records, not just the file's size."""
    from nebula_ckpt.dcp import NebulaStorageReader
    from nebula_ckpt.restore.open import read_manifest
    from nebula_ckpt.restore.reshard import gather_full
    from nebula_ckpt.storage.local import LocalStorage

    root = str(tmp_path / "ck")
    want = _chain(root)
    st = LocalStorage(root)
    full = gather_full(st, 2, read_manifest(st, 2), verify=verify)
    assert torch.equal(full["frozen"], want[2]["frozen"]) and torch.equal(full["train"], want[2]["train"])
    _copy_step_from_another_run(tmp_path, root, 0)
    with pytest.raises(CorruptCheckpointError, match=r"refers to step 0.*'frozen'"):
        gather_full(st, 2, read_manifest(st, 2), verify=verify)
    with pytest.raises(CorruptCheckpointError, match=r"refers to step 0.*'frozen'"):
        NebulaStorageReader(st, 2, verify=verify)


@pytest.mark.parametrize("damage", ["folder deleted", "COMMIT deleted", "manifest deleted", "shard deleted",
                                    "shard truncated"])
def test_a_base_deleted_by_hand_while_the_job_runs_makes_the_next_save_whole(
        tmp_path, shm_dir, damage: str) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    frozen, train = _frozen(), torch.zeros(64)
    with knobs.override(incremental_full_every=10), nc.Checkpointer(root, memory_tier=False, keep_last=20) as ck:
        ck.save(0, _state(frozen, train, 0))
        ck.save(1, _state(frozen, train + 1, 1))
        _DAMAGE[damage](os.path.join(root, "step-0"))  # "I only need the newest": rm -rf step-0
        ck.save(2, _state(frozen, train + 2, 2))
    got = _read(root, 2)
    assert torch.equal(got["frozen"], frozen) and torch.equal(got["train"], train + 2)


def test_a_memory_tier_base_deleted_by_hand_while_the_job_runs_makes_the_next_save_whole(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    frozen, train = _frozen(), torch.zeros(64)
    with knobs.override(incremental_full_every=10), \
            nc.Checkpointer(root, tiers=[nc.MemoryTier(keep_last=20)], keep_last=20) as ck:  # type: ignore[arg-type]
        folder = _mem_folder(ck)
        ck.save(0, _state(frozen, train, 0))
        ck.save(1, _state(frozen, train + 1, 1))
        shutil.rmtree(os.path.join(folder, "step-0"))
        ck.save(2, _state(frozen, train + 2, 2))
        assert len(_man(folder, 2)["shards"]) == 1
        got_step, got = ck.read(2)
    assert got_step == 2 and torch.equal(got["frozen"], frozen) and torch.equal(got["train"], train + 2)


def test_saves_where_no_tensor_changed_or_only_the_key_order_did_restore_every_step(
        tmp_path, shm_dir, mem: bool) -> None:  # noqa: ANN001
    big, small = _frozen(), torch.arange(16.0)
    states: list[dict[str, Any]] = [
        {"big": big, "small": small, "n": 0},
        {"big": big, "small": small, "n": 1},           # no tensor changed: the own shard holds none
        {"small": small, "big": big, "n": 2},           # the same tensors, keys in another order
        {"small": small + 1, "big": big, "n": 3},
    ]
    shards = _saves(str(tmp_path / "ck"), states, mem)
    assert shards[1] == 2, shards
    if not mem:
        with safe_open(os.path.join(str(tmp_path / "ck"), "step-1", SHARD), "pt") as f:
            assert list(f.keys()) == []  # a valid safetensors file all the same


def test_a_restarted_writer_builds_on_the_restored_chain_and_retention_keeps_its_base(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    want = _chain(root)  # generation 1: 1 and 2 refer to 0
    frozen, train = _frozen(), want[2]["train"].clone()
    with nc.Checkpointer(root, memory_tier=False, keep_last=1) as ck:  # generation 2, restarted
        into = {"frozen": torch.zeros(256, 256), "train": torch.zeros(64), "step": -1}
        assert ck.load_latest(into=into) == 2
        train += 1
        ck.save(3, _state(frozen, train, 3))
        assert [s.get("step") for s in _man(root, 3)["shards"]] == [None, 0]  # built on the restored step
        assert ck.list() == [0, 3], ck.list()
    got = _read(root, 3)
    assert torch.equal(got["frozen"], frozen) and torch.equal(got["train"], train)


def test_only_the_newest_step_folder_copied_elsewhere_is_refused_naming_the_step_it_needs(
        tmp_path, shm_dir, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    """The operator copies the newest step's folder alone to another machine: it needs step 0."""
    root, moved = str(tmp_path / "ck"), str(tmp_path / "moved")
    _chain(root)
    os.makedirs(moved)
    shutil.copytree(os.path.join(root, "step-2"), os.path.join(moved, "step-2"))
    _assert_refused(moved, 2, "step 2", "refers to step 0", SHARD)
    capsys.readouterr()
    assert main(["export", moved, "--step", "2", "--to", str(tmp_path / "x.safetensors")]) == 1
    err = capsys.readouterr().err
    assert "refers to step 0" in err and "Traceback" not in err, err
    assert not os.path.exists(tmp_path / "x.safetensors")
    assert main(["inspect", moved, "--step", "2"]) == 1
    err = capsys.readouterr().err
    assert "refers to step 0" in err and "Traceback" not in err, err
    with nc.Checkpointer(moved, memory_tier=False) as ck:  # nothing healthy: load_latest raises, naming it
        with pytest.raises(CorruptCheckpointError, match="refers to step 0"):
            ck.load_latest(into={"frozen": torch.zeros(256, 256), "train": torch.zeros(64), "step": -1})


def test_a_chain_at_huge_step_numbers_restores(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    big = 2 ** 40
    frozen = _frozen()
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(big, _state(frozen, torch.zeros(64), 0))
        ck.save(big + 1, _state(frozen, torch.ones(64), 1))
    assert _man(root, big + 1)["shards"][1]["step"] == big
    got = _read(root, big + 1)
    assert torch.equal(got["frozen"], frozen) and torch.equal(got["train"], torch.ones(64))


def test_a_memory_tier_base_replaced_by_another_runs_step_is_refused_after_a_restart(tmp_path, shm_dir) -> None:  # noqa: ANN001
    """Only the memory tier: the restarted process finds steps 1 and 2 referring to a step 0 that
    is another run's (same sizes, other bytes): it restores that step 0 as it is, never 1 or 2."""
    folders = {}
    for name, seed in (("ck", 1), ("other", 7)):
        frozen, train = _frozen(seed), torch.zeros(64)
        with knobs.override(incremental_full_every=10), \
                nc.Checkpointer(str(tmp_path / name), tiers=[nc.MemoryTier(keep_last=20)]) as ck:  # type: ignore[arg-type]
            folders[name] = _mem_folder(ck)
            for step in range(3 if name == "ck" else 1):
                train += 1
                ck.save(step, _state(frozen, train, step))
    assert [s.get("step") for s in _man(folders["ck"], 2)["shards"]] == [None, 0]
    shutil.rmtree(os.path.join(folders["ck"], "step-0"))
    shutil.copytree(os.path.join(folders["other"], "step-0"), os.path.join(folders["ck"], "step-0"))
    with nc.Checkpointer(str(tmp_path / "ck"), tiers=[nc.MemoryTier(keep_last=20)]) as ck:  # type: ignore[arg-type]
        for step in (1, 2):
            with pytest.raises(CorruptCheckpointError, match="refers to step 0"):
                ck.read(step)
        into = {"frozen": torch.zeros(256, 256), "train": torch.zeros(64), "step": -1}
        assert ck.load_latest(into=into) == 0
    assert torch.equal(into["frozen"], _frozen(7))


def test_an_export_with_odd_key_names_is_the_same_bytes_every_time(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    state = {"wé\tights/ü": torch.arange(5.0), "\"q\"\\": torch.ones(2, dtype=torch.int8), "n": 1}
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(0, state)
        ck.save(1, state)  # incremental: every tensor referred to
    assert len(_man(root, 1)["shards"]) == 2
    out = []
    for i in range(3):
        dest = str(tmp_path / f"x{i}.safetensors")
        assert main(["export", root, "--step", "1", "--to", dest]) == 0
        with open(dest, "rb") as f:
            out.append(f.read())
    assert out[0] == out[1] == out[2]
    got = load_file(str(tmp_path / "x0.safetensors"))
    assert torch.equal(got["wé\tights/ü"], torch.arange(5.0))
    assert torch.equal(got["\"q\"\\"], torch.ones(2, dtype=torch.int8))


_CRASHING_SAVER = """
import os, sys, torch
import nebula_ckpt as nc
from nebula_ckpt import knobs
root = sys.argv[1]
frozen, train = torch.randn(256, 256, generator=torch.Generator().manual_seed(1)), torch.zeros(64)
with knobs.override(incremental_full_every=10):
    ck = nc.Checkpointer(root, tiers=[nc.MemoryTier(keep_last=20), nc.LocalTier(root)], keep_last=20)
    for step in range(3):
        train += 1
        ck.save(step, {"frozen": frozen, "train": train, "step": step})
os._exit(0)  # a crash: nothing closed, the memory tier stays
"""


def test_gc_keeps_a_memory_tier_whose_newest_step_on_the_root_lacks_its_base(
        tmp_path, shm_dir, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    import sys

    import warm_python

    root = str(tmp_path / "ck")
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir, PYTHONPATH=here)
    r = warm_python.run([sys.executable, "-c", _CRASHING_SAVER, root], env=env, capture_output=True, timeout=180)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    assert [s.get("step") for s in _man(root, 2)["shards"]] == [None, 0]
    shutil.rmtree(os.path.join(root, "step-0"))  # "I only need the newest": the root's step 2 is now unrestorable
    capsys.readouterr()
    assert main(["gc", "--shm-dir", shm_dir, "--json"]) == 0
    decisions = json.loads(capsys.readouterr().out)
    assert decisions and not any(d.get("removed") for d in decisions), decisions
    with nc.Checkpointer(root, tiers=[nc.MemoryTier(keep_last=20), nc.LocalTier(root)]) as ck:
        into = {"frozen": torch.zeros(256, 256), "train": torch.zeros(64), "step": -1}
        assert ck.load_latest(into=into) == 2  # from the memory tier
    assert torch.equal(into["frozen"], _frozen()) and into["step"] == 2


def test_several_zero_size_tensors_at_one_offset_are_referred_to_and_restore(tmp_path, shm_dir, mem: bool) -> None:  # noqa: ANN001
    big = _frozen()
    empties = {"e0": torch.zeros(0, 5), "e1": torch.zeros(3, 0, dtype=torch.int8), "e2": torch.zeros(0),
               "e3": torch.zeros(0, dtype=torch.float64)}
    states = [{"big": big, **empties, "t": torch.zeros(4)}, {"big": big, **empties, "t": torch.ones(4)}]
    shards = _saves(str(tmp_path / "ck"), states, mem)
    assert shards == [1, 2], shards


def test_overlapping_views_of_one_storage_restore_every_step(tmp_path, shm_dir, mem: bool) -> None:  # noqa: ANN001
    """The saved tensors are views of one storage (overlapping, strided), changed in place between
    saves: each step holds what the views showed when it was saved."""
    root = str(tmp_path / "ck")
    store = torch.arange(4096, dtype=torch.float32)
    big = _frozen()
    state = {"big": big, "a": store[:200], "b": store[100:300], "w": store.view(64, 64)[:, 3], "n": 0}
    want = []
    tiers = [nc.MemoryTier(keep_last=20)] if mem else [nc.LocalTier(root)]
    with knobs.override(incremental_full_every=100), \
            nc.Checkpointer(root, tiers=tiers, keep_last=20) as ck:  # type: ignore[arg-type]
        for step in range(3):
            if step == 2:
                store[131] = -1.0  # in "a", "b" and "w" (row 2, column 3)
            ck.save(step, state)
            want.append({k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)})
        folder = _mem_folder(ck) if mem else root
        assert len(_man(folder, 1)["shards"]) == 2
        for step in range(3):
            _, got = ck.read(step)
            for k, v in want[step].items():
                _assert_same(got[k], v, f"step {step}/{k}")
    assert not torch.equal(want[2]["w"], want[1]["w"]) and torch.equal(want[2]["big"], big)


def test_close_writes_an_incremental_step_of_odd_dtypes_whole_on_a_tier_that_skipped_it(tmp_path, shm_dir) -> None:  # noqa: ANN001
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    g = torch.Generator().manual_seed(4)
    frozen = {"f64": torch.randn(33, generator=g, dtype=torch.float64), "bf16": torch.randn(7, 3).to(torch.bfloat16),
              "bool": torch.rand(13, generator=g) > 0.5, "c64": torch.randn(5, dtype=torch.complex64),
              "u8": torch.randint(0, 255, (3,), dtype=torch.uint8), "i16": torch.arange(9, dtype=torch.int16),
              "empty": torch.zeros(0, 4), "big": _frozen()}
    train = torch.zeros(5)
    with nc.Checkpointer(a, tiers=[nc.LocalTier(a), nc.LocalTier(b, every=3)], keep_last=10) as ck:
        for step in range(5):
            train += 1
            ck.save(step, {**frozen, "tied": frozen["f64"], "train": train})
    assert len(_man(a, 4)["shards"]) == 2 and len(_man(b, 4)["shards"]) == 1
    got = _read(b, 4)
    _assert_same({k: got[k] for k in frozen}, frozen, "step 4 on b")
    assert torch.equal(got["train"], train) and torch.equal(got["tied"], frozen["f64"])


@pytest.mark.parametrize("verify", ["full", "size"])
def test_a_remote_base_replaced_by_another_runs_step_is_refused(shm_dir, verify: str) -> None:  # noqa: ANN001
    import uuid

    import fsspec

    base = f"memory://nebula-attack-{uuid.uuid4().hex}"
    url, other = f"{base}/run", f"{base}/other"
    for where, seed, steps in ((url, 1, 3), (other, 7, 1)):
        train = torch.zeros(64)
        with nc.Checkpointer(where, tiers=[nc.RemoteTier(where)], keep_last=20) as ck:
            for step in range(steps):
                train += 1
                ck.save(step, _state(_frozen(seed), train, step))
    fs = fsspec.filesystem("memory")
    run, oth = url[len("memory://"):], other[len("memory://"):]
    assert fs.exists(f"{run}/step-0/{SHARD}")
    for name in fs.ls(f"{oth}/step-0", detail=False):
        fs.pipe(f"{run}/step-0/{name.rsplit('/', 1)[-1]}", fs.cat(name))
    with nc.Checkpointer(url, tiers=[nc.RemoteTier(url, verify=verify)], read_only=True) as ck:
        for step in (1, 2):
            with pytest.raises(CorruptCheckpointError, match=r"refers to step 0.*'frozen'"):
                ck.read(step)
        assert ck.read(0)[0] == 0  # the step itself: the other run's, as it saved it
    fs.rm(f"/{base[len('memory://'):]}", recursive=True)
