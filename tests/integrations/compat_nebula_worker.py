"""Worker of tests/integrations/test_compat_nebula.py: a Nebula-style training script, killed and resumed.

``train ROOT``: commits ``global_step1..3`` (model + optimizer, two parts each) with Nebula's API,
prints ``COMMITTED <tag> <digest>`` once each is durable, then waits to be SIGKILLed. With
``persistent_time_interval=3600`` only the first reaches the disk: the others live in the memory
tier, which must survive the kill.
``resume ROOT``: a new process resumes from ``get_latest_checkpoint()`` and prints
``RESUMED <tag> <step> <tier> <digest>``, trains one more step and commits it, then shuts down.
``train-kill ROOT``: ``train``, then SIGKILL itself once the commits are durable.

As a rank of a multi-rank job (``WORLD_SIZE`` > 1, env:// as torchrun sets it) every rank does
the same on gloo, on data of its own (so each rank's state differs, as with sharded optimizers);
``train-kill`` ranks meet in a barrier before they die.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time

import torch

import nebula_ckpt.compat.torch_nebula as tn


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step + 1000 * rank))
    (model(x) - x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for k, t in model.state_dict().items():
        h.update(k.encode() + t.contiguous().view(torch.uint8).numpy().tobytes())
    sd = opt.state_dict()
    for i in sorted(sd["state"]):
        for k in sorted(sd["state"][i]):
            t = sd["state"][i][k].reshape(-1).contiguous()
            h.update(f"{i}{k}".encode() + t.view(torch.uint8).numpy().tobytes())
    h.update(repr(sd["param_groups"]).encode())
    return h.hexdigest()[:16]


def main() -> None:
    mode, root = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        torch.distributed.init_process_group("gloo")
    tn.init(persistent_storage_path=root, persistent_time_interval=3600, num_of_version_in_retention=2)
    model, opt = make()
    if mode in ("train", "train-kill"):
        for step in (1, 2, 3):
            train_step(model, opt, step)
            ckpt = tn.Checkpoint(f"global_step{step}", 2)
            ckpt.save("model", model)
            ckpt.save("optimizer", opt)
            ckpt.commit()
            tn.flush_persistence()
            print(f"COMMITTED global_step{step} {digest(model, opt)}", flush=True)
        if mode == "train-kill":
            if torch.distributed.is_initialized():
                torch.distributed.barrier()  # every rank's commits are durable: none dies mid-commit
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)  # the test kills us here
        return
    latest = tn.get_latest_checkpoint()
    if latest is None:
        print("RESUMED none", flush=True)
        return
    model.load_state_dict(latest.load("model"))
    opt.load_state_dict(latest.load("optimizer"))
    tier = (tn.checkpointer().last_restore or {}).get("tier", "?").split(":")[0]
    print(f"RESUMED {latest.tag} {latest.step} {tier} {digest(model, opt)}", flush=True)
    train_step(model, opt, latest.step + 1)
    ckpt = tn.Checkpoint(f"global_step{latest.step + 1}", 2)
    ckpt.save("model", model)
    ckpt.save("optimizer", opt)
    tn.shutdown()
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
