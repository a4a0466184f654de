"""Saving a Hugging Face ``Trainer``'s checkpoint through nebula_ckpt: the state one checkpoint
holds, the save itself, ``save_total_limit`` over the committed checkpoints, and each save's
metrics reported into the trainer's logs.

Every function takes the trainer; its nebula_ckpt state is :func:`~.common.run_of` (trainer).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import weakref
from typing import Any, Optional

import transformers
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import SaveStrategy
from transformers.training_args import ParallelMode

import nebula_ckpt as nc
from nebula_ckpt.integrations.huggingface import folders
from nebula_ckpt.integrations.huggingface.common import (
    FORMAT,
    KEEP_ALL,
    RunState,
    is_checkpoint_tag,
    run_of,
    tag_for,
)
from nebula_ckpt.integrations.huggingface.engines import engine_of, save_deepspeed
from nebula_ckpt.integrations.huggingface.fsdp import KEY as FSDP_KEY
from nebula_ckpt.integrations.huggingface.fsdp import sharded_state
from nebula_ckpt.integrations.huggingface.rng import rng_states

log = logging.getLogger("nebula_ckpt")


class TrainerCheckpointer(nc.Checkpointer):
    """The trainer's :class:`~nebula_ckpt.Checkpointer` (``trainer.nebula``): once :meth:`wait`
    returns (and so ``close()``), the ``checkpoint-N/`` folder of every save it waited for is in
    place, as the stock ``Trainer``'s folder is once its save returns (a callback may wait, then
    kill the process)."""

    def __init__(self, root: str, run: RunState, **options: Any) -> None:
        super().__init__(root, **options)
        self._run = weakref.ref(run)

    def wait(self, timeout: Optional[float] = None) -> None:
        """:meth:`nebula_ckpt.Checkpointer.wait`, then the folders of the saves that are over."""
        super().wait(timeout)
        run = self._run()
        if run is not None:
            folders.finish_done(run)


def checkpointer(trainer: Any) -> nc.Checkpointer:
    """The trainer's :class:`~nebula_ckpt.Checkpointer`, made (again) when there is none open; a
    new one first puts in place the folders of committed checkpoints a crash left staged
    (:func:`.folders.rebuild`)."""
    run = run_of(trainer)
    if run.ckpt is None or run.ckpt.closed:
        opts = dict(run.options)
        opts.setdefault("keep_last", KEEP_ALL)
        if engine_of(trainer) == "DeepSpeed":
            # DeepSpeed's states hold Python objects (its LossScaler, ZeRO's fragment addresses) that
            # typed values cannot: its own files are pickles too. Tensors are never pickled.
            opts.setdefault("allow_pickle", True)
        run.ckpt = TrainerCheckpointer(run.root, run, **opts)
        run.prepared = False
        run.committed = {t: s for t, s in run.ckpt.tags().items() if is_checkpoint_tag(t)}
        run.inflight = []
        _rebuild_folders(trainer)
    return run.ckpt


def _rebuild_folders(trainer: Any) -> None:
    """The folders of the committed checkpoints whose process ended before it put them in place;
    the staged folders of the others removed (nothing is in flight: the Checkpointer is new), and
    the folders of checkpoints no tier holds any more (deleted while no trainer watched)."""
    run = run_of(trainer)
    with run.folder_lock:
        run.folders.clear()  # a closed Checkpointer's saves: what they staged is judged from the tiers
        if not trainer.args.should_save or run.ckpt is None:
            return
        out = trainer._get_output_dir(trial=None)
        try:
            folders.rebuild(out, run.root, run.committed)
            for gone in folders.drop_gone(out, run.root, set(run.ckpt.list())):
                log.info("nebula_ckpt: removed %s: no tier of %s holds its checkpoint any more", gone, run.root)
        except OSError as e:  # the tags still resume; the folders are tried again at the next open
            log.warning("nebula_ckpt: could not put the checkpoint folders of %s in place: %s", run.root, e)


def tag_of_path(trainer: Any, path: Optional[str]) -> Optional[str]:
    """The tag of a checkpoint named the way HF names folders (``<output_dir>/checkpoint-N``,
    ``checkpoint-N``); None when ``path`` is None."""
    if path is None:
        return None
    out = os.path.abspath(trainer.args.output_dir)
    p = os.path.abspath(path)
    if p.startswith(out + os.sep):
        return os.path.relpath(p, out).replace(os.sep, "/")
    return path.replace(os.sep, "/").strip("/")


def metrics_logs(m: nc.SaveMetrics) -> dict[str, float]:
    """One save's :class:`~nebula_ckpt.SaveMetrics` as the flat numbers ``Trainer.log`` takes
    (``nebula/...`` keys: seconds, bytes, MB/s per tier)."""
    logs: dict[str, float] = {"nebula/step": float(m.step), "nebula/bytes": float(m.bytes)}
    if m.blocked_s is not None:
        logs["nebula/blocked_s"] = m.blocked_s
    if m.snapshot_s is not None:
        logs["nebula/snapshot_s"] = m.snapshot_s
    for tier, name in _short_names(list(m.durable_s)).items():
        logs[f"nebula/durable_s/{name}"] = m.durable_s[tier]
        rate = m.throughput(tier)
        if rate is not None:
            logs[f"nebula/throughput_MBps/{name}"] = rate / 1e6
    if m.failed:
        logs["nebula/failed_tiers"] = float(len(m.failed))
    return logs


def _short_names(tiers: list[str]) -> dict[str, str]:
    """Tier name -> its kind (``memory``, ``local``, ``remote``), numbered when a kind repeats
    (``local``, ``local_2``): the full names hold paths, too long for a logger's keys."""
    out: dict[str, str] = {}
    seen: dict[str, int] = {}
    for t in tiers:
        kind = t.split(":", 1)[0]
        seen[kind] = seen.get(kind, 0) + 1
        out[t] = kind if seen[kind] == 1 else f"{kind}_{seen[kind]}"
    return out


def settle(trainer: Any) -> None:
    """Count the saves that are now over: durable ones become committed checkpoints with their
    ``checkpoint-N/`` folder in place (failed ones do not: the core raises their error from the
    next save / wait), and each one's metrics go to the trainer's loggers. Once one is durable,
    the committed checkpoints are checked against the tiers (:func:`_forget_gone`)."""
    run = run_of(trainer)
    left = []
    durable = False
    for h in run.inflight:
        if not h.done():
            left.append(h)
            continue
        folders.finish(run, h)  # (a no-op when the watching thread or a wait() did it)
        if folders.is_durable(h) and h.tag:
            run.committed[h.tag] = h.step
            durable = True
        if h.skipped is not None or h.tiers_dropped:  # never silent: the framework may ask for it again
            log.warning("nebula_ckpt: %s (step %d) was not written to %s: %s", h.tag, h.step,
                        h.tiers_dropped or "any tier", h.skipped or "a newer save came first")
        if run.log_metrics and h.skipped is None:
            _log(trainer, metrics_logs(h.metrics))
    run.inflight = left
    if durable:
        _forget_gone(trainer)


def _forget_gone(trainer: Any) -> None:
    """Forget the committed checkpoints no tier holds any more, and remove their folders: the core
    deletes steps of its own accord (a save of a step already saved, as a re-run in the same
    output dir without resuming makes, deletes the later steps whose deltas refer to that step's
    old bytes; its own ``keep_last``). A folder then never names a checkpoint that is gone, and
    ``save_total_limit`` never keeps one in place of a real one. One listing of the tiers' commit
    markers per save that became durable (the saves in flight are not in ``committed``)."""
    run = run_of(trainer)
    if run.ckpt is None or run.ckpt.closed:
        return
    try:
        held = set(run.ckpt.list())
    except (OSError, nc.NebulaError) as e:  # checked again when the next save is durable
        log.warning("nebula_ckpt: could not list the checkpoints of %s: %s", run.root, e)
        return
    for tag in [t for t, s in run.committed.items() if s not in held]:
        del run.committed[tag]
        run.saved.pop(tag, None)
        log.info("nebula_ckpt: %s is on no tier of %s any more: its folder is removed", tag, run.root)
        if trainer.args.should_save:
            with run.folder_lock:
                folders.remove(os.path.join(trainer._get_output_dir(trial=None), tag))


def wait_previous(trainer: Any) -> None:
    """Wait until the saves in flight are over (durable, or failed: the next ``save_async`` raises
    the failure), so that a tier busy with one never drops it for the next: every checkpoint may
    be one the framework asks for again (the best model, a ``save_total_limit`` survivor, the last)."""
    for h in list(run_of(trainer).inflight):
        h.wait()
    settle(trainer)


def _log(trainer: Any, logs: dict[str, float]) -> None:
    """Hand one save's metrics to the ``report_to`` loggers (the callbacks' ``on_log``) and keep
    them in :attr:`RunState.metrics`. Not ``Trainer.log``: that appends to ``state.log_history``,
    which HF saves in each checkpoint and compares across a resume (timings differ from run to
    run), and it clears ``control.should_log``, which the training loop reads after the step."""
    run_of(trainer).metrics.append(dict(logs))
    wanted = trainer.control.should_log
    trainer.control = trainer.callback_handler.on_log(trainer.args, trainer.state, trainer.control, dict(logs))
    trainer.control.should_log = wanted


def rotate(trainer: Any, final: bool = False) -> None:
    """HF's ``rotate_checkpoints`` over the committed checkpoints (newest and best kept); with
    ``final``, also ``_finalize_training``'s rule (limit 1 and a best one: only the best stays).
    The checkpoint a restart resumes from is kept too (:func:`_resume_point`)."""
    run = run_of(trainer)
    limit = trainer.args.save_total_limit
    if limit is None or limit <= 0 or run.ckpt is None:
        return
    settle(trainer)
    # save order, as HF's mtime order: this trainer's saves (by save number) are newer than the
    # checkpoints it found (by step), so a re-run without resume keeps its own newest
    committed = sorted(run.committed.items(),
                       key=lambda kv: (1, run.saved[kv[0]]) if kv[0] in run.saved else (0, kv[1]))
    if len(committed) <= limit:
        return
    best = tag_of_path(trainer, trainer.state.best_model_checkpoint)
    protected = {committed[-1][0]}
    if best in run.committed:
        protected.add(best)
        if final and limit == 1:
            protected = {best}
    resume = _resume_point(trainer)
    if resume is None:
        return  # not known now: nothing is deleted (tried again at the next save)
    if resume and resume != committed[-1][0]:  # (the newest: kept, unless the final rule keeps only the best)
        protected.add(resume)
    keep = max(limit, len(protected))
    remaining = len(committed)
    for tag, _ in committed:
        if remaining <= keep:
            break
        if tag in protected:
            continue
        try:
            run.ckpt.remove(tag=tag)
            log.info("nebula_ckpt: removed %s (save_total_limit=%d)", tag, limit)
        except nc.NotFoundError:
            pass  # gone already (another process, or retention of an explicit tier)
        if trainer.args.should_save:
            folders.remove(os.path.join(trainer._get_output_dir(trial=None), tag))
        del run.committed[tag]
        run.saved.pop(tag, None)
        remaining -= 1


def _resume_point(trainer: Any) -> Optional[str]:
    """The tag of the checkpoint a restart resumes from (:meth:`~nebula_ckpt.Checkpointer.latest`:
    the newest not marked suspect), which ``save_total_limit`` never deletes: a run that keeps
    saving a diverged (suspect) state keeps the step before it, as the core's retention does
    (``docs/health.md``). ``""`` when it is none of the committed checkpoints; None (with a
    warning) when the tiers cannot be read now."""
    run = run_of(trainer)
    assert run.ckpt is not None
    try:
        got = run.ckpt.latest()
    except (OSError, nc.NebulaError) as e:
        log.warning("nebula_ckpt: save_total_limit: could not find the checkpoint a restart resumes from in "
                    "%s (%s): nothing is deleted now", run.root, e)
        return None
    if got is None or got[1] is None or run.committed.get(got[1]) != got[0]:
        return ""
    return got[1]


def build_state(trainer: Any) -> dict[str, Any]:
    """The state one checkpoint holds (see :data:`~.common.STATE_KEYS`): the live objects
    themselves, so that ``save_async`` copies their tensors once (and, on a GPU, overlaps the copy)."""
    args = trainer.args
    engine = engine_of(trainer)
    ds = engine == "DeepSpeed"
    state: dict[str, Any] = {}
    if ds:
        # the engine writes model, optimizer (its ZeRO partitions) and its own scheduler
        state["deepspeed"] = save_deepspeed(trainer, int(trainer.state.global_step))
    elif engine == "FSDP":
        # this rank's shards of model and optimizer, as DTensors (the optimizer's by parameter name)
        state[FSDP_KEY] = sharded_state(trainer.model_wrapped, None if args.save_only_model else trainer.optimizer)
    else:
        state["model"] = trainer.model
    if not args.save_only_model:
        if not ds and engine != "FSDP":
            state["optimizer"] = trainer.optimizer
        if not ds or not _is_ds_scheduler(trainer.lr_scheduler):
            state["scheduler"] = trainer.lr_scheduler
        scaler = getattr(trainer.accelerator, "scaler", None)
        if scaler is not None:
            state["scaler"] = scaler
        state["rng"] = rng_states(args.parallel_mode == ParallelMode.DISTRIBUTED)
    state["trainer_state"] = json.dumps(dataclasses.asdict(trainer.state), indent=2, sort_keys=True) + "\n"
    to_json = getattr(getattr(trainer.model, "config", None), "to_json_string", None)
    state["config"] = to_json() if callable(to_json) else None
    state["hf"] = {"format": FORMAT, "transformers": transformers.__version__, "world_size": int(args.world_size)}
    return state


def _is_ds_scheduler(scheduler: Any) -> bool:
    return type(scheduler).__name__ == "DeepSpeedSchedulerWrapper"


def prepare(trainer: Any) -> None:
    """After the first optimizer step (the optimizer's state exists): make the staging memory of
    the checkpoints in the background (:meth:`~nebula_ckpt.Checkpointer.prepare`), so the first
    save blocks no longer than the later ones."""
    run = run_of(trainer)
    run.prepared = True
    if trainer.args.save_strategy == SaveStrategy.NO or trainer.hp_search_backend is not None \
            or trainer.optimizer is None or engine_of(trainer) == "DeepSpeed":
        return  # (DeepSpeed: its parts exist only inside save_checkpoint)
    ck = checkpointer(trainer)
    run.prepared = True  # (a new Checkpointer starts unprepared)
    try:
        ck.prepare(build_state(trainer))
    except nc.NebulaError as e:  # the first save raises it, with the trainer's context
        log.debug("nebula_ckpt: prepare() failed: %s", e)


def _mark_best(trainer: Any, tag: str, run_dir: str) -> None:
    """As HF: the best checkpoint becomes ``state.best_model_checkpoint`` once it exists."""
    run = run_of(trainer)
    if trainer.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) \
            and trainer.state.best_global_step:
        best = tag_for(trainer.state.best_global_step)
        if best in run.committed or best == tag or any(h.tag == best for h in run.inflight):
            trainer.state.best_model_checkpoint = os.path.join(run_dir, best)


def save_checkpoint(trainer: Any, run_dir: str) -> nc.SaveHandle:
    """``Trainer._save_checkpoint`` (outside hyperparameter search) as one ``save_async``."""
    run = run_of(trainer)
    tag = tag_for(trainer.state.global_step)
    ck = checkpointer(trainer)
    wait_previous(trainer)
    _mark_best(trainer, tag, run_dir)
    # as HF, the stateful callbacks' state goes into the trainer state (on every rank: each
    # rank's checkpoint holds its own trainer state)
    for cb in [c for c in trainer.callback_handler.callbacks + [trainer.control] if isinstance(c, ExportableState)]:
        name = cb.__class__.__name__
        if isinstance(trainer.state.stateful_callbacks.get(name), list):
            trainer.state.stateful_callbacks[name].append(cb.state())
        else:
            trainer.state.stateful_callbacks[name] = cb.state()
    state = build_state(trainer)
    handle = ck.save_async(int(trainer.state.global_step), state, tag=tag)
    if "deepspeed" in state or FSDP_KEY in state:
        # DeepSpeed's parts and FSDP's state dicts are live tensors no hook guards: copied before training goes on
        handle.wait_snapshot()
    run.committed.pop(tag, None)  # replaced by this save (same step)
    run.saves += 1
    run.saved[tag] = run.saves
    run.inflight.append(handle)
    if trainer.args.should_save:  # its checkpoint-N/ folder, staged until the save is durable
        with run.folder_lock:
            staged = folders.stage(run_dir, run.root, tag, handle.step, state["trainer_state"], state["config"])
            run.folders[tag] = (os.path.join(run_dir, tag), staged, handle)
        folders.watch(run, handle)
    if trainer.args.push_to_hub and run.once("hub"):
        log.warning("nebula_ckpt: push_to_hub: checkpoints live in nebula_ckpt and are not pushed at save "
                    "time; trainer.push_to_hub() pushes the final model")
    rotate(trainer)
    return handle
