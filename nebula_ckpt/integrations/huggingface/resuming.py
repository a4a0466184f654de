"""Resuming a Hugging Face ``Trainer`` from nebula_ckpt: what ``resume_from_checkpoint`` names,
reading that checkpoint once (verified, fastest healthy tier), the one-file folder ``Trainer.train``
opens by path, and the end of ``train()`` (saves durable, limit applied, checkpointer closed).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
from typing import Any, Iterator, Optional

import nebula_ckpt as nc
from nebula_ckpt.adapters import canonical_root
from nebula_ckpt.integrations.huggingface import folders
from nebula_ckpt.integrations.huggingface.common import TRAINER_STATE_NAME, run_of, tag_for
from nebula_ckpt.integrations.huggingface.engines import engine_of
from nebula_ckpt.integrations.huggingface.fsdp import KEY as FSDP_KEY
from nebula_ckpt.integrations.huggingface.fsdp import read_sharded
from nebula_ckpt.integrations.huggingface.saving import checkpointer, rotate, settle, tag_of_path

log = logging.getLogger("nebula_ckpt")

#: what :func:`find` returns for ``resume_from_checkpoint=True`` when nothing exists yet
FRESH = ("fresh", None)


def find(trainer: Any, resume: Any) -> Optional[tuple[str, Any]]:
    """What ``resume_from_checkpoint`` names in nebula_ckpt: ``("latest", None)``, ``("tag", tag)``,
    ``("step", n)``, ``("folder", record)`` (a checkpoint folder naming another run's root);
    :data:`FRESH` for ``True`` when there is no checkpoint at all (a first run);
    None for HF's own handling (nothing given, a real checkpoint folder, or ``True`` with HF
    folders but nothing in nebula_ckpt)."""
    if resume is None or resume is False:
        return None
    if resume is True:
        if checkpointer(trainer).list():
            return ("latest", None)
        from transformers.trainer_utils import get_last_checkpoint as hf_last

        out = trainer.args.output_dir
        if os.path.isdir(out) and hf_last(out) is not None:
            return None
        root = run_of(trainer).root
        where = root.removeprefix("file://") if isinstance(root, str) else ""
        missing = "://" not in where and not os.path.isdir(os.path.expanduser(where))  # a typo is said, not quiet
        log.log(logging.WARNING if missing else logging.INFO, "nebula_ckpt: resume_from_checkpoint=True: no checkpoint "
                "under %s%s nor in %s yet; starting fresh", root, " (it does not exist: check the path)" if missing
                else "", out)
        return FRESH
    if isinstance(resume, int):
        return ("step", resume)
    if not isinstance(resume, (str, os.PathLike)):
        raise nc.ValidationError("resume_from_checkpoint must be a bool, a step (int), a tag or a path, "
                                 f"got {resume!r}")
    path = os.fspath(resume)
    tags = checkpointer(trainer).tags()
    rec = folders.read(path)
    if rec is not None:  # a folder of this integration: its checkpoint, in this root or the one it names
        if canonical_root(rec["root"]) == canonical_root(run_of(trainer).root):
            if rec["tag"] not in tags:
                raise nc.NotFoundError(f"Can't find a valid checkpoint at {path}: it names {rec['tag']} (step "
                                       f"{rec['step']}), which {rec['root']} no longer holds (tags: "
                                       f"{sorted(tags)[-10:]})")
            return ("tag", rec["tag"])
        return ("folder", rec)  # another run's checkpoint: read from its root, saved into ours
    if os.path.isfile(os.path.join(path, TRAINER_STATE_NAME)):
        return None  # an HF checkpoint folder: stock resume
    for cand in (path, tag_of_path(trainer, path), os.path.basename(path.rstrip("/" + os.sep))):
        if cand in tags:
            return ("tag", cand)
    # HF's wording first: scripts and tests look for it
    raise nc.NotFoundError(f"Can't find a valid checkpoint at {path}: no checkpoint folder there and no healthy "
                           f"nebula_ckpt checkpoint tagged so under {run_of(trainer).root} "
                           f"(tags: {sorted(tags)[-10:]})")


def read(trainer: Any, how: tuple[str, Any]) -> tuple[int, dict[str, Any]]:
    """Read the checkpoint ``how`` names (see :func:`find`); check it was saved by this integration."""
    kind, what = how
    if kind == "folder":  # another run's root, read only
        with _other_root(trainer, what["root"]) as other:
            return read_from(trainer, other, ("tag", what["tag"]))
    return read_from(trainer, checkpointer(trainer), how)


@contextlib.contextmanager
def _other_root(trainer: Any, root: str) -> Iterator[nc.Checkpointer]:
    """A read-only Checkpointer on the root another run's checkpoint folder names."""
    opts = run_of(trainer).options
    ck = nc.Checkpointer(root, read_only=True, storage_options=opts.get("storage_options"),
                         allow_pickle=opts.get("allow_pickle", engine_of(trainer) == "DeepSpeed"))
    try:
        yield ck
    finally:
        ck.close()


def read_from(trainer: Any, ck: nc.Checkpointer, how: tuple[str, Any]) -> tuple[int, dict[str, Any]]:
    """Read the checkpoint ``how`` names from ``ck``; check it was saved by this integration."""
    kind, what = how
    run = run_of(trainer)
    if engine_of(trainer) == "FSDP":
        # read before the model is sharded: its DTensors on a mesh of every rank until load_sharded
        step, tree = read_sharded(ck, what if kind == "step" else None, what if kind == "tag" else None)
    elif kind == "latest":
        step, tree = ck.read()
    elif kind == "tag":
        step, tree = ck.read(tag=what)
    else:
        step, tree = ck.read(step=what)
    if not isinstance(tree, dict) or not isinstance(tree.get("trainer_state"), str) \
            or not any(k in tree for k in ("model", "deepspeed", FSDP_KEY)):
        keys = list(tree)[:8] if isinstance(tree, dict) else type(tree).__name__
        raise nc.ValidationError(f"step {step} under {ck.root} was not saved by the Hugging Face "
                                 f"integration (top-level keys {keys}); name one of its checkpoints "
                                 f"(tags: {sorted(ck.tags())[-10:]})")
    run.restored = dict(ck.last_restore or {"step": step})
    log.info("nebula_ckpt: resuming from step %d (tier %s) of %s", step, run.restored.get("tier"), ck.root)
    return step, tree


@contextlib.contextmanager
def stub(trainer: Any, how: Optional[tuple[str, Any]]) -> Iterator[Optional[str]]:
    """Read the checkpoint to resume from; yield a folder holding its ``trainer_state.json``
    (the only file ``Trainer.train`` opens by path), removed afterwards."""
    if how is None or how == FRESH:
        yield None
        return
    run = run_of(trainer)
    step, tree = read(trainer, how)
    ts = json.loads(tree["trainer_state"])
    # HF drops a best checkpoint whose folder is missing (with a warning): kept aside, put back
    # by restore_best when nebula_ckpt still has it
    run.resume_best = ts.pop("best_model_checkpoint", None)
    ts["best_model_checkpoint"] = None
    folder = tempfile.mkdtemp(prefix=f"nebula-hf-{tag_for(step)}-")
    try:
        with open(os.path.join(folder, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
            json.dump(ts, f)
        run.resume = tree
        yield folder
    finally:
        run.resume = None
        shutil.rmtree(folder, ignore_errors=True)


def restore_best(trainer: Any) -> None:
    """After ``_init_training_state``: the resumed state's best checkpoint, when still held."""
    run = run_of(trainer)
    best = run.resume_best
    run.resume_best = None
    if run.resume is None or best is None:
        return
    if tag_of_path(trainer, best) in run.committed:
        trainer.state.best_model_checkpoint = best
    else:
        log.warning("nebula_ckpt: the best checkpoint %s of the resumed state is not in %s anymore; "
                    "ignoring it for this run", best, run.root)


def part(trainer: Any, key: str) -> Any:
    """A part of the checkpoint being resumed, handed over once (its memory freed as soon as it
    is loaded) unless ``auto_find_batch_size`` may run the loop, and so the loads, again."""
    tree = run_of(trainer).resume
    assert tree is not None
    return tree[key] if trainer.args.auto_find_batch_size else tree.pop(key)


def finish(trainer: Any, ok: bool) -> None:
    """End of ``train()``: wait for the saves, report them, apply the limit, close the
    checkpointer (on an exception only close, logging what fails, so the original error stays
    the one raised)."""
    ck = run_of(trainer).ckpt
    if ck is None or ck.closed:
        return
    if not ok:
        # said before closing: in a multi-rank job close() waits for the other ranks, which may be
        # blocked in a collective of the training loop that this rank will never join
        log.error("nebula_ckpt: train() failed (%r); closing the checkpointer", sys.exc_info()[1], exc_info=True)
        try:
            ck.close()
        except Exception as e:
            log.error("nebula_ckpt: closing the checkpointer after a failed train() also failed: %s", e)
        return
    try:
        ck.wait()  # raises a failed save (once: close() then does not raise it again)
        settle(trainer)
        rotate(trainer, final=True)
    finally:
        ck.close()
