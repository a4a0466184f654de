"""The systems of the multi-rank cases, rank-aware: DCP on a process group, nebula across ranks.

Each class adapts a single-process peer of :mod:`benchmarks.peers` to a rank of a job
(:mod:`benchmarks.rank_jobs`); :func:`make_peer` picks one by name and :data:`CALLS` says how
each is called, for the report.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

from benchmarks.peer_base import Peer, StateFn, fsync_path, quiet_dcp
from benchmarks.peers import DcpAsyncSave, DcpSave, Nebula

log = logging.getLogger(__name__)

#: systems of the multi-rank cases, in report order
SYSTEMS = ("nebula", "dcp_save", "dcp_async_save")
#: file names of one rank's shard: DCP ``__<R>_0.distcp``, nebula ``shard-g<G>-r<R>.safetensors``
DCP_SHARD = re.compile(r"__(\d+)_\d+\.distcp")
NEBULA_SHARD = re.compile(r"shard-g\d+-r(\d+)\.safetensors")


def _dcp_state(state: dict[str, Any]) -> dict[str, Any]:
    """``{"model", "optim", "step"}`` -> DCP's state dict through ``get_state_dict`` (FQN keys; DDP's
    ``module.`` prefix removed), as DCP's documentation saves a DDP / FSDP model."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(state["model"], optimizers=state["optim"])
    return {"model": msd, "optim": osd, "step": state["step"]}


class RankDcpSave(DcpSave):
    """``dcp.save`` of ``get_state_dict(model, opt)`` on every rank (collective)."""

    name = "dcp_save"
    calls = ("torch.distributed.checkpoint.save(get_state_dict(model, opt), checkpoint_id=dir, "
             "process_group=<gloo group of its own>) on every rank - default FileSystemWriter")
    durability = ("FileSystemWriter fsyncs its data (every rank) and .metadata (rank 0) files; the "
                  "benchmark adds the directory fsyncs DCP leaves out")

    def __init__(self, rank: int = 0, world: int = 1, group: Any = None) -> None:
        super().__init__()
        self.rank, self.world, self.group = rank, world, group

    def save(self, step: int, state_fn: StateFn) -> None:
        import torch.distributed.checkpoint as dcp

        path = self._new_path(step)
        with quiet_dcp():
            dcp.save(_dcp_state(state_fn()), checkpoint_id=str(path), process_group=self.group,
                     no_dist=self.world == 1)
        _fsync_dirs(path)

    def prune(self) -> None:
        if self.rank == 0:  # one rank deletes; the others only forget
            super().prune()
        self._older.clear()


class RankDcpAsyncSave(DcpAsyncSave):
    """``dcp.async_save`` of ``get_state_dict(model, opt)``; one save in flight at a time."""

    name = "dcp_async_save"
    calls = ("torch.distributed.checkpoint.async_save(get_state_dict(model, opt), checkpoint_id=dir, "
             "process_group=<gloo group of its own>) on every rank (thread; default stager); "
             "the future's result() for durable; the next save waits for the previous one")
    durability = ("FileSystemWriter fsyncs data and .metadata; the benchmark fsyncs the directories "
                  "once the future is done")

    def __init__(self, rank: int = 0, world: int = 1, group: Any = None) -> None:
        super().__init__()
        self.rank, self.world, self.group = rank, world, group

    def save(self, step: int, state_fn: StateFn) -> None:
        import torch.distributed.checkpoint as dcp

        self.wait_durable()
        path = self._new_path(step)
        with quiet_dcp():
            resp = dcp.async_save(_dcp_state(state_fn()), checkpoint_id=str(path), process_group=self.group,
                                  no_dist=self.world == 1)
        # torch >= 2.9 may return AsyncSaveResponse(staging_completion, upload_completion)
        self._future = cast(Future, getattr(resp, "upload_completion", resp))
        self._pending_path = path

    def prune(self) -> None:
        if self.rank == 0:
            super().prune()
        self._older.clear()


class TimedCoordinator:
    """Factory of a ``DistCoordinator`` whose rounds are timestamped (``events``: one dict per round
    with tier, index, phase, enter, exit, and the step for index rounds)."""

    @staticmethod
    def create() -> Any:
        from nebula_ckpt.ranks.distributed import DistCoordinator

        class _Timed(DistCoordinator):
            def __init__(self) -> None:
                super().__init__()
                self.events: list[dict[str, Any]] = []
                self._ev_lock = threading.Lock()

            def round(self, tier: str, index: int, phase: int, payload: Any) -> list[Any]:
                enter = time.monotonic()
                try:
                    return super().round(tier, index, phase, payload)
                finally:
                    ev = {"tier": tier, "index": index, "phase": phase, "enter": enter, "exit": time.monotonic(),
                          "step": payload.get("step") if isinstance(payload, dict) else None}
                    with self._ev_lock:
                        self.events.append(ev)

        return _Timed()


class RankNebula(Nebula):
    """nebula's ``Checkpointer(root)`` (default tiers), its coordinator timestamping the protocol's
    rounds: with several ranks, the :class:`TimedCoordinator` replaces the default
    ``DistCoordinator`` over all ranks it is a subclass of (the same protocol, timed)."""

    def __init__(self, world: int = 1) -> None:
        super().__init__()
        self.world = world
        self.coordinator: Any = None

    def open(self, root: Path | str) -> None:
        import nebula_ckpt as nc

        self.root = root if isinstance(root, Path) else None
        self.url = str(root)
        if isinstance(root, Path):
            root.mkdir(parents=True, exist_ok=True)
        self.coordinator = TimedCoordinator.create() if self.world > 1 else None
        self.ck = nc.Checkpointer(str(root), coordinator=self.coordinator)
        self._handle = None
        self._handles = []

    def events(self) -> list[dict[str, Any]]:
        """The timestamped rounds so far (empty in one process)."""
        return list(getattr(self.coordinator, "events", []))


def _fsync_dirs(path: Path) -> None:

    fsync_path(path)
    fsync_path(path.parent)


def make_peer(name: str, rank: int, world: int, group: Any) -> Peer:
    """The system ``name`` for this rank (``group``: DCP's own gloo group)."""
    if name == "nebula":
        return RankNebula(world)
    if name == "dcp_save":
        return RankDcpSave(rank, world, group)
    if name == "dcp_async_save":
        return RankDcpAsyncSave(rank, world, group)
    raise ValueError(f"unknown multi-rank system {name!r}; choose from {', '.join(SYSTEMS)}")


CALLS = {"nebula": "nc.Checkpointer(root) on every rank (default tiers; coordinates the ranks of the process "
                   "group itself; here with coordinator=a DistCoordinator subclass that only timestamps the "
                   "protocol's rounds); h = ck.save_async(step, {model, optim, step}); h.wait_snapshot(); "
                   "h.result()",
         "dcp_save": RankDcpSave.calls, "dcp_async_save": RankDcpAsyncSave.calls}


