"""One rank of a job that loads each of several roots with ``dcp.load`` + ``NebulaStorageReader(root)``.

    python dcp_fallback_worker.py OUT ROOT...

For each ROOT (``{rank}`` in it is replaced by the rank; a 2-rank checkpoint of ``{"w": (4, 3), "b": (3,)}``) it
reports, in
``OUT/fallback-r<rank>.json``, the step the reader chose and the values loaded, or the error.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from launch import gloo, write_report

from nebula_ckpt.dcp import NebulaStorageReader


def main() -> None:
    out, roots = sys.argv[1], sys.argv[2:]
    with gloo() as rank:
        got: dict[str, Any] = {}
        for name in roots:
            root = name.replace("{rank}", str(rank))  # a root of this rank's own
            sd = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
            try:
                with NebulaStorageReader(root) as reader:
                    dcp.load(sd, storage_reader=reader)
                got[name] = {"step": reader.step, "w": sd["w"].tolist(), "b": sd["b"].tolist()}
            except BaseException as e:  # CheckpointException is a BaseException
                got[name] = {"error": f"{type(e).__name__}: {e}"}
            dist.barrier()
        write_report(out, "fallback", rank, got)


if __name__ == "__main__":
    main()
