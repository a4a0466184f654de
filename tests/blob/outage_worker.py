"""A rank of the two-rank outage tests of test_outage_restore.py (gloo on 127.0.0.1, a blob root).

Usage: ``python outage_worker.py SCENARIO URL OUT`` with ``TEST_STORAGE_OPTIONS`` (JSON) and
``TEST_SERVER_PID`` (the blob server's process, which the ranks freeze with SIGSTOP and thaw with
SIGCONT: a hung endpoint, real requests timing out at ``NEBULA_REMOTE_TIMEOUT_S``).

* ``save``: steps 1, 2, 3 saved by both ranks to the blob root (no memory tier);
* ``list_down``: the server is frozen while the ranks resume (``load_latest``), then thawed and they resume again;
* ``read_down``: rank 1 freezes the server while it reads its part of step 3, then thaws it.

Each rank reports ``{"first": <step restored, or the name of the error raised>, "message", "again": <step>}``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from datetime import timedelta
from typing import Any

import torch

from tests.dist.launch import gloo, write_report


def _state(rank: int, step: int) -> dict[str, Any]:
    return {"w": torch.full((50_000,), float(step * 10 + rank)), "step": step}


def _signal(sig: int) -> None:
    os.kill(int(os.environ["TEST_SERVER_PID"]), sig)


def _freeze_on_step_3_read() -> None:
    """This rank freezes the server while its first read of step 3's shard runs (thawed after)."""
    from nebula_ckpt.storage.remote.base import FsspecStorage

    orig, fired = FsspecStorage.read_buffer, []

    def read_buffer(self: Any, rel: str, *a: Any, **kw: Any) -> Any:
        if rel.startswith("step-3/shard") and not fired:
            fired.append(rel)
            _signal(signal.SIGSTOP)
            try:
                return orig(self, rel, *a, **kw)
            finally:
                _signal(signal.SIGCONT)
        return orig(self, rel, *a, **kw)

    FsspecStorage.read_buffer = read_buffer  # type: ignore[method-assign]


def main() -> None:
    scenario, url, out = sys.argv[1:4]
    opts = json.loads(os.environ["TEST_STORAGE_OPTIONS"])
    import torch.distributed as dist

    import nebula_ckpt as nc

    with gloo(timeout=timedelta(seconds=90)) as rank:
        with nc.Checkpointer(url, storage_options=opts, memory_tier=False) as ck:
            if scenario == "save":
                for s in (1, 2, 3):
                    ck.save(s, _state(rank, s))
                write_report(out, scenario, rank, {})
                return
            report: dict[str, Any] = {}
            dist.barrier()  # every rank is done opening the root before the server freezes
            if scenario == "list_down" and rank == 0:
                _signal(signal.SIGSTOP)
            elif scenario == "read_down" and rank == 1:
                _freeze_on_step_3_read()
            dist.barrier()
            into = _state(rank, -1)
            try:
                report["first"] = ck.load_latest(into=into)
            except Exception as e:
                report["first"], report["message"] = type(e).__name__, str(e)
            if scenario == "list_down" and rank == 0:
                _signal(signal.SIGCONT)
            dist.barrier()
            into = _state(rank, -1)
            report["again"] = ck.load_latest(into=into)
            report["exact"] = bool(torch.equal(into["w"], _state(rank, 3)["w"]))
            write_report(out, scenario, rank, report)


if __name__ == "__main__":
    main()
