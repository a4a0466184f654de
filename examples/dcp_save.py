"""Save with ``torch.distributed.checkpoint`` into nebula_ckpt's format, read it back three ways.

    python examples/dcp_save.py --root /tmp/ckpt/dcp-run                  # one process
    torchrun --nproc_per_node 2 examples/dcp_save.py --root /tmp/ckpt/dcp-run --fsdp   # FSDP2, gloo

``dcp.save`` / ``dcp.async_save`` take ``storage_writer=NebulaStorageWriter(root, step=N)``: every
rank writes its shard ``step-N/shard-g<G>-r<R>.safetensors`` (CRC32C per tensor, fsync'd), and rank 0
writes ``manifest.json`` and ``COMMIT`` once every rank's shard is durable. The result is a normal
nebula_ckpt checkpoint: ``dcp.load`` + ``NebulaStorageReader`` reads it on any number of ranks,
``Checkpointer.load_latest`` restores it, and ``nebula-ckpt verify ROOT`` checks it.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import nebula_ckpt as nc
from nebula_ckpt.dcp import NebulaStorageReader, NebulaStorageWriter


def build(fsdp: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(1 + (dist.get_rank() if dist.is_initialized() else 0))
    for _ in range(steps):
        x = torch.randn(32, 64, generator=g)
        loss = (model(x) - x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True, help="checkpoint root every rank sees (shared FS or blob URL)")
    p.add_argument("--fsdp", action="store_true", help="shard the model with fully_shard (FSDP2)")
    args = p.parse_args()
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")  # async_save needs a CPU backend: "cpu:gloo,cuda:nccl" on GPUs
    else:
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    rank = dist.get_rank() if distributed else 0
    try:  # a new step each run: a committed step is never overwritten
        first = (NebulaStorageReader(args.root).step // 10 + 1) * 10
    except nc.NotFoundError:
        first = 0

    model, opt = build(args.fsdp and distributed)
    train(model, opt, 5)
    msd, osd = get_state_dict(model, opt)                       # DCP-style state dicts (DTensors under FSDP2)
    dcp.save({"model": msd, "optim": osd, "step": first},
             storage_writer=NebulaStorageWriter(args.root, step=first))
    train(model, opt, 5)
    msd, osd = get_state_dict(model, opt)
    fut = dcp.async_save({"model": msd, "optim": osd, "step": first + 5},
                         storage_writer=NebulaStorageWriter(args.root, step=first + 5))
    fut.result()                                                # wait before the next save
    if rank == 0:
        print(f"saved steps {first} and {first + 5} under {args.root}", flush=True)

    # read it back: dcp.load through NebulaStorageReader (any world size) ...
    model2, opt2 = build(args.fsdp and distributed)
    train(model2, opt2, 1)                                      # AdamW state must exist to be filled
    msd2, osd2 = get_state_dict(model2, opt2)
    sd = {"model": msd2, "optim": osd2, "step": -1}
    with NebulaStorageReader(args.root) as reader:              # the newest committed step
        dcp.load(sd, storage_reader=reader)
    set_state_dict(model2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    # ... or with the Checkpointer (same world size directly, another one resharded)
    msd3, osd3 = get_state_dict(model2, opt2)
    into = {"model": msd3, "optim": osd3, "step": -1}
    with nc.Checkpointer(args.root, memory_tier=False) as ck:
        ck.load_latest(into=into)

    same = all(torch.equal(a.full_tensor() if hasattr(a, "full_tensor") else a,
                           b.full_tensor() if hasattr(b, "full_tensor") else b)
               for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True))
    if rank == 0:
        print(f"dcp.load restored step {sd['step']}, Checkpointer restored step {into['step']}; "
              f"model bit-exact: {same}", flush=True)
        print(f"check it: nebula-ckpt verify {args.root}", flush=True)
    if distributed:
        dist.destroy_process_group()
        if args.fsdp:
            # FSDP2 on gloo: torch keeps the group's worker threads alive past destroy_process_group,
            # and one that frees the last collective's tensors while Python shuts down aborts the
            # process. Everything above is saved and checked: leave without that teardown.
            sys.stdout.flush()
            os._exit(0)


if __name__ == "__main__":
    main()
