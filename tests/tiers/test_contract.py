"""The tier contract: one suite, identical for the memory, local, Azure and S3 tiers.

Every test takes ``tier_factory`` (see conftest.py) and runs once per kind of tier: round trips
are bit-exact, retention deletes marker first, nothing is visible before its commit marker,
damage is detected and skipped, a new Checkpointer (and a new process) finds what an old one
wrote, milestones survive retention, and saving a step again replaces it. The remote tiers
additionally round-trip zstd-compressed shards.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from typing import Any, Callable, Optional

import pytest
import torch

import nebula_ckpt as nc
from faults import FaultyTier
from nebula_ckpt import knobs
from nebula_ckpt.cli import main as cli
from nebula_ckpt.storage.base import Storage

from .conftest import TierUnderTest, run_python

MiB = 1 << 20


# --------------------------------------------------------------------------------------- states

class Net(torch.nn.Module):
    """Small model with a buffer (BatchNorm) and tied weights."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(24, 12)
        self.lin = torch.nn.Linear(12, 12)
        self.bn = torch.nn.BatchNorm1d(12)
        self.head = torch.nn.Linear(12, 24, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(torch.relu(self.lin(self.emb(idx)))))


def mixed_state(seed: int) -> tuple[Net, torch.optim.Optimizer, dict[str, Any]]:
    """Model + AdamW (with state after a step) + plain values + bf16 + non-contiguous view."""
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    idx = torch.randint(0, 24, (6,))
    torch.nn.functional.cross_entropy(model(idx), idx).backward()
    opt.step()
    opt.zero_grad()
    base = torch.randn(10, 16)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45, 3.4e38, 0.1])
    state: dict[str, Any] = {
        "model": model,
        "optim": opt,
        "step": 1000 + seed,
        "big_int": 2**62 + seed,
        "pos": (3, 1024, (seed, -1)),
        "lr": 1 / 3 + seed,
        "floats": [-0.0, float("inf"), float("nan"), 1e-310],
        "name": f"run-{seed}-é",
        "flags": [True, None, False],
        "bf16": torch.randn(33, 7).to(torch.bfloat16),
        "view": base.t()[::2, 1:],          # non-contiguous view of a bigger tensor
        "special": special,
        "nested": {"ints": [1, 2, (3, 4)], "half": torch.arange(6, dtype=torch.float16).reshape(2, 3)},
    }
    assert not state["view"].is_contiguous()
    return model, opt, state


def expected_tree(state: dict[str, Any]) -> dict[str, Any]:
    """What ``read()`` must return for ``state`` at this moment (owned copies)."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        if hasattr(v, "state_dict"):
            out[k] = _clone(v.state_dict())
        else:
            out[k] = _clone(v)
    return out


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return type(x)((k, _clone(v)) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(v) for v in x)
    return x


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(got: Any, want: Any, path: str = "") -> None:
    """Bit-exact equality of two trees: same container types, dtypes, shapes, bytes, float bits."""
    where = path or "<root>"
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__}, expected a tensor"
        assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), \
            f"{where}: {got.dtype} {tuple(got.shape)} != {want.dtype} {tuple(want.shape)}"
        assert _bits(got) == _bits(want), f"{where}: tensor bytes differ"
    elif isinstance(want, dict):
        assert isinstance(got, dict), f"{where}: {type(got).__name__}, expected a dict"
        assert list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{path}/{k}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want), f"{where}: {type(got).__name__}, expected {type(want).__name__}"
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{path}/{i}")
    elif isinstance(want, float):
        assert type(got) is float, f"{where}: {type(got).__name__}, expected float"
        assert struct.pack("<d", got) == struct.pack("<d", want) or (math.isnan(got) and math.isnan(want)), \
            f"{where}: {got!r} != {want!r} (bitwise)"
    else:
        assert type(got) is type(want) and got == want, f"{where}: {got!r} != {want!r}"


def small_state(step: int, n: int = 4096) -> dict[str, Any]:
    """A deterministic small state for ``step``."""
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=g), "b16": torch.randn(64, generator=g).to(torch.bfloat16),
            "step": step}


def assert_is_state(got: Any, step: int, n: int = 4096) -> None:
    assert_same(got, small_state(step, n))


def _fresh_small(n: int = 4096) -> dict[str, Any]:
    return {"w": torch.zeros(n), "b16": torch.zeros(64, dtype=torch.bfloat16), "step": -1}


# ------------------------------------------------------------------- storage instrumentation

class HookedStorage:
    """Delegates to a real storage; calls ``hook(op, rel)`` before each write or delete.

    The hook runs on the tier's writer thread, so it may block there (pausing a save at a stage
    of the commit protocol) or look at the tier from outside while the writer waits.
    """

    def __init__(self, inner: Storage, hook: Callable[[str, str], None]) -> None:
        self._inner = inner
        self._hook = hook

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def write_buffer(self, rel: str, data: Any) -> dict[str, Any]:
        self._hook("write_buffer", rel)
        return self._inner.write_buffer(rel, data)

    def write_small(self, rel: str, data: bytes, *, create_only: bool = False) -> None:
        self._hook("write_small", rel)
        self._inner.write_small(rel, data, create_only=create_only)

    def remove(self, rel: str) -> None:
        self._hook("remove", rel)
        self._inner.remove(rel)

    def remove_dir(self, rel: str) -> None:
        self._hook("remove_dir", rel)
        self._inner.remove_dir(rel)


def instrument(tier: nc.Tier, hook: Callable[[str, str], None]) -> nc.Tier:
    """Make ``tier`` (any kind) hand out a :class:`HookedStorage` around its real storage."""
    make = tier.make_storage
    tier.make_storage = lambda: HookedStorage(make(), hook)  # type: ignore[method-assign, assignment, return-value]
    return tier


def _step_of(rel: str) -> Optional[int]:
    head = rel.split("/", 1)[0]
    return int(head[5:]) if head.startswith("step-") and head[5:].isdigit() else None


def _cli_json(capsys: pytest.CaptureFixture, args: list[str]) -> tuple[int, Any]:
    capsys.readouterr()
    rc = cli(args)
    out = capsys.readouterr().out
    return rc, json.loads(out) if out.strip().startswith(("[", "{")) else out


# ------------------------------------------------------------------------------- the contract

def test_round_trip_bit_exact(tier_factory: TierUnderTest) -> None:
    """A mixed state (model, AdamW, ints/tuples/floats, bf16, non-contiguous view) comes back bit for bit."""
    tk = tier_factory
    _, _, state = mixed_state(1)
    want = expected_tree(state)
    with tk.checkpointer() as ck:
        h = ck.save(10, state)
        assert h.tiers_written == [tk.name] and h.tiers_dropped == []
        step, tree = ck.read(10)
    assert step == 10
    assert_same(tree, want)

    # in place, into other objects of the same shapes, from a new Checkpointer
    model2, opt2, state2 = mixed_state(2)
    view2 = state2["view"]
    with tk.checkpointer() as ck2:
        assert ck2.load_latest(into=state2) == 10
        assert ck2.last_restore is not None
        assert ck2.last_restore["step"] == 10 and ck2.last_restore["tier"] == tk.name
    assert state2["model"] is model2 and state2["optim"] is opt2 and state2["view"] is view2
    assert_same(model2.state_dict(), want["model"])
    assert_same(opt2.state_dict(), want["optim"])
    assert model2.head.weight is model2.emb.weight  # still tied
    for k in want:
        if k not in ("model", "optim"):
            assert_same(state2[k], want[k], k)
    # the restored optimizer works
    idx = torch.randint(0, 24, (6,))
    torch.nn.functional.cross_entropy(model2(idx), idx).backward()
    opt2.step()


def test_list_and_retention_marker_first(tier_factory: TierUnderTest) -> None:
    """keep_last=2: list() after each save shows the newest two; a deleted step loses its marker
    before any of its data, so an outside reader never sees a listed step with missing data."""
    tk = tier_factory
    reader = tk.checkpointer()  # another Checkpointer on the same tier, looking in from outside
    events: list[tuple[str, str]] = []
    problems: list[str] = []

    def hook(op: str, rel: str) -> None:
        events.append((op, rel))
        s = _step_of(rel)
        if s is None or op not in ("remove", "remove_dir") or rel.endswith("/COMMIT"):
            return
        try:
            seen = reader.list()
            if s in seen:
                problems.append(f"{op} {rel} while step {s} is still listed ({seen})")
            healthy = reader.load_latest()
            if healthy is None or healthy < s:
                problems.append(f"during {op} {rel}: newest healthy step is {healthy}")
        except Exception as e:  # noqa: BLE001 - reported below
            problems.append(f"reader failed during {op} {rel}: {type(e).__name__}: {e}")

    tier = instrument(tk.make(keep_last=2), hook)
    with tk.checkpointer(tier, keep_last=2) as ck:
        for s in range(1, 6):
            ck.save(s, small_state(s))
            want = [x for x in (s - 1, s) if x >= 1]
            assert ck.list() == want
            assert ck.list(detailed=True) == {tk.name: want}
            assert reader.list() == want
            assert tk.step_dirs() == [f"step-{x}" for x in want]  # nothing else left behind
    assert not problems, problems
    for s in (1, 2, 3):
        deletes = [(op, rel) for op, rel in events if op.startswith("remove") and _step_of(rel) == s]
        assert deletes, f"step {s} was never deleted"
        assert deletes[0] == ("remove", f"step-{s}/COMMIT"), deletes
        assert ("remove_dir", f"step-{s}") in deletes
    out = _fresh_small()
    assert reader.load_latest(into=out) == 5
    assert_is_state(out, 5)
    reader.close()


def test_nothing_visible_before_the_marker(tier_factory: TierUnderTest, capsys: pytest.CaptureFixture) -> None:
    """A save paused before its manifest, then before its marker: no reader sees it, the previous
    checkpoint is what restores, ``ls`` calls it uncommitted and ``verify`` does not check it."""
    tk = tier_factory
    stages = {"manifest": "step-2/manifest.json", "commit": "step-2/COMMIT"}
    reached = {k: threading.Event() for k in stages}
    release = {k: threading.Event() for k in stages}

    def hook(op: str, rel: str) -> None:
        for stage, target in stages.items():
            if op == "write_small" and rel == target:
                reached[stage].set()
                release[stage].wait(60)

    ck = tk.checkpointer(instrument(tk.make(keep_last=5), hook))
    try:
        ck.save(1, small_state(1))
        h = ck.save_async(2, small_state(2))
        h.wait_snapshot()
        reader = tk.checkpointer()
        for stage in stages:
            assert reached[stage].wait(60), f"the save never reached the {stage} stage"
            with tk.raw() as st:
                present = set(st.list("step-2"))
            assert "COMMIT" not in present
            assert any(n.startswith("shard-") for n in present), present
            assert ("manifest.json" in present) == (stage == "commit"), present
            assert reader.list() == [1]
            assert ck.list() == [1]
            out = _fresh_small()
            assert reader.load_latest(into=out) == 1
            assert_is_state(out, 1)
            with pytest.raises(nc.NotFoundError):
                reader.load(2)
            if stage == "commit":
                rc, rows = _cli_json(capsys, tk.cli_args("ls", "--json"))
                assert rc == 0
                by_step = {r["step"]: r for r in rows}
                assert by_step[1]["committed"] and by_step[1]["healthy"]
                assert by_step[2]["committed"] is False and by_step[2]["healthy"] is False
                rc, rows = _cli_json(capsys, tk.cli_args("verify", "--json"))
                assert rc == 0 and [r["step"] for r in rows] == [1]
            release[stage].set()
        h.result(timeout=60)
        assert reader.list() == [1, 2]
        out = _fresh_small()
        assert reader.load_latest(into=out) == 2
        assert_is_state(out, 2)
        reader.close()
    finally:
        for ev in release.values():
            ev.set()
        ck.close()


def test_flipped_byte_falls_back_and_verify_fails(tier_factory: TierUnderTest,
                                                  capsys: pytest.CaptureFixture) -> None:
    """One flipped byte in the newest shard: restore skips it for the previous step, ``verify`` exits 1."""
    tk = tier_factory
    with tk.checkpointer(tk.make(keep_last=5)) as ck:
        ck.save(1, small_state(1))
        ck.save(2, small_state(2))
    with tk.raw() as st:
        man = json.loads(st.read_small("step-2/manifest.json"))
        shard = f"step-2/{man['shards'][0]['file']}"
        start, end = man["tensors"]["w"]["offsets"]
        data = bytearray(st.read_small(shard))
        data[start + (end - start) // 2] ^= 0x40
        st.write_small(shard, bytes(data))
    out = _fresh_small()
    with tk.checkpointer() as ck2:
        assert ck2.list() == [1, 2]  # still committed: damage is found by verification, not listing
        assert ck2.load_latest(into=out) == 1
        assert ck2.last_restore is not None and ck2.last_restore["step"] == 1
        with pytest.raises(nc.CorruptCheckpointError, match="checksum"):
            ck2.load(2)   # committed but damaged everywhere: said as such, not "not found"
    assert_is_state(out, 1)

    capsys.readouterr()
    assert cli(tk.cli_args("verify")) == 1
    text = capsys.readouterr().out
    assert "DAMAGED" in text and "checksum mismatch in tensor 'w'" in text, text
    assert cli(tk.cli_args("verify", "--step", "1")) == 0


def test_new_checkpointer_restores(tier_factory: TierUnderTest) -> None:
    """What one Checkpointer wrote, a brand-new one on the same tier lists and restores (any step)."""
    tk = tier_factory
    ck = tk.checkpointer(tk.make(keep_last=5))
    ck.save(1, small_state(1))
    ck.save_async(2, small_state(2)).result(timeout=60)
    ck.close()
    del ck
    fresh = tk.checkpointer(tk.make(keep_last=5))
    assert fresh.list() == [1, 2]
    assert fresh.list(detailed=True) == {tk.name: [1, 2]}
    out = _fresh_small()
    assert fresh.load_latest(into=out) == 2
    assert_is_state(out, 2)
    assert fresh.load(1, into=out) == 1
    assert_is_state(out, 1)
    step, tree = fresh.read()
    assert step == 2
    assert_is_state(tree, 2)
    # and it goes on saving where the old one stopped
    fresh.save(3, small_state(3))
    assert fresh.list() == [1, 2, 3]
    fresh.close()


_CHILD_RESTORE = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from tiers.conftest import tier_from_plain
tk = tier_from_plain(json.loads(sys.argv[1]))
ck = tk.checkpointer()
step, tree = ck.read()
torch.save({{"step": step, "tree": tree, "list": ck.list(), "tier": ck.last_restore["tier"]}}, sys.argv[2])
"""


@pytest.mark.slow
@pytest.mark.parametrize("tier_factory", ["memory"], indirect=True)
def test_restore_in_a_real_subprocess(tier_factory: TierUnderTest, tmp_path: Any) -> None:
    """A new process (nothing shared but the tier) restores the mixed state bit for bit."""
    tk = tier_factory
    _, _, state = mixed_state(3)
    want = expected_tree(state)
    with tk.checkpointer() as ck:
        ck.save(7, state)
    out = tmp_path / "restored.pt"
    run_python(_CHILD_RESTORE.format(tests=os.path.dirname(os.path.dirname(__file__))),
               json.dumps(tk.plain()), str(out), timeout=80)
    got = torch.load(out, weights_only=False)
    assert got["step"] == 7 and got["list"] == [7] and got["tier"] == tk.name
    assert_same(got["tree"], want)


def test_keep_every_milestones_kept(tier_factory: TierUnderTest) -> None:
    """keep_last=1, keep_every=2: the newest one plus every even step survive retention."""
    tk = tier_factory
    with tk.checkpointer(tk.make(keep_last=1, keep_every=2)) as ck:
        for s in range(1, 6):
            ck.save(s, small_state(s, 256))
        assert ck.list() == [2, 4, 5]
    assert tk.step_dirs() == ["step-2", "step-4", "step-5"]
    with tk.checkpointer() as ck2:
        out = _fresh_small(256)
        assert ck2.load(2, into=out) == 2
        assert_is_state(out, 2, 256)


def test_same_step_twice_replaces_it(tier_factory: TierUnderTest) -> None:
    """Saving a step that exists replaces it: by the same writer, and by a new run (new generation)."""
    tk = tier_factory
    with tk.checkpointer(tk.make(keep_last=5)) as ck:
        ck.save(4, small_state(4))
        ck.save(5, small_state(50))
        ck.save(5, small_state(51))
        assert ck.list() == [4, 5]
        assert_is_state(ck.read(5)[1], 51)
    with tk.raw() as st:
        first = sorted(st.list("step-5"))
    with tk.checkpointer(tk.make(keep_last=5)) as ck2:  # a resumed run saves step 5 again
        ck2.save(5, small_state(52))
        assert ck2.list() == [4, 5]
    with tk.raw() as st:
        names = sorted(st.list("step-5"))
    shards = [n for n in names if n.startswith("shard-")]
    assert len(shards) == 1 and names == sorted(shards + ["manifest.json", "COMMIT"]), names
    assert shards[0] not in first  # the new generation's shard; the old one is gone
    with tk.checkpointer() as ck3:
        assert_is_state(ck3.read(5)[1], 52)
        assert_is_state(ck3.read(4)[1], 4)
        assert ck3.read()[0] == 5


# ------------------------------------------------------------------------------- remote only

def test_zstd_round_trip_and_ratio(remote_tier_factory: TierUnderTest, capsys: pytest.CaptureFixture) -> None:
    """compression="zstd": bit-exact, the stored object is smaller than the raw shard, and
    ``nebula-ckpt ls --json`` reports a compression ratio above 1."""
    tk = remote_tier_factory
    g = torch.Generator().manual_seed(5)
    state = {"zeros": torch.zeros(6 * MiB // 4), "ramp": torch.arange(200_000, dtype=torch.float32),
             "noise": torch.randn(50_000, generator=g), "bf16": torch.randn(999, generator=g).bfloat16(),
             "step": 5, "pos": (1, 2.5)}
    want = expected_tree(state)
    with knobs.override(remote_part_bytes=1 * MiB, remote_concurrency=3):
        with tk.checkpointer(tk.make(compression="zstd")) as ck:
            ck.save(5, state)
        with tk.raw() as st:
            man = json.loads(st.read_small("step-5/manifest.json"))
            sh = man["shards"][0]
            info = sh["storage"]
            stored = st.size(f"step-5/{sh['file']}")
        assert info["compression"] == "zstd" and len(info["frames"]) >= 2  # compressed part by part
        assert stored == info["stored_bytes"] < sh["bytes"] / 4
        with tk.checkpointer() as ck2:  # reading needs no compression setting
            step, tree = ck2.read()
        assert step == 5
        assert_same(tree, want)
    rc, rows = _cli_json(capsys, tk.cli_args("ls", "--json"))
    assert rc == 0 and len(rows) == 1
    assert rows[0]["committed"] and rows[0]["healthy"]
    assert rows[0]["raw_bytes"] == sh["bytes"]
    assert rows[0]["compression_ratio"] is not None and rows[0]["compression_ratio"] > 1
    assert cli(tk.cli_args("verify")) == 0


# ------------------------------------------------------------ memory tier in front of a slower tier

def test_close_keeps_the_memory_tier_when_it_holds_the_only_copy(tmp_path: Any, shm_dir: str) -> None:
    root = str(tmp_path / "ck")
    slow = FaultyTier(root, fail_at="shard", fail_steps={2})
    ck = nc.Checkpointer(root, tiers=[nc.MemoryTier(), slow], on_persist_error="log")
    mem = ck.tiers[0].name
    ck.save(1, small_state(1))
    h = ck.save_async(2, small_state(2))
    with pytest.raises(nc.PersistError, match="injected failure"):
        h.result(timeout=60)
    assert h.tiers_written == [mem]  # step 2 lives on the memory tier only
    assert ck.list(detailed=True) == {mem: [2], slow.name: [1]}
    ck.close()
    out = _fresh_small()
    with nc.Checkpointer(root) as ck2:  # the same root's default tiers, as after a restart
        assert ck2.load_latest(into=out) == 2, "close() deleted the only copy of step 2"
    assert_is_state(out, 2)
