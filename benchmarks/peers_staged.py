"""Peers that stage the state into reusable host buffers and write it in the background:
``dcp.async_save`` with the ``DefaultStager`` of pinned / shared-memory staging (what
torchtitan's fastest mode, ``async_with_pinned_mem``, passes) and Meta's ``torch-checkpointing``
(``CheckpointManager``: staging on a thread, a writer process). Both are in
:data:`benchmarks.peers.PEERS`; the interface is :mod:`benchmarks.peer_base`'s.

For both, ``save()`` returns before the state is copied: :meth:`Peer.wait_safe` waits until it
is (the state must not change before), and the benchmark counts that wait as blocking.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any, Optional, cast

import torch

from benchmarks.peer_base import (
    Peer,
    PeerUnavailable,
    StateFn,
    fsync_path,
    fsync_tree,
    load_plain,
    plain_state_dict,
    quiet_dcp,
)


def _accelerator() -> bool:
    return torch.cuda.is_available()


class DcpAsyncSaveShared(Peer):
    name = "dcp_async_save_shared"
    calls = ("torch.distributed.checkpoint.async_save(..., no_dist=True, async_stager=DefaultStager("
             "StagingOptions(use_pinned_memory, use_shared_memory, use_async_staging, use_non_blocking_copy))), "
             "the stager reused across saves: all four True with a GPU (torchtitan's async_with_pinned_mem); "
             "on a CPU-only machine the last two need an accelerator and are False, and PyTorch ignores "
             "use_pinned_memory (page-locking needs CUDA): the staging buffers are shared memory, reused")
    durability = ("FileSystemWriter fsyncs data and .metadata; the benchmark fsyncs the directories in "
                  "wait_durable()")
    overlaps_snapshot = True

    def open(self, root: Path) -> None:
        import warnings

        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        super().open(root)
        gpu = _accelerator()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*pin.*memory.*")
            self._stager = DefaultStager(StagingOptions(True, True, gpu, gpu))
        self._staged: Optional[Future] = None
        self._upload: Optional[Future] = None
        self._pending: Optional[Path] = None

    def save(self, step: int, state_fn: StateFn) -> None:
        import torch.distributed.checkpoint as dcp

        self.wait_durable()  # one upload in flight, as torchtitan does
        path = self._new_path(step)
        with quiet_dcp():
            resp = dcp.async_save(plain_state_dict(state_fn()), checkpoint_id=str(path), no_dist=True,
                                  async_stager=self._stager)
        self._staged = getattr(resp, "staging_completion", None)
        self._upload = cast(Future, getattr(resp, "upload_completion", resp))
        self._pending = path

    def wait_safe(self) -> None:
        if self._staged is not None:
            self._staged.result()
            self._staged = None

    def wait_durable(self) -> None:
        self.wait_safe()
        if self._upload is not None:
            self._upload.result()
            self._upload = None
        if self._pending is not None:
            fsync_path(self._pending)
            fsync_path(self._pending.parent)
            self._pending = None

    def restore(self, into: dict[str, Any]) -> int:
        import torch.distributed.checkpoint as dcp

        assert self._latest is not None
        sd = plain_state_dict({**into, "step": 0})
        with quiet_dcp():
            dcp.load(sd, checkpoint_id=str(self._latest), no_dist=True)
        return load_plain(into, sd)

    def close(self) -> None:
        self.wait_durable()
        self._stager.close()


class TorchCheckpointing(Peer):
    name = "torch_checkpointing"
    calls = ("torch_checkpointing.CheckpointManager (0.1.1, Meta) with its defaults (asynchronous saver: "
             "staging on a thread into reused pinned/shared buffers, writes by a writer process) except "
             "LocalFileSystemStorageConfig(use_direct_io=False) and a 600 s subprocess start timeout; "
             "save(dir, {model, optim state_dict(), step}); `with manager.lock(): pass` until the state may "
             "change; the returned future for written")
    durability = ("torch-checkpointing never fsyncs; the benchmark fsyncs every file and directory in "
                  "wait_durable(). Its default O_DIRECT writer fails on ext4 (EINVAL on torch.save's "
                  "unaligned writes), hence use_direct_io=False")
    overlaps_snapshot = True

    def check(self, target: str) -> None:
        super().check(target)
        try:
            import torch_checkpointing  # noqa: F401
        except ImportError as e:
            raise PeerUnavailable("torch-checkpointing is not installed (make bench-deps)") from e

    def open(self, root: Path) -> None:
        from torch_checkpointing import AsyncCheckpointSaverConfig, CheckpointManager
        from torch_checkpointing.checkpoint_process import CheckpointProcessConfig
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        super().open(root)
        save = AsyncCheckpointSaverConfig(process_config=CheckpointProcessConfig(subprocess_init_timeout_secs=600))
        self._mgr = CheckpointManager(CheckpointManager.Config(
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False), save=save))
        self._written: Optional[Future] = None
        self._pending: Optional[Path] = None

    def save(self, step: int, state_fn: StateFn) -> None:
        self.wait_durable()
        path = self._new_path(step)
        self._written = self._mgr.save(str(path), plain_state_dict(state_fn()))
        self._pending = path

    def wait_safe(self) -> None:
        with self._mgr.lock():  # waits while a capture is in progress
            pass

    def wait_durable(self) -> None:
        if self._written is not None:
            self._written.result()
            self._written = None
        if self._pending is not None:
            fsync_tree(self._pending)
            self._pending = None

    def restore(self, into: dict[str, Any]) -> int:
        assert self._latest is not None
        got = self._mgr.load(str(self._latest), into=plain_state_dict({**into, "step": 0}))
        return load_plain(into, dict(got))

    def close(self) -> None:
        self.wait_durable()
        self._mgr.close()
