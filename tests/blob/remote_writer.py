"""Writer process for the SIGKILL test of test_remote_tier.py: saves to remote tiers, then parks.

Usage::

    python remote_writer.py SPEC_JSON

``SPEC_JSON``: ``{"storage_options": {...}, "big": <floats>, "part": <bytes>, "jobs": [[url, park_at], ...]}``.
Each job runs on its own thread: a Checkpointer whose only tier is a RemoteTier at ``url`` saves
step 1 (small), then step 2 (``big`` float32 values, uploaded in parts of ``part`` bytes) and parks:

* ``part``: the upload thread parks once the first part of step 2's shard is accepted (the
  multi-part upload is unfinished);
* ``commit``: the writer parks just before step 2's commit marker (shard and manifest complete).

Protocol on stdout, one flushed line each: ``COMMITTED 1 <url>`` once step 1 is durable, then
``PARKED <park_at> <url>``. The parent SIGKILLs the process once every job is parked; a watchdog
ends it after 120 s in any case.

:func:`make_state` is shared with the test, which checks what it restores bit for bit.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import torch

_print_lock = threading.Lock()


def make_state(step: int, floats: int) -> dict[str, Any]:
    """Deterministic state of ``step`` with ``floats`` float32 values plus a few small leaves."""
    g = torch.Generator().manual_seed(1234 + step)
    return {"w": torch.randn(floats, generator=g), "b16": torch.randn(257, generator=g).to(torch.bfloat16),
            "step": step, "pos": (step, 2.5)}


def _say(line: str) -> None:
    with _print_lock:
        print(line, flush=True)


def _park(line: str) -> None:
    _say(line)
    time.sleep(300)  # until the parent's SIGKILL
    os._exit(3)


def main() -> None:
    spec = json.loads(sys.argv[1])
    threading.Timer(120, lambda: os._exit(4)).start()  # never outlive a broken test

    import nebula_ckpt as nc
    from nebula_ckpt import knobs
    from nebula_ckpt.storage.remote import FsspecStorage, storage_class_for

    opts = spec["storage_options"]

    def job(url: str, park_at: str) -> None:
        class ParkingStorage(storage_class_for(url)):  # type: ignore[misc]
            def write_small(self, rel: str, data: bytes, *, create_only: bool = False) -> None:
                if park_at == "commit" and rel == "step-2/COMMIT":
                    _park(f"PARKED commit {url}")
                super().write_small(rel, data, create_only=create_only)

        def on_part(rel: str, index: int) -> None:
            if park_at == "part" and rel.startswith("step-2/"):
                _park(f"PARKED part {url}")

        class ParkingTier(nc.RemoteTier):
            def make_storage(self) -> FsspecStorage:
                st = ParkingStorage(self.url, self.storage_options)
                st.on_part_uploaded = on_part
                return st

        try:
            ck = nc.Checkpointer(url, storage_options=opts, tiers=[ParkingTier(url, storage_options=opts)])
            ck.save(1, make_state(1, 4096))
            _say(f"COMMITTED 1 {url}")
            ck.save(2, make_state(2, spec["big"]))
            _say(f"UNEXPECTED: step 2 finished on {url}")
        except BaseException as e:  # noqa: BLE001 - reported; the parent fails the test
            _say(f"ERROR {url}: {type(e).__name__}: {e}")
        os._exit(5)

    with knobs.override(remote_part_bytes=spec["part"], remote_concurrency=2):
        threads = [threading.Thread(target=job, args=(url, park), daemon=True) for url, park in spec["jobs"]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


if __name__ == "__main__":
    main()
