"""Multi-rank checkpoints with nebula_ckpt: a DDP job launched with torchrun.

    torchrun --nproc_per_node 2 examples/torchrun_ddp.py --root /tmp/ckpt/ddp-run --steps 200

Every rank runs the same code: ``Checkpointer(root)`` finds the process group by itself. Each
rank snapshots its state, writes its share in parallel (replicated DDP state is written once,
spread over the ranks), and rank 0 commits the checkpoint once every rank's share is durable.
Run it again (or after a crash) and it resumes from the newest step every rank can restore:
each rank's memory tier (/dev/shm) if the processes died, else the shared root.
"""

from __future__ import annotations

import argparse
import logging

import torch
import torch.distributed as dist

import nebula_ckpt as nc


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True, help="checkpoint root seen by every rank (shared FS or blob URL)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=20, help="save every N steps")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    dist.init_process_group("gloo")  # "nccl" on GPUs: the checkpoint protocol still runs on gloo
    rank = dist.get_rank()

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optim": opt, "step": 0}

    with nc.Checkpointer(args.root) as ckpt:
        start = ckpt.load_latest(into=state)           # the same step on every rank, or None
        first = 0 if start is None else start + 1
        if rank == 0:
            print(f"rank 0: {'fresh start' if start is None else f'resumed from step {start}'} "
                  f"({ckpt.last_restore})", flush=True)
        g = torch.Generator().manual_seed(rank)
        for step in range(first, args.steps):
            x = torch.randn(32, 64, generator=g)
            loss = (model(x) - x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % args.every == 0 or step == args.steps - 1:
                state["step"] = step
                ckpt.save_async(step, state)             # returns after the snapshot
        # leaving the block waits until every save is committed (or raises its failure)
    if rank == 0:
        print(f"rank 0: done at step {args.steps - 1}, loss {loss.item():.5f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
