"""A tiny, deterministic Hugging Face ``Trainer`` run (GPT-2 of 2 layers, 32 wide, an in-memory
dataset), used in-process by the tests and as a subprocess by the crash test.

``python hf_worker.py OUT ROOT RESULT [--kill-at K] [--resume] [--stock] [--deepspeed STAGE] [--peft]``:
train, checkpointing every ``SAVE_STEPS`` through nebula_ckpt (``--stock``: HF's own folders), writing to RESULT (JSON)
the loss of every step as ``float.hex`` and what was restored. ``--kill-at K``: at the end of step K,
wait until every save so far is durable, write RESULT, then SIGKILL this process. ``--resume``:
``train(resume_from_checkpoint=True)``. Launched as a rank of a multi-rank job (``WORLD_SIZE`` > 1,
env:// as torchrun sets it), HF trains with DDP on gloo and each rank writes ``RESULT.r<rank>``; the
ranks meet in a barrier before the kill, so both die with checkpoint-K committed. ``--deepspeed
STAGE``: HF's DeepSpeed integration with ZeRO stage STAGE on the CPU (``DS_ACCELERATOR=cpu``, one
gloo rank unless launched as several). ``--peft``: the model is a LoRA adapter (peft) over the GPT-2.
``--record-saves``: after each save, wait until it is durable and record its metrics
(``Checkpointer.stats()``'s ``last_save``) under ``saves`` in RESULT. ``--kill-on-save``: the kill
of ``--kill-at K`` comes right after the save of step K instead (its ``on_save``, once
``trainer.nebula.wait()`` returned: the pattern of ``examples/hf_trainer.py``). ``--lose-folders``:
no ``checkpoint-N/`` folder is ever put in place (as if each time the process died between the
commit and the folder). ``--save-total-limit N``: HF's ``save_total_limit``.
``--fsdp``: FSDP2 through accelerate (each GPT-2 block and the root ``fully_shard``-ed) on the
GPUs, one per rank: accelerate turns FSDP on only for accelerator devices.

Deterministic on purpose: one intra-op thread, seeded model, data order (``data_seed``) and
dropout (kept on: the restored RNG states must reproduce it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any, Optional

import torch

MAX_STEPS = 16
SAVE_STEPS = 5
SEED = 7
VOCAB, SEQ, N = 64, 16, 32


class TinyData(torch.utils.data.Dataset):
    """``N`` random token sequences; labels = inputs (causal LM)."""

    def __init__(self, n: int = N, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_model(seed: int = SEED) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel, set_seed

    set_seed(seed)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0,
                     eos_token_id=0)  # dropout stays at GPT-2's 0.1
    return GPT2LMHeadModel(cfg)


def make_peft_model(seed: int = SEED) -> Any:
    """The tiny GPT-2 with a LoRA adapter on its attention (peft): only the adapter trains."""
    from peft import LoraConfig, get_peft_model

    model = make_model(seed)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["c_attn"],
                                            fan_in_fan_out=True, task_type="CAUSAL_LM"))


def deepspeed_config(stage: int) -> dict[str, Any]:
    """A DeepSpeed config for HF's integration ("auto" values come from TrainingArguments)."""
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}


def deepspeed_on_cpu() -> None:
    """What DeepSpeed needs to run on the CPU without building ops: the CPU accelerator, a rank's
    env:// variables (rank 0 of 1 unless a launcher set them), and no op-compatibility probe (it
    JIT-builds a shared-memory collective: over a minute on 2 cores, useless to one rank)."""
    import socket

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for k, v in dict(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1").items():
        os.environ.setdefault(k, v)
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__ = {}  # type: ignore[attr-defined]


def make_trainer(out: str, root: Optional[str] = None, *, stock: bool = False, max_steps: int = MAX_STEPS,
                 save_steps: int = SAVE_STEPS, callbacks: tuple = (), eval_dataset: Any = None,
                 nebula_options: Optional[dict[str, Any]] = None, trainer_cls: Any = None, peft: bool = False,
                 **args_kw: Any) -> Any:
    """A Trainer over the tiny model and data: ``NebulaTrainer`` (checkpoints in ``root``), or
    ``trainer_cls`` / stock ``Trainer`` with ``stock``."""
    from transformers import Trainer, TrainingArguments

    torch.set_num_threads(1)
    kw: dict[str, Any] = dict(output_dir=out, max_steps=max_steps, per_device_train_batch_size=4, learning_rate=3e-3,
                              warmup_steps=2, weight_decay=0.01, logging_steps=1, save_strategy="steps",
                              save_steps=save_steps, report_to=[], seed=SEED, data_seed=SEED, use_cpu=True,
                              dataloader_num_workers=0, disable_tqdm=True)
    kw.update(args_kw)
    args = TrainingArguments(**kw)
    model = make_peft_model() if peft else make_model()
    common = dict(model=model, args=args, train_dataset=TinyData(), eval_dataset=eval_dataset,
                  callbacks=list(callbacks))
    if stock or trainer_cls is not None:
        return (trainer_cls or Trainer)(**common)
    from nebula_ckpt.integrations.huggingface import NebulaTrainer

    return NebulaTrainer(**common, nebula_root=root, nebula_options=nebula_options)


def loss_recorder() -> tuple[Any, dict[int, str]]:
    """A callback recording each logged step's loss as ``float.hex``, and the dict it fills."""
    from transformers import TrainerCallback

    losses: dict[int, str] = {}

    class Record(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Optional[dict] = None, **kw: Any) -> None:
            if logs and "loss" in logs:
                losses[state.global_step] = float(logs["loss"]).hex()

    return Record(), losses


def digest(obj: Any) -> str:
    """SHA-256 of every tensor (bytes, dtype, shape) and scalar in a state tree, in key order."""
    import hashlib

    h = hashlib.sha256()

    def walk(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            # a DTensor (FSDP) whole: a collective, which every rank reaches in the same key order
            t = (o.full_tensor() if hasattr(o, "full_tensor") else o).detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(o, dict):
            for k in sorted(o, key=str):
                h.update(str(k).encode())
                walk(o[k])
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)
        else:
            h.update(repr(o).encode())

    walk(obj)
    return h.hexdigest()


def main(argv: Optional[list[str]] = None) -> int:
    from transformers import TrainerCallback

    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("root")
    p.add_argument("result")
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--stock", action="store_true")
    p.add_argument("--deepspeed", type=int, default=None)
    p.add_argument("--peft", action="store_true")
    p.add_argument("--record-saves", action="store_true")
    p.add_argument("--fsdp", action="store_true")
    p.add_argument("--kill-on-save", action="store_true")
    p.add_argument("--lose-folders", action="store_true")
    p.add_argument("--save-total-limit", type=int, default=None)
    a = p.parse_args(argv)
    kw: dict[str, Any] = {"peft": a.peft, "save_total_limit": a.save_total_limit}
    if a.lose_folders:
        from nebula_ckpt.integrations.huggingface import folders

        folders.promote = lambda staged, folder: True  # type: ignore[assignment]  # staged, never in place
    if a.fsdp:
        kw.update(fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]},
                  use_cpu=False)
    if a.deepspeed is not None:
        deepspeed_on_cpu()
        kw["deepspeed"] = deepspeed_config(a.deepspeed)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        a.result = f"{a.result}.r{os.environ['RANK']}"
    record, losses = loss_recorder()
    holder: dict[str, Any] = {}
    saves: list[dict[str, Any]] = []

    def write(**extra: Any) -> None:
        with open(a.result + ".tmp", "w") as f:
            json.dump({"losses": losses, "saves": saves, **extra}, f)
        os.replace(a.result + ".tmp", a.result)

    class Kill(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if not a.kill_on_save:
                self.kill(state)

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if a.kill_on_save:
                self.kill(state)

        def kill(self, state: Any) -> None:
            if state.global_step == a.kill_at:
                tr = holder["trainer"]
                if not a.stock:
                    tr.nebula.wait()  # at least one checkpoint committed before the kill
                if torch.distributed.is_available() and torch.distributed.is_initialized():
                    torch.distributed.barrier()  # every rank is here: none dies while another commits
                write(killed_at=state.global_step, committed=[] if a.stock else tr.nebula.list())
                os.kill(os.getpid(), signal.SIGKILL)

    class RecordSaves(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            holder["trainer"].nebula.wait()
            saves.append(holder["trainer"].nebula.stats()["last_save"])

    extra = (RecordSaves(),) if a.record_saves else ()
    tr = make_trainer(a.out, a.root, stock=a.stock, callbacks=(record, Kill(), *extra), **kw)
    holder["trainer"] = tr
    tr.train(resume_from_checkpoint=True if a.resume else None)
    restored = None if a.stock else tr.nebula_restored
    model = {k: v for k, v in tr.model.state_dict().items() if not a.peft or "lora_" in k}
    write(restored=restored, final_step=tr.state.global_step, model=digest(model),
          optimizer=digest(tr.optimizer.state_dict()), rng=digest(torch.random.get_rng_state()))
    return 0


if __name__ == "__main__":
    code = main()
    # No interpreter teardown after a gloo / FSDP2 run: torch's gloo worker threads may still free
    # the last collective's tensors then and abort the process (see tests/dist/launch.py `leave`).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
