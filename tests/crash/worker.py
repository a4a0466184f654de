"""Crash-test worker: restore the newest healthy checkpoint, report it, then train and save every step.

Protocol on stdout, one line each, flushed: ``RESTORED <step|none> <digest> <tier>``,
``COMMITTED <step>`` (durable on every tier), and the library's DEBUG log lines carrying
``phase=<name>``, which the test uses to aim its SIGKILLs.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys

import torch

STEPS = 400
#: NEBULA_CRASH_FROZEN=1: the model also holds a large frozen parameter, so saves are incremental
FROZEN = os.environ.get("NEBULA_CRASH_FROZEN") == "1"
#: NEBULA_CRASH_MEMORY=1 (with FROZEN): the memory tier too, whose saves are then incremental as well
MEMORY = os.environ.get("NEBULA_CRASH_MEMORY") == "1"


def make(frozen: bool = FROZEN) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    if frozen:
        model.register_parameter("frozen", torch.nn.Parameter(torch.randn(512, 512), requires_grad=False))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, opt


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 64, generator=g)
    loss = (model(x) - x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> str:
    h = hashlib.sha256(str(step).encode())
    for t in model.state_dict().values():
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    for st in opt.state_dict()["state"].values():
        for k in sorted(st):
            h.update(st[k].reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def reference_digests(n: int, frozen: bool = FROZEN) -> dict[int, str]:
    """Digest of the state after step s, for s < n (training from scratch, same code)."""
    model, opt = make(frozen)
    out = {}
    for s in range(n):
        train_step(model, opt, s)
        out[s] = digest(model, opt, s)
    return out


def main() -> None:
    root = sys.argv[1]
    torch.set_num_threads(1)
    # One handler (one lock) for the library's log lines and the protocol lines, so that lines
    # written by different threads never interleave.
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    lg = logging.getLogger("nebula_ckpt")
    lg.addHandler(handler)
    lg.setLevel(logging.DEBUG)
    out = logging.getLogger("crash_worker")
    out.addHandler(handler)
    out.setLevel(logging.INFO)
    say = out.info
    import nebula_ckpt as nc

    model, opt = make()
    # frozen: restores from the incremental disk tier, or (MEMORY) from the incremental memory tier
    ck = nc.Checkpointer(root, keep_last=2, memory_tier=MEMORY or not FROZEN)
    state = {"model": model, "optim": opt, "step": -1}
    got = ck.load_latest(into=state)
    if got is None:
        say("RESTORED none - -")
        start = 0
    else:
        say(f"RESTORED {got} {digest(model, opt, got)} {ck.last_restore['tier']}")
        start = got + 1
    pending = []
    for s in range(start, STEPS):
        train_step(model, opt, s)
        state["step"] = s
        pending.append(ck.save_async(s, state))
        for h in [h for h in pending if h.done()]:
            pending.remove(h)
            h.result()
            if h.tiers_written and not h.tiers_dropped:
                say(f"COMMITTED {h.step}")
    ck.close()
    say("FINISHED")


if __name__ == "__main__":
    main()
