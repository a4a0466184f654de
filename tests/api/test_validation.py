"""Bad input: a clear error naming the key, raised before anything is written."""

from __future__ import annotations

import collections
import logging
import os
import pickle
from typing import Any

import pytest
import torch

import nebula_ckpt as nc
from conftest import make_training, train_step


def _snapshot_tree(path: str) -> dict[str, bytes]:
    out = {}
    for dp, _, files in os.walk(path):
        for f in files:
            p = os.path.join(dp, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = fh.read()
    return out


BAD = [
    ("meta", {"model": {"w": torch.empty(3, device="meta")}}, "model/w", "meta device"),
    ("sparse", {"s": torch.eye(3).to_sparse()}, "'s'", "to_dense"),
    ("nested", {"n": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])}, "'n'", "nested"),
    ("quantized", {"q": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)}, "'q'", "quantized"),
    ("collision", {"a/b": torch.ones(1), "a": {"b": torch.ones(1)}}, "a/b", "twice"),
    ("int-str-collision", {"d": {0: torch.ones(1), "0": torch.ones(1)}}, "d/0", "twice"),
    ("object", {"cfg": {"fn": object()}}, "cfg/fn", "allow_pickle"),
    ("namedtuple", {"nt": collections.namedtuple("P", "x y")(1, 2)}, "'nt'", "namedtuple"),
    ("bad-key", {"d": {(1, 2): 3}}, "'d'", "key"),
    ("huge-int", {"d": {"n": 2**5000}}, "d/n", "4096 bits"),
    ("huge-int-key", {"d": {2**5000: 1}}, "'d'", "4096 bits"),
]


@pytest.mark.parametrize("name,state,key,hint", BAD, ids=[b[0] for b in BAD])
def test_bad_state_rejected_before_writing(root: str, name: str, state: object, key: str, hint: str) -> None:
    with nc.Checkpointer(root) as ck:
        ck.save(1, {"w": torch.ones(4)})
        before = _snapshot_tree(root)
        with pytest.raises(nc.ValidationError) as ei:
            ck.save_async(2, state)
        msg = str(ei.value)
        assert key in msg and hint in msg, msg
        ck.wait()
        assert _snapshot_tree(root) == before
        assert ck.list() == [1]


@pytest.mark.parametrize("step", [-1, 1.5, "3", True, None])
def test_bad_steps(root: str, step: object) -> None:
    with nc.Checkpointer(root) as ck:
        with pytest.raises(nc.ValidationError, match="step must be a non-negative int"):
            ck.save_async(step, {"w": torch.ones(1)})  # type: ignore[arg-type]
        assert ck.list() == []


def test_bad_constructor_arguments(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(nc.ValidationError, match="keep_last"):
        nc.Checkpointer(str(tmp_path), keep_last=0)
    for bad in (-5, 0, 1.5, 0.0, True, "1G"):
        with pytest.raises(nc.ValidationError, match="host_memory_budget"):
            nc.Checkpointer(str(tmp_path), host_memory_budget=bad)
    with pytest.raises(nc.ValidationError, match="every"):
        nc.Checkpointer(str(tmp_path), tiers=[nc.LocalTier(str(tmp_path), every=0)])
    with pytest.raises(nc.ValidationError, match="storage_options"):
        nc.Checkpointer(str(tmp_path), storage_options={"key": "x"})
    # "False" is truthy: allow_pickle="False" used to turn pickle on
    for name, bad in (("allow_pickle", "False"), ("memory_tier", "false"), ("read_only", 1), ("incremental", None)):
        with pytest.raises(nc.ValidationError, match=f"{name} must be True or False"):
            nc.Checkpointer(str(tmp_path), **{name: bad})
    with pytest.raises(nc.ValidationError, match="keep_last"):
        nc.Checkpointer(str(tmp_path), keep_last=True)


def test_state_larger_than_host_memory_budget(root: str) -> None:
    with nc.Checkpointer(root, host_memory_budget=1 << 20) as ck:
        with pytest.raises(nc.ValidationError, match="host_memory_budget 1.0 MiB") as e:
            ck.save_async(1, {"w": torch.zeros(1 << 20)})
        assert "4.0 MiB" in str(e.value) and "nothing was written" in str(e.value)
        assert ck.list() == []


class _Evil:
    def __reduce__(self):  # noqa: ANN204
        return (os.system, ("touch /tmp/nebula-pwned-$PPID",))


class Cfg:
    def __init__(self, x: int) -> None:
        self.x = x

    def __eq__(self, o: object) -> bool:
        return isinstance(o, Cfg) and o.x == self.x


def test_pickle_only_when_allowed_on_both_sides(root: str) -> None:
    with nc.Checkpointer(root, allow_pickle=True) as ck:
        ck.save(1, {"cfg": Cfg(3), "w": torch.ones(2)})
        assert ck.read(1)[1]["cfg"] == Cfg(3)
    with nc.Checkpointer(root) as ck:
        with pytest.raises(nc.PickleNotAllowedError, match="cfg"):
            ck.read(1)
        with pytest.raises(nc.PickleNotAllowedError, match="cfg"):
            ck.load_latest(into={"cfg": None, "w": torch.zeros(2)})


def test_loading_never_executes_code_by_default(root: str, tmp_path) -> None:  # noqa: ANN001
    marker = f"/tmp/nebula-pwned-{os.getpid()}"
    if os.path.exists(marker):
        os.unlink(marker)
    with nc.Checkpointer(root, allow_pickle=True) as ck:
        ck.save(1, {"x": _Evil()} if False else {"x": 1})
    # Forge a checkpoint whose tree carries a malicious pickle, with a valid commit marker.
    import base64
    import json

    from nebula_ckpt.format.commit import Commit
    from nebula_ckpt.native import get_ops
    d = os.path.join(root, "step-1")
    man = json.load(open(os.path.join(d, "manifest.json")))
    man["tree"]["v"][0][1] = {"t": "pickle", "v": base64.b64encode(pickle.dumps(_Evil())).decode()}
    mb = json.dumps(man).encode()
    open(os.path.join(d, "manifest.json"), "wb").write(mb)
    os.unlink(os.path.join(d, "COMMIT"))
    commit = Commit(1, man["generation"], len(mb), get_ops().crc32c_bytes(mb))
    open(os.path.join(d, "COMMIT"), "wb").write(commit.to_bytes())
    with nc.Checkpointer(root) as ck:
        with pytest.raises(nc.PickleNotAllowedError, match="would execute code"):
            ck.read(1)
    assert not os.path.exists(marker)


# -- restoring into a model that does not match ----------------------------------------------------
def _mlp(hidden: int, extra: bool = False) -> torch.nn.Module:
    torch.manual_seed(hidden)
    layers = [torch.nn.Linear(16, hidden), torch.nn.BatchNorm1d(hidden), torch.nn.Linear(hidden, 4)]
    return torch.nn.Sequential(*layers, *([torch.nn.Linear(4, 4)] if extra else []))


def _saved(root: str) -> None:
    model = _mlp(32)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    with nc.Checkpointer(root) as ck:
        ck.save(5, {"optim": opt, "model": model, "step": 5})  # the optimizer first: it would load first


def _values(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t.clone() for t in model.state_dict().values()] + \
        [v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("memory_tier", [True, False])
@pytest.mark.parametrize("case", ["shape", "keys", "shape-not-strict"])
def test_a_model_that_does_not_match_is_refused_before_anything_changes(root: str, memory_tier: bool,
                                                                         case: str) -> None:
    """torch's load_state_dict copies every matching tensor before it raises for the others; the
    restore names the mismatch first, with the model and the optimizer untouched."""
    _saved(root)
    model = _mlp(32 if case == "keys" else 48, extra=case == "keys")
    opt = torch.optim.AdamW(model[:3].parameters())  # as many parameters as saved: the model is what differs
    before = _values(model, opt)
    want = "missing in the checkpoint .'3.weight', '3.bias'." if case == "keys" else \
        r"key 'model/0.weight': the checkpoint of step 5 has shape \(32, 16\), the Sequential has \(48, 16\)"
    with nc.Checkpointer(root, memory_tier=memory_tier) as ck:
        with pytest.raises(nc.ValidationError, match=want):
            ck.load_latest(into={"optim": opt, "model": model, "step": 0}, strict=case != "shape-not-strict")
    after = _values(model, opt)
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert not opt.state


def test_strict_false_loads_the_keys_both_have(root: str) -> None:
    _saved(root)
    with nc.Checkpointer(root) as ck:
        ref = ck.read(5)[1]["model"]
        model = _mlp(32, extra=True)
        extra = model[3].weight.detach().clone()
        ck.load_latest(into={"model": model}, strict=False)
    assert torch.equal(model[0].weight, ref["0.weight"]) and torch.equal(model[3].weight, extra)


def test_a_module_whose_load_hooks_rename_keys_is_left_to_them(root: str) -> None:
    """A module with its own loading (here a pre-hook that maps a legacy key) is not second-guessed."""
    with nc.Checkpointer(root) as ck:
        ck.save(1, {"model": {"old.weight": torch.ones(4, 4), "old.bias": torch.zeros(4)}})
    model = torch.nn.Sequential()
    model.add_module("new", torch.nn.Linear(4, 4))

    def rename(state: dict, prefix: str, *args: object) -> None:
        for k in [k for k in state if k.startswith(prefix + "old.")]:
            state[prefix + "new." + k[len(prefix) + 4:]] = state.pop(k)

    model._register_load_state_dict_pre_hook(rename)
    with nc.Checkpointer(root) as ck:
        ck.load_latest(into={"model": model})
    assert torch.equal(model.new.weight, torch.ones(4, 4)) and torch.equal(model.new.bias, torch.zeros(4))


@pytest.mark.parametrize("memory_tier", [True, False])
def test_an_optimizer_with_other_parameter_groups_is_refused_before_the_model_loads(root: str,
                                                                                   memory_tier: bool) -> None:
    _saved(root)
    model = _mlp(32)
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": list(model[1:].parameters())}])
    before = _values(model, opt)
    with nc.Checkpointer(root, memory_tier=memory_tier) as ck:
        with pytest.raises(nc.ValidationError, match=r"2 parameter group\(s\) of \[2, 4\] parameters, the checkpoint "
                                                     r"1 of \[6\]"):
            ck.load_latest(into={"model": model, "optim": opt, "step": 0})
    after = _values(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)) and not opt.state


# -- strict holds both ways: what the checkpoint holds and `into` lacks ------------------------------
def _training_saved(root: str, memory_tier: bool = True) -> None:
    """A run that saved its scheduler too, at step 4 (the scheduler's learning rate halves every 3 steps)."""
    model, opt, sched = make_training(0)
    for i in range(4):
        train_step(model, opt, sched, i)
    with nc.Checkpointer(root, memory_tier=memory_tier) as ck:
        ck.save(4, {"model": model, "optim": opt, "sched": sched, "extra": {"seen": 4, "best": 0.5}, "step": 4})


def _all_values(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[Any]:
    return [t.clone() for t in model.state_dict().values()] + [repr(opt.state_dict())]


@pytest.mark.parametrize("memory_tier", [True, False])
def test_a_forgotten_scheduler_is_refused_naming_it_before_anything_changes(root: str, memory_tier: bool) -> None:
    """`into` without the saved scheduler (and without a nested entry) used to restore the rest and
    drop those silently: the resumed run's learning rate, and so its losses, differ."""
    _training_saved(root, memory_tier)
    model, opt, sched = make_training(1)
    train_step(model, opt, sched, 0)                     # the optimizer has state of its own
    before = _all_values(model, opt)
    into = {"model": model, "optim": opt, "extra": {"seen": 0}, "step": 0}
    with nc.Checkpointer(root, memory_tier=memory_tier) as ck:
        with pytest.raises(nc.ValidationError) as ei:
            ck.load_latest(into=into)
    msg = str(ei.value)
    assert "'sched'" in msg and "'extra/best'" in msg and "step 4" in msg, msg
    assert "add them to `into`" in msg and "strict=False" in msg, msg
    assert into == {"model": model, "optim": opt, "extra": {"seen": 0}, "step": 0}
    after = _all_values(model, opt)
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
               for a, b in zip(before, after, strict=True))
    # with the scheduler in `into`, the run resumes with the saved learning rate
    with nc.Checkpointer(root, memory_tier=memory_tier) as ck:
        into = {"model": model, "optim": opt, "sched": sched, "extra": {"seen": 0, "best": 0.0}, "step": 0}
        assert ck.load_latest(into=into) == 4
    assert sched.last_epoch == 4 and opt.param_groups[0]["lr"] == 1e-2 * 0.5
    assert into["extra"] == {"seen": 4, "best": 0.5} and into["step"] == 4


def test_strict_false_restores_the_keys_into_has(root: str) -> None:
    _training_saved(root)
    model, opt, _ = make_training(1)
    with nc.Checkpointer(root) as ck:
        ref = ck.read(4)[1]["model"]
        into: dict[str, Any] = {"model": model, "step": 0}
        assert ck.load_latest(into=into, strict=False) == 4
    assert into["step"] == 4 and all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())


def test_into_of_another_shape_than_saved_is_refused_not_skipped(root: str) -> None:
    """Where `into` holds objects the saved value cannot go into (a tuple saved, a dict given; a
    list of two models for three saved), strict refuses instead of leaving them as they are."""
    models = [torch.nn.Linear(2, 2) for _ in range(3)]
    with nc.Checkpointer(root) as ck:
        ck.save(1, {"models": models})
        ck.save(2, (models[0], models[1]))
    fresh = [torch.nn.Linear(2, 2) for _ in range(2)]
    before = [m.weight.detach().clone() for m in fresh]
    with nc.Checkpointer(root) as ck:
        with pytest.raises(nc.ValidationError, match="'<root>'.*tuple of 2.*dict"):
            ck.load_latest(into={"models": fresh})
        with pytest.raises(nc.ValidationError, match="'models'.*list of 3.*list of 2"):
            ck.load(1, into={"models": fresh})
        assert ck.load_latest(into=tuple(fresh)) == 2
    assert all(torch.equal(m.weight, s.weight) for m, s in zip(fresh, models, strict=False))
    assert not torch.equal(fresh[0].weight, before[0])


class _Positions(torch.nn.Module):
    def __init__(self, pos: torch.Tensor) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(5, 5)
        self.register_buffer("pos", pos)


@pytest.mark.parametrize("memory_tier", [True, False])
@pytest.mark.parametrize("case", ["expanded", "interleaved", "module-buffer"])
def test_a_destination_whose_elements_share_memory_is_refused_before_anything_changes(
        root: str, memory_tier: bool, case: str) -> None:
    """An expanded tensor (stride 0) has the saved shape and dtype, but torch's copy into it raises
    once the keys before it were written (an interleaving one keeps one value of several): refused
    first, naming the key and the fix, with `into` untouched; its clone restores."""
    pos = torch.arange(15.).reshape(3, 5)
    with nc.Checkpointer(root, memory_tier=memory_tier) as ck:
        ck.save(1, {"a": torch.ones(4), "pos": pos, "model": _Positions(pos), "z": torch.ones(3)})
    shared = {"expanded": torch.zeros(5).expand(3, 5),
              "interleaved": torch.zeros(8).as_strided((3, 5), (1, 1))}.get(case, torch.zeros(5).expand(3, 5))
    model = _Positions(shared if case == "module-buffer" else torch.zeros(3, 5))
    into = {"a": torch.zeros(4), "pos": shared if case != "module-buffer" else torch.zeros(3, 5),
            "model": model, "z": torch.zeros(3)}
    before = [into["a"].clone(), into["z"].clone(), model.lin.weight.detach().clone()]
    key = "model/pos" if case == "module-buffer" else "pos"
    with nc.Checkpointer(root, memory_tier=memory_tier) as ck:
        with pytest.raises(nc.ValidationError, match=f"key '{key}'.*share memory.*clone"):
            ck.load(1, into=into)
        after = [into["a"], into["z"], model.lin.weight]
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        if case == "module-buffer":
            model.pos = model.pos.clone()
        else:
            into["pos"] = into["pos"].clone()
        ck.load(1, into=into)
    assert torch.equal(into["pos"], pos) and torch.equal(model.pos, pos) and into["z"].eq(1).all()


def test_a_resharding_restore_is_strict_both_ways(tmp_path) -> None:  # noqa: ANN001
    """The resharding path (another world size, DCP underneath) refuses the forgotten scheduler too."""
    from nebula_ckpt.restore.dcp_reader import newest_manifest
    from nebula_ckpt.restore.reshard import load_resharded
    from nebula_ckpt.storage.local import LocalStorage

    root = str(tmp_path / "ck")
    _training_saved(root, memory_tier=False)
    storage = LocalStorage(root)
    man = newest_manifest(storage)
    model, opt, sched = make_training(1)
    train_step(model, opt, sched, 0)
    before = _all_values(model, opt)
    into = {"model": model, "optim": opt, "extra": {"seen": 0}, "step": 0}
    with pytest.raises(nc.ValidationError) as ei:
        load_resharded(storage, man.step, man, into)
    msg = str(ei.value)
    assert "'sched'" in msg and "'extra/best'" in msg and "strict=False" in msg, msg
    assert into == {"model": model, "optim": opt, "extra": {"seen": 0}, "step": 0}
    after = _all_values(model, opt)
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
               for a, b in zip(before, after, strict=True))
    load_resharded(storage, man.step, man, into, strict=False)   # said explicitly: the rest is restored
    assert into["step"] == 4 and into["extra"] == {"seen": 4, "best": 0.5}


def test_a_pathlib_root_and_tier_paths_are_taken_as_their_strings(root: str, tmp_path) -> None:  # noqa: ANN001
    """What a user's code holds (``pathlib.Path``) works where a path string does."""
    from pathlib import Path
    state = {"w": torch.arange(4.0)}
    with nc.Checkpointer(Path(root)) as ck:
        ck.save(1, state)
    disk = tmp_path / "disk"
    with nc.Checkpointer(Path(root), tiers=[nc.LocalTier(disk)]) as ck:
        ck.save(2, state)
        assert ck.tiers[0].name == f"local:{disk}"
    into = {"w": torch.zeros(4)}
    with nc.Checkpointer(str(root), read_only=True, memory_tier=False) as ck:
        assert ck.load_latest(into) == 1
    assert torch.equal(into["w"], state["w"])
    with nc.Checkpointer(str(disk), read_only=True, memory_tier=False) as ck:
        assert ck.list() == [2]


@pytest.mark.parametrize("second", ["slash", "file-url", "dot"])
def test_two_tiers_in_one_folder_are_refused_naming_both_before_anything_is_written(tmp_path, second: str,  # noqa: ANN001
                                                                                   shm_dir: str) -> None:
    """Each tier commits, prunes and sweeps its folder: two of them in one would delete each other's
    steps (each save then failed, though committed). Refused at construction, nothing created."""
    where = str(tmp_path / "ckpt")
    other = {"slash": nc.LocalTier(where + "/"), "file-url": nc.RemoteTier("file://" + where),
             "dot": nc.LocalTier(os.path.join(where, "."))}[second]
    with pytest.raises(nc.ValidationError, match="same location") as e:
        nc.Checkpointer(where, tiers=[nc.LocalTier(where), other])
    assert f"local:{where}" in str(e.value) and "drop one" in str(e.value)
    assert not os.path.exists(where)


@pytest.mark.parametrize("call", ["bad-step", "bad-state", "bad-tag", "prepare-bad-state"])
def test_a_refused_first_save_leaves_a_new_root_unmade(root: str, call: str) -> None:
    """"Nothing was written": a first save refused at the API boundary does not make the root or its
    run record either (a later resume from it would no longer be told that the path does not exist)."""
    with nc.Checkpointer(root) as ck:
        with pytest.raises(nc.ValidationError):
            {"bad-step": lambda: ck.save_async(-1, {"w": torch.ones(2)}),
             "bad-state": lambda: ck.save_async(1, {"cfg": {"fn": object()}}),
             "bad-tag": lambda: ck.save_async(1, {"w": torch.ones(2)}, tag="no spaces allowed"),
             "prepare-bad-state": lambda: ck.prepare({"cfg": {"fn": object()}})}[call]()
        assert not os.path.exists(root), os.listdir(root)
        ck.save(2, {"w": torch.ones(2)})  # the next good save makes it
        assert ck.run_id is not None and ck.list() == [2]
    assert os.path.exists(os.path.join(root, "_nebula", "run.json"))


def test_the_one_liners_share_one_checkpointer_per_root_however_it_is_spelled(  # noqa: ANN001
        tmp_path, monkeypatch, shm_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    """``"ckpt/run"``, ``"./ckpt/run"``, its absolute path and a ``pathlib.Path`` are one root: the
    one-liners made a Checkpointer per spelling, and the second fenced the first (its next save
    failed with FencedError, its step never committed). Options a later call passes are named as
    ignored (names only: their values may hold credentials)."""
    from pathlib import Path
    monkeypatch.chdir(tmp_path)
    try:
        for step, root in enumerate(["ckpt/run", "./ckpt/run", str(tmp_path / "ckpt" / "run"), Path("ckpt/run"),
                                     "ckpt/run"]):
            nc.save_async(root, step, {"w": torch.full((2,), float(step))}).result()
        with caplog.at_level(logging.WARNING, logger="nebula_ckpt"):
            nc.save_async("ckpt/run", 9, {"w": torch.ones(2)}, keep_last=1, storage_options=None).result()
            nc.save_async("ckpt/run", 10, {"w": torch.ones(2)}, keep_last=1, storage_options=None).result()
    finally:
        nc.close_all()
    assert caplog.text.count("this call's keep_last, storage_options are ignored") == 1, caplog.text
    with nc.Checkpointer(str(tmp_path / "ckpt" / "run"), read_only=True) as ck:
        assert ck.list() == [4, 9, 10]  # every save committed (keep_last=3)


def test_a_single_tier_or_a_bad_timeout_is_refused_naming_it(root: str, tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(nc.ValidationError, match=r"tiers must be a list of tiers.*LocalTier"):
        nc.Checkpointer(root, tiers=nc.LocalTier(str(tmp_path / "d")))  # type: ignore[arg-type]
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save_async(1, {"w": torch.ones(2)})
        for bad in ("x", -1, True, float("nan")):
            with pytest.raises(nc.ValidationError, match="timeout must be None"):
                ck.wait(timeout=bad)
        ck.wait(timeout=60)
        assert ck.list() == [1]


def test_a_url_with_a_password_is_shown_without_its_query_either() -> None:
    from nebula_ckpt.tiers import strip_credentials
    shown = strip_credentials("s3://KEY:SECRET@bucket/run?sig=TOKEN#frag")
    assert "SECRET" not in shown and "TOKEN" not in shown and "frag" not in shown and shown.endswith("bucket/run")
