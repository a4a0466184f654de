"""A restore into a running model and optimizer refills the tensors they hold, after every check.

``load_state_dict`` keeps the tensors it is given when their dtype and device suit their
parameter (optimizers) and copies each value into its parameter or buffer (modules, a copy onto
itself costing nothing), so the restore copies the checked bytes into the job's own tensors on
the native copy threads (no new buffer, no page faults, the storages a later save planned stay)
and hands those over. These tests pin the promise: the values are the saved ones, bit for bit,
in the very tensors, ties kept; nothing changes when a byte is damaged; where torch's own
loading is not what runs (a hook), or dtypes, shapes or layouts differ, torch's loading and
owned copies do it as before.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt.format.names import step_dir
from nebula_ckpt.native import get_ops
from nebula_ckpt.restore.open import read_manifest
from nebula_ckpt.tiers.local import LocalTier


def _trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt)
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 32)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _opt_state(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {f"{i}/{k}": v for i, st in opt.state_dict()["state"].items() for k, v in st.items()}


@pytest.mark.parametrize("memory_tier", [False, True])
def test_a_running_optimizer_is_refilled_in_its_own_tensors(tmp_path: Path, shm_dir: str, memory_tier: bool) -> None:
    model, opt = _trained()
    with nc.Checkpointer(str(tmp_path / "ck"), memory_tier=memory_tier) as ck:
        ck.save(1, {"model": model, "optim": opt})
        saved = {k: v.clone() for k, v in _opt_state(opt).items()}
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        _step(model, opt)
        before = {k: v.data_ptr() for k, v in _opt_state(opt).items()}
        assert ck.load_latest(into={"model": model, "optim": opt}) == 1
    after = _opt_state(opt)
    assert after.keys() == saved.keys() and all(torch.equal(after[k], saved[k]) for k in saved)
    assert all(after[k].dtype == saved[k].dtype for k in saved)
    assert {k: v.data_ptr() for k, v in after.items()} == before, "the optimizer's tensors were replaced"
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    _step(model, opt)  # and it trains on


def test_a_damaged_byte_leaves_the_running_optimizer_untouched(tmp_path: Path) -> None:
    root = str(tmp_path / "ck")
    model, opt = _trained()
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, {"model": model, "optim": opt})
    st = LocalTier(root).make_storage()
    man = read_manifest(st, 1)
    st.close()
    rec = max((r for k, r in man.tensors.items() if "exp_avg_sq" in k), key=lambda r: r.start)  # the last one
    with open(Path(root, step_dir(1), man.shards[rec.shard].file), "r+b") as f:
        f.seek(rec.end - 1)
        b = f.read(1)
        f.seek(rec.end - 1)
        f.write(bytes([b[0] ^ 0x01]))
    _step(model, opt)
    live = {k: v.clone() for k, v in _opt_state(opt).items()}
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with nc.Checkpointer(root, memory_tier=False) as ck:
        with pytest.raises(nc.CorruptCheckpointError, match="exp_avg_sq"):
            ck.load_latest(into={"model": model, "optim": opt})
    assert all(torch.equal(v, live[k]) for k, v in _opt_state(opt).items()), "the optimizer changed"
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items()), "the model changed"


def test_owned_copies_where_torch_loading_is_not_what_runs(tmp_path: Path) -> None:
    model, opt = _trained()
    with nc.Checkpointer(str(tmp_path / "ck"), memory_tier=False) as ck:
        ck.save(1, {"model": model, "optim": opt})
        saved = {k: v.clone() for k, v in _opt_state(opt).items()}
        _step(model, opt)
        seen: list[int] = []
        opt.register_load_state_dict_pre_hook(lambda o, sd: seen.append(len(sd["state"])))
        before = {k: v.data_ptr() for k, v in _opt_state(opt).items()}
        ck.load_latest(into={"model": model, "optim": opt})
    after = _opt_state(opt)
    assert seen == [len(opt.state)] and all(torch.equal(after[k], saved[k]) for k in saved)
    assert all(after[k].data_ptr() != before[k] for k in before if after[k].numel()), "a hook's optimizer got refilled"


class _Tied(torch.nn.Module):
    """An embedding tied to the head (GPT-2's layout), a norm with running statistics, a
    parametrized layer and a transposed (non-contiguous) parameter."""

    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.mid = torch.nn.Linear(8, 8)
        torch.nn.utils.parametrize.register_parametrization(self.mid, "weight", _Scale())
        self.head = torch.nn.Linear(8, 16, bias=False)
        if tie:
            self.head.weight = self.emb.weight
        self.odd = torch.nn.Parameter(torch.randn(8, 3).t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.norm(self.emb(x))) + self.odd.sum()
        return self.head(h)


class _Scale(torch.nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * 2


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randint(0, 16, (12,))).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _fresh_values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("memory_tier", [False, True])
def test_a_running_model_is_refilled_in_its_own_tensors_ties_kept(tmp_path: Path, shm_dir: str,
                                                                   memory_tier: bool) -> None:
    torch.manual_seed(0)
    model = _Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt)
    with nc.Checkpointer(str(tmp_path / "ck"), memory_tier=memory_tier) as ck:
        ck.save(1, {"model": model, "optim": opt})
        saved, saved_opt = _fresh_values(model), {k: v.clone() for k, v in _opt_state(opt).items()}
        _train(model, opt)
        live = {k: v.data_ptr() for k, v in model.state_dict(keep_vars=True).items()}
        assert ck.load_latest(into={"model": model, "optim": opt}) == 1
    now = model.state_dict(keep_vars=True)
    assert all(torch.equal(now[k], saved[k]) and now[k].dtype == saved[k].dtype for k in saved)
    assert {k: v.data_ptr() for k, v in now.items()} == live, "a parameter or buffer was replaced"
    assert model.head.weight is model.emb.weight, "the tie was broken"
    assert all(torch.equal(v, saved_opt[k]) for k, v in _opt_state(opt).items())
    _train(model, opt)  # and it trains on


def test_a_model_tied_now_but_saved_untied_loads_as_torch_loads_it(tmp_path: Path) -> None:
    torch.manual_seed(1)
    untied = _Tied(tie=False)
    with nc.Checkpointer(str(tmp_path / "ck"), memory_tier=False) as ck:
        ck.save(1, {"model": untied})
        expected, theirs = _Tied(), _Tied()
        expected.load_state_dict(untied.state_dict())  # torch: the later key of the tied pair wins
        assert ck.load_latest(into={"model": theirs}) == 1
    got = theirs.state_dict()
    assert all(torch.equal(got[k], v) for k, v in expected.state_dict().items())
    assert theirs.head.weight is theirs.emb.weight


def test_a_model_of_another_dtype_or_with_load_hooks_is_loaded_by_torch(tmp_path: Path) -> None:
    torch.manual_seed(2)
    model = _Tied()
    with nc.Checkpointer(str(tmp_path / "ck"), memory_tier=False) as ck:
        ck.save(1, {"model": model})
        half = _Tied().to(torch.bfloat16)  # load_state_dict converts; bytes as they are would be wrong
        ck.load_latest(into={"model": half})
        hooked, seen = _Tied(), []
        hooked.mid.register_load_state_dict_post_hook(lambda m, keys: seen.append(m))
        ck.load_latest(into={"model": hooked})
    assert all(torch.equal(half.state_dict()[k], v.to(torch.bfloat16) if v.is_floating_point() else v)
               for k, v in model.state_dict().items())
    assert all(torch.equal(hooked.state_dict()[k], v) for k, v in model.state_dict().items())
    assert seen == [hooked.mid]


def test_a_damaged_model_byte_leaves_model_and_optimizer_untouched(tmp_path: Path) -> None:
    root = str(tmp_path / "ck")
    torch.manual_seed(3)
    model = _Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, {"model": model, "optim": opt})
    st = LocalTier(root).make_storage()
    man = read_manifest(st, 1)
    st.close()
    rec = next(r for k, r in man.tensors.items() if k.endswith("mid.parametrizations.weight.original"))
    with open(Path(root, step_dir(1), man.shards[rec.shard].file), "r+b") as f:
        f.seek(rec.start)
        b = f.read(1)
        f.seek(rec.start)
        f.write(bytes([b[0] ^ 0x10]))
    _train(model, opt)
    weights, state = _fresh_values(model), {k: v.clone() for k, v in _opt_state(opt).items()}
    with nc.Checkpointer(root, memory_tier=False) as ck:
        with pytest.raises(nc.CorruptCheckpointError, match="weight.original"):
            ck.load_latest(into={"model": model, "optim": opt})
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items()), "the model changed"
    assert all(torch.equal(v, state[k]) for k, v in _opt_state(opt).items()), "the optimizer changed"


@pytest.mark.parametrize("memory_tier", [False, True])
def test_a_running_job_gets_each_saved_byte_copied_once_on_the_native_threads(
        tmp_path: Path, shm_dir: str, memory_tier: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # the refill is what runs (not torch's copy per tensor, and no tensor twice: a tied one once)
    torch.manual_seed(4)
    model = _Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt)
    ops = get_ops()
    copied: list[int] = []
    real = ops.copy_into

    def spy(src: torch.Tensor, offsets: list[int], dsts: list[torch.Tensor]) -> None:
        copied.extend(d.numel() * d.element_size() for d in dsts)
        real(src, offsets, dsts)
    with nc.Checkpointer(str(tmp_path / "ck"), memory_tier=memory_tier) as ck:
        ck.save(1, {"model": model, "optim": opt})
        _train(model, opt)
        distinct = {t.data_ptr(): t for t in list(model.state_dict().values()) + list(_opt_state(opt).values())}
        # every tensor but the transposed parameter and its moments (not contiguous: copied by
        # torch's loading, owned copies)
        want = sorted(t.numel() * t.element_size() for t in distinct.values() if t.is_contiguous())
        monkeypatch.setattr(ops, "copy_into", spy)
        ck.load_latest(into={"model": model, "optim": opt})
    assert sorted(copied) == want


class _Nested(torch.nn.Module):
    """:class:`_Tied` one level down, with a head tied (or not) to its embedding from outside it."""

    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(_Tied(tie=False))
        self.lm_head = torch.nn.Linear(8, 16, bias=False)
        if tie:
            self.lm_head.weight = self.body[0].emb.weight

    def tied(self) -> bool:
        return self.lm_head.weight is self.body[0].emb.weight


@pytest.mark.parametrize("nested", [False, True])
def test_ties_restore_as_torch_loads_them_whichever_side_is_tied(tmp_path: Path, ops_path: str,
                                                                 nested: bool) -> None:
    # saved tied into separate weights: each gets the saved one; saved separate into tied: torch's
    # loading decides (the later key wins); tied into tied: still tied. All in the live tensors.
    def make(tie: bool) -> torch.nn.Module:
        return _Nested(tie) if nested else _Tied(tie)

    def tied(m: torch.nn.Module) -> bool:
        return m.tied() if isinstance(m, _Nested) else m.head.weight is m.emb.weight
    for n, (saved_tie, live_tie) in enumerate([(True, False), (False, True), (True, True)]):
        torch.manual_seed(10 + n)
        saved = make(saved_tie)
        with nc.Checkpointer(str(tmp_path / f"ck{n}"), memory_tier=False) as ck:
            ck.save(1, {"run": {"model": saved}} if nested else {"model": saved})
            live, expected = make(live_tie), make(live_tie)
            expected.load_state_dict(saved.state_dict())
            ptrs = {k: v.data_ptr() for k, v in live.state_dict().items()}
            assert ck.load_latest(into={"run": {"model": live}} if nested else {"model": live}) == 1
        got, want = live.state_dict(), expected.state_dict()
        wrong = [k for k, v in want.items() if not torch.equal(got[k], v)]
        assert not wrong, f"saved tied={saved_tie}, live tied={live_tie}: {wrong} differ from torch's loading"
        assert tied(live) == live_tie and {k: v.data_ptr() for k, v in got.items()} == ptrs
