"""A training run that checkpoints with ``dcp.save`` + ``NebulaStorageWriter`` (one process).

    python dcp_worker.py ROOT LOSSES STEPS [--kill-at K] [--resume]

Every 3 steps it saves ``{"model", "optim", "rng", "step"}`` as step N; with ``--kill-at K`` it
SIGKILLs itself right after the save of step K is committed; with ``--resume`` it first loads the
newest committed step with ``dcp.load`` + ``NebulaStorageReader`` and goes on from there. Each
step's loss is appended to LOSSES as ``step float.hex``.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed.checkpoint as dcp

from nebula_ckpt.dcp import NebulaStorageReader, NebulaStorageWriter


def main() -> None:
    root, losses, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    kill_at = int(sys.argv[sys.argv.index("--kill-at") + 1]) if "--kill-at" in sys.argv else None
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.zeros(1, 16)).sum().backward()  # the optimizer's state exists before a load
    opt.step()
    opt.zero_grad()
    torch.manual_seed(1)
    start = 0
    if "--resume" in sys.argv:
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "rng": torch.get_rng_state(), "step": 0}
        dcp.load(state, storage_reader=NebulaStorageReader(root))
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        torch.set_rng_state(state["rng"])
        start = int(state["step"])
    with open(losses, "a") as out:
        for step in range(start + 1, steps + 1):
            x = torch.randn(8, 16)
            loss = (model(x) - x[:, :4]).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.write(f"{step} {loss.item().hex()}\n")
            out.flush()
            if step % 3 == 0:
                state = {"model": model.state_dict(), "optim": opt.state_dict(), "rng": torch.get_rng_state(),
                         "step": step}
                dcp.save(state, storage_writer=NebulaStorageWriter(root, step=step))
                if step == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
