"""Hugging Face ``Trainer`` checkpoints through nebula_ckpt's tiers, and ``resume_from_checkpoint`` from them.

One line switches it on, for a new trainer or for one that already exists (any ``Trainer``
subclass: TRL's ``SFTTrainer``, your own)::

    from nebula_ckpt.integrations.huggingface import NebulaTrainer, enable

    trainer = NebulaTrainer(model=model, args=args, train_dataset=ds)    # instead of Trainer(...)
    trainer = enable(SFTTrainer(model=model, args=args, ...))            # or: any existing trainer

    trainer.train(resume_from_checkpoint=True)   # a first run starts fresh; after a crash: the newest healthy one
    trainer.train(resume_from_checkpoint="checkpoint-400")   # or a tag, a step, or HF's folder path

What happens:

* **Saves don't block for a ``torch.save``.** Where ``Trainer`` would write ``checkpoint-N/``,
  one :meth:`~nebula_ckpt.Checkpointer.save_async` takes the model, optimizer, scheduler, grad
  scaler, RNG states and trainer state as one checkpoint of step ``global_step``, tagged
  ``checkpoint-N``. The training thread pays for the copy into host memory only; the memory tier
  (``/dev/shm``) and the persistent root (default ``<output_dir>/nebula``; any path, ``az://`` /
  ``s3://`` URL or explicit ``tiers``) are written in the background.
* **Each save's metrics go to the trainer's loggers** once it is over (every ``report_to``
  logger, and ``trainer.nebula_metrics``; not ``state.log_history``, which HF saves in every
  checkpoint and compares across a resume): ``nebula/step``, ``nebula/bytes``, ``nebula/blocked_s``,
  ``nebula/snapshot_s``, ``nebula/durable_s/<tier>``, ``nebula/throughput_MBps/<tier>``
  (``nebula_log_metrics=False`` turns it off).
* **HF's checkpoint folders**: each checkpoint also gets ``<output_dir>/checkpoint-N/`` with
  ``trainer_state.json``, ``config.json`` and a pointer to it (:mod:`.folders`), once it is
  durable (at the latest when ``trainer.nebula.wait()`` returns; after a crash in between, when
  the root is next opened on that output dir), so ``resume_from_checkpoint=<folder>``,
  ``get_last_checkpoint`` and scripts that look for the folders work; no weight or optimizer file
  is written there.
* **No save is dropped**: a save waits for the previous one to be durable on every tier, so a
  busy disk tier never skips a checkpoint the trainer may ask for again (the best, the last, a
  ``save_total_limit`` survivor).
* **Resume** with ``resume_from_checkpoint=True`` restores the newest healthy checkpoint from the
  fastest tier that has it (a damaged one is skipped for the next older one); with no checkpoint
  at all it starts fresh (an INFO log), so one script both starts and resumes a run. A tag, HF's
  path ``<output_dir>/checkpoint-400`` or a step names one. A real ``checkpoint-N/`` folder still
  resumes the stock way.
* **DeepSpeed** (ZeRO 0-3): the engine's own files (model states, each rank's ZeRO partition)
  are kept as parts of the same checkpoint, no ``torch.save``; resume hands them back to
  ``engine.load_checkpoint``. These checkpoints are written with pickle allowed (DeepSpeed's
  states hold Python objects).
* **FSDP** (torch FSDP2 through accelerate): each rank saves its shards of model and optimizer
  (``get_state_dict``: DTensors) in the same checkpoint; resume loads them into the wrapped model
  with ``set_state_dict`` (:mod:`.fsdp`). FSDP on XLA and SageMaker model parallelism are refused
  with a clear error.
* **PEFT / LoRA models** save the whole model state (the frozen base too) and resume exactly.
* **``save_total_limit``** is HF's, applied with :meth:`~nebula_ckpt.Checkpointer.remove` on every
  tier (the best checkpoint kept), once a newer checkpoint is durable; exact when ``train()`` returns.
* **Exact resume**: RNG states in HF's ``rng_state.pth`` layout (no pickle), the trainer state as
  ``trainer_state.json`` holds it: a run SIGKILLed and resumed gives the same losses, bit for bit.
* **Weights for ``from_pretrained``**: :func:`export_pretrained` writes ``config.json`` and
  ``model.safetensors`` of the best checkpoint (``load_best_model_at_end``) or the newest, tied
  weights once; :func:`to_hf_checkpoint` writes the stock ``checkpoint-N/`` folder.

Why a ``Trainer`` subclass: a ``TrainerCallback`` runs before the step's evaluation, never sees
the grad scaler, and cannot intercept ``train(resume_from_checkpoint=...)``, which HF resolves and
reads before any callback runs; rebuilding a ``checkpoint-N/`` folder at resume would cost a
``torch.save`` and ``torch.load`` of everything. The mixin overrides the private seams ``Trainer``
itself uses (checked at import: transformers 5.x, tested with 5.23.0).

Limits: hyperparameter search saves the stock way; checkpoints are not pushed to the Hub at save
time; the tokenizer is not part of the checkpoint. Multi-rank (``torchrun`` + DDP, DeepSpeed or FSDP):
every rank saves and restores its own part of one multi-rank checkpoint.
"""

from __future__ import annotations

from nebula_ckpt.integrations.huggingface.common import STATE_KEYS
from nebula_ckpt.integrations.huggingface.export import export_pretrained, get_last_checkpoint, to_hf_checkpoint
from nebula_ckpt.integrations.huggingface.mixin import NebulaCheckpointMixin, NebulaTrainer, enable

__all__ = ["NebulaTrainer", "NebulaCheckpointMixin", "enable", "get_last_checkpoint", "export_pretrained",
           "to_hf_checkpoint", "STATE_KEYS"]
