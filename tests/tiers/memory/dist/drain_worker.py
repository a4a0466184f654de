"""One rank of a job on simulated nodes whose memory-tier steps are restored or drained (run by
tests/tiers/memory/dist/test_drain.py).

Usage: python drain_worker.py SCENARIO ROOT OUT SHM_BASE NODES_OF K DISK_EVERY [STEPS]

``NODES_OF`` maps ranks to simulated nodes (``"0,0,1,1"``: ranks 0 and 1 on node n0, ...); each
simulated node has its own memory tier under ``SHM_BASE/n<i>`` (``NEBULA_SHM_DIR``) and its id in
``NEBULA_NODE_ID``. Tiers: ``[MemoryTier(replicas=K, keep_last=2), LocalTier(ROOT, every=DISK_EVERY)]``.
Scenarios:

* ``save``: train and save steps 1..STEPS, wait for every handle (replicas included), report each
  step's state digest, then end like a crash (``os._exit``: nothing is closed, the memory tiers stay);
* ``twice``: save step 5, train, save step 5 again (a step number saved twice: "replacing existing
  checkpoint"), report both writes' digests; with replicas, every rank dies (SIGKILL) once its
  memory tier committed the second write and before that write's replica round;
* ``restore``: a fresh state, ``load_latest`` into it, report the step, the digest and ``last_restore``;
* ``restore_fresh``: the same on nodes without any memory tier (``[LocalTier(ROOT)]`` only): a job
  moved to fresh nodes.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from tests.dist.launch import gloo, simulated_node, write_report

SCENARIO, ROOT, OUT, SHM_BASE, NODES_OF, K, DISK_EVERY = sys.argv[1:8]
STEPS = int(sys.argv[8]) if len(sys.argv) > 8 else 3
RANK = int(os.environ["RANK"])
NODE = NODES_OF.split(",")[RANK]
simulated_node(SHM_BASE, f"n{NODE}")

import torch  # noqa: E402

import nebula_ckpt as nc  # noqa: E402
from nebula_ckpt.tiers.memory import replicas  # noqa: E402
from tests.dist.state_digest import digest  # noqa: E402


def _state(seed: int) -> dict[str, Any]:
    """Model, AdamW and a frozen tensor (the memory tier's steps after the first are incremental:
    a rank's own copy refers to its first step's shard, a partner's replica is whole)."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(32, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    frozen = torch.randn(64 * 1024, generator=torch.Generator().manual_seed(seed))
    return {"model": model, "optim": opt, "extra": torch.zeros(64), "frozen": frozen}


def _train(st: dict[str, Any], step: int) -> None:
    g = torch.Generator().manual_seed(1000 * RANK + step)
    loss = st["model"](torch.randn(4, 32, generator=g)).square().mean()
    st["optim"].zero_grad()
    loss.backward()
    st["optim"].step()
    st["extra"].add_(RANK + step)


def _tiers() -> list[nc.Tier]:
    return [nc.MemoryTier(replicas=int(K), keep_last=2), nc.LocalTier(ROOT, every=int(DISK_EVERY))]


def _report(data: dict[str, Any]) -> None:
    write_report(OUT, SCENARIO, RANK, data, default=str)


def _die_at_the_next_replica_round() -> None:
    """Every rank dies once its memory tier committed the save, before that save's replica round."""
    def dying(*_: Any, **__: Any) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)
    replicas.replicate = dying  # the name the replicas' thread runs a save round through


def save() -> None:
    st = _state(RANK)
    ck = nc.Checkpointer(ROOT, tiers=_tiers())
    digests = {}
    for step in range(1, STEPS + 1):
        _train(st, step)
        ck.save_async(step, st).result()
        digests[step] = digest(st)
    _report({"digests": digests})
    os._exit(0)


def twice() -> None:
    st = _state(RANK)
    ck = nc.Checkpointer(ROOT, tiers=_tiers())
    _train(st, 1)
    ck.save_async(5, st).result()
    first = digest(st)
    _train(st, 2)
    _report({"first": first, "second": digest(st)})
    if int(K):
        _die_at_the_next_replica_round()
    ck.save_async(5, st).wait()
    os._exit(0)


def restore() -> None:
    st = _state(100 + RANK)
    tiers = [nc.LocalTier(ROOT)] if SCENARIO == "restore_fresh" else _tiers()
    with nc.Checkpointer(ROOT, tiers=tiers) as ck:
        step = ck.load_latest(st)
        _report({"step": step, "digest": digest(st), "last_restore": ck.last_restore})


if __name__ == "__main__":
    with gloo():
        {"save": save, "twice": twice, "restore": restore, "restore_fresh": restore}[SCENARIO]()
