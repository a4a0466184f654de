"""One rank of a job whose ``LoopState`` is saved and restored (run by tests/dist/test_loop_ranks.py).

Usage: python loop_worker.py ROOT OUT   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in env)

Each rank seeds its random streams with its rank and loads its share of the data through a
``DistributedSampler`` (2 epochs of 4 batches). A first loop saves at step ``SAVE_AT`` (in
epoch 1) and goes on to the end; then, in the same process, every global stream is reseeded and a
second loop with a new loader restores and runs to the end. Both record, per step after the save,
the batch (sample index, np.random draw) and a draw of every global stream, into ``OUT/r<rank>.json``.
"""

from __future__ import annotations

import json
import random
import sys
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import nebula_ckpt as nc

SAVE_AT = 5


class Draws(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), float(np.random.normal())], dtype=torch.float64)


def run(ck: nc.Checkpointer, rank: int, restore: bool) -> dict[str, Any]:
    torch.manual_seed(rank)
    np.random.seed(rank)
    random.seed(rank)
    ds = Draws()
    sampler = torch.utils.data.DistributedSampler(ds, shuffle=True, seed=7)
    loop = nc.LoopState(torch.utils.data.DataLoader(ds, batch_size=2, sampler=sampler))
    state = {"loop": loop}
    report: dict[str, Any] = {}
    if restore:
        torch.manual_seed(100 + rank)  # other streams than at the save, as a new process would have
        np.random.seed(100 + rank)
        report["restored"] = ck.load_latest(into=state)
        report["position"] = [loop.epoch, loop.batch, loop.step]
    seen: list[Any] = []
    for _ in loop.epochs(2):
        for batch in loop:
            if loop.step > SAVE_AT:
                seen.append([loop.step, batch.tolist(), float(torch.rand(())), float(np.random.normal()),
                             random.random()])
            if not restore and loop.step == SAVE_AT:
                ck.save(loop.step, state)
    report["seen"] = seen
    return report


def main() -> None:
    root, out = sys.argv[1:3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with nc.Checkpointer(root) as ck:
        report = {"rank": rank, "first": run(ck, rank, False), "second": run(ck, rank, True)}
    with open(f"{out}/r{rank}.json", "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
