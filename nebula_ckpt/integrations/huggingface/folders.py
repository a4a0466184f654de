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

A folder exists only for a checkpoint that is durable on every tier that took it, so a folder
names a checkpoint that loads (after a crash ``get_last_checkpoint`` finds the newest committed
one); it is removed with the checkpoint (``save_total_limit``). Its life:

1. at the save, the folder is written whole where HF never looks, ``<output_dir>/_nebula_pending/
   checkpoint-N/`` (:func:`stage`; HF's ``checkpoint-*`` globs do not reach it, and ``push_to_hub``
   ignores ``_*``);
2. once the save is durable it is renamed to ``<output_dir>/checkpoint-N/`` (:func:`promote`,
   :func:`finish`): by a thread waiting for the save (:func:`watch`), by
   ``trainer.nebula.wait()`` / ``close()`` before they return, or by the next step's housekeeping,
   whichever comes first; a failed or skipped save's staged folder is removed;
3. a process killed between the commit and the rename leaves the staged folder: the next time the
   integration opens the root on that output dir (``train()``, ``trainer.nebula``), the folder of
   every committed checkpoint is put in place (:func:`rebuild`) and the staged folders of
   checkpoints that are not committed (never were, or were removed since by ``save_total_limit``)
   are removed: a rotated checkpoint never comes back. The drop-in ``get_last_checkpoint`` puts
   them in place too (and removes nothing: a live run may still be saving).

Each file is written atomically, the pointer last: a folder without it is not one of these (HF's
own, or a crash mid-write).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import threading
from typing import Any, Optional

import nebula_ckpt as nc
from nebula_ckpt.adapters import canonical_root, write_file_atomic
from nebula_ckpt.integrations.huggingface.common import TRAINER_STATE_NAME, RunState, is_checkpoint_tag
from nebula_ckpt.integrations.pointers import check_steps, read_pointer_head

log = logging.getLogger("nebula_ckpt")

#: the file of a checkpoint folder naming where its tensors are
POINTER_NAME = "nebula_checkpoint.json"
#: ``format`` of that file (the version after the slash)
FOLDER_FORMAT = "nebula_ckpt.huggingface/1"
CONFIG_NAME = "config.json"
#: where the folders of the saves in flight wait, in the output dir (``_*``: push_to_hub skips it)
PENDING_DIR = "_nebula_pending"
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
    except (ValueError, RecursionError) as e:
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


# -- a folder's life: staged at the save, put in place once the save is durable -----------------------
def stage(output_dir: str, root: str, tag: str, step: int, trainer_state: str, config: Optional[str]) -> str:
    """Write the folder of the save of ``tag`` (in flight) under :data:`PENDING_DIR` of
    ``output_dir``, where HF never looks; return its path (:func:`promote` puts it in place)."""
    staged = os.path.join(output_dir, PENDING_DIR, tag)
    if os.path.lexists(staged):  # an earlier save of this tag whose process ended before it committed
        shutil.rmtree(staged, ignore_errors=True)
    write(staged, root, tag, step, trainer_state, config)
    return staged


def promote(staged: str, folder: str) -> bool:
    """Put the staged folder of a durable checkpoint in place as ``folder``: renamed, so that it
    appears whole; over an existing folder (an earlier save of that step, HF's own folder of that
    name) its files are written into it, the pointer last. False when nothing is staged there
    (another process put it in place first)."""
    try:
        os.rename(staged, folder)
    except FileNotFoundError:
        if os.path.lexists(staged):
            raise
        return False
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        _write_into(staged, folder)
    else:
        _fsync_dir(os.path.dirname(os.path.abspath(folder)))
    return True


def _write_into(staged: str, folder: str) -> None:
    rec = read(staged)
    if rec is None:
        raise nc.ValidationError(f"{staged}: no {POINTER_NAME} (a staged checkpoint folder written halfway)")
    with open(os.path.join(staged, TRAINER_STATE_NAME), encoding="utf-8") as f:
        trainer_state = f.read()
    config = None
    if os.path.isfile(os.path.join(staged, CONFIG_NAME)):
        with open(os.path.join(staged, CONFIG_NAME), encoding="utf-8") as f:
            config = f.read()
    write(folder, rec["root"], rec["tag"], rec["step"], trainer_state, config)
    shutil.rmtree(staged, ignore_errors=True)




def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some network file systems refuse a folder's fsync: the rename is done all the same
        pass
    finally:
        os.close(fd)


def _drop_if_empty(pending: str) -> None:
    """Remove the folder of the staged folders once empty: only by the run that stages into it,
    under its lock (another process doing so could race a save making its staged folder)."""
    try:
        os.rmdir(pending)
    except OSError:
        pass  # not empty (another save in flight), or gone


def rebuild(output_dir: str, root: str, committed: dict[str, int], *, drop_stale: bool = True) -> list[str]:
    """Put in place the folder of each committed checkpoint that a crash left staged (the process
    ended between the commit and :func:`promote`); return the folders written.

    Only what this integration staged in ``output_dir`` for ``root`` is taken: a committed tag is
    never given a folder in an output dir it was not saved from. With ``drop_stale``, the staged
    folders of ``root``'s checkpoints that are not committed (the save never committed, or the
    checkpoint was removed since, by ``save_total_limit``) are removed: never resurrected. Without
    it (a reader, while a run may still be saving), nothing is removed.
    """
    pending = os.path.join(output_dir, PENDING_DIR)
    try:
        names = sorted(os.listdir(pending))
    except OSError:  # none staged
        return []
    made = []
    for name in names:
        staged = os.path.join(pending, name)
        try:
            rec = read(staged)
        except nc.ValidationError as e:
            log.warning("nebula_ckpt: leaving %s alone: %s", staged, e)
            continue
        if rec is not None and canonical_root(rec["root"]) != canonical_root(root):
            continue  # staged for another root: not this one's to judge
        final = os.path.join(output_dir, name)
        if rec is not None and rec["tag"] == name and committed.get(name) == rec["step"] and not _is_ours(final):
            if promote(staged, final):
                log.info("nebula_ckpt: wrote %s: %s was committed, but the process ended before its folder was "
                         "in place", final, name)
                made.append(final)
        elif drop_stale:
            shutil.rmtree(staged, ignore_errors=True)  # not committed (anymore), or its folder is in place
    if drop_stale:
        _drop_if_empty(pending)
    return made


def drop_gone(output_dir: str, root: str, held_steps: set[int]) -> list[str]:
    """Remove the ``checkpoint-N/`` folders of ``output_dir`` naming a checkpoint of ``root`` whose
    step no tier holds any more (``held_steps``: the committed steps); return them. HF's own
    folders, another root's and damaged pointers are left alone."""
    try:
        names = sorted(os.listdir(output_dir))
    except OSError:  # no output dir yet
        return []
    gone = []
    for name in names:
        if not is_checkpoint_tag(name):
            continue
        folder = os.path.join(output_dir, name)
        try:
            rec = read(folder)
        except nc.ValidationError:
            continue
        if rec is None or rec["tag"] != name or rec["step"] in held_steps \
                or canonical_root(rec["root"]) != canonical_root(root):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        gone.append(folder)
    return gone


def _is_ours(folder: str) -> bool:
    try:
        return read(folder) is not None
    except nc.ValidationError:
        return False  # a damaged pointer: written again


# -- the folders of one trainer's saves ---------------------------------------------------------------
def is_durable(handle: nc.SaveHandle) -> bool:
    """Whether the save of ``handle`` (over) became a committed checkpoint with a tag."""
    return handle.error() is None and handle.skipped is None and bool(handle.tiers_written) and bool(handle.tag)


def finish(run: RunState, handle: nc.SaveHandle) -> None:
    """The save of ``handle`` is over: its staged folder becomes ``checkpoint-N/`` (durable) or is
    removed (failed, skipped). Once, whichever thread comes first; a failure leaves it for the
    next call (the training thread's raises it)."""
    tag = handle.tag or ""
    with run.folder_lock:  # (re-entrant: a signal handler's close() on this thread finds the entry taken)
        entry = run.folders.get(tag)
        if entry is None or entry[2] is not handle:  # done already (or another save's)
            return
        del run.folders[tag]
        folder, staged, _ = entry
        try:
            if not is_durable(handle):
                shutil.rmtree(staged, ignore_errors=True)
            elif not promote(staged, folder) and not _is_ours(folder):
                log.warning("nebula_ckpt: the staged folder %s of %s is gone; %s loads by its tag", staged, tag, tag)
        except BaseException:
            run.folders.setdefault(tag, entry)  # tried again by the next settle
            raise
        _drop_if_empty(os.path.dirname(staged))


def finish_done(run: RunState) -> None:
    """The folders of every save of ``run`` that is over (``trainer.nebula.wait()``, ``close()``)."""
    for h in list(run.inflight):
        if h.done():
            try:
                finish(run, h)
            except (OSError, nc.NebulaError) as e:
                log.warning("nebula_ckpt: putting the folder of %s in place failed (tried again at the next "
                            "step): %s", h.tag, e)


def watch(run: RunState, handle: nc.SaveHandle) -> None:
    """Put the folder of ``handle``'s save in place as soon as it is durable, from a thread of its
    own: a process killed after the commit then rarely lacks it (:func:`rebuild` closes the rest)."""
    def when_durable() -> None:
        handle.wait()
        try:
            finish(run, handle)
        except Exception as e:  # the training thread's settle tries again, and raises
            log.warning("nebula_ckpt: putting the folder of %s in place failed (tried again at the next step): %s",
                        handle.tag, e)

    threading.Thread(target=when_durable, name=f"nebula-hf-folder-{handle.step}", daemon=True).start()
