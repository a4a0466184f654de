"""Hugging Face ``Trainer`` checkpointing through nebula_ckpt: save, crash, resume, export.

    python examples/hf_trainer.py --out /tmp/hf-run                 # all of it, in seconds on a CPU
    python examples/hf_trainer.py --out /tmp/hf-run --kill-at 25    # SIGKILL itself at step 25 ...
    python examples/hf_trainer.py --out /tmp/hf-run --resume        # ... and resume in a new process

The one line that matters is ``NebulaTrainer(...)`` instead of ``Trainer(...)`` (or
``enable(trainer)`` for a trainer you already have): checkpoints at ``save_steps`` are taken by
``save_async`` (the training thread pays for a copy into host memory, not for a ``torch.save``),
written to the memory tier (``/dev/shm``) and ``<out>/nebula`` in the background, and
``train(resume_from_checkpoint=True)`` restores the newest healthy one from the fastest tier.
``save_total_limit`` is honoured on every tier. ``export_pretrained`` writes ``config.json`` and
``model.safetensors`` for ``from_pretrained``.

The model is a 2-layer GPT-2 built from a config (nothing is downloaded); the data is random tokens.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments, set_seed

from nebula_ckpt.integrations.huggingface import NebulaTrainer, export_pretrained

MAX_STEPS, SAVE_STEPS = 30, 10


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, seq: int = 32, vocab: int = 128) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Timer(TrainerCallback):
    """Prints how long each checkpoint held up training (the time inside ``_save_checkpoint``)."""

    def __init__(self, trainer_ref: dict[str, Any]) -> None:
        self.ref = trainer_ref

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        t = self.ref.get("t0")
        if t is not None:
            print(f"  step {state.global_step}: checkpoint-{state.global_step} saved, training held up "
                  f"{(time.perf_counter() - t) * 1e3:.1f} ms (written in the background)")


class KillAt(TrainerCallback):
    def __init__(self, step: int, trainer_ref: dict[str, Any]) -> None:
        self.step, self.ref = step, trainer_ref

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.step:
            self.ref["trainer"].nebula.wait()   # so that the demo's last save is surely committed
            print(f"  step {state.global_step}: SIGKILL (committed: {self.ref['trainer'].nebula.list()})", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


class StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.step:
            control.should_training_stop = True   # an interruption, as far as checkpoints go


def make_trainer(out: str, callbacks: list[Any]) -> NebulaTrainer:
    set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32,
                                           bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(output_dir=out, max_steps=MAX_STEPS, per_device_train_batch_size=8, learning_rate=1e-3,
                             logging_steps=5, save_strategy="steps", save_steps=SAVE_STEPS, save_total_limit=2,
                             report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
    ref: dict[str, Any] = {}
    trainer = NebulaTrainer(model=model, args=args, train_dataset=RandomTokens(), callbacks=callbacks)
    # time each save from the moment HF decides to save (a thin wrapper, for the printout only)
    save = trainer._save_checkpoint

    def timed(*a: Any, **k: Any) -> None:
        ref["t0"] = time.perf_counter()
        save(*a, **k)

    trainer._save_checkpoint = timed
    trainer.add_callback(Timer(ref))
    ref["trainer"] = trainer
    for cb in callbacks:
        if hasattr(cb, "ref"):
            cb.ref["trainer"] = trainer
    return trainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="output_dir (default: a new temporary folder)")
    p.add_argument("--kill-at", type=int, default=None, help="SIGKILL this process at the end of that step")
    p.add_argument("--resume", action="store_true", help="only resume (after --kill-at)")
    a = p.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    if a.out is None:
        if a.resume:
            p.error("--resume needs the --out of the interrupted run")
        a.out = tempfile.mkdtemp(prefix="nebula-hf-example-")
    elif not a.resume and os.path.isdir(a.out) and os.listdir(a.out):
        p.error(f"--out {a.out} is not empty: a fresh run needs a fresh folder (or pass --resume)")

    if not a.resume:
        stop = KillAt(a.kill_at, {}) if a.kill_at else StopAt(25)
        print(f"train to step {MAX_STEPS}, checkpoint every {SAVE_STEPS}; interrupted at step "
              f"{a.kill_at or 25}{' (SIGKILL)' if a.kill_at else ''}")
        make_trainer(a.out, [stop]).train()

    print("resume: train(resume_from_checkpoint=True)")
    trainer = make_trainer(a.out, [])
    trainer.train(resume_from_checkpoint=True)
    print(f"  restored {trainer.nebula_restored}; now at step {trainer.state.global_step}")

    folder = os.path.join(a.out, "pretrained")
    step = export_pretrained(os.path.join(a.out, "nebula"), folder)
    x = RandomTokens(2).ids
    with torch.no_grad():
        same = torch.equal(GPT2LMHeadModel.from_pretrained(folder).eval()(x).logits, trainer.model.eval()(x).logits)
    print(f"export_pretrained: step {step} -> {folder} (config.json, model.safetensors); "
          f"from_pretrained gives the trained model's logits: {same}")
    print(f"checkpoints kept (save_total_limit=2): nebula-ckpt ls {os.path.join(a.out, 'nebula')}")


if __name__ == "__main__":
    main()
