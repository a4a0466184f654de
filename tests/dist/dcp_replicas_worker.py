"""One rank of a 4-rank DCP job whose ranks hold different, partly shared state (run by
tests/dist/test_dcp_replicas.py).

Usage: python dcp_replicas_worker.py ROOT OUT   (RANK, WORLD_SIZE, MASTER_* in env)

What each rank holds (:func:`state`), so DCP's dedup stores an item once for only *some* of the
ranks holding it:

* ``common``: every rank's (one copy for the job);
* ``stage0/w`` on ranks 0 and 1, ``stage1/w`` on ranks 2 and 3 (pipeline stages);
* ``hsdp/w``: a DTensor on a 2 x 2 mesh, ``(Replicate(), Shard(0))``: ranks 0 and 2 hold one
  chunk, ranks 1 and 3 the other (each chunk stored once: by a different rank);
* ``emb`` and ``head``: one tensor under two keys on every rank (tied);
* ``step``: a value.

The job saves step 1 with ``dcp.save`` + ``NebulaStorageWriter``, then loads it back twice, into
zeroed state of the same structure: with ``dcp.load`` + ``NebulaStorageReader`` and with
``Checkpointer.load_latest``. Then step 2 fails on the coordinator when it writes the manifest
(after every records file and ``ranks.json``). Each rank writes ``OUT/job-r<rank>.json``: whether each
load gave back its own state bit for bit, step 2's error and what is left of its folder.
"""

from __future__ import annotations

import datetime
import os
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def state(rank: int, mesh: Any, fill: bool = True) -> dict[str, Any]:
    """Rank ``rank``'s state (zeros of the same structure when not ``fill``)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    def make(seed: int, *shape: int) -> torch.Tensor:
        t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
        return t if fill else torch.zeros_like(t)

    stage = rank // 2
    tied = make(3, 5, 4)
    return {"common": make(1, 7), f"stage{stage}/w": make(10 + stage, 3, 3),
            "hsdp": {"w": distribute_tensor(make(20, 6, 2), mesh, [Replicate(), Shard(0)])},
            "emb": tied, "head": tied, "step": 1 if fill else -1}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal keys, bit-exact tensors (DTensors by their local chunk) and equal values."""
    if a.keys() != b.keys():
        return False
    for k, v in a.items():
        w = b[k]
        if isinstance(v, dict):
            if not same(v, w):
                return False
        elif isinstance(v, torch.Tensor):
            lv = v.to_local() if hasattr(v, "to_local") else v
            lw = w.to_local() if hasattr(w, "to_local") else w
            if lv.dtype != lw.dtype or not torch.equal(lv, lw):
                return False
        elif v != w:
            return False
    return True


def main() -> None:
    root, out = sys.argv[1:3]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    import torch.distributed.checkpoint as dcp
    from launch import write_report  # the script's folder is on sys.path
    from torch.distributed.device_mesh import init_device_mesh

    import nebula_ckpt as nc
    from nebula_ckpt.dcp import NebulaStorageReader, NebulaStorageWriter

    mesh = init_device_mesh("cpu", (2, 2))
    saved = state(rank, mesh)
    dcp.save(saved, storage_writer=NebulaStorageWriter(root, step=1))

    back = state(rank, mesh, fill=False)
    with NebulaStorageReader(root, 1) as reader:
        dcp.load(back, storage_reader=reader)
    report: dict[str, Any] = {"rank": rank, "dcp_load": same(saved, back),
                              "dcp_tied": back["emb"].data_ptr() == back["head"].data_ptr() or
                              torch.equal(back["emb"], back["head"])}
    into = state(rank, mesh, fill=False)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        report["latest"] = ck.load_latest(into)
    report["checkpointer_load"] = same(saved, into)
    # step 2: the coordinator's write of the manifest fails, after the records files and ranks.json
    from nebula_ckpt.storage.local import LocalStorage

    real = LocalStorage.write_small
    if rank == 0:
        def failing(self: LocalStorage, rel: str, data: bytes) -> Any:
            if rel == "step-2/manifest.json":
                raise OSError(5, "injected: manifest write failed")
            return real(self, rel, data)

        LocalStorage.write_small = failing  # type: ignore[method-assign]
    try:
        dcp.save(saved, storage_writer=NebulaStorageWriter(root, step=2))
        report["step2"] = "committed"
    except BaseException as e:  # noqa: B036 - DCP raises CheckpointException (a BaseException)
        report["step2"] = f"{type(e).__name__}: {e}"
    LocalStorage.write_small = real  # type: ignore[method-assign]
    dist.barrier()
    report["after2"] = sorted(os.listdir(os.path.join(root, "step-2"))) if os.path.isdir(
        os.path.join(root, "step-2")) else None
    write_report(out, "job", rank, report)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from launch import leave  # the script's folder is on sys.path

    leave()
