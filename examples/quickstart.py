"""Train, crash, resume bit-exact: model, optimizer, scheduler, step and every RNG stream.

    python examples/quickstart.py                  # trains 60 steps, a checkpoint every 10
    python examples/quickstart.py --crash-at 35    # dies with SIGKILL at step 35 ...
    python examples/quickstart.py                  # ... and this run resumes from step 30

The resumed run ends with the same loss, to the last bit, as one that never crashed.
"""
import argparse
import os
import random
import signal

import numpy as np
import torch

import nebula_ckpt as nc

p = argparse.ArgumentParser()
p.add_argument("--root", default="ckpt/quickstart")
p.add_argument("--crash-at", type=int, default=-1)
args = p.parse_args()

torch.manual_seed(0)
random.seed(0)
np.random.seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)
state = {"model": model, "optim": opt, "sched": sched, "step": -1,
         "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}}

with nc.Checkpointer(args.root) as ckpt:
    if ckpt.load_latest(into=state) is not None:      # None on a fresh start
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
        print(f"resumed from step {state['step']} ({ckpt.last_restore['tier']})")
    for step in range(state["step"] + 1, 60):
        x = torch.randn(32, 16) * random.uniform(0.5, 2.0) + float(np.random.normal())
        loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step == args.crash_at:
            os.kill(os.getpid(), signal.SIGKILL)      # a hard crash: no cleanup runs
        if step % 10 == 0:
            state["step"] = step
            state["rng"] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                            "python": random.getstate()}
            ckpt.save_async(step, state)
print(f"final loss {loss.item()!r}")
