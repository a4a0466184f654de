"""One rank of the multi-rank tag / remove / NumPy test (run by tests/dist/test_tags_multirank.py).

Usage: python tags_worker.py ROOT OUT   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in env)

Every rank saves steps 1..3 with tags and a rank-specific NumPy RNG state, lists the tags, loads by
tag, removes by tag, and writes what it saw to ``OUT/tags-r<rank>.json``.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from launch import gloo, write_report

import nebula_ckpt as nc


def gloo_threads() -> int:
    """Threads of gloo process groups alive in this process (their names come from torch/gloo)."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                n += "gloo" in f.read()
        except OSError:  # the thread ended while we looked
            pass
    return n


def main() -> None:
    root, out = sys.argv[1:3]
    with gloo() as rank:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8)
        opt = torch.optim.AdamW(model.parameters())
        report: dict[str, object] = {"rank": rank}
        report["gloo_before"] = gloo_threads()
        with nc.Checkpointer(root, keep_last=10) as ck:
            report["gloo_open"] = gloo_threads()
            saved_rng = {}
            for step, tag in ((1, "a"), (2, "b"), (3, "b")):
                np.random.seed(100 * rank + step)
                state = {"model": model, "optim": opt, "rng": np.random.get_state(), "step": step}
                saved_rng[step] = state["rng"][1].tolist()
                ck.save(step, state, tag=tag)
            report["tags"] = ck.tags()
            into = {"model": model, "optim": opt, "rng": None, "step": 0}
            report["loaded"] = ck.load(tag="a", into=into)
            report["rng_ok"] = into["rng"][1].tolist() == saved_rng[1] and into["rng"][1].dtype == np.uint32
            report["removed"] = ck.remove(tag="b")
            dist.barrier()
            report["after"] = ck.list()
            report["tags_after"] = ck.tags()
        # close() frees the protocol's gloo groups itself (threads joined now, not at a later garbage
        # collection or at interpreter exit, where a gloo worker that frees a tensor aborts the process)
        report["gloo_closed"] = gloo_threads()
    write_report(out, "tags", rank, report)


if __name__ == "__main__":
    main()
