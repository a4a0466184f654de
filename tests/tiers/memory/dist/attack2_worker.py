"""One rank of the replica attack jobs of tests/tiers/memory/dist/test_attack_replicas2.py.

Usage: python attack2_worker.py SPEC_JSON OUT

``SPEC_JSON`` (one object, the same on every rank) says what this job does:

* ``root``, ``shm``: the root and the folder holding each simulated node's memory tier
  (``<shm>/n<id>``);
* ``nodes``: the node of each rank (a list of strings, by rank: ``NEBULA_NODE_ID`` is that string,
  the node's memory tier ``<shm>/n<index of its first rank's node in the list of distinct nodes>``
  unless ``shm_of`` names it);
* ``k``, ``keep``, ``disk_every``: ``MemoryTier(replicas=k, keep_last=keep)`` then
  ``LocalTier(root, every=disk_every)``;
* ``same``: every rank trains the same state (a replicated model, restorable in another world
  size); else each rank's state is its own;
* ``frozen``: a large tensor beside the trained ones that never changes (incremental steps);
* ``load``: ``"latest"`` (``load_latest``), a step number (``load(step)``), another string (the
  newest step with that tag: ``load(tag=...)``), or absent; ``tag``: the tag of every save;
* ``sleep``: seconds to wait after that (training elsewhere);
* ``save``: the steps to save after that, in order; ``wait``: wait for each handle before the next
  save (else save every iteration and wait for all at the end); ``seed``: varies the training
  (another run's steps of the same numbers hold other bytes);
* ``die``: ``[rank, step]``: that rank waits for its saves so far (their rounds are over on
  every rank), then SIGKILLs itself instead of saving that step;
* ``end``: ``"crash"`` (``os._exit``: nothing closed, the memory tiers stay) or ``"close"``
  (``close()`` right after the last save, before the handles not waited for are; its time
  reported).

Each rank writes ``OUT/r<rank>.json``: what it restored (step, digest, ``last_restore``), the
digest of every step it saved, each handle's outcome, ``stats()``, any error construction or a
restore raised (type and message).
"""

from __future__ import annotations

import glob
import json
import os
import signal
import sys
import time
from typing import Any

SPEC = json.loads(sys.argv[1])
OUT = sys.argv[2]
RANK = int(os.environ["RANK"])
NODE = SPEC["nodes"][RANK]
os.environ["NEBULA_NODE_ID"] = NODE
_SHM_NAME = SPEC.get("shm_of", {}).get(NODE) or f"n{list(dict.fromkeys(SPEC['nodes'])).index(NODE)}"
os.environ["NEBULA_SHM_DIR"] = os.path.join(SPEC["shm"], _SHM_NAME)
os.makedirs(os.environ["NEBULA_SHM_DIR"], exist_ok=True)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import nebula_ckpt as nc  # noqa: E402
from tests.dist.state_digest import digest as _digest  # noqa: E402


def _state() -> dict[str, Any]:
    torch.manual_seed(7 if SPEC.get("same") else 100 + RANK)
    model = torch.nn.Linear(32, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out: dict[str, Any] = {"model": model, "optim": opt, "extra": torch.zeros(64)}
    if SPEC.get("frozen"):
        out["frozen"] = torch.randn(256 * 1024, generator=torch.Generator().manual_seed(
            7 if SPEC.get("same") else RANK))
    _train(out, 0, 0)  # the optimizer has its state (a resharded restore needs it)
    return out


def _train(st: dict[str, Any], step: int, seed: int) -> None:
    who = 0 if SPEC.get("same") else RANK
    g = torch.Generator().manual_seed(100_000 * seed + 1000 * who + step)
    loss = st["model"](torch.randn(4, 32, generator=g)).square().mean()
    st["optim"].zero_grad()
    loss.backward()
    st["optim"].step()
    st["extra"].add_(who + step + seed)


def _report(data: dict[str, Any]) -> None:
    with open(os.path.join(OUT, f"r{RANK}.json"), "w") as f:
        json.dump(data, f, default=str)


def _error(e: BaseException) -> dict[str, str]:
    return {"type": type(e).__name__, "message": str(e)}


def _restore(ck: nc.Checkpointer, st: dict[str, Any], rep: dict[str, Any]) -> None:
    load = SPEC.get("load")
    if load is None:
        return
    try:
        if load == "latest":
            step = ck.load_latest(st)
        elif isinstance(load, str):  # a tag
            step = ck.load(tag=load, into=st)
        else:
            step = ck.load(int(load), st)
    except nc.NebulaError as e:
        rep["restore_error"] = _error(e)
        return
    rep.update(step=step, digest=_digest(st), last_restore=ck.last_restore)


def _saves(ck: nc.Checkpointer, st: dict[str, Any], rep: dict[str, Any]) -> list[Any]:
    """Save ``SPEC["save"]``; the handles not waited for yet."""
    digests, outcome, pending = {}, {}, []
    die = SPEC.get("die")
    for step in SPEC.get("save", []):
        if die and die[0] == RANK and die[1] == step:
            _settle(pending, outcome)  # every round before it is over, on every rank
            os.kill(os.getpid(), signal.SIGKILL)
        _train(st, step, int(SPEC.get("seed", 0)))
        h = ck.save_async(step, st, tag=SPEC.get("tag"))
        digests[step] = _digest(st)
        pending.append(h)
        if SPEC.get("wait", True):
            _settle(pending, outcome)
    rep.update(digests=digests, outcome=outcome)
    return pending


def _settle(pending: list[Any], outcome: dict[int, Any]) -> None:
    for h in pending:
        t0 = time.monotonic()
        try:
            h.result()
            outcome[h.step] = {"written": list(h.tiers_written), "dropped": list(h.tiers_dropped)}
        except nc.NebulaError as e:
            outcome[h.step] = {"error": _error(e), "written": list(h.tiers_written),
                               "dropped": list(h.tiers_dropped)}
        outcome[h.step]["wait_s"] = time.monotonic() - t0
    pending.clear()


def _held() -> dict[str, list[str]]:
    """This node's replica stores as listed: ``<folder>/replicas/<entry>`` -> its entries."""
    out = {}
    for d in glob.glob(os.path.join(os.environ["NEBULA_SHM_DIR"], "nebula_ckpt-*", "*", "replicas", "*")):
        out[os.path.relpath(d, os.environ["NEBULA_SHM_DIR"])] = sorted(os.listdir(d))
    return out


def main() -> None:
    rep: dict[str, Any] = {"rank": RANK, "node": NODE}
    tiers = [nc.MemoryTier(replicas=int(SPEC["k"]), keep_last=int(SPEC.get("keep", 1))),
             nc.LocalTier(SPEC["root"], every=int(SPEC.get("disk_every", 1000)))]
    try:
        ck = nc.Checkpointer(SPEC["root"], tiers=tiers)
    except nc.NebulaError as e:
        rep["init_error"] = _error(e)
        _report(rep)
        return
    st = _state()
    _restore(ck, st, rep)
    time.sleep(float(SPEC.get("sleep", 0)))
    pending = _saves(ck, st, rep)
    if SPEC.get("end", "crash") == "crash":
        _settle(pending, rep["outcome"])
        rep.update(stats=ck.stats(), held=_held())
        _report(rep)
        sys.stdout.flush()
        os._exit(0)
    t0 = time.monotonic()
    try:  # with the rounds of the saves not waited for still to run
        ck.close()
    except nc.NebulaError as e:
        rep["close_error"] = _error(e)
    rep["close_s"] = time.monotonic() - t0
    _settle(pending, rep["outcome"])
    rep.update(stats=ck.stats(), held=_held())
    _report(rep)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    main()
    dist.destroy_process_group()
