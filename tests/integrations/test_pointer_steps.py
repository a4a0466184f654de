"""The step a pointer file records is read as every step is: an int in ``[0, 2**63-1]``.

A framework's pointer file (Lightning's checkpoint path, DeepSpeed's part files, a Hugging Face
checkpoint folder's ``nebula_checkpoint.json``) records the root, tag and step of the checkpoint
it stands for. The step is shown and compared as the load goes on; one no save takes (negative,
beyond int64, or a pickled int of thousands of digits, whose ``str`` raises) is damage, refused at
once with a :class:`~nebula_ckpt.errors.ValidationError` naming the file and the field, like a
field of the wrong type, never a bare exception or a logging error later. And a Hugging Face
pointer file that is a named pipe is refused, never waited on (as the other pointers are).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt.adapters import MAX_STEP
from nebula_ckpt.integrations import deepspeed_files
from nebula_ckpt.integrations.huggingface import folders
from nebula_ckpt.integrations.pointers import encode_pointer, write_local_pointer
from test_hostile_files import _within

BAD_STEPS = [-1, MAX_STEP + 1, -(10**5000), 10**5000]
IDS = ["negative", "past-int64", "huge-negative", "huge"]


def _refused(path: str, field: str = "step") -> str:
    return re.escape(f"{path}: pointer field '{field}' must be a step, an int in [0, {MAX_STEP}]")


@pytest.mark.parametrize("step", BAD_STEPS, ids=IDS)
def test_a_lightning_pointer_whose_step_no_save_takes_is_refused_naming_it(tmp_path: Any, shm_dir: str,
                                                                            step: int) -> None:
    pytest.importorskip("pytorch_lightning", reason="PyTorch Lightning is not installed")
    from nebula_ckpt.integrations.lightning import POINTER_FORMAT, load_checkpoint, open_pointer

    root = str(tmp_path / "root")
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(5, {"state_dict": {"w": torch.ones(2)}}, tag="epoch=1.ckpt")
    path = str(tmp_path / "epoch=1.ckpt")
    record = {"format": POINTER_FORMAT, "root": root, "tag": "epoch=1.ckpt", "step": step}
    write_local_pointer(path, encode_pointer(record, open_pointer))
    with pytest.raises(nc.ValidationError, match=_refused(path)):
        load_checkpoint(path)
    for good in (5, MAX_STEP):  # the step a save takes loads (another one is logged as never committed)
        write_local_pointer(path, encode_pointer(dict(record, step=good), open_pointer))
        assert torch.equal(load_checkpoint(path)["state_dict"]["w"], torch.ones(2))
    write_local_pointer(path, encode_pointer(dict(record, step=5, prev_tag="x", prev_step=step), open_pointer))
    with pytest.raises(nc.ValidationError, match=_refused(path, "prev_step")):
        load_checkpoint(path)


@pytest.mark.parametrize("step", BAD_STEPS, ids=IDS)
def test_a_deepspeed_pointer_whose_step_no_save_takes_is_refused_naming_it(tmp_path: Any, step: int) -> None:
    path = str(tmp_path / "mp_rank_00_model_states.pt")
    deepspeed_files.write_pointer(path, str(tmp_path / "root"), "global_step5", 5, "model")
    assert deepspeed_files.read_pointer(path) is not None
    deepspeed_files.write_pointer(path, str(tmp_path / "root"), "global_step5", step, "model")
    with pytest.raises(nc.ValidationError, match=_refused(path)):
        deepspeed_files.read_pointer(path)


def _hf_pointer(folder: str, step: Any) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, folders.POINTER_NAME)
    with open(path, "w") as f:
        json.dump({"format": folders.FOLDER_FORMAT, "root": "/nowhere", "tag": "checkpoint-5", "step": step}, f)
    return path


@pytest.mark.parametrize("step", [-1, MAX_STEP + 1, 10**4000], ids=["negative", "past-int64", "huge"])
def test_a_hugging_face_folder_whose_step_no_save_takes_is_refused_naming_it(tmp_path: Any, step: int) -> None:
    folder = str(tmp_path / "checkpoint-5")
    assert folders.read(folder) is None  # no pointer file: not a folder of this integration
    _hf_pointer(folder, MAX_STEP)
    assert folders.read(folder)["step"] == MAX_STEP
    path = _hf_pointer(folder, step)
    with pytest.raises(nc.ValidationError, match=_refused(path)):
        folders.read(folder)


def test_a_hugging_face_pointer_that_is_a_fifo_is_refused_at_once(tmp_path: Any) -> None:
    folder = str(tmp_path / "checkpoint-5")
    path = _hf_pointer(folder, 5)
    os.unlink(path)
    os.mkfifo(path)
    with pytest.raises(nc.ValidationError, match=re.escape(f"{path} is not a regular file")):
        _within(path, lambda: folders.read(folder))
