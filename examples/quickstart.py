"""Train, crash, resume bit-exact: model, optimizer, scheduler, every random stream and the data.

    python examples/quickstart.py                  # 3 epochs of 12 batches, a checkpoint every 4
    python examples/quickstart.py --crash-at 30    # dies with SIGKILL at step 30 ...
    python examples/quickstart.py                  # ... and this run resumes from step 28

The loader shuffles, loads in two worker processes and draws a random augmentation with
``np.random`` in ``__getitem__``; the model has dropout; the loop accumulates gradients over two
batches. Every loss the resumed run prints is the one a run that never crashed prints, to the
last bit.
"""
import argparse
import os
import random
import signal

import numpy as np
import torch

import nebula_ckpt as nc


class Noisy(torch.utils.data.Dataset):
    """96 samples; each load adds noise drawn from np.random (in the loader's worker processes)."""

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.linspace(-1.0, 1.0, 16) * (i % 7 - 3) + torch.from_numpy(np.random.normal(0, 0.1, 16)).float()
        return x, x.sum(0, keepdim=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="ckpt/quickstart")
    p.add_argument("--crash-at", type=int, default=-1)
    args = p.parse_args()

    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    loader = torch.utils.data.DataLoader(Noisy(), batch_size=8, shuffle=True, num_workers=2)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    loop = nc.LoopState(loader)                           # every random stream + where the loop is
    state = {"model": model, "optim": opt, "sched": sched, "loop": loop}

    with nc.Checkpointer(args.root) as ckpt:
        if ckpt.load_latest(into=state) is not None:      # None on a fresh start
            print(f"resumed at step {loop.step} (epoch {loop.epoch}, batch {loop.batch}) "
                  f"from {ckpt.last_restore['tier']}")
        for epoch in loop.epochs(3):                      # from the restored epoch on
            for x, y in loop:                             # this epoch's batches still to come
                loss = (model(x) * random.uniform(0.9, 1.1) - y).square().mean() / 2
                loss.backward()
                if loop.step % 2 == 0:                    # gradients accumulated over 2 batches
                    opt.step()
                    opt.zero_grad()
                    sched.step()
                print(f"step {loop.step} loss {loss.item()!r}")
                if loop.step == args.crash_at:            # a hard crash (no cleanup runs) once the
                    ckpt.wait()                           # saves so far are durable: a known resume point
                    os.kill(os.getpid(), signal.SIGKILL)
                if loop.step % 4 == 0:                    # last in the loop body, after the optimizer
                    ckpt.save_async(loop.step, state)


if __name__ == "__main__":
    main()
