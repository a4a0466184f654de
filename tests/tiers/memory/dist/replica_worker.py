"""One rank of a memory-tier replica test job (run by tests/tiers/memory/dist/test_replicas.py).

Usage: python replica_worker.py SCENARIO ROOT OUT SHM_BASE NODES_OF K [DISK_EVERY] [STEPS]

``NODES_OF`` maps ranks to simulated nodes (``"0,0,1,1"``: ranks 0 and 1 on node n0, ...); each
simulated node has its own memory tier under ``SHM_BASE/n<i>`` (``NEBULA_SHM_DIR``) and its id in
``NEBULA_NODE_ID``. Scenarios:

* ``save``: train, save steps 1..STEPS to ``[MemoryTier(replicas=K), LocalTier(ROOT, every=DISK_EVERY)]``,
  wait for every handle (replicas included), report each step's state digest, then end like a
  crash (``os._exit``: nothing is closed, the memory tiers stay);
* ``save_kill_receiving``: as ``save``, but a rank holding replicas SIGKILLs itself while a copy
  is being received (after the bytes arrived, before it is verified and made visible);
* ``restore``: a fresh model, ``load_latest`` into it, report the step, the digest, ``last_restore``
  and ``stats()``, then close;
* ``save_frozen`` / ``restore_frozen``: as ``save`` / ``restore`` with a large frozen tensor beside
  the trained ones (the memory tier's steps after the first are incremental); ``save_frozen``
  also reports ``sent_bytes`` after each step and each own memory-tier step's manifest shards
  and own shard size;
* ``save_frozen_drop``: as ``save_frozen``, but before the last save every rank deletes the
  replicas it holds of the step before (their partners then lack the base);
* ``save_frozen_flip``: as ``save_frozen``, but before the last save every rank flips a byte of
  the frozen tensor in the replicas it holds of the step before (the base a copy is made whole from).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import sys
from typing import Any

from tests.dist.launch import gloo, simulated_node, write_report

SCENARIO, ROOT, OUT, SHM_BASE, NODES_OF, K = sys.argv[1:7]
DISK_EVERY = int(sys.argv[7]) if len(sys.argv) > 7 else 1000
STEPS = int(sys.argv[8]) if len(sys.argv) > 8 else 3
RANK = int(os.environ["RANK"])
NODE = NODES_OF.split(",")[RANK]
simulated_node(SHM_BASE, f"n{NODE}")

import torch  # noqa: E402

import nebula_ckpt as nc  # noqa: E402
from nebula_ckpt.tiers.memory import replica_store  # noqa: E402
from tests.dist.state_digest import digest as _digest  # noqa: E402


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(32, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = {"model": model, "optim": opt, "extra": torch.zeros(64)}
    if "frozen" in SCENARIO:
        out["frozen"] = torch.randn(256 * 1024, generator=torch.Generator().manual_seed(seed))
    return out


def _train(st: dict[str, Any], step: int) -> None:
    g = torch.Generator().manual_seed(1000 * RANK + step)
    loss = st["model"](torch.randn(4, 32, generator=g)).square().mean()
    st["optim"].zero_grad()
    loss.backward()
    st["optim"].step()
    st["extra"].add_(RANK + step)


def _tiers() -> list[nc.Tier]:
    return [nc.MemoryTier(replicas=int(K)), nc.LocalTier(ROOT, every=DISK_EVERY)]


def _report(data: dict[str, Any]) -> None:
    write_report(OUT, SCENARIO, RANK, data, default=str)


def _kill_while_receiving() -> None:
    """A holder dies with a copy's bytes received but not yet verified nor visible."""
    real = replica_store.verify_step

    def dying(folder: str, *a: Any, **kw: Any) -> None:
        if ".incoming-" in folder:
            os.kill(os.getpid(), signal.SIGKILL)
        real(folder, *a, **kw)
    replica_store.verify_step = dying  # the name a received copy is checked through


def save() -> None:
    st = _state(RANK)
    ck = nc.Checkpointer(ROOT, tiers=_tiers())
    digests, written, errors, inodes, sent, own = {}, {}, {}, {}, {}, {}
    for step in range(1, STEPS + 1):
        _train(st, step)
        if SCENARIO == "save_frozen_drop" and step == STEPS:
            _drop_held(ck, step - 1)
        if SCENARIO == "save_frozen_flip" and step == STEPS:
            _flip_held(ck, step - 1)
        if SCENARIO == "save_kill_receiving" and step == STEPS and RANK == 1:
            _kill_while_receiving()
        h = ck.save_async(step, st)
        digests[step] = _digest(st)
        try:
            written[step] = h.result()
        except nc.NebulaError as e:
            errors[step] = str(e)
        inodes[step] = _held_inodes(ck, step)  # the round is over on every rank once h is done
        sent[step], own[step] = ck.stats()["replicas"]["sent_bytes"], _own_step(step)
    if SCENARIO == "save_remove":  # the newest step removed on every rank, then a crash (no close)
        digests["removed"] = ck.remove(STEPS)
        torch.distributed.barrier()  # each rank drops the copies it holds: look once every rank has
        digests["replicas_left"] = glob.glob(f"{SHM_BASE}/*/nebula_ckpt-*/*/replicas/r*/step-{STEPS}")
    _report({"digests": digests, "written": written, "errors": errors, "stats": ck.stats(), "inodes": inodes,
             "sent": sent, "own": own,
             "nice": {"training": os.getpriority(os.PRIO_PROCESS, 0), "threads": _thread_nice()}})
    os._exit(0)


def _held_inodes(ck: nc.Checkpointer, step: int) -> list[int]:
    """Inode numbers of the shard files of the replicas of ``step`` this rank holds."""
    shm = os.environ["NEBULA_SHM_DIR"]
    held = ck.stats()["replicas"]["holding_for"]
    return sorted(os.stat(p).st_ino for r in held
                  for p in glob.glob(f"{shm}/nebula_ckpt-*/*/replicas/r{r}/step-{step}/shard-*"))


def _drop_held(ck: nc.Checkpointer, step: int) -> None:
    """Delete the replicas of ``step`` this rank holds (commit marker first, as pruning does)."""
    shm = os.environ["NEBULA_SHM_DIR"]
    for r in ck.stats()["replicas"]["holding_for"]:
        for d in glob.glob(f"{shm}/nebula_ckpt-*/*/replicas/r{r}/step-{step}"):
            os.unlink(os.path.join(d, "COMMIT"))
            shutil.rmtree(d)


def _flip_held(ck: nc.Checkpointer, step: int) -> None:
    """Flip a byte in the middle (the frozen tensor) of the shards of ``step``'s replicas held here."""
    shm = os.environ["NEBULA_SHM_DIR"]
    for r in ck.stats()["replicas"]["holding_for"]:
        for p in glob.glob(f"{shm}/nebula_ckpt-*/*/replicas/r{r}/step-{step}/shard-*"):
            with open(p, "r+b") as f:
                f.seek(os.path.getsize(p) // 2)
                b = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([b[0] ^ 0xFF]))


def _own_step(step: int) -> dict[str, Any]:
    """This rank's own memory-tier ``step``: its manifest's shard count and its own shard's size."""
    shm = os.environ["NEBULA_SHM_DIR"]
    for p in glob.glob(f"{shm}/nebula_ckpt-*/*/step-{step}/shard-*-r{RANK}.safetensors"):
        if "replicas" not in p.split(os.sep):
            with open(os.path.join(os.path.dirname(p), "manifest.json")) as f:
                return {"shards": len(json.load(f)["shards"]), "bytes": os.path.getsize(p)}
    return {}


def _thread_nice() -> list[tuple[str, int]]:
    """``(name, nice)`` of every thread of this process (Linux)."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}  # Python's names (the OS's are "python")
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = names.get(int(tid)) or f.read().strip()
            out.append((name, os.getpriority(os.PRIO_PROCESS, int(tid))))
        except OSError:
            pass
    return out


def restore() -> None:
    st = _state(100 + RANK)
    with nc.Checkpointer(ROOT, tiers=_tiers()) as ck:
        step = ck.load_latest(st)
        _report({"step": step, "digest": _digest(st), "last_restore": ck.last_restore, "stats": ck.stats()})


if __name__ == "__main__":
    with gloo():
        {"save": save, "save_remove": save, "save_kill_receiving": save, "save_frozen": save, "save_frozen_drop": save,
         "save_frozen_flip": save, "restore": restore, "restore_frozen": restore}[SCENARIO]()
