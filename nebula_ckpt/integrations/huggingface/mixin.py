"""The ``Trainer`` mixin: the seams ``Trainer`` itself uses to save and load, overridden to go
through nebula_ckpt (see the package docstring), plus :class:`NebulaTrainer` and :func:`enable`.

The mixin's methods are thin: the work is in :mod:`.saving`, :mod:`.resuming` and
:mod:`.engines`; the trainer's state is one :class:`~.common.RunState` (never attributes set on
the trainer).
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any, Optional, Union

from transformers import Trainer, TrainerCallback
from transformers.training_args import ParallelMode

import nebula_ckpt as nc
from nebula_ckpt.adapters import refuse_url_credentials
from nebula_ckpt.integrations.huggingface import folders, resuming, saving
from nebula_ckpt.integrations.huggingface.common import RunState, attach, run_of
from nebula_ckpt.integrations.huggingface.engines import check_supported, engine_of, load_deepspeed
from nebula_ckpt.integrations.huggingface.fsdp import KEY as FSDP_KEY
from nebula_ckpt.integrations.huggingface.fsdp import load_sharded, read_sharded
from nebula_ckpt.integrations.huggingface.rng import set_rng_states

log = logging.getLogger("nebula_ckpt")


class NebulaCheckpointMixin:
    """Mixin for a ``transformers.Trainer`` (sub)class: its checkpoints go through nebula_ckpt.

    Put it first in the bases (``class MyTrainer(NebulaCheckpointMixin, SFTTrainer)``), or use
    :class:`NebulaTrainer` / :func:`enable`. Extra keyword arguments of ``__init__``:

    Args:
        nebula_root: the checkpoint root (path or fsspec URL); default ``<args.output_dir>/nebula``.
        nebula_options: keyword arguments of :class:`~nebula_ckpt.Checkpointer` (``tiers``,
            ``storage_options``, ``snapshot``, ``on_persist_error`` ...). Without ``keep_last``,
            the persistent tiers keep what ``save_total_limit`` says (all when it is None) and the
            memory tier its default (the newest).
        nebula_log_metrics: put each save's metrics (``nebula/blocked_s``, ``nebula/durable_s/<tier>``
            ...) into the trainer's logs once the save is over (default True).
    """

    def __init__(self, *args: Any, nebula_root: Optional[str] = None,
                 nebula_options: Optional[dict[str, Any]] = None, nebula_log_metrics: bool = True,
                 **kwargs: Any) -> None:
        refuse_url_credentials(nebula_root, "nebula_root")
        super().__init__(*args, **kwargs)
        setup_trainer(self, nebula_root, nebula_options, log_metrics=nebula_log_metrics)

    @property
    def nebula(self) -> nc.Checkpointer:
        """The :class:`~nebula_ckpt.Checkpointer` of this trainer (created at first use; closed at
        the end of ``train()``, and opened again by the next use: close it when done with it)."""
        return saving.checkpointer(self)

    @property
    def nebula_metrics(self) -> list[dict[str, float]]:
        """Each finished save's metrics (``nebula/step``, ``nebula/blocked_s``, ``nebula/durable_s/<tier>``
        ...), oldest first: what the ``report_to`` loggers received (kept out of ``state.log_history``,
        which HF saves in every checkpoint and compares across a resume)."""
        return list(run_of(self).metrics)

    @property
    def nebula_restored(self) -> Optional[dict[str, Any]]:
        """``{"step": N, "tier": name}`` of the checkpoint the last ``train(resume_from_checkpoint=...)``
        restored through nebula_ckpt (None before)."""
        return run_of(self).restored

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.training_step``; its loss is reported at the step's end (:class:`Housekeeping`)."""
        loss = super().training_step(*args, **kwargs)  # type: ignore[misc]
        run_of(self).losses.append(loss)
        return loss

    # -- saving ----------------------------------------------------------------------------------
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """``Trainer._save_checkpoint`` through :meth:`~nebula_ckpt.Checkpointer.save_async`."""
        t: Any = self
        if trial is not None or t.hp_search_backend is not None:
            if run_of(self).once("trial"):
                log.warning("nebula_ckpt: hyperparameter search: checkpoints are saved the stock way "
                            "(each trial's steps would collide in one nebula_ckpt root)")
            return super()._save_checkpoint(model, trial)  # type: ignore[misc]
        check_supported(self)
        t.store_flos()
        saving.save_checkpoint(self, t._get_output_dir(trial=trial))

    # -- resuming --------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: Union[str, bool, int, None] = None, trial: Any = None,
              ignore_keys_for_eval: Optional[list[str]] = None, **kwargs: Any) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint`` may also be a nebula_ckpt tag
        (``"checkpoint-400"``, or ``<output_dir>/checkpoint-400``) or step (``400``), and ``True``
        takes the newest healthy nebula_ckpt checkpoint (HF's folder search when there is none;
        a fresh start, logged, when there is no checkpoint at all). Returns once this run's saves
        are durable; the limit is then applied and the checkpointer closed."""
        check_supported(self)
        ok = False
        try:
            how = resuming.find(self, resume_from_checkpoint)
            with resuming.stub(self, how) as folder:
                given = None if how == resuming.FRESH else resume_from_checkpoint
                out = super().train(  # type: ignore[misc]
                    resume_from_checkpoint=folder if folder is not None else given,
                    trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
            ok = True
        finally:
            resuming.finish(self, ok)
        return out

    def _init_training_state(self, *args: Any, **kwargs: Any) -> Any:
        out = super()._init_training_state(*args, **kwargs)  # type: ignore[misc]
        resuming.restore_best(self)
        return out

    def _prepare_for_training(self, max_steps: Any, train_dataloader: Any, resume_from_checkpoint: Any) -> Any:
        tree = run_of(self).resume
        if tree is None or "deepspeed" not in tree:
            return super()._prepare_for_training(  # type: ignore[misc]
                max_steps, train_dataloader, resume_from_checkpoint)
        # DeepSpeed: HF would read <folder>/global_step*/ files; the engine reads our parts instead
        model, loader = super()._prepare_for_training(max_steps, train_dataloader, None)  # type: ignore[misc]
        load_deepspeed(self, resuming.part(self, "deepspeed"))
        self._load_optimizer_and_scheduler(resume_from_checkpoint)
        self._load_scaler(resume_from_checkpoint)
        return model, loader

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        tree = run_of(self).resume
        if tree is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        target = self.model if model is None else model  # type: ignore[attr-defined]
        if FSDP_KEY in tree:
            # FSDP: called once the model is sharded and its optimizer made; both loaded here
            load_sharded(target, self.optimizer, resuming.part(self, FSDP_KEY))  # type: ignore[attr-defined]
            return
        target.load_state_dict(resuming.part(self, "model"), strict=True)

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        tree = run_of(self).resume
        if tree is None:
            return super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        t: Any = self
        if "optimizer" in tree:
            t.optimizer.load_state_dict(resuming.part(self, "optimizer"))
        if "scheduler" in tree:
            t.lr_scheduler.load_state_dict(resuming.part(self, "scheduler"))

    def _load_scaler(self, checkpoint: Optional[str]) -> None:
        tree = run_of(self).resume
        if tree is None:
            return super()._load_scaler(checkpoint)  # type: ignore[misc]
        scaler = getattr(self.accelerator, "scaler", None)  # type: ignore[attr-defined]
        if "scaler" in tree and scaler is not None:
            scaler.load_state_dict(resuming.part(self, "scaler"))

    def _load_rng_state(self, checkpoint: Optional[str]) -> None:
        tree = run_of(self).resume
        if tree is None:
            return super()._load_rng_state(checkpoint)  # type: ignore[misc]
        if "rng" not in tree:
            log.info("nebula_ckpt: the checkpoint holds no RNG states (save_only_model): reproducibility "
                     "is not guaranteed")
            return
        args: Any = self.args  # type: ignore[attr-defined]
        set_rng_states(tree["rng"], args.parallel_mode == ParallelMode.DISTRIBUTED)

    def _load_best_model(self) -> None:
        t: Any = self
        best = t.state.best_model_checkpoint
        tag = saving.tag_of_path(self, best)
        if tag is None or (os.path.isdir(best) and folders.read(best) is None):
            return super()._load_best_model()  # type: ignore[misc]  # HF's own folder
        self.nebula.wait()  # the best may be the save still in flight
        if tag not in self.nebula.tags():
            log.warning("nebula_ckpt: load_best_model_at_end: the best checkpoint %s (score %s) is on no tier of %s; "
                        "the model keeps the weights of the last step", tag, t.state.best_metric, self.nebula.root)
            return
        log.info("nebula_ckpt: loading the best model from %s (score: %s)", tag, t.state.best_metric)
        if engine_of(self) == "FSDP":
            _, tree = read_sharded(self.nebula, tag=tag)
            load_sharded(t.model_wrapped, None, {"model": tree[FSDP_KEY]["model"]})
            return
        _, tree = self.nebula.read(tag=tag)
        if "deepspeed" in tree:
            load_deepspeed(self, tree["deepspeed"])
        else:
            t.model.load_state_dict(tree["model"], strict=True)


class Housekeeping(TrainerCallback):
    """At the end of each step: after the first one, prepare the staging memory; report the step's
    loss (:meth:`~nebula_ckpt.Checkpointer.report`); later, report the saves that are over (their
    metrics into the logs) and apply ``save_total_limit`` as soon as a save that was in flight is
    durable (a check of the pending handles per step; a deletion only when one is due). After the
    last save of ``train()``: wait until it is durable, its folder in place."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = weakref.ref(trainer)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        tr = self.trainer()
        if tr is None:
            return
        run = run_of(tr)
        if not run.prepared:
            saving.prepare(tr)
        losses, run.losses = run.losses, []
        if losses and run.ckpt is not None and not run.ckpt.closed:  # the step's loss: checkpoints' health
            run.ckpt.report(int(state.global_step), loss=sum(float(x) for x in losses) / len(losses))
        if run.inflight and run.ckpt is not None and not run.ckpt.closed:
            saving.settle(tr)
            saving.rotate(tr)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The last save of ``train()`` durable and its ``checkpoint-N/`` folder in place before HF's
        end of training looks at the folders (with ``save_total_limit=1`` it compares each with
        ``state.best_model_checkpoint``, which may be this one): ``train()`` waits for it anyway."""
        tr = self.trainer()
        if tr is None or not control.should_training_stop:
            return
        run = run_of(tr)
        if run.inflight and run.ckpt is not None and not run.ckpt.closed:
            run.ckpt.wait()  # (TrainerCheckpointer: the folders too)
            saving.settle(tr)


def setup_trainer(trainer: Any, root: Optional[str], options: Optional[dict[str, Any]], *,
                  log_metrics: bool = True) -> None:
    """Switch ``trainer`` to nebula_ckpt checkpoints (what ``NebulaTrainer(...)`` runs after
    ``Trainer.__init__``): a URL carrying a password is refused before anything else."""
    refuse_url_credentials(root, "nebula_root")
    if not any(isinstance(cb, Housekeeping) for cb in trainer.callback_handler.callbacks):
        trainer.add_callback(Housekeeping(trainer))
    attach(trainer, RunState(root=root or os.path.join(trainer.args.output_dir, "nebula"),
                             options=dict(options or {}), log_metrics=log_metrics))
    check_supported(trainer)
    if engine_of(trainer) == "DeepSpeed":
        log.info("nebula_ckpt: DeepSpeed training: each checkpoint holds the engine's own files "
                 "(model, ZeRO partitions) as parts, written with pickle allowed")
    elif engine_of(trainer) == "FSDP":
        log.info("nebula_ckpt: FSDP training: each rank saves its shards of model and optimizer (DTensors)")


class NebulaTrainer(NebulaCheckpointMixin, Trainer):
    """``transformers.Trainer`` whose checkpoints go through nebula_ckpt (see the package docstring).

    Takes ``Trainer``'s arguments, plus ``nebula_root``, ``nebula_options`` and
    ``nebula_log_metrics`` (:class:`NebulaCheckpointMixin`)."""


_classes: dict[type, type] = {}


def enable(trainer: Any, root: Optional[str] = None, *, log_metrics: bool = True,
           **checkpointer_options: Any) -> Any:
    """Switch an existing trainer (any ``transformers.Trainer`` subclass) to nebula_ckpt checkpoints;
    returns it. Its class becomes a subclass of its own class with :class:`NebulaCheckpointMixin`
    first (``isinstance`` checks still hold).

    Args:
        root: the checkpoint root; default ``<args.output_dir>/nebula``.
        log_metrics: each save's metrics into the trainer's logs (see :class:`NebulaCheckpointMixin`).
        checkpointer_options: keyword arguments of :class:`~nebula_ckpt.Checkpointer`.
    """
    if not isinstance(trainer, Trainer):
        raise nc.ValidationError(f"enable() takes a transformers.Trainer, got {type(trainer).__name__}")
    refuse_url_credentials(root, "root")
    cls = type(trainer)
    if not isinstance(trainer, NebulaCheckpointMixin):
        new = _classes.get(cls)
        if new is None:
            new = _classes[cls] = type(f"Nebula{cls.__name__}", (NebulaCheckpointMixin, cls),
                                       {"__module__": cls.__module__, "__doc__": cls.__doc__})
        trainer.__class__ = new
    setup_trainer(trainer, root, checkpointer_options, log_metrics=log_metrics)
    return trainer
