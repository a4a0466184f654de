"""Hugging Face ``Trainer`` checkpoints through nebula_ckpt's tiers, and ``resume_from_checkpoint`` from them.

One line switches it on, for a new trainer or for one that already exists (any ``Trainer``
subclass: TRL's ``SFTTrainer``, your own)::

    from nebula_ckpt.integrations.huggingface import NebulaTrainer, enable

    trainer = NebulaTrainer(model=model, args=args, train_dataset=ds)    # instead of Trainer(...)
    trainer = enable(SFTTrainer(model=model, args=args, ...))            # or: any existing trainer

    trainer.train()                                 # saves at args.save_steps / save_strategy
    trainer.train(resume_from_checkpoint=True)      # after a crash: the newest healthy checkpoint
    trainer.train(resume_from_checkpoint="checkpoint-400")   # or a tag, a step, or HF's folder path

What happens:

* **Saves don't block for a ``torch.save``.** Where ``Trainer`` would write ``checkpoint-N/``
  (``model.safetensors``, ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``, ``rng_state.pth``,
  ``trainer_state.json``), one :meth:`~nebula_ckpt.Checkpointer.save_async` takes the model,
  optimizer, scheduler, grad scaler, RNG states and trainer state as one checkpoint of step
  ``global_step``, tagged ``checkpoint-N`` (HF's folder name). The training thread pays for the
  copy into host memory only; the memory tier (``/dev/shm``, survives a crash of the process) and
  the persistent root (default ``<output_dir>/nebula``; any path, ``az://`` or ``s3://`` URL or
  explicit ``tiers``) are written in the background.
* **Resume** with ``resume_from_checkpoint=True`` restores the newest healthy checkpoint from the
  fastest tier that has it (a damaged one is skipped for the next older one); a tag
  (``"checkpoint-400"``, or the path ``<output_dir>/checkpoint-400`` HF would have used) or a step
  (``400``) names one. A real ``checkpoint-N/`` folder (``trainer_state.json`` inside) still
  resumes the stock way, and ``True`` with nothing in nebula_ckpt falls back to HF's own search.
* **``save_total_limit``** is HF's, applied with :meth:`~nebula_ckpt.Checkpointer.remove` on every
  tier: the newest ``save_total_limit`` checkpoints are kept, and the best one
  (``load_best_model_at_end``) too. A checkpoint is removed only once a newer one is durable
  (checked at each save and step end), so while saves are in flight there are more (a crash then
  never leaves fewer than the limit); when ``train()`` returns the count is exact.
* **Exact resume**: the RNG states are HF's ``rng_state.pth`` layout (``python``, ``numpy``,
  ``cpu``, ``cuda`` and the other devices' states), stored as tensors and typed values (no
  pickle); the trainer state is the JSON ``trainer_state.json`` holds. Continuing after a SIGKILL
  gives the same per-step losses, bit for bit, as a run that was never interrupted
  (``tests/integrations/test_huggingface.py``).
* **Weights for ``from_pretrained``**: :func:`export_pretrained` writes ``config.json`` and
  ``model.safetensors`` (the checkpoint keeps the model's config); ``nebula-ckpt export ROOT
  --step N --to model.safetensors --key model`` writes the weights alone.
* ``train()`` ends by waiting for its saves to be durable (raising a failure), applying the
  limit, and closing the :class:`~nebula_ckpt.Checkpointer` (the memory tier is freed once its
  newest checkpoint is on the persistent tier).

Why a ``Trainer`` subclass, and not a callback or a ``checkpoint-N/`` folder rebuilt at resume
(the three ways to do this):

* A ``TrainerCallback`` cannot do it. It can veto HF's save (``control.should_save = False``) and
  save instead, but it runs in ``on_step_end``, before the evaluation of that step, so the best
  metric of the checkpoint is not yet known; it never sees the grad scaler, the stateful callbacks'
  state or ``trial``; and it cannot intercept ``train(resume_from_checkpoint=...)``, which HF
  resolves and reads before any callback runs.
* Rebuilding a ``checkpoint-N/`` folder from the newest nebula checkpoint and letting stock
  ``Trainer`` read it works with no override at all, but costs at every resume what this library
  exists to avoid: a ``torch.save`` of the whole model and optimizer to disk, then a ``torch.load``
  back (and pickle on both sides). :func:`to_hf_checkpoint` does exactly that, for handing a
  checkpoint to stock tools; it is not the resume path.
* So: a mixin overriding the seams ``Trainer`` itself uses. ``_save_checkpoint`` makes one
  ``save_async`` (HF's bookkeeping kept: FLOs, best checkpoint, stateful callbacks, rotation);
  ``train`` resolves ``resume_from_checkpoint`` to a nebula checkpoint, reads it once (verified;
  the fastest healthy tier) and hands ``Trainer`` a folder holding only ``trainer_state.json``
  (the one file ``train`` opens by path); ``_load_from_checkpoint``,
  ``_load_optimizer_and_scheduler``, ``_load_scaler`` and ``_load_rng_state`` take their part of
  that state instead of files; ``_load_best_model`` loads the best checkpoint by tag. These are
  private methods: the module checks at import that the installed ``Trainer`` has every one of
  them (transformers 5.x; tested with 5.23.0). A Trainer for which they do not apply (DeepSpeed,
  FSDP, SageMaker MP: engines that write their own sharded files) is refused with a clear error
  (``nebula_ckpt.integrations.deepspeed`` is DeepSpeed's adapter).

Limits: hyperparameter search (``trial``) saves the stock way (each trial's steps would collide in
one root); checkpoints are not pushed to the Hub at save time (``push_to_hub`` at the end pushes
the final model as usual); the tokenizer / processor is not part of the checkpoint (save it once
with ``save_pretrained``). A restore reads the whole checkpoint into fresh host memory before it
is loaded into the model and optimizer (as ``torch.load`` would).

Multi-rank (``torchrun`` + DDP): every rank saves and restores (each its own RNG states; the
replicated model and optimizer are written once, see the README), as the core does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
import re
import shutil
import tempfile
import weakref
from typing import Any, Iterator, Optional, Union

import numpy as np
import torch

from nebula_ckpt.checkpointer import Checkpointer
from nebula_ckpt.errors import NebulaError, NotFoundError, ValidationError
from nebula_ckpt.handle import SaveHandle
from nebula_ckpt.tiers import refuse_url_credentials

try:
    import transformers
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_callback import ExportableState
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy
    from transformers.training_args import ParallelMode
except ImportError as _e:  # pragma: no cover - exercised only without transformers
    raise ImportError("nebula_ckpt.integrations.huggingface needs transformers: "
                      "pip install 'nebula_ckpt[huggingface]'") from _e

log = logging.getLogger("nebula_ckpt")

#: the ``Trainer`` methods this integration overrides or calls (private API: checked at import)
_SEAMS = ("_save_checkpoint", "_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_scaler",
          "_load_rng_state", "_load_best_model", "_init_training_state", "_get_output_dir", "store_flos")
_missing = [m for m in _SEAMS if not callable(getattr(Trainer, m, None))]
if _missing:  # pragma: no cover - another transformers generation
    raise ImportError(f"nebula_ckpt.integrations.huggingface needs transformers 5.x: the installed "
                      f"transformers {transformers.__version__} has no Trainer.{', Trainer.'.join(_missing)}")

__all__ = ["NebulaTrainer", "NebulaCheckpointMixin", "enable", "get_last_checkpoint", "export_pretrained",
           "to_hf_checkpoint", "STATE_KEYS"]

#: The top-level keys of a checkpoint saved by this integration: ``model`` (the module: ``nebula-ckpt
#: export --key model``), ``optimizer``, ``scheduler``, ``scaler`` (when the trainer has one),
#: ``rng`` (HF's rng_state.pth layout), ``trainer_state`` (the text of trainer_state.json),
#: ``config`` (the model's config.json text, or None), ``hf`` (format version, transformers version).
STATE_KEYS = ("model", "optimizer", "scheduler", "scaler", "rng", "trainer_state", "config", "hf")
FORMAT = 1
TRAINER_STATE_NAME = "trainer_state.json"
#: retention on the persistent tiers is this integration's (``save_total_limit``, best kept):
#: the core's own ``keep_last`` is set out of the way unless the caller gives one
_KEEP_ALL = 2**31 - 1
_CKPT_TAG = re.compile(r"^(?:.*/)?" + re.escape(PREFIX_CHECKPOINT_DIR) + r"-(\d+)$")


def _is_checkpoint_tag(tag: str) -> bool:
    """Whether ``tag`` (read back from a checkpoint) names an HF checkpoint folder *inside* the
    output dir: ``checkpoint-N``, maybe below relative folders; never ``..``, ``.`` or absolute
    (it becomes ``<output_dir>/<tag>``, which ``train`` then opens)."""
    return bool(_CKPT_TAG.match(tag)) and not tag.startswith("/") \
        and not any(part in ("", ".", "..") for part in tag.split("/"))
#: device modules whose RNG state HF's rng_state.pth holds besides python / numpy / cpu
_DEVICE_RNG = ("cuda", "npu", "hpu", "mlu", "musa")


# -- RNG states in HF's rng_state.pth layout ------------------------------------------------------
def _device_module(name: str) -> Any:
    """``torch.cuda`` / ``torch.npu`` ... when that device is usable here, else None."""
    mod = getattr(torch, name, None)
    try:
        return mod if mod is not None and mod.is_available() else None
    except Exception:
        return None


def _rng_states(distributed: bool) -> dict[str, Any]:
    """What ``Trainer._save_rng_state`` puts in ``rng_state.pth``: the state of every generator a
    training step may draw from (one rank's; device states of every local device when distributed)."""
    states: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                              "cpu": torch.random.get_rng_state()}
    for name in _DEVICE_RNG:
        mod = _device_module(name)
        if mod is not None:
            rnd = getattr(mod, "random", mod)
            states[name] = rnd.get_rng_state_all() if distributed else rnd.get_rng_state()
    xm = _xla()
    if xm is not None:  # pragma: no cover - TPU only
        states["xla"] = xm.get_rng_state()
    return states


def _xla() -> Any:
    """``torch_xla.core.xla_model`` on a TPU host, else None."""
    from transformers.utils import is_torch_xla_available

    if not is_torch_xla_available():
        return None
    import importlib  # pragma: no cover - TPU only

    return importlib.import_module("torch_xla.core.xla_model")  # pragma: no cover


def _set_rng_states(states: dict[str, Any], distributed: bool) -> None:
    """``Trainer._load_rng_state`` from the restored dict instead of ``rng_state.pth``."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.random.set_rng_state(states["cpu"])
    for name in _DEVICE_RNG:
        mod = _device_module(name)
        if mod is None:
            continue
        if name not in states:
            log.warning("nebula_ckpt: the checkpoint holds no %s RNG state (saved without %s): the resumed run "
                        "will not reproduce the interrupted one exactly", name, name.upper())
            continue
        rnd = getattr(mod, "random", mod)
        try:
            if distributed:
                rnd.set_rng_state_all(states[name])
            else:
                rnd.set_rng_state(states[name])
        except Exception as e:  # as HF: a different device count is not fatal, but said
            log.error("nebula_ckpt: could not restore the %s RNG states (%s: %s): the resumed run will not "
                      "reproduce the interrupted one exactly", name, type(e).__name__, e)
    xm = _xla() if "xla" in states else None
    if xm is not None:  # pragma: no cover - TPU only
        xm.set_rng_state(states["xla"])


# -- the mixin --------------------------------------------------------------------------------------
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
    """

    # set by _nebula_setup (declared for type checkers; the Trainer attributes come from the host class)
    _nebula_root: str
    _nebula_options: dict[str, Any]
    _nebula_ckpt: Optional[Checkpointer]
    _nebula_committed: dict[str, int]
    _nebula_inflight: list[SaveHandle]
    _nebula_resume: Optional[dict[str, Any]]
    _nebula_resume_best: Optional[str]
    _nebula_told: set[str]
    _nebula_prepared: bool
    #: ``{"step": N, "tier": name}`` of the checkpoint the last ``train(resume_from_checkpoint=...)``
    #: restored through nebula_ckpt (None before)
    nebula_restored: Optional[dict[str, Any]]

    def __init__(self, *args: Any, nebula_root: Optional[str] = None,
                 nebula_options: Optional[dict[str, Any]] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _nebula_setup(self, nebula_root, nebula_options)

    # -- the checkpointer ------------------------------------------------------------------------
    @property
    def nebula(self) -> Checkpointer:
        """The :class:`~nebula_ckpt.Checkpointer` of this trainer (created at first use; closed at
        the end of ``train()``, and opened again by the next use: close it when done with it)."""
        if self._nebula_ckpt is None or self._nebula_ckpt.closed:
            opts = dict(self._nebula_options)
            opts.setdefault("keep_last", _KEEP_ALL)
            self._nebula_ckpt = Checkpointer(self._nebula_root, **opts)
            self._nebula_prepared = False
            self._nebula_committed = {t: s for t, s in self._nebula_ckpt.tags().items() if _is_checkpoint_tag(t)}
            self._nebula_inflight = []
        return self._nebula_ckpt

    def _nebula_tag(self, path: Optional[str]) -> Optional[str]:
        """The tag of a checkpoint named the way HF names folders (``<output_dir>/checkpoint-N``,
        ``checkpoint-N``); None when ``path`` is None."""
        if path is None:
            return None
        out = os.path.abspath(self.args.output_dir)  # type: ignore[attr-defined]
        p = os.path.abspath(path)
        if p.startswith(out + os.sep):
            return os.path.relpath(p, out).replace(os.sep, "/")
        return path.replace(os.sep, "/").strip("/")

    def _nebula_settle(self) -> None:
        """Count the saves that are now durable as committed checkpoints (failed ones are not:
        the core raises their error from the next save / wait)."""
        left = []
        for h in self._nebula_inflight:
            if not h.done():
                left.append(h)
            elif h.error() is None and h.skipped is None and h.tiers_written and h.tag:
                self._nebula_committed[h.tag] = h.step
        self._nebula_inflight = left

    def _nebula_rotate(self, final: bool = False) -> None:
        """HF's ``rotate_checkpoints`` over the committed checkpoints (newest and best kept); with
        ``final``, also ``_finalize_training``'s rule (limit 1 and a best one: only the best stays)."""
        limit = self.args.save_total_limit  # type: ignore[attr-defined]
        if limit is None or limit <= 0 or self._nebula_ckpt is None:
            return
        self._nebula_settle()
        committed = sorted(self._nebula_committed.items(), key=lambda kv: kv[1])
        if len(committed) <= limit:
            return
        best = self._nebula_tag(self.state.best_model_checkpoint)  # type: ignore[attr-defined]
        protected = {committed[-1][0]}
        if best in self._nebula_committed:
            protected.add(best)
            if final and limit == 1:
                protected = {best}
        keep = max(limit, len(protected))
        remaining = len(committed)
        for tag, _ in committed:
            if remaining <= keep:
                break
            if tag in protected:
                continue
            try:
                self._nebula_ckpt.remove(tag=tag)
                log.info("nebula_ckpt: removed %s (save_total_limit=%d)", tag, limit)
            except NotFoundError:
                pass  # gone already (another process, or retention of an explicit tier)
            del self._nebula_committed[tag]
            remaining -= 1

    def _nebula_check_supported(self) -> None:
        t: Any = self
        engine = next((n for n, on in (("DeepSpeed", getattr(t, "is_deepspeed_enabled", False)),
                                       ("FSDP", getattr(t, "is_fsdp_enabled", False)),
                                       ("FSDP-XLA", getattr(t, "is_fsdp_xla_enabled", False))) if on), None)
        if engine is None:
            try:
                from transformers.utils import is_sagemaker_mp_enabled

                engine = "SageMaker model parallelism" if is_sagemaker_mp_enabled() else None
            except ImportError:  # pragma: no cover
                pass
        if engine is not None:
            raise NebulaError(f"nebula_ckpt's Hugging Face integration does not handle {engine} training: that engine "
                              "writes its own sharded checkpoint files. Use the stock Trainer checkpoints"
                              + (" with nebula_ckpt.integrations.deepspeed (a DeepSpeed CheckpointEngine)"
                                 if engine == "DeepSpeed" else ""))

    def _nebula_state(self) -> dict[str, Any]:
        """The state one checkpoint holds (see :data:`STATE_KEYS`): the live objects themselves, so
        that ``save_async`` copies their tensors once (and, on a GPU, overlaps the copy)."""
        t: Any = self
        args = t.args
        state: dict[str, Any] = {"model": t.model}
        if not args.save_only_model:
            state["optimizer"] = t.optimizer
            state["scheduler"] = t.lr_scheduler
            scaler = getattr(t.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler
            state["rng"] = _rng_states(args.parallel_mode == ParallelMode.DISTRIBUTED)
        state["trainer_state"] = json.dumps(dataclasses.asdict(t.state), indent=2, sort_keys=True) + "\n"
        to_json = getattr(getattr(t.model, "config", None), "to_json_string", None)
        state["config"] = to_json() if callable(to_json) else None
        state["hf"] = {"format": FORMAT, "transformers": transformers.__version__, "world_size": int(args.world_size)}
        return state

    def _nebula_prepare(self) -> None:
        """After the first optimizer step (the optimizer's state exists): make the staging memory of
        the checkpoints in the background (:meth:`~nebula_ckpt.Checkpointer.prepare`), so the first
        save blocks no longer than the later ones."""
        t: Any = self
        if t.args.save_strategy == SaveStrategy.NO or t.hp_search_backend is not None or t.optimizer is None:
            self._nebula_prepared = True
            return
        ck = self.nebula
        self._nebula_prepared = True
        try:
            ck.prepare(self._nebula_state())
        except NebulaError as e:  # the first save raises it, with the trainer's context
            log.debug("nebula_ckpt: prepare() failed: %s", e)

    # -- saving ----------------------------------------------------------------------------------
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """``Trainer._save_checkpoint`` through :meth:`~nebula_ckpt.Checkpointer.save_async`."""
        t: Any = self
        if trial is not None or t.hp_search_backend is not None:
            if "trial" not in self._nebula_told:
                self._nebula_told.add("trial")
                log.warning("nebula_ckpt: hyperparameter search: checkpoints are saved the stock way "
                            "(each trial's steps would collide in one nebula_ckpt root)")
            return super()._save_checkpoint(model, trial)  # type: ignore[misc]
        self._nebula_check_supported()
        args = t.args
        t.store_flos()
        run_dir = t._get_output_dir(trial=trial)
        tag = f"{PREFIX_CHECKPOINT_DIR}-{t.state.global_step}"
        ck = self.nebula
        self._nebula_settle()
        if args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) \
                and t.state.best_global_step:
            best = f"{PREFIX_CHECKPOINT_DIR}-{t.state.best_global_step}"
            if best in self._nebula_committed or best == tag or any(h.tag == best for h in self._nebula_inflight):
                t.state.best_model_checkpoint = os.path.join(run_dir, best)
        # as HF, the stateful callbacks' state goes into the trainer state (on every rank: each
        # rank's checkpoint holds its own trainer state)
        for cb in [c for c in t.callback_handler.callbacks + [t.control] if isinstance(c, ExportableState)]:
            name = cb.__class__.__name__
            if isinstance(t.state.stateful_callbacks.get(name), list):
                t.state.stateful_callbacks[name].append(cb.state())
            else:
                t.state.stateful_callbacks[name] = cb.state()
        state = self._nebula_state()
        handle = ck.save_async(int(t.state.global_step), state, tag=tag)
        self._nebula_committed.pop(tag, None)  # replaced by this save (same step)
        self._nebula_inflight.append(handle)
        if args.push_to_hub and "hub" not in self._nebula_told:
            self._nebula_told.add("hub")
            log.warning("nebula_ckpt: push_to_hub: checkpoints live in nebula_ckpt and are not pushed at save "
                        "time; trainer.push_to_hub() pushes the final model")
        self._nebula_rotate()

    # -- resuming --------------------------------------------------------------------------------
    def _nebula_find(self, resume: Any) -> Optional[tuple[str, Any]]:
        """What ``resume_from_checkpoint`` names in nebula_ckpt: ``("latest", None)``,
        ``("tag", tag)``, ``("step", n)``; None for HF's own handling (nothing given, a real
        checkpoint folder, or ``True`` with nothing committed in nebula_ckpt)."""
        if resume is None or resume is False:
            return None
        if resume is True:
            return ("latest", None) if self.nebula.list() else None
        if isinstance(resume, int):
            return ("step", resume)
        if not isinstance(resume, (str, os.PathLike)):
            raise ValidationError("resume_from_checkpoint must be a bool, a step (int), a tag or a path, "
                                  f"got {resume!r}")
        path = os.fspath(resume)
        if os.path.isfile(os.path.join(path, TRAINER_STATE_NAME)):
            return None  # an HF checkpoint folder: stock resume
        tags = self.nebula.tags()
        for cand in (path, self._nebula_tag(path), os.path.basename(path.rstrip("/" + os.sep))):
            if cand in tags:
                return ("tag", cand)
        raise NotFoundError(f"resume_from_checkpoint={path!r}: no checkpoint folder there and no healthy nebula_ckpt "
                            f"checkpoint tagged so under {self._nebula_root} (tags: {sorted(tags)[-10:]})")

    def _nebula_read(self, how: tuple[str, Any]) -> tuple[int, dict[str, Any]]:
        kind, what = how
        ck = self.nebula
        if kind == "latest":
            step, tree = ck.read()
        elif kind == "tag":
            step, tree = ck.read(tag=what)
        else:
            step, tree = ck.read(step=what)
        if not isinstance(tree, dict) or not isinstance(tree.get("trainer_state"), str) or "model" not in tree:
            keys = list(tree)[:8] if isinstance(tree, dict) else type(tree).__name__
            raise ValidationError(f"step {step} under {self._nebula_root} was not saved by the Hugging Face "
                                  f"integration (top-level keys {keys}); name one of its checkpoints "
                                  f"(tags: {sorted(ck.tags())[-10:]})")
        self.nebula_restored = dict(ck.last_restore or {"step": step})
        log.info("nebula_ckpt: resuming from step %d (tier %s) of %s", step, self.nebula_restored.get("tier"),
                 self._nebula_root)
        return step, tree

    def train(self, resume_from_checkpoint: Union[str, bool, int, None] = None, trial: Any = None,
              ignore_keys_for_eval: Optional[list[str]] = None, **kwargs: Any) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint`` may also be a nebula_ckpt tag
        (``"checkpoint-400"``, or ``<output_dir>/checkpoint-400``) or step (``400``), and ``True``
        takes the newest healthy nebula_ckpt checkpoint (HF's folder search when there is none).
        Returns once this run's saves are durable; the limit is then applied and the
        checkpointer closed."""
        self._nebula_check_supported()
        ok = False
        try:
            how = self._nebula_find(resume_from_checkpoint)
            with self._nebula_stub(how) as folder:
                out = super().train(  # type: ignore[misc]
                    resume_from_checkpoint=folder if how is not None else resume_from_checkpoint,
                    trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
            ok = True
        finally:
            self._nebula_resume = None
            self._nebula_finish(ok)
        return out

    @contextlib.contextmanager
    def _nebula_stub(self, how: Optional[tuple[str, Any]]) -> Iterator[Optional[str]]:
        """Read the checkpoint to resume from; yield a folder holding its ``trainer_state.json``
        (the only file ``Trainer.train`` opens by path), removed afterwards."""
        if how is None:
            yield None
            return
        step, tree = self._nebula_read(how)
        ts = json.loads(tree["trainer_state"])
        # HF drops a best checkpoint whose folder is missing (with a warning): kept aside, put back
        # in _init_training_state when nebula_ckpt still has it
        self._nebula_resume_best = ts.pop("best_model_checkpoint", None)
        ts["best_model_checkpoint"] = None
        folder = tempfile.mkdtemp(prefix=f"nebula-hf-{PREFIX_CHECKPOINT_DIR}-{step}-")
        try:
            with open(os.path.join(folder, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
                json.dump(ts, f)
            self._nebula_resume = tree
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _nebula_finish(self, ok: bool) -> None:
        """End of ``train()``: wait for the saves, apply the limit, close the checkpointer (on an
        exception only close, logging what fails, so the original error stays the one raised)."""
        ck = self._nebula_ckpt
        if ck is None or ck.closed:
            return
        if not ok:
            try:
                ck.close()
            except Exception as e:
                log.error("nebula_ckpt: closing the checkpointer after a failed train() also failed: %s", e)
            return
        try:
            ck.wait()  # raises a failed save (once: close() then does not raise it again)
            self._nebula_rotate(final=True)
        finally:
            ck.close()

    def _init_training_state(self, *args: Any, **kwargs: Any) -> Any:
        out = super()._init_training_state(*args, **kwargs)  # type: ignore[misc]
        best = getattr(self, "_nebula_resume_best", None)
        if self._nebula_resume is not None and best is not None:
            if self._nebula_tag(best) in self._nebula_committed:
                self.state.best_model_checkpoint = best  # type: ignore[attr-defined]
            else:
                log.warning("nebula_ckpt: the best checkpoint %s of the resumed state is not in %s anymore; "
                            "ignoring it for this run", best, self._nebula_root)
        self._nebula_resume_best = None
        return out

    def _nebula_part(self, key: str) -> Any:
        """A part of the checkpoint being resumed, handed over once (its memory freed as soon as it
        is loaded) unless ``auto_find_batch_size`` may run the loop, and so the loads, again."""
        tree = self._nebula_resume
        assert tree is not None
        return tree[key] if self.args.auto_find_batch_size else tree.pop(key)  # type: ignore[attr-defined]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        tree = self._nebula_resume
        if tree is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        target = self.model if model is None else model  # type: ignore[attr-defined]
        target.load_state_dict(self._nebula_part("model"), strict=True)

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        tree = self._nebula_resume
        if tree is None:
            return super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        t: Any = self
        if "optimizer" in tree:
            t.optimizer.load_state_dict(self._nebula_part("optimizer"))
        if "scheduler" in tree:
            t.lr_scheduler.load_state_dict(self._nebula_part("scheduler"))

    def _load_scaler(self, checkpoint: Optional[str]) -> None:
        tree = self._nebula_resume
        if tree is None:
            return super()._load_scaler(checkpoint)  # type: ignore[misc]
        scaler = getattr(self.accelerator, "scaler", None)  # type: ignore[attr-defined]
        if "scaler" in tree and scaler is not None:
            scaler.load_state_dict(self._nebula_part("scaler"))

    def _load_rng_state(self, checkpoint: Optional[str]) -> None:
        tree = self._nebula_resume
        if tree is None:
            return super()._load_rng_state(checkpoint)  # type: ignore[misc]
        if "rng" not in tree:
            log.info("nebula_ckpt: the checkpoint holds no RNG states (save_only_model): reproducibility "
                     "is not guaranteed")
            return
        args: Any = self.args  # type: ignore[attr-defined]
        _set_rng_states(tree["rng"], args.parallel_mode == ParallelMode.DISTRIBUTED)

    def _load_best_model(self) -> None:
        t: Any = self
        tag = self._nebula_tag(t.state.best_model_checkpoint)
        if tag is None or os.path.isdir(t.state.best_model_checkpoint):
            return super()._load_best_model()  # type: ignore[misc]
        self.nebula.wait()  # the best may be the save still in flight
        if tag not in self.nebula.tags():
            return super()._load_best_model()  # type: ignore[misc]
        log.info("nebula_ckpt: loading the best model from %s (score: %s)", tag, t.state.best_metric)
        _, tree = self.nebula.read(tag=tag)
        t.model.load_state_dict(tree["model"], strict=True)


class _Housekeeping(TrainerCallback):
    """At the end of each step: after the first one, prepare the staging memory; later, apply
    ``save_total_limit`` as soon as a save that was in flight is durable (a check of the pending
    handles per step; a deletion only when one is due)."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = weakref.ref(trainer)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        tr = self._trainer()
        if tr is None:
            return
        if not tr._nebula_prepared:
            tr._nebula_prepare()
        if tr._nebula_inflight and tr._nebula_ckpt is not None and not tr._nebula_ckpt.closed:
            tr._nebula_rotate()


def _nebula_setup(trainer: Any, root: Optional[str], options: Optional[dict[str, Any]]) -> None:
    refuse_url_credentials(root, "nebula_root")
    if not any(isinstance(cb, _Housekeeping) for cb in trainer.callback_handler.callbacks):
        trainer.add_callback(_Housekeeping(trainer))
    trainer._nebula_root = root or os.path.join(trainer.args.output_dir, "nebula")
    trainer._nebula_options = dict(options or {})
    trainer._nebula_ckpt = None
    trainer._nebula_committed = {}
    trainer._nebula_inflight = []
    trainer._nebula_resume = None
    trainer._nebula_resume_best = None
    trainer._nebula_told = set()
    trainer.nebula_restored = None
    trainer._nebula_prepared = False
    NebulaCheckpointMixin._nebula_check_supported(trainer)


class NebulaTrainer(NebulaCheckpointMixin, Trainer):
    """``transformers.Trainer`` whose checkpoints go through nebula_ckpt (see the module docstring).

    Takes ``Trainer``'s arguments, plus ``nebula_root`` and ``nebula_options``
    (:class:`NebulaCheckpointMixin`)."""


_classes: dict[type, type] = {}


def enable(trainer: Any, root: Optional[str] = None, **checkpointer_options: Any) -> Any:
    """Switch an existing trainer (any ``transformers.Trainer`` subclass) to nebula_ckpt checkpoints;
    returns it. Its class becomes a subclass of its own class with :class:`NebulaCheckpointMixin`
    first (``isinstance`` checks still hold).

    Args:
        root: the checkpoint root; default ``<args.output_dir>/nebula``.
        checkpointer_options: keyword arguments of :class:`~nebula_ckpt.Checkpointer`.
    """
    if not isinstance(trainer, Trainer):
        raise ValidationError(f"enable() takes a transformers.Trainer, got {type(trainer).__name__}")
    cls = type(trainer)
    if not isinstance(trainer, NebulaCheckpointMixin):
        new = _classes.get(cls)
        if new is None:
            new = _classes[cls] = type(f"Nebula{cls.__name__}", (NebulaCheckpointMixin, cls),
                                       {"__module__": cls.__module__, "__doc__": cls.__doc__})
        trainer.__class__ = new
    _nebula_setup(trainer, root, checkpointer_options)
    return trainer


def get_last_checkpoint(output_dir: str, root: Optional[str] = None,
                        storage_options: Optional[dict[str, Any]] = None) -> Optional[str]:
    """Drop-in for ``transformers.trainer_utils.get_last_checkpoint`` in scripts written as
    ``trainer.train(resume_from_checkpoint=get_last_checkpoint(output_dir))``: the newest
    nebula_ckpt checkpoint under ``root`` (default ``<output_dir>/nebula``) as the path HF would
    have used (``<output_dir>/checkpoint-N``, which :class:`NebulaTrainer` resumes from), else HF's
    own answer (a real folder, or None).

    It names the newest checkpoint whose marker, manifest and shard sizes check out; its checksums
    are verified when it is loaded. ``resume_from_checkpoint=True`` also falls back past one that
    fails them.
    """
    from transformers.trainer_utils import get_last_checkpoint as hf_last

    where = root or os.path.join(output_dir, "nebula")
    tags: dict[str, int] = {}
    if "://" in where or os.path.isdir(where):
        with Checkpointer(where, storage_options=storage_options, read_only=True) as ck:
            tags = {t: s for t, s in ck.tags().items() if _is_checkpoint_tag(t)}
    if tags:
        return os.path.join(output_dir, max(tags, key=tags.__getitem__))
    return hf_last(output_dir) if os.path.isdir(output_dir) else None


# -- leaving nebula_ckpt: files the rest of the HF world reads ------------------------------------
@contextlib.contextmanager
def _opened(root: Union[str, Checkpointer], storage_options: Optional[dict[str, Any]]) -> Iterator[Checkpointer]:
    if isinstance(root, Checkpointer):
        yield root
        return
    with Checkpointer(root, storage_options=storage_options, read_only=True) as ck:  # a read writes nothing
        yield ck


def _read(root: Union[str, Checkpointer], step: Optional[int], tag: Optional[str],
          storage_options: Optional[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    with _opened(root, storage_options) as ck:
        if step is not None or tag is not None:
            n, tree = ck.read(step, tag=tag)
        else:
            n, tree = ck.read()
    if not isinstance(tree, dict) or "model" not in tree:
        raise ValidationError(f"step {n}: not a checkpoint of the Hugging Face integration (no 'model' key)")
    return n, tree


def _write_pretrained(tree: dict[str, Any], out_dir: str, config: Any, need_config: bool = True) -> None:
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    seen: dict[tuple[int, Any], torch.Tensor] = {}
    tensors: dict[str, torch.Tensor] = {}
    for k, v in tree["model"].items():
        if not isinstance(v, torch.Tensor):
            continue
        key = (v.untyped_storage().data_ptr(), v.storage_offset())
        # safetensors refuses shared memory: a tied weight is written under each name (as `nebula-ckpt export`)
        tensors[k] = v.detach().clone().contiguous() if key in seen else v.detach().contiguous()
        seen.setdefault(key, v)
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
        raise ValidationError("the checkpoint holds no model config (the model has no .config): pass config=")


def export_pretrained(root: Union[str, Checkpointer], out_dir: str, *, step: Optional[int] = None,
                      tag: Optional[str] = None, config: Any = None,
                      storage_options: Optional[dict[str, Any]] = None) -> int:
    """Write ``config.json`` and ``model.safetensors`` of a checkpoint into ``out_dir``, so that
    ``AutoModel*.from_pretrained(out_dir)`` loads it; return the step written.

    Args:
        root: the checkpoint root (or an open :class:`~nebula_ckpt.Checkpointer`, e.g. ``trainer.nebula``).
        step / tag: which checkpoint (at most one); default the newest healthy one.
        config: a ``PretrainedConfig`` (or its JSON text) to write instead of the one saved
            with the checkpoint.

    The whole checkpoint is read (verified) into host memory; for a model much larger than the
    host's memory, ``nebula-ckpt export ROOT --step N --to out/model.safetensors --key model``
    reads only the weights (and gathers a multi-rank checkpoint).
    """
    n, tree = _read(root, step, tag, storage_options)
    _write_pretrained(tree, out_dir, config)
    return n


def to_hf_checkpoint(root: Union[str, Checkpointer], out_dir: str, *, step: Optional[int] = None,
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
