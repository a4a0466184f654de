"""Training engines under a Hugging Face ``Trainer``: which ones this integration handles, and
DeepSpeed's state as parts of one nebula_ckpt checkpoint.

Under DeepSpeed (ZeRO 0-3) the model, optimizer and DeepSpeed's scheduler live in the engine,
partitioned per rank; only the engine can write and read them. So a save runs
``engine.save_checkpoint`` with a :class:`PartsCollector` as its checkpoint engine (the files it
would write, by path relative to the tag folder, kept as live state dicts: no ``torch.save``),
and those parts go into the trainer's one checkpoint under the key ``deepspeed``. A resume runs
``engine.load_checkpoint`` on a folder of empty placeholder files (DeepSpeed checks that the
files exist) with a :class:`PartsServer` handing out the restored parts.

FSDP (accelerate's FSDP plugin) keeps its sharded state as DTensors in the checkpoint (see
:mod:`.fsdp`); FSDP on XLA and SageMaker model parallelism are refused with a clear error.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Any, Optional, TypeGuard

import nebula_ckpt as nc
from nebula_ckpt.integrations.deepspeed_files import check_tag_folder

log = logging.getLogger("nebula_ckpt")

#: the tag folder name of the DeepSpeed parts (HF's own: ``global_step<N>``)
DS_TAG = "global_step{}"


def engine_of(trainer: Any) -> Optional[str]:
    """The engine a trainer trains with when it is not plain PyTorch / DDP: ``"DeepSpeed"``,
    ``"FSDP"``, ``"FSDP-XLA"``, ``"SageMaker model parallelism"``; else None."""
    for name, on in (("DeepSpeed", getattr(trainer, "is_deepspeed_enabled", False)),
                     ("FSDP", getattr(trainer, "is_fsdp_enabled", False)),
                     ("FSDP-XLA", getattr(trainer, "is_fsdp_xla_enabled", False))):
        if on:
            return name
    try:
        from transformers.utils import is_sagemaker_mp_enabled

        return "SageMaker model parallelism" if is_sagemaker_mp_enabled() else None
    except ImportError:  # pragma: no cover
        return None


def check_supported(trainer: Any) -> None:
    """Raise :class:`~nebula_ckpt.NebulaError` for an engine this integration cannot save."""
    engine = engine_of(trainer)
    if engine == "FSDP":
        _check_fsdp(trainer)
    if engine is None or engine in ("DeepSpeed", "FSDP"):
        return
    raise nc.NebulaError(
        f"nebula_ckpt's Hugging Face integration does not handle {engine} training yet: that engine keeps the "
        "model sharded across ranks and writes its own files. Train with FSDP (torch, through accelerate), "
        "DeepSpeed ZeRO (1-3) or DDP, which NebulaTrainer saves and resumes, or use the stock Trainer "
        "checkpoints for this run")


def _check_fsdp(trainer: Any) -> None:
    """Refuse the FSDP setups whose state is not DTensors on a 1-D mesh of every rank: FSDP1
    (accelerate gives it no device mesh: its sharded state holds ``ShardedTensor``s) and
    accelerate's multi-dimensional parallelism (HSDP, tensor / context parallel)."""
    state = getattr(getattr(trainer, "accelerator", None), "state", None)
    plugin = getattr(state, "fsdp_plugin", None)
    if int(getattr(plugin, "fsdp_version", 2) or 2) == 1:
        raise nc.NebulaError("nebula_ckpt's Hugging Face integration saves FSDP2 (fsdp_config={'version': 2}, "
                             "transformers' default), not FSDP1: FSDP1's sharded state holds ShardedTensors. Use "
                             "FSDP2, or the stock Trainer checkpoints for this run")
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    dims = [n for n in ("dp_replicate_size", "tp_size", "cp_size", "sp_size") if getattr(pc, n, 1) not in (None, 1)]
    if dims:
        raise nc.NebulaError(f"nebula_ckpt's Hugging Face integration resumes FSDP sharded over one mesh dimension "
                             f"of every rank; this accelerate parallelism config also sets {dims}. Use plain FSDP2, "
                             "or the stock Trainer checkpoints for this run")


def _base() -> Any:
    try:
        from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
    except ImportError as e:  # pragma: no cover - a DeepSpeed trainer implies DeepSpeed
        raise ImportError(f"nebula_ckpt: DeepSpeed training needs deepspeed importable: {e}") from e
    return CheckpointEngine


def _relative(path: str, tag_dir: str) -> Optional[str]:
    apath = os.path.abspath(path)
    if os.path.commonpath([tag_dir, apath]) != tag_dir or apath == tag_dir:
        return None
    return os.path.relpath(apath, tag_dir).replace(os.sep, "/")


def make_collector(tag_dir: str) -> Any:
    """A DeepSpeed ``CheckpointEngine`` that keeps what ``save_checkpoint`` saves in ``tag_dir``
    (``.parts``: relative path -> state dict) and writes nothing there."""

    class PartsCollector(_base()):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.parts: dict[str, Any] = {}

        def create(self, info: Any) -> None:
            self.parts = {}

        def save(self, state_dict: Any, path: str) -> None:
            key = _relative(path, tag_dir)
            if key is None:  # outside the tag folder (save_16bit_model's weights): not part of a checkpoint
                log.debug("nebula_ckpt: DeepSpeed file %s outside the checkpoint folder is not kept", path)
                return
            self.parts[key] = state_dict

        def load(self, path: str, map_location: Any = None) -> Any:
            raise nc.NebulaError("nebula_ckpt: the collecting checkpoint engine does not load")

        def commit(self, info: Any) -> bool:
            return True

        def is_data_parallel_writer(self, dp_rank: int) -> bool:
            return True  # each rank's checkpoint holds what it reads back (replicas stored once)

        def preserves_storage_sharing(self) -> bool:
            return False  # nebula_ckpt stores each tensor's own bytes: no clone of views needed

    return PartsCollector()


def make_server(tag_dir: str, parts: dict[str, Any]) -> Any:
    """A DeepSpeed ``CheckpointEngine`` handing out ``parts`` (relative path -> state dict) for the
    files of ``tag_dir`` that ``load_checkpoint`` asks for."""

    class PartsServer(_base()):  # type: ignore[misc]
        def create(self, info: Any) -> None:
            raise nc.NebulaError("nebula_ckpt: the serving checkpoint engine does not save")

        save = commit = create

        def load(self, path: str, map_location: Any = None) -> Any:
            key = _relative(path, tag_dir)
            if key is None or key not in parts:
                raise nc.NotFoundError(f"DeepSpeed asked for {path}, which the checkpoint does not hold "
                                       f"(it holds: {sorted(parts)}); was it saved with another ZeRO stage or "
                                       "world size?")
            return parts[key]

    return PartsServer()


def save_deepspeed(trainer: Any, step: int) -> dict[str, Any]:
    """The files ``engine.save_checkpoint`` writes for ``step``, as parts (nothing written to disk
    but DeepSpeed's small side files, in a temporary folder removed afterwards)."""
    engine = trainer.model_wrapped
    folder = tempfile.mkdtemp(prefix="nebula-hf-ds-")
    tag = DS_TAG.format(step)
    collector = make_collector(os.path.join(os.path.abspath(folder), tag))
    old, old_writer = engine.checkpoint_engine, engine.save_non_zero_checkpoint
    engine.checkpoint_engine = collector
    # DeepSpeed decided at initialize() that only data-parallel rank 0 saves the model states;
    # here every rank does, so each rank's part of the checkpoint holds all it loads back
    engine.save_non_zero_checkpoint = True
    try:
        kw = {"exclude_frozen_parameters": True} if _peft(trainer) and _accepts_exclude(engine) else {}
        engine.save_checkpoint(folder, tag=tag, **kw)
    finally:
        engine.checkpoint_engine, engine.save_non_zero_checkpoint = old, old_writer
        shutil.rmtree(folder, ignore_errors=True)
    return {"tag": tag, "parts": collector.parts}


def _relative_name(rel: Any) -> TypeGuard[str]:
    """Whether ``rel`` is a relative path that stays where it is joined (no ``..``, no ``/`` first)."""
    return isinstance(rel, str) and bool(rel) and not rel.startswith("/") and ".." not in rel.split("/") \
        and "\\" not in rel and "\0" not in rel


def placeholders(folder: str, saved: Any) -> tuple[str, dict[str, str]]:
    """The tag folder under ``folder`` of ``saved`` (what :func:`save_deepspeed` returned, restored)
    and the placeholder path of each of its parts, found before anything is written.

    The tag and the part names are read back from a checkpoint: each must be a relative path
    inside the tag folder (as the DeepSpeed plugin's ``restore_pointers`` requires), never one
    that leaves ``folder``.

    Raises:
        ValidationError: naming the tag or part that is not such a path.
    """
    tag, parts = (saved.get("tag"), saved.get("parts")) if isinstance(saved, dict) else (None, None)
    if not isinstance(parts, dict):
        raise nc.ValidationError(f"the checkpoint's 'deepspeed' part is not what NebulaTrainer saves (a dict of "
                                 f"'tag' and 'parts', got {type(saved).__name__}); resume from another checkpoint")
    if not _relative_name(tag):
        raise nc.ValidationError(f"the checkpoint's DeepSpeed tag {tag!r} is not a relative folder name (NebulaTrainer "
                                 "saves 'global_step<N>'); resume from another checkpoint")
    check_tag_folder(tag)
    tag_dir = os.path.join(os.path.abspath(folder), tag)  # the path DeepSpeed joins: the server matches it
    real = os.path.realpath(tag_dir)
    paths: dict[str, str] = {}
    for key in parts:
        path = os.path.join(tag_dir, *key.split("/")) if _relative_name(key) else ""
        if not path or os.path.commonpath([real, os.path.realpath(path)]) != real or os.path.realpath(path) == real:
            raise nc.ValidationError(f"DeepSpeed checkpoint {tag!r}: part {key!r} is not a relative path inside the "
                                     "tag folder (NebulaTrainer never saves one); resume from another checkpoint")
        paths[key] = path
    return tag_dir, paths


def load_deepspeed(trainer: Any, saved: dict[str, Any]) -> None:
    """``engine.load_checkpoint`` (optimizer and scheduler states included) from ``saved``
    (what :func:`save_deepspeed` returned, restored; its names are checked by :func:`placeholders`)."""
    engine = trainer.model_wrapped
    folder = tempfile.mkdtemp(prefix="nebula-hf-ds-")
    try:
        tag_dir, paths = placeholders(folder, saved)
        for path in paths.values():  # DeepSpeed globs / checks these paths before it loads them
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "wb").close()
        old = engine.checkpoint_engine
        engine.checkpoint_engine = make_server(tag_dir, saved["parts"])
        try:
            loaded, _ = engine.load_checkpoint(folder, tag=saved["tag"], load_module_strict=not _peft(trainer),
                                               load_optimizer_states=True, load_lr_scheduler_states=True)
        finally:
            engine.checkpoint_engine = old
        if loaded is None:
            raise nc.NebulaError(f"DeepSpeed could not load checkpoint {saved['tag']} (parts {sorted(saved['parts'])})")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _peft(trainer: Any) -> bool:
    """Whether the trainer's model is a PEFT model (as HF asks before saving under DeepSpeed)."""
    try:
        from peft import PeftMixedModel, PeftModel  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return False
    return isinstance(trainer.model, (PeftModel, PeftMixedModel))


def _accepts_exclude(engine: Any) -> bool:
    import inspect

    return "exclude_frozen_parameters" in inspect.signature(engine.save_checkpoint).parameters
