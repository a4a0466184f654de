"""The ``<output_dir>/checkpoint-N/`` folder of each checkpoint, where Hugging Face looks for it.

HF users, their scripts and ``Trainer`` itself address checkpoints as folders:
``resume_from_checkpoint="out/checkpoint-15"``, ``get_last_checkpoint(out)``, rotation by folder
name, ``trainer_state.json`` read from inside. Each checkpoint this integration saves gets that
folder, holding small files only:

* ``trainer_state.json``: HF's trainer state at the save, byte for byte what ``Trainer`` writes;
* ``config.json``: the model's config, when the model has one;
* ``nebula_checkpoint.json`` (:data:`POINTER_NAME`): which nebula_ckpt root, tag and step hold the
  checkpoint's tensors (model, optimizer, scheduler, scaler, RNG states).

No ``model.safetensors``, ``optimizer.pt``, ``scheduler.pt`` nor ``rng_state.pth``: those bytes
live in the tiers (``to_hf_checkpoint`` writes them when a tool needs them).

A folder is written once its checkpoint is durable on every tier that took it, so a folder names
a checkpoint that loads (after a crash ``get_last_checkpoint`` finds the newest committed one);
it is removed with the checkpoint (``save_total_limit``). Each file is written atomically, the
pointer last: a folder without it is not one of these (HF's own, or a crash mid-write).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any, Optional

import nebula_ckpt as nc
from nebula_ckpt.adapters import canonical_root, write_file_atomic
from nebula_ckpt.integrations.huggingface.common import TRAINER_STATE_NAME
from nebula_ckpt.integrations.pointers import check_steps, read_pointer_head

log = logging.getLogger("nebula_ckpt")

#: the file of a checkpoint folder naming where its tensors are
POINTER_NAME = "nebula_checkpoint.json"
#: ``format`` of that file (the version after the slash)
FOLDER_FORMAT = "nebula_ckpt.huggingface/1"
CONFIG_NAME = "config.json"
_FIELDS: dict[str, type] = {"root": str, "tag": str, "step": int}


def write(folder: str, root: str, tag: str, step: int, trainer_state: str, config: Optional[str]) -> None:
    """Write the checkpoint folder ``folder`` of checkpoint ``tag`` (step ``step``) under ``root``."""
    os.makedirs(folder, exist_ok=True)
    write_file_atomic(os.path.join(folder, TRAINER_STATE_NAME), trainer_state.encode("utf-8"))
    if config is not None:
        write_file_atomic(os.path.join(folder, CONFIG_NAME), config.encode("utf-8"))
    record = {"format": FOLDER_FORMAT, "root": canonical_root(root), "tag": tag, "step": int(step)}
    write_file_atomic(os.path.join(folder, POINTER_NAME), (json.dumps(record, indent=1) + "\n").encode("utf-8"))


def read(folder: str) -> Optional[dict[str, Any]]:
    """The record of the checkpoint folder ``folder``; None when it is not one (no pointer file).

    Raises:
        ValidationError: a pointer file that is damaged, of another format version, records a
            step no save takes, or is no regular file (a FIFO is never waited on) (named).
    """
    path = os.path.join(folder, POINTER_NAME)
    try:
        data = read_pointer_head(path)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    try:
        rec = json.loads(data)
    except ValueError as e:
        raise nc.ValidationError(f"{path}: not a nebula_ckpt checkpoint pointer ({e}); remove the folder "
                                 "or name the checkpoint by its tag") from None
    fmt = rec.get("format") if isinstance(rec, dict) else None
    if fmt != FOLDER_FORMAT:
        raise nc.ValidationError(f"{path}: pointer format {fmt!r} is not {FOLDER_FORMAT!r} (written by a newer "
                                 "nebula_ckpt? upgrade it)")
    for name, typ in _FIELDS.items():
        if type(rec.get(name)) is not typ:
            raise nc.ValidationError(f"{path}: field {name!r} must be a {typ.__name__}, got {rec.get(name)!r}")
    check_steps(rec, path)
    return dict(rec)


def remove(folder: str) -> bool:
    """Remove the checkpoint folder ``folder`` if it is one of these (HF's own folders are left
    alone); True if removed."""
    try:
        if read(folder) is None:
            return False
    except nc.ValidationError as e:
        log.warning("nebula_ckpt: not removing %s: %s", folder, e)
        return False
    shutil.rmtree(folder, ignore_errors=True)
    return True
