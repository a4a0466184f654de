"""DeepSpeed training whose ``save_checkpoint`` / ``load_checkpoint`` go through nebula_ckpt.

    python examples/deepspeed_train.py --save-dir /tmp/ds/ckpt --root /tmp/ds/nebula --steps 30
    python examples/deepspeed_train.py --save-dir /tmp/ds/ckpt --root /tmp/ds/nebula --steps 50   # resumes
    python examples/deepspeed_train.py ... --steps 50 --crash-at 45     # SIGKILL itself; run again: resumes at 40
    torchrun --nproc_per_node 2 examples/deepspeed_train.py ... --zero 2   # two ranks (gloo on a CPU)

One line switches it on, after ``deepspeed.initialize``: ``enable(engine, root)``. DeepSpeed
keeps its own folder layout (``<save-dir>/<tag>/...`` and ``<save-dir>/latest``), where each file
is now a small pointer; the bytes live in nebula_ckpt's tiers (``/dev/shm``, then ``--root``),
and a restart restores from the fastest healthy copy. On a machine without CUDA it runs on
DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``, gloo) in a few seconds.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402

from nebula_ckpt.integrations.deepspeed import enable  # noqa: E402


def launched_alone() -> None:
    """Started with plain ``python``: describe a one-rank job as a launcher would (env://)."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                      LOCAL_WORLD_SIZE="1")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--save-dir", required=True, help="DeepSpeed's checkpoint folder (tags, `latest`)")
    p.add_argument("--root", required=True, help="nebula_ckpt root: path or az:// / s3:// URL (not --save-dir)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=10, help="save_checkpoint every N steps")
    p.add_argument("--zero", type=int, default=1, choices=[0, 1, 2], help="ZeRO stage")
    p.add_argument("--crash-at", type=int, default=-1, help="SIGKILL this process after that step")
    args = p.parse_args()

    launched_alone()
    if not torch.cuda.is_available():
        # A CPU job needs none of DeepSpeed's compiled ops; without this, DeepSpeed probes the compiler
        # and JIT-builds its shared-memory collective first (a minute or more).
        deepspeed.ops.__compatible_ops__ = {}  # type: ignore[attr-defined]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # DeepSpeed's fused Adam needs CUDA
    config = {"train_micro_batch_size_per_gpu": 16, "gradient_clipping": 1.0, "steps_per_print": 10**9,
              "zero_optimization": {"stage": args.zero},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 10}}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    ckpt = enable(engine, args.root)  # the one nebula_ckpt line

    rank = engine.global_rank
    path, client = engine.load_checkpoint(args.save_dir)  # the tag `latest` names; (None, None) if none
    if path is None:
        print(f"rank {rank}: fresh start", flush=True)
    else:
        torch.set_rng_state(client["rng"])  # dropout goes on where it stopped
        print(f"rank {rank}: resumed from step {engine.global_steps} ({ckpt.checkpointer.last_restore['tier']})",
              flush=True)

    g = torch.Generator().manual_seed(1 + rank)
    while engine.global_steps < args.steps:
        step = engine.global_steps + 1
        g.manual_seed(1000 * step + rank)  # the batch of a step does not depend on where a run started
        x = torch.randn(16, 64, generator=g)
        loss = (engine(x) - x).square().mean()
        engine.backward(loss)
        engine.step()
        if step % args.every == 0 or step == args.steps:
            engine.save_checkpoint(args.save_dir, client_state={"rng": torch.get_rng_state()})
            print(f"rank {rank}: step {step} loss {loss.item():.5f} saved", flush=True)
        if step == args.crash_at:
            print(f"rank {rank}: SIGKILL after step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()  # waits for the persists to the slower tiers
    print(f"rank {rank}: done at step {engine.global_steps}", flush=True)


if __name__ == "__main__":
    main()
