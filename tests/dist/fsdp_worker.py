"""One rank of an FSDP2 training job checkpointed through the Hugging Face integration's FSDP
functions (run as a subprocess by tests/dist/test_fsdp_resume.py; gloo on 127.0.0.1).

Usage: python fsdp_worker.py MODE ROOT OUT [KILL_AT]   (RANK, WORLD_SIZE, MASTER_* in env)

A small model with dropout, every ``nn.Linear`` and the root wrapped with ``fully_shard`` over
every rank, AdamW and a warm-up scheduler, trains ``TOTAL`` steps (each rank its own batches,
drawn from a generator seeded by rank and step; dropout draws from the global RNG). Every
``SAVE_EVERY`` steps it saves what ``NebulaTrainer`` saves under FSDP, with the same functions:
``fsdp.sharded_state`` (the shards of model and optimizer), the scheduler, ``rng.rng_states``.

``run``: train, saving; with KILL_AT, at the end of that step wait until the saves are durable,
meet the other ranks in a barrier, write ``OUT/run-r<rank>.json`` and SIGKILL this process.
Without it, run to the end (the uninterrupted reference; rank 0 also writes the whole model's
state at each save, ``OUT/full-<step>.pt``). ``resume``: build the model from
another seed, read the newest checkpoint with ``fsdp.read_sharded`` (before sharding, as the
Trainer does), shard, load it with ``fsdp.load_sharded`` and ``rng.set_rng_states``, train to
the end. ``mismatch``: the same with a wider hidden layer (or, run with another number of ranks, the
same read): the read or the load must refuse it (the error
and the model's digests before / after go into the report) and leave the weights as they were
(the fresh optimizer gets its zero state: ``get_state_dict``'s rule). Each rank writes its losses
(``float.hex``), digests of the whole (unsharded) model and optimizer state after each save / the
load, and at the end.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from typing import Any, Optional

import torch
import torch.distributed as dist

TOTAL = 10
SAVE_EVERY = 3


def build(seed: int, hidden: int = 32) -> torch.nn.Module:
    """The model (not yet sharded): seeded weights."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.Dropout(0.2), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 6))


def shard(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    """Shard ``model`` with FSDP2 over every rank; its AdamW and warm-up scheduler."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    return opt, sched


def digest(model: torch.nn.Module, opt: Optional[torch.optim.Optimizer]) -> str:
    """SHA-256 of every parameter and (when given) optimizer state value, unsharded (a collective)."""
    h = hashlib.sha256()

    def add(name: str, t: Any) -> None:
        if isinstance(t, torch.Tensor):
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
            h.update(f"{name}{full.dtype}{tuple(full.shape)}".encode())
            h.update(full.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{name}{t!r}".encode())

    for k, v in model.state_dict().items():
        add(k, v)
    if opt is None:
        return h.hexdigest()
    osd = opt.state_dict()
    for i in sorted(osd["state"]):
        for k in sorted(osd["state"][i]):
            add(f"{i}/{k}", osd["state"][i][k])
    for g in osd["param_groups"]:
        add("lr", g["lr"])
    return h.hexdigest()


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, s: int) -> str:
    """Training step ``s`` (1-based) on this rank's batch of that step; its loss as ``float.hex``."""
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + s)
    loss = model(torch.randn(8, 16, generator=g)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return float(loss.detach()).hex()


def main() -> None:
    mode, root, out = sys.argv[1:4]
    kill_at = int(sys.argv[4]) if len(sys.argv) > 4 else None
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    import nebula_ckpt as nc
    from nebula_ckpt.integrations.huggingface.fsdp import KEY, load_sharded, read_sharded, sharded_state
    from nebula_ckpt.integrations.huggingface.rng import rng_states, set_rng_states

    report: dict[str, Any] = {"losses": {}, "saved": {}}
    ck = nc.Checkpointer(root)
    first = 1
    if mode == "resume":
        model = build(seed=99)
        saved_step, tree = read_sharded(ck)  # before sharding, as NebulaTrainer reads it
        opt, sched = shard(model)
        load_sharded(model, opt, tree[KEY])
        sched.load_state_dict(tree["scheduler"])
        set_rng_states(tree["rng"], True)
        report.update(restored=saved_step, restored_digest=digest(model, opt), tier=ck.last_restore)
        first = saved_step + 1
    elif mode == "mismatch":
        model = build(seed=99, hidden=40)
        before = digest(model, None)
        try:
            saved_step, tree = read_sharded(ck)
            opt, sched = shard(model)
            before = digest(model, None)
            load_sharded(model, opt, tree[KEY])
        except nc.ValidationError as e:
            report["error"] = str(e)
        report.update(before=before, after=digest(model, None))
        _write(out, mode, rank, report)
        ck.close()
        dist.destroy_process_group()
        return
    else:
        model = build(seed=0)
        opt, sched = shard(model)
    for s in range(first, TOTAL + 1):
        report["losses"][s] = step(model, opt, sched, s)
        if s % SAVE_EVERY == 0:
            state = {KEY: sharded_state(model, opt), "scheduler": sched, "rng": rng_states(True), "step": s}
            ck.save_async(s, state, tag=f"checkpoint-{s}").wait_snapshot()
            report["saved"][s] = digest(model, opt)
            full = {k: v.full_tensor() for k, v in model.state_dict().items()}  # a collective
            if rank == 0 and kill_at is None and mode == "run":
                torch.save(full, os.path.join(out, f"full-{s}.pt"))
        if s == kill_at:
            ck.wait()
            dist.barrier()  # every rank's saves are durable: none dies while another commits
            report["committed"] = ck.list()
            _write(out, mode, rank, report)
            os.kill(os.getpid(), signal.SIGKILL)
    ck.close()
    report["final"] = digest(model, opt)
    _write(out, mode, rank, report)
    dist.barrier()
    dist.destroy_process_group()


def _write(out: str, mode: str, rank: int, report: dict[str, Any]) -> None:
    path = os.path.join(out, f"{mode}-r{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
    from launch import leave  # the script's folder is on sys.path

    leave()  # no interpreter teardown: see launch.leave (a torch / gloo abort at exit)
