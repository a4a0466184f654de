"""Leaving nebula_ckpt: the files the rest of the Hugging Face world reads (``from_pretrained``
folders, the stock ``checkpoint-N/`` layout), and ``get_last_checkpoint`` for HF scripts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Any, Iterator, Optional, Union

import torch

import nebula_ckpt as nc
from nebula_ckpt.adapters import LocalCoordinator, canonical_root
from nebula_ckpt.integrations.huggingface import folders
from nebula_ckpt.integrations.huggingface.common import TRAINER_STATE_NAME, is_checkpoint_tag

log = logging.getLogger("nebula_ckpt")


def get_last_checkpoint(output_dir: str, root: Optional[str] = None,
                        storage_options: Optional[dict[str, Any]] = None) -> Optional[str]:
    """Drop-in for ``transformers.trainer_utils.get_last_checkpoint`` in scripts written as
    ``trainer.train(resume_from_checkpoint=get_last_checkpoint(output_dir))``: the newest
    nebula_ckpt checkpoint under ``root`` (default ``<output_dir>/nebula``) as the path HF would
    have used (``<output_dir>/checkpoint-N``, which :class:`NebulaTrainer` resumes from), else HF's
    own answer (a real folder, or None).

    It names the checkpoint a restart resumes from (:meth:`~nebula_ckpt.Checkpointer.latest`: after a
    rollback the new run's newest, not the abandoned run's higher step; a step marked suspect is
    passed over) whose marker, manifest and shard sizes check out; its checksums are verified when
    it is loaded (``resume_from_checkpoint=True`` also falls back past one that fails them). Called
    on one rank alone, it waits for no other rank. The folder it names exists: a committed
    checkpoint whose process was killed before it put its folder in place gets it here
    (:func:`.folders.rebuild`; nothing is removed).

    Raises:
        CorruptCheckpointError: every checkpoint under ``root`` is marked suspect, as
            ``resume_from_checkpoint=True`` raises (HF's own function has no such case: it returns
            None only when there is no checkpoint). Naming one would restore the diverged state on
            every restart (a loop); None would start afresh silently and lose the run. The message
            names the checkpoints and ``nebula-ckpt mark ROOT --healthy STEP``, which clears a mark.
    """
    from transformers.trainer_utils import get_last_checkpoint as hf_last

    where = root or os.path.join(output_dir, "nebula")
    tags: dict[str, int] = {}
    latest: Optional[tuple[int, Optional[str]]] = None
    if "://" in where or os.path.isdir(where):
        # one rank's read (HF scripts call it on every rank, or on rank 0 alone): no collective
        with nc.Checkpointer(where, storage_options=storage_options, read_only=True,
                             coordinator=LocalCoordinator()) as ck:
            tags = {t: s for t, s in ck.tags().items() if is_checkpoint_tag(t)}
            latest = ck.latest()  # the restart's order: after a rollback, the new run's newest step
    if tags:
        try:
            folders.rebuild(output_dir, where, tags, drop_stale=False)
        except OSError as e:  # (a read-only output dir) the path still resumes NebulaTrainer, by its tag
            log.warning("nebula_ckpt: could not put the checkpoint folders of %s in place: %s", output_dir, e)
        return os.path.join(output_dir, _resume_tag(where, tags, latest))
    return hf_last(output_dir) if os.path.isdir(output_dir) else None


def _resume_tag(root: str, tags: dict[str, int], latest: Optional[tuple[int, Optional[str]]]) -> str:
    """Of ``tags`` (not empty), the one a restart resumes from: ``latest`` (``Checkpointer.latest()``)
    when it is one of them, else the newest one not above it (``latest`` is untagged).

    Raises:
        CorruptCheckpointError: none is (every checkpoint is marked suspect): naming them, and the
            command that clears a mark, as ``resume_from_checkpoint=True`` does.
    """
    if latest is not None and latest[1] in tags and tags[latest[1]] == latest[0]:
        return latest[1]
    below = {t: s for t, s in tags.items() if latest is not None and s <= latest[0]}
    if below:
        return max(below, key=below.__getitem__)
    named = sorted(tags.items(), key=lambda kv: kv[1])
    raise nc.CorruptCheckpointError(
        f"get_last_checkpoint: no checkpoint of {canonical_root(root)} is left to resume from: every one is marked "
        f"suspect ({', '.join(f'{t} (step {s})' for t, s in named[-20:])}; `nebula-ckpt ls` says why). Resuming "
        f"one again would repeat the failure: fix its cause, then clear a mark with "
        f"`nebula-ckpt mark {canonical_root(root)} --healthy STEP` (STEP: one of those), or start afresh "
        "(resume_from_checkpoint=None)")


@contextlib.contextmanager
def _opened(root: Union[str, nc.Checkpointer], storage_options: Optional[dict[str, Any]]) -> Iterator[nc.Checkpointer]:
    if isinstance(root, nc.Checkpointer):
        yield root
        return
    with nc.Checkpointer(root, storage_options=storage_options, read_only=True,  # a read writes nothing,
                         coordinator=LocalCoordinator()) as ck:  # and waits for no other rank
        yield ck


def _read(root: Union[str, nc.Checkpointer], step: Optional[int], tag: Optional[str],
          storage_options: Optional[dict[str, Any]], best: bool = False) -> tuple[int, dict[str, Any]]:
    """The checkpoint named (default: the newest healthy one; with ``best``, the best one the
    newest one's trainer state names, when it is still held)."""
    with _opened(root, storage_options) as ck:
        if step is not None or tag is not None:
            n, tree = ck.read(step, tag=tag)
        else:
            n, tree = ck.read()
            chosen = _best_tag(tree, ck) if best else None
            if chosen is not None:
                log.info("nebula_ckpt: exporting the best checkpoint %s, not the newest (step %d)", chosen, n)
                n, tree = ck.read(tag=chosen)
    if not isinstance(tree, dict) or "model" not in tree:
        what = "a DeepSpeed checkpoint: its weights are partitioned in the engine's files" \
            if isinstance(tree, dict) and "deepspeed" in tree else "no 'model' key"
        raise nc.ValidationError(f"step {n}: not a checkpoint of the Hugging Face integration with the model's "
                                 f"weights ({what}); see docs/integrations.md")
    return n, tree


def _best_tag(tree: Any, ck: nc.Checkpointer) -> Optional[str]:
    """The tag of the best checkpoint (``load_best_model_at_end``) the trainer state of ``tree``
    names, when that checkpoint is held and is not ``tree``'s own; else None."""
    if not isinstance(tree, dict) or not isinstance(tree.get("trainer_state"), str):
        return None
    try:
        state = json.loads(tree["trainer_state"])
    except (ValueError, RecursionError):  # not the trainer's JSON: no best checkpoint named
        return None
    best = state.get("best_model_checkpoint") if isinstance(state, dict) else None
    if not best:
        return None
    tag = os.path.basename(str(best).rstrip("/"))
    own = state.get("global_step")
    if not is_checkpoint_tag(tag) or ck.tags().get(tag) in (None, own):
        return None
    return tag


def _write_pretrained(tree: dict[str, Any], out_dir: str, config: Any, need_config: bool = True) -> None:
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    seen: set[tuple[Any, ...]] = set()
    tensors: dict[str, torch.Tensor] = {}
    for k, v in tree["model"].items():
        if not isinstance(v, torch.Tensor):
            continue
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), v.stride(), v.dtype)
        if key in seen:  # a tied weight (lm_head = embeddings): written once, as HF does; re-tied at load
            log.debug("nebula_ckpt: %s is tied to an earlier weight: not written again", k)
            continue
        seen.add(key)
        tensors[k] = v.detach().contiguous()
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        if hasattr(config, "save_pretrained"):
            config.save_pretrained(out_dir)
        else:
            with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
                f.write(config if isinstance(config, str) else json.dumps(config, indent=2))
    elif tree.get("config"):
        with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
            f.write(tree["config"])
    elif need_config:
        raise nc.ValidationError("the checkpoint holds no model config (the model has no .config): pass config=")


def export_pretrained(root: Union[str, nc.Checkpointer], out_dir: str, *, step: Optional[int] = None,
                      tag: Optional[str] = None, config: Any = None, best: bool = True,
                      storage_options: Optional[dict[str, Any]] = None) -> int:
    """Write ``config.json`` and ``model.safetensors`` of a checkpoint into ``out_dir``, so that
    ``AutoModel*.from_pretrained(out_dir)`` loads it; return the step written.

    Args:
        root: the checkpoint root (or an open :class:`~nebula_ckpt.Checkpointer`, e.g. ``trainer.nebula``).
        step / tag: which checkpoint (at most one); default the best one the trainer kept
            (``load_best_model_at_end``: ``best_model_checkpoint`` of the newest checkpoint's
            trainer state) when it is still held, else the newest healthy one.
        best: False exports the newest healthy checkpoint even when a best one is recorded.
        config: a ``PretrainedConfig`` (or its JSON text) to write instead of the one saved
            with the checkpoint.

    The whole checkpoint is read (verified) into host memory; for a model much larger than the
    host's memory, ``nebula-ckpt export ROOT --step N --to out/model.safetensors --key model``
    reads only the weights (and gathers a multi-rank checkpoint).
    """
    n, tree = _read(root, step, tag, storage_options, best=best)
    _write_pretrained(tree, out_dir, config)
    return n


def to_hf_checkpoint(root: Union[str, nc.Checkpointer], out_dir: str, *, step: Optional[int] = None,
                     tag: Optional[str] = None, storage_options: Optional[dict[str, Any]] = None) -> int:
    """Write a checkpoint as the ``checkpoint-N/`` folder stock ``Trainer`` writes (``config.json``,
    ``model.safetensors``, ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``, ``rng_state.pth``,
    ``trainer_state.json``), for tools that read only that layout; return the step written.

    ``Trainer.train(resume_from_checkpoint=out_dir)`` resumes from it. Not needed to resume with
    :class:`NebulaTrainer` (which reads the checkpoint directly, without this ``torch.save``).
    """
    n, tree = _read(root, step, tag, storage_options)
    _write_pretrained(tree, out_dir, None, need_config=False)
    for key, name in (("optimizer", "optimizer.pt"), ("scheduler", "scheduler.pt"), ("scaler", "scaler.pt"),
                      ("rng", "rng_state.pth")):
        if key in tree:
            torch.save(tree[key], os.path.join(out_dir, name))
    with open(os.path.join(out_dir, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
        f.write(tree["trainer_state"])
    return n
