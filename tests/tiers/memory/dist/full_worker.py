"""One rank of a replicas-on-a-full-tmpfs job (run by tests/tiers/memory/dist/test_replicas_full.py).

Usage: python full_worker.py save ROOT OUT SHM_BASE [STEPS FILL_STEP [WHEN]]
       python full_worker.py restore ROOT OUT SHM_BASE [fill KEEP [PULL_CHUNK]]

Two simulated nodes, one rank each: rank 0 is node ``n0`` (A), rank 1 node ``n1`` (B), each with
its own ``NEBULA_SHM_DIR`` (``SHM_BASE/n<i>``; the test mounts a small tmpfs there for B) and
``MemoryTier(replicas=1)``, so each holds the other's replica. A's state is 2 MiB, B's 0.5 MiB.

* ``save``: save steps 1..STEPS to ``[MemoryTier(replicas=1), LocalTier(ROOT, every=1000)]``
  (only step 1 reaches the disk tier). Before step FILL_STEP, B fills its tmpfs with a file of
  "another job" so that its own step still fits but A's replica does not; before the step after
  it, that file is gone. With WHEN ``receiving``, that job takes the room later: after B said it
  has room for A's copy, just before B allocates the copy's files (the race the allocation of a
  copy's pages before any byte lands is there for). Each rank reports, per step, what its handle said and (B) what its
  memory tier holds, then ends like a crash (``os._exit``: nothing closed, the tiers stay).
* ``restore``: a fresh state, ``load_latest`` into it; report the step, its digest, ``last_restore``,
  the library's warnings and (B) what its memory tier holds after ``close()``. With ``restore fill
  KEEP``, B fills its tmpfs once its Checkpointer is open, leaving KEEP bytes free (less than the
  copy it pulls: its memory tier's copy runs out of room part way).
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import sys
from typing import Any

from tests.dist.launch import gloo, simulated_node, write_report

SCENARIO, ROOT, OUT, SHM_BASE = sys.argv[1:5]
STEPS, FILL_STEP = (int(a) for a in (sys.argv[5:7] if len(sys.argv) > 6 and SCENARIO == "save" else ("0", "0")))
WHEN = sys.argv[7] if len(sys.argv) > 7 else "before"
RANK = int(os.environ["RANK"])
SHM = simulated_node(SHM_BASE, f"n{RANK}")
MiB = 1 << 20
NBYTES = 2 * MiB if RANK == 0 else MiB // 2

import torch  # noqa: E402

import nebula_ckpt as nc  # noqa: E402
from nebula_ckpt.tiers.memory import replica_pull  # noqa: E402
from nebula_ckpt.tiers.memory.replica_store import ReplicaStore  # noqa: E402


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * RANK + step)
    return {"w": torch.randn(NBYTES // 4, generator=g), "step": step}


def _digest(st: dict[str, Any]) -> str:
    return hashlib.sha256(st["w"].numpy().tobytes() + str(st["step"]).encode()).hexdigest()


def _tiers() -> list[nc.Tier]:
    return [nc.MemoryTier(replicas=1), nc.LocalTier(ROOT, every=1000, keep_last=10)]


def _report(data: dict[str, Any]) -> None:
    write_report(OUT, SCENARIO, RANK, data, default=str)


def _free() -> int:
    st = os.statvfs(SHM)
    return st.f_bavail * st.f_frsize


def _fill(keep: int = NBYTES + MiB) -> dict[str, int]:
    """Another job's file on B's tmpfs: what stays free (``keep``; by default B's own step, its
    shard and a margin) does not hold A's 2 MiB replica beside it."""
    before = _free()
    path = os.path.join(SHM, "other-job.bin")
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        os.posix_fallocate(fd, 0, before - keep)
    finally:
        os.close(fd)
    return {"free_before": before, "free_after": _free()}


def _holds() -> dict[str, Any]:
    """What B's memory tier holds: its own steps (committed) and every entry of its replica store."""
    own = sorted(os.path.basename(os.path.dirname(p)) for p in glob.glob(f"{SHM}/nebula_ckpt-*/*/step-*/COMMIT"))
    store = {}
    for d in glob.glob(f"{SHM}/nebula_ckpt-*/*/replicas"):
        for dp, dirs, files in os.walk(d):
            store[os.path.relpath(dp, d)] = sorted(dirs) + sorted(files)
    return {"own": own, "replicas": store}


def _fill_when_receiving(filled: dict[str, int]) -> None:
    """Take the room once B starts receiving a copy (its room check passed)."""
    real = ReplicaStore.incoming

    def taking(self: ReplicaStore, step: int) -> str:
        if step == FILL_STEP and not filled:
            filled.update(_fill())
        return real(self, step)
    ReplicaStore.incoming = taking  # type: ignore[method-assign]


def save() -> None:
    st = _state(0)
    ck = nc.Checkpointer(ROOT, tiers=_tiers())
    digests, written, errors, failures, holds = {}, {}, {}, {}, {}
    filled: dict[str, int] = {}
    for step in range(1, STEPS + 1):
        if RANK == 1 and step == FILL_STEP:
            if WHEN == "receiving":
                _fill_when_receiving(filled)
            else:
                filled.update(_fill())
        if RANK == 1 and step == FILL_STEP + 1:
            os.unlink(os.path.join(SHM, "other-job.bin"))
        st = _state(step)
        h = ck.save_async(step, st)
        digests[step] = _digest(st)
        try:
            written[step] = h.result()
        except nc.PersistError as e:
            errors[step] = str(e)
            failures[step] = sorted(e.failures)
            written[step] = list(h.tiers_written)
        holds[step] = _holds()
    _report({"digests": digests, "written": written, "errors": errors, "failures": failures, "holds": holds,
             "filled": filled, "stats": ck.stats()})
    os._exit(0)


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def restore() -> None:
    if len(sys.argv) > 7 and sys.argv[5] == "fill":  # bytes per transfer of a pull (default 8 MiB)
        replica_pull.PULL_CHUNK_BYTES = int(sys.argv[7])
    st = _state(10_000)
    warnings = _Warnings()
    logging.getLogger("nebula_ckpt").addHandler(warnings)
    filled: dict[str, int] = {}
    with nc.Checkpointer(ROOT, tiers=_tiers()) as ck:
        if RANK == 1 and len(sys.argv) > 6 and sys.argv[5] == "fill":
            filled = _fill(int(sys.argv[6]))
        step = ck.load_latest(st)
        last = ck.last_restore
    stats = ck.stats()  # after close()
    # after close(): a copy pulled into memory at the restore is kept in the memory tier by then
    _report({"step": step, "digest": _digest(st), "last_restore": last, "stats": stats,
             "warnings": warnings.messages, "filled": filled, "holds": _holds() if RANK == 1 else None})


if __name__ == "__main__":
    with gloo():
        {"save": save, "restore": restore}[SCENARIO]()
