"""`nebula-ckpt export --key model`: a file whose keys are the module's own state_dict() keys, as
Hugging Face's from_pretrained loads it (issue #13)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

import nebula_ckpt as nc
from conftest import TinyNet
from nebula_ckpt.cli import main


@pytest.fixture
def saved(root: str) -> TinyNet:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 32, (8,))).sum().backward()
    opt.step()
    with nc.Checkpointer(root) as ck:
        ck.save(3, {"model": model, "optim": opt, "step": 3, "extra": {"ema": {"w": torch.ones(2)}}})
    return model


def test_safetensors_export_has_the_modules_own_keys(root: str, saved: TinyNet, tmp_path,  # noqa: ANN001
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "model.safetensors")
    assert main(["export", root, "--step", "3", "--to", out, "--key", "model", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"step": 3, "to": out, "format": "safetensors", "key": "model",
                                                  "config": None}
    want = saved.state_dict()
    with safe_open(out, "pt") as f:
        assert set(f.keys()) == set(want)           # "emb.weight", "bn.running_mean", ... : no "model/" prefix
        assert f.metadata()["format"] == "pt"       # transformers refuses safetensors files without it
        for k, v in want.items():
            assert torch.equal(f.get_tensor(k), v), k
        assert torch.equal(f.get_tensor("head.weight"), f.get_tensor("emb.weight"))   # tied: both names
    # what from_pretrained does with it, in essence: a strict load into a fresh module
    from safetensors.torch import load_file

    fresh = TinyNet()
    fresh.load_state_dict(load_file(out), strict=True)
    assert torch.equal(fresh.lin.weight, saved.lin.weight)


def test_torch_export_of_a_key(root: str, saved: TinyNet, tmp_path) -> None:  # noqa: ANN001
    out = str(tmp_path / "pytorch_model.bin")
    assert main(["export", root, "--step", "3", "--to", out, "--key", "model"]) == 0
    sd = torch.load(out, weights_only=True)
    assert list(sd) == list(saved.state_dict())
    TinyNet().load_state_dict(sd, strict=True)
    assert sd["head.weight"].data_ptr() == sd["emb.weight"].data_ptr()   # tied stays tied in a .pt
    nested = str(tmp_path / "ema.safetensors")
    assert main(["export", root, "--step", "3", "--to", nested, "--key", "extra/ema"]) == 0
    with safe_open(nested, "pt") as f:
        assert list(f.keys()) == ["w"]


@pytest.mark.parametrize("key, message", [
    ("modle", "no key 'modle' at the top level (keys there: ['model', 'optim', 'step', 'extra'])"),
    ("model/nope", "no key 'nope' at model"),
    ("step", "holds no tensors"),
    ("extra/ema/w", "holds a tensor itself"),
    ("/", "--key must name a key"),
])
def test_bad_key_is_a_clear_error(root: str, saved: TinyNet, tmp_path, key: str, message: str,  # noqa: ANN001
                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "x.safetensors")
    assert main(["export", root, "--step", "3", "--to", out, "--key", key]) == 1
    assert message in capsys.readouterr().err
    assert not os.path.exists(out)


def test_whole_export_is_unchanged_but_loadable_by_transformers(root: str, saved: TinyNet,  # noqa: ANN001
                                                                tmp_path) -> None:
    out = str(tmp_path / "all.safetensors")
    assert main(["export", root, "--step", "3", "--to", out]) == 0
    with safe_open(out, "pt") as f:
        assert "model/lin.weight" in f.keys() and f.metadata()["format"] == "pt"


def _tiny_gpt2() -> "torch.nn.Module":
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=16))


def test_export_key_writes_the_saved_hugging_face_config(root: str, tmp_path,  # noqa: ANN001
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The Hugging Face integration saves the model's config as ``config`` beside ``model``:
    ``export --key model`` writes it as config.json next to the weights, so ``from_pretrained``
    of the folder builds the saved architecture (not a default one)."""
    from transformers import GPT2LMHeadModel

    model = _tiny_gpt2()
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(5, {"model": model, "config": model.config.to_json_string(), "step": 5})
    out = tmp_path / "hf" / "model.safetensors"
    assert main(["export", root, "--step", "5", "--to", str(out), "--key", "model", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["config"] == str(tmp_path / "hf" / "config.json")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["n_embd"] == 16
    loaded = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"))
    assert loaded.config.n_embd == 16 and loaded.config.vocab_size == 40
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    # a different config.json already there is never overwritten: a clear error, nothing written
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"n_embd": 99}')
    assert main(["export", root, "--step", "5", "--to", str(tmp_path / "other"), "--key", "model"]) == 1
    err = capsys.readouterr().err
    assert "config.json" in err and "differs" in err, err
    assert (tmp_path / "other" / "config.json").read_text() == '{"n_embd": 99}'
    assert os.listdir(tmp_path / "other") == ["config.json"]
    # into a folder: the file names from_pretrained looks for
    assert main(["export", root, "--step", "5", "--to", str(tmp_path / "pt") + os.sep, "--key", "model",
                 "--format", "torch", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["to"] == str(tmp_path / "pt" / "pytorch_model.bin")
    assert GPT2LMHeadModel.from_pretrained(str(tmp_path / "pt")).config.n_embd == 16


def test_export_key_of_a_hugging_face_model_without_a_config_says_so(root: str, tmp_path,  # noqa: ANN001
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    model = _tiny_gpt2()
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(5, {"model": model, "step": 5})
    out = tmp_path / "model.safetensors"
    assert main(["export", root, "--step", "5", "--to", str(out), "--key", "model", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["config"] is None
    assert not (tmp_path / "config.json").exists()
    assert "no Hugging Face config" in captured.err and "config.json" in captured.err, captured.err
    assert "save_pretrained" in captured.err  # the fix, named


def test_export_key_of_a_plain_model_says_nothing_of_hugging_face(root: str, saved: TinyNet, tmp_path,  # noqa: ANN001
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A plain torch module exported to a file: no word of a Hugging Face config (a module saved as
    a plain dict into a folder, the file names from_pretrained looks for, still gets the note)."""
    for to in (tmp_path / "model.safetensors", tmp_path / "w.pt", str(tmp_path / "folder") + os.sep):
        assert main(["export", root, "--step", "3", "--to", str(to), "--key", "model"]) == 0
        err = capsys.readouterr().err
        assert "Hugging Face" not in err and "config" not in err, (to, err)
    with nc.Checkpointer(root) as ck:
        ck.save(4, {"model": saved.state_dict(), "step": 4})
    assert main(["export", root, "--step", "4", "--to", str(tmp_path / "plain.safetensors"), "--key", "model"]) == 0
    assert "config" not in capsys.readouterr().err
    assert main(["export", root, "--step", "4", "--to", str(tmp_path / "hf") + os.sep, "--key", "model"]) == 0
    assert "no Hugging Face config" in capsys.readouterr().err


def test_export_key_with_a_config_nested_past_the_json_parser_goes_on_without_it(
        root: str, saved: TinyNet, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    """A ``config`` string leaf that is JSON nested deeper than the parser's stack is no config (as
    text that is not a JSON object is): the weights are exported, never a RecursionError."""
    with nc.Checkpointer(root) as ck:
        ck.save(4, {"model": saved.state_dict(), "config": "[" * 100_000 + "]" * 100_000})
    out = tmp_path / "model.safetensors"
    assert main(["export", root, "--step", "4", "--to", str(out), "--key", "model", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["config"] is None, captured.err
    assert "RecursionError" not in captured.err
    with safe_open(str(out), "pt") as f:
        assert set(f.keys()) == set(saved.state_dict())


def test_sub_byte_dtypes_are_refused_by_both_formats_naming_them_before_anything_is_written(  # noqa: ANN001
        root: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """torch.save cannot write uint1..7 / int1..7 either: no export advises it; another --key still exports."""
    packed = torch.randint(0, 16, (6,), dtype=torch.uint8).view(torch.uint4)
    signed = torch.zeros(3, dtype=torch.uint8).view(torch.int3)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, {"model": {"w": torch.randn(4), "packed": packed, "signed": signed}, "head": {"b": torch.ones(2)}})
    capsys.readouterr()
    for key, to in (([], tmp_path / "a" / "x.pt"), (["--key", "model"], tmp_path / "b" / "x.pt"),
                    ([], tmp_path / "c" / "x.safetensors")):
        assert main(["export", root, *key, "--to", str(to)]) == 1
        err = capsys.readouterr().err
        assert "'model/packed' (uint4)" in err and "'model/signed' (int3)" in err and "'model/w'" not in err, err
        assert "torch.save cannot write" in err and "--format torch" not in err and "KeyError" not in err, err
        assert not os.path.exists(to.parent)
    assert main(["export", root, "--key", "head", "--to", str(tmp_path / "head.pt")]) == 0
    assert torch.equal(torch.load(tmp_path / "head.pt", weights_only=True)["b"], torch.ones(2))
