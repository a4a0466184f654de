"""What the Hugging Face adapter's modules share: the transformers check, the checkpoint's keys,
HF's tag rule, and the one object holding a trainer's nebula_ckpt state (:class:`RunState`).

A trainer's state lives in a :class:`weakref.WeakKeyDictionary` keyed by the trainer (see
:func:`run_of`), never in attributes set on the ``Trainer`` object.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import weakref
from typing import Any, Optional

import nebula_ckpt as nc

try:
    import transformers
    from transformers import Trainer
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as _e:  # pragma: no cover - exercised only without transformers
    raise ImportError("nebula_ckpt.integrations.huggingface needs transformers: "
                      "pip install 'nebula_ckpt[huggingface]'") from _e

#: the ``Trainer`` methods this integration overrides or calls (private API: checked at import)
SEAMS = ("_save_checkpoint", "_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_scaler",
         "_load_rng_state", "_load_best_model", "_init_training_state", "_get_output_dir", "store_flos",
         "_prepare_for_training")
_missing = [m for m in SEAMS if not callable(getattr(Trainer, m, None))]
if _missing:  # pragma: no cover - another transformers generation
    raise ImportError(f"nebula_ckpt.integrations.huggingface needs transformers 5.x: the installed "
                      f"transformers {transformers.__version__} has no Trainer.{', Trainer.'.join(_missing)}")

#: The top-level keys of a checkpoint saved by this integration: ``model`` (the module: ``nebula-ckpt
#: export --key model``), ``optimizer``, ``scheduler``, ``scaler`` (when the trainer has one),
#: ``rng`` (HF's rng_state.pth layout), ``trainer_state`` (the text of trainer_state.json),
#: ``config`` (the model's config.json text, or None), ``hf`` (format version, transformers version).
#: Under DeepSpeed, ``deepspeed`` (the files ``engine.save_checkpoint`` writes, by relative path)
#: holds the model, optimizer and scheduler instead; under FSDP, ``fsdp`` (``{"model", "optimizer"}``:
#: each rank's shards as DTensors, by parameter name) holds the model and optimizer.
STATE_KEYS = ("model", "optimizer", "scheduler", "scaler", "rng", "trainer_state", "config", "hf", "deepspeed",
              "fsdp")
FORMAT = 1
TRAINER_STATE_NAME = "trainer_state.json"
#: retention on the persistent tiers is this integration's (``save_total_limit``, best kept):
#: the core's own ``keep_last`` is set out of the way unless the caller gives one
KEEP_ALL = 2**31 - 1
_CKPT_TAG = re.compile(r"^(?:.*/)?" + re.escape(PREFIX_CHECKPOINT_DIR) + r"-(\d+)$")


def is_checkpoint_tag(tag: str) -> bool:
    """Whether ``tag`` (read back from a checkpoint) names an HF checkpoint folder *inside* the
    output dir: ``checkpoint-N``, maybe below relative folders; never ``..``, ``.`` or absolute
    (it becomes ``<output_dir>/<tag>``, which ``train`` then opens)."""
    return bool(_CKPT_TAG.match(tag)) and not tag.startswith("/") \
        and not any(part in ("", ".", "..") for part in tag.split("/"))


def tag_for(step: int) -> str:
    """The tag of the checkpoint of ``step``: HF's folder name ``checkpoint-<step>``."""
    return f"{PREFIX_CHECKPOINT_DIR}-{step}"


@dataclasses.dataclass
class RunState:
    """Everything this integration keeps about one trainer.

    Attributes:
        root: the checkpoint root; ``options``: keyword arguments of the Checkpointer.
        ckpt: the Checkpointer (made at first use, closed at the end of ``train()``).
        committed: tag -> step of the HF checkpoints durable on the tiers (for the limit), checked
            against the tiers each time a save becomes durable (:func:`.saving.settle`).
        saved: tag -> this trainer's save number of each of its checkpoints (the order of
            ``save_total_limit``: after a re-run without resume, newer than an earlier run's
            higher steps); ``saves``: how many saves it made.
        inflight: handles of saves not yet over.
        resume: the tree being resumed from, while ``train()`` loads it.
        resume_best: the best checkpoint named by the resumed trainer state.
        told: one-time warnings already given.
        prepared: whether the staging memory was prepared.
        restored: ``{"step": N, "tier": name}`` of the last checkpoint resumed through nebula_ckpt.
        log_metrics: whether each save's metrics go to the trainer's loggers.
        losses: the losses of this step's ``training_step`` calls, reported at its end (health).
        folders: tag -> ``(folder, staged folder, handle)`` of the saves in flight whose
            ``checkpoint-N/`` folder waits, staged, until they are durable (:mod:`.folders`).
        folder_lock: held while a staged folder is written, put in place or removed (the thread
            watching a save and the training thread may both try); re-entrant, so that a
            ``close()`` from a signal handler on a thread holding it never waits for itself.
        metrics: each finished save's metrics, as logged (``NebulaTrainer.nebula_metrics``).
    """

    root: str
    options: dict[str, Any]
    ckpt: Optional[nc.Checkpointer] = None
    committed: dict[str, int] = dataclasses.field(default_factory=dict)
    saved: dict[str, int] = dataclasses.field(default_factory=dict)
    saves: int = 0
    inflight: list[nc.SaveHandle] = dataclasses.field(default_factory=list)
    resume: Optional[dict[str, Any]] = None
    resume_best: Optional[str] = None
    told: set[str] = dataclasses.field(default_factory=set)
    prepared: bool = False
    restored: Optional[dict[str, Any]] = None
    log_metrics: bool = True
    losses: list[Any] = dataclasses.field(default_factory=list)
    folders: dict[str, tuple[str, str, nc.SaveHandle]] = dataclasses.field(default_factory=dict)
    folder_lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)
    metrics: list[dict[str, float]] = dataclasses.field(default_factory=list)

    def once(self, what: str) -> bool:
        """True the first time ``what`` is asked about (a warning given once per trainer)."""
        if what in self.told:
            return False
        self.told.add(what)
        return True


_RUNS: "weakref.WeakKeyDictionary[Any, RunState]" = weakref.WeakKeyDictionary()


def attach(trainer: Any, run: RunState) -> None:
    """Make ``run`` the state of ``trainer``; an earlier one's open Checkpointer is closed first
    (its pending saves written)."""
    old = _RUNS.get(trainer)
    if old is not None and old.ckpt is not None and not old.ckpt.closed:
        old.ckpt.close()
    _RUNS[trainer] = run


def run_of(trainer: Any) -> RunState:
    """The :class:`RunState` of a trainer switched to nebula_ckpt."""
    try:
        return _RUNS[trainer]
    except KeyError:
        raise nc.NebulaError(f"{type(trainer).__name__} was not set up by nebula_ckpt: build it as NebulaTrainer(...) "
                             "or pass it to nebula_ckpt.integrations.huggingface.enable()") from None
