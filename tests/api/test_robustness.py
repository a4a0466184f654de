"""Hardening: clear errors for hostile input, no torn or lost saves, nothing silent at exit."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading

import pytest
import torch

import nebula_ckpt as nc
import warm_python
from faults import FaultyTier
from nebula_ckpt.cli import main as cli_main


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return warm_python.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                           env=dict(os.environ, **env))


# -- bad input: ValidationError at the call, nothing written -------------------------------------------

def _deep(n: int) -> dict:
    top = cur = {}
    for _ in range(n):
        cur["k"] = {}
        cur = cur["k"]
    return top


def _cyclic() -> dict:
    d: dict = {"w": torch.ones(1)}
    d["self"] = d
    return d


HOSTILE = [
    ("huge-step", 10**300, {"w": torch.ones(1)}, "2**63-1"),
    ("enormous-step", 10**5000, {"w": torch.ones(1)}, "2**63-1"),
    ("cycle", 1, _cyclic(), "cycle"),
    ("list-cycle", 1, (lambda lst: (lst.append(lst), {"l": lst})[1])([]), "cycle"),
    ("deep", 1, _deep(5000), "levels deep"),
    ("metadata-key", 1, {"__metadata__": torch.ones(1)}, "reserved"),
    ("huge-int", 1, {"n": 10**5000}, "too large"),
]


@pytest.mark.parametrize("name,step,state,hint", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_input_is_a_validation_error(root: str, name: str, step: int, state: object, hint: str) -> None:
    with nc.Checkpointer(root) as ck:
        with pytest.raises(nc.ValidationError, match=hint.replace("*", r"\*")):
            ck.save_async(step, state)
        assert ck.list() == []
    assert not os.path.exists(root), os.listdir(root)  # nothing written: not even the new root


def test_same_tensor_under_two_keys_is_not_a_cycle(root: str) -> None:
    shared = {"w": torch.ones(3)}
    with nc.Checkpointer(root) as ck:
        ck.save(1, {"a": shared, "b": shared})        # a DAG, not a cycle: stored twice, fine
        _, back = ck.read(1)
    assert torch.equal(back["a"]["w"], back["b"]["w"])


# -- errors by type -------------------------------------------------------------------------------------

def test_fenced_error_is_catchable_as_such(root: str) -> None:
    stale = nc.Checkpointer(root, memory_tier=False)
    stale.save(1, {"w": torch.ones(2)})
    with nc.Checkpointer(root, memory_tier=False) as new:
        new.save(2, {"w": torch.ones(2)})
    h = stale.save_async(3, {"w": torch.ones(2)})
    with pytest.raises(nc.FencedError) as ei:
        h.result()
    assert isinstance(ei.value, nc.PersistError) and "newer writer" in str(ei.value)
    stale.save_async(4, {"w": torch.ones(2)})      # not waited for: close() raises it
    with pytest.raises(nc.FencedError):
        stale.close()
    with nc.Checkpointer(root, memory_tier=False) as reader:
        assert reader.list() == [1, 2]


def test_failed_step_leaves_no_files(tmp_path) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    for stage in ("shard", "manifest", "commit"):
        tier = FaultyTier(root, fail_at=stage, fail_steps={2})
        with nc.Checkpointer(root, tiers=[tier], on_persist_error="log") as ck:
            ck.save(1, {"w": torch.ones(4)})
            h = ck.save_async(2, {"w": torch.ones(4)})
            with pytest.raises(nc.PersistError):
                h.result()
            assert not os.path.exists(os.path.join(root, "step-2")), (stage, os.listdir(root))


# -- torn snapshots ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["data", "numpy"])
def test_changes_invisible_to_version_counters_never_reach_the_checkpoint(root: str, how: str) -> None:
    """``.data`` and numpy writes bypass version counters: a CPU save is taken before it returns."""
    tensors = {f"t{i}": torch.full((256, 256), float(i)) for i in range(16)}
    with nc.Checkpointer(root) as ck:
        h = ck.save_async(1, tensors)
        for v in tensors.values():
            if how == "data":
                v.data.fill_(-1.0)
            else:
                v.numpy()[:] = -1.0
        h.result()
        _, back = ck.read(1)
    for i in range(16):
        assert torch.all(back[f"t{i}"] == float(i)), f"t{i} torn"


def test_racing_writer_never_commits_a_bad_checkpoint_nor_loses_the_last_good(root: str) -> None:
    """A thread writes through numpy while saves run, keep_last=1: every commit verifies."""
    big = torch.zeros(4 << 20)            # 16 MiB: the copy takes long enough to be raced
    arr = big.numpy()
    stop = threading.Event()

    def scribble() -> None:
        v = 0.0
        while not stop.is_set():
            v += 1.0
            arr[::4096] = v

    t = threading.Thread(target=scribble, daemon=True)
    with nc.Checkpointer(root, keep_last=1, on_persist_error="log") as ck:
        ck.save(0, {"w": big.clone()})     # one good checkpoint before the race
        t.start()
        errors = 0
        for step in range(1, 25):
            try:
                ck.save(step, {"w": big})
            except nc.ConsistencyError:
                errors += 1
        stop.set()
        t.join()
        assert ck.load_latest() is not None
    assert cli_main(["verify", root]) == 0      # whatever committed matches its checksums


# -- nothing silent at exit -------------------------------------------------------------------------------

def test_forgotten_close_still_persists_pending_saves(root: str, shm_dir: str) -> None:
    code = f"""
import torch, nebula_ckpt as nc
ck = nc.Checkpointer({root!r})
for s in range(3):
    ck.save_async(s, {{"w": torch.full((1000,), float(s))}})
# no close(): the program just ends
"""
    r = _run(code, NEBULA_SHM_DIR=shm_dir)
    assert r.returncode == 0, r.stderr
    assert "was not closed" in r.stderr             # said loudly, by default
    with nc.Checkpointer(root, memory_tier=False) as ck:
        assert ck.list()[-1] == 2
        assert ck.load_latest() == 2


def test_close_puts_newest_step_on_the_persistent_tier(root: str) -> None:
    """A disk tier with every=10 never saw step 3; close() writes the newest step there."""
    with nc.Checkpointer(root, tiers=[nc.MemoryTier(), nc.LocalTier(root, every=10)]) as ck:
        for s in range(4):
            ck.save(s, {"w": torch.full((16,), float(s))})
        assert ck.list(detailed=True)[f"local:{os.path.abspath(root)}"] == [0]
    w = torch.zeros(16)
    with nc.Checkpointer(root, memory_tier=False) as again:
        assert again.list() == [0, 3]
        assert again.load_latest(into={"w": w}) == 3
    assert torch.all(w == 3)
    assert cli_main(["verify", root]) == 0


def test_library_warnings_are_visible_without_logging_setup(root: str, shm_dir: str) -> None:
    os.chmod(shm_dir, 0o777)   # a shared, non-sticky tmpfs: the memory tier refuses it
    code = f"""
import torch, nebula_ckpt as nc
with nc.Checkpointer({root!r}) as ck:
    ck.save(1, {{"w": torch.ones(2)}})
"""
    r = _run(code, NEBULA_SHM_DIR=shm_dir)
    assert r.returncode == 0, r.stderr
    assert "memory tier not used" in r.stderr and "sticky" in r.stderr


# -- a root whose every checkpoint is damaged is not an empty root ------------------------------------------

def _damage_all(root: str) -> None:
    for d in os.listdir(root):
        if d.startswith("step-"):
            shard = [n for n in os.listdir(os.path.join(root, d)) if n.startswith("shard-")][0]
            with open(os.path.join(root, d, shard), "r+b") as f:
                f.seek(-3, os.SEEK_END)
                f.write(b"\xff\xfe\xfd")


def test_all_damaged_raises_naming_the_damage(root: str) -> None:
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, {"w": torch.ones(64)})
        ck.save(2, {"w": torch.ones(64)})
    _damage_all(root)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        with pytest.raises(nc.CorruptCheckpointError, match="step 2") as ei:
            ck.load_latest()
        assert "step 1" in str(ei.value) and "checksum" in str(ei.value)
        assert ck.load_latest(on_damaged="warn") is None
    assert cli_main(["ls", root]) == 1 and cli_main(["verify", root]) == 1


def test_empty_root_is_none_not_an_error(root: str) -> None:
    with nc.Checkpointer(root) as ck:
        assert ck.load_latest() is None


# -- secrets --------------------------------------------------------------------------------------------

def test_remote_tier_repr_hides_credentials() -> None:
    key = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
    t = nc.RemoteTier("az://c/p?sig=SECRET", storage_options={"account_key": key, "connection_string": key})
    for text in (repr(t), str(t), repr([t])):
        assert key not in text and "SECRET" not in text, text


def test_enospc_keeps_its_errno(tmp_path) -> None:  # noqa: ANN001
    """A full disk is reported as ENOSPC (not EIO), and the failed step leaves nothing behind."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = warm_python.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        root = str(mnt / "ck")
        with nc.Checkpointer(root, memory_tier=False, on_persist_error="log") as ck:
            h = ck.save_async(1, {"w": torch.ones(1 << 20)})    # 4 MiB into 1 MiB
            with pytest.raises(nc.PersistError) as ei:
                h.result()
            cause = next(iter(ei.value.failures.values()))
            assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC, repr(cause)
        assert not os.path.exists(os.path.join(root, "step-1"))
    finally:
        warm_python.run(["umount", "-l", str(mnt)])


@pytest.mark.parametrize("kw", [{"on_full": "bogus"}, {"snapshot": "later"}, {"keep_last": 0},
                                {"on_persist_error": "ignore"}])
def test_bad_constructor_argument_touches_nothing(root: str, shm_dir: str, kw: dict) -> None:
    with pytest.raises(nc.ValidationError):
        nc.Checkpointer(root, **kw)
    assert not os.path.exists(root)                  # not even the run id
    assert os.listdir(shm_dir) == []                 # nor a memory tier


class WrappedOptimizer(torch.optim.Optimizer):
    """Like accelerate's AcceleratedOptimizer: an Optimizer by isinstance, but no hook machinery."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:  # no super().__init__ on purpose
        self.inner = inner

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.inner.load_state_dict(sd)

    def step(self, closure: object = None) -> None:  # type: ignore[override]
        self.inner.step()


def test_unhookable_optimizer_makes_the_save_wait_instead_of_failing(root: str) -> None:
    model = torch.nn.Linear(64, 64)
    opt = WrappedOptimizer(torch.optim.AdamW(model.parameters()))
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with nc.Checkpointer(root, snapshot="async") as ck:
        h = ck.save_async(1, {"model": model, "optim": opt})   # cannot hook: waits for the copy
        model(torch.randn(2, 64)).sum().backward()
        opt.step()                                            # changes the weights right away
        assert h.result()
        _, back = ck.read(1)
    for k, v in before.items():
        assert torch.equal(back["model"][k], v)
