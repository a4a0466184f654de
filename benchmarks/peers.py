"""The checkpointing systems the benchmark compares: torch.save (plain and on a thread as
Lightning does), safetensors, DCP (``save`` / ``async_save``, and ``async_save`` with pinned /
shared staging from :mod:`benchmarks.peers_staged`), torchsnapshot, Meta's
torch-checkpointing (:mod:`benchmarks.peers_staged`), nebula_ckpt (default tiers / local
only), and the bare snapshot copy as a floor; :data:`PEERS` names them in report order. The
interface and what "durable" means for all of them: :mod:`benchmarks.peer_base`.
"""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional, cast

import torch

from benchmarks.peer_base import (
    Peer,
    PeerUnavailable,
    StateFn,
    fsync_path,
    fsync_tree,
    list_files,
    load_plain,
    plain_state_dict,
    quiet_dcp,
)
from benchmarks.peers_staged import DcpAsyncSaveShared, TorchCheckpointing

log = logging.getLogger(__name__)



# --------------------------------------------------------------------------- torch.save

class TorchSave(Peer):
    name = "torch_save"
    blocking = True
    calls = "torch.save({model,optim state_dict(),step}, f); f.flush(); os.fsync; fsync(dir)"
    durability = "the benchmark fsyncs the file and its directory inside save() (blocking)"

    def save(self, step: int, state_fn: StateFn) -> None:
        path = self._new_path(step, ".pt")
        with open(path, "wb") as f:
            torch.save(plain_state_dict(state_fn()), f)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(path.parent)

    def restore(self, into: dict[str, Any]) -> int:
        assert self._latest is not None
        return load_plain(into, torch.load(self._latest, map_location="cpu", weights_only=True))


def _lightning_clone(t: torch.Tensor) -> torch.Tensor:
    # Lightning's AsyncCheckpointIO (lightning/pytorch/plugins/io/async_plugin.py, _clone_tensor)
    # snapshots on the caller thread: detach().clone() for CPU tensors, detach().cpu() for CUDA.
    return t.detach().clone() if t.is_cpu else t.detach().cpu()


def _clone_tree(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return _lightning_clone(obj)
    if isinstance(obj, dict):
        return {k: _clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone_tree(v) for v in obj)
    return obj


class TorchSaveThread(Peer):
    """What Lightning's ``AsyncCheckpointIO`` does.

    Mirrors Lightning (master, 2025): the training thread clones every tensor of the checkpoint
    dict (fresh allocation per save, CUDA tensors copied to pageable host memory), then submits
    ``torch.save`` to a ``ThreadPoolExecutor(max_workers=1)`` (its queue is unbounded) and
    returns. Lightning's ``_atomic_save`` writes through an fsspec transaction (temp file then
    move) and never fsyncs; the benchmark adds fsync(file) + rename + fsync(dir) on the worker
    thread so "durable" means the same as for the others.
    """

    name = "torch_save_thread"
    calls = ("caller: clone every tensor (detach().clone() / .cpu()), then "
             "ThreadPoolExecutor(1).submit(torch.save to tmp, rename) - Lightning AsyncCheckpointIO")
    durability = ("Lightning does not fsync; the benchmark fsyncs the file, renames, and fsyncs "
                  "the directory on the worker thread before the future completes")

    def open(self, root: Path) -> None:
        super().open(root)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-torch-save")
        self._futures: list[Future] = []

    def save(self, step: int, state_fn: StateFn) -> None:
        path = self._new_path(step, ".pt")
        snapshot = _clone_tree(plain_state_dict(state_fn()))
        self._futures.append(self._pool.submit(self._write, snapshot, path))

    @staticmethod
    def _write(obj: Any, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(path.parent)

    def wait_durable(self) -> None:
        futures, self._futures = self._futures, []
        for f in futures:
            f.result()

    def restore(self, into: dict[str, Any]) -> int:
        assert self._latest is not None
        return load_plain(into, torch.load(self._latest, map_location="cpu", weights_only=True))

    def close(self) -> None:
        self.wait_durable()
        self._pool.shutdown(wait=True)


# --------------------------------------------------------------------------- safetensors

def flatten_for_safetensors(sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Plain state dict -> (flat ``{key: tensor}``, string metadata).

    Tensors sharing storage (tied weights) are stored once; safetensors refuses shared tensors
    (``save_model`` drops the duplicates the same way). The non-tensor parts (optimizer
    ``param_groups``, the step, the alias map) go into the header metadata as JSON.
    """
    flat: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}

    def put(key: str, t: torch.Tensor) -> None:
        ident = (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape))
        if ident in seen:
            aliases[key] = seen[ident]
            return
        seen[ident] = key
        flat[key] = t.detach().contiguous()

    for k, t in sd["model"].items():
        put(f"model/{k}", t)
    for pid, st in sd["optim"]["state"].items():
        for k, v in st.items():
            put(f"optim/state/{pid}/{k}", v)
    meta = {"param_groups": json.dumps(sd["optim"]["param_groups"]), "step": str(sd["step"]),
            "aliases": json.dumps(aliases)}
    return flat, meta


def unflatten_safetensors(flat: dict[str, torch.Tensor], meta: dict[str, str]) -> dict[str, Any]:
    """Inverse of :func:`flatten_for_safetensors`."""
    for alias, key in json.loads(meta["aliases"]).items():
        flat[alias] = flat[key]
    model = {k[len("model/"):]: v for k, v in flat.items() if k.startswith("model/")}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for k, v in flat.items():
        if k.startswith("optim/state/"):
            _, _, pid, name = k.split("/", 3)
            state.setdefault(int(pid), {})[name] = v
    return {"model": model, "optim": {"state": state, "param_groups": json.loads(meta["param_groups"])},
            "step": int(meta["step"])}


class Safetensors(Peer):
    name = "safetensors"
    blocking = True
    calls = ("safetensors.torch.save_file(flat model+optimizer tensors, path, metadata=JSON of "
             "param_groups/step/aliases); tied tensors stored once")
    durability = "save_file does not fsync; the benchmark fsyncs the file and directory in save()"

    def check(self, target: str) -> None:
        super().check(target)
        try:
            import safetensors.torch  # noqa: F401
        except ImportError as e:
            raise PeerUnavailable(f"safetensors is not installed ({e}): pip install safetensors") from e

    def save(self, step: int, state_fn: StateFn) -> None:
        from safetensors.torch import save_file

        path = self._new_path(step, ".safetensors")
        flat, meta = flatten_for_safetensors(plain_state_dict(state_fn()))
        save_file(flat, str(path), metadata=meta)
        fsync_path(path)
        fsync_path(path.parent)

    def restore(self, into: dict[str, Any]) -> int:
        from safetensors import safe_open

        assert self._latest is not None
        with safe_open(str(self._latest), framework="pt", device="cpu") as f:
            meta = f.metadata()
            flat = {k: f.get_tensor(k) for k in f.keys()}
        return load_plain(into, unflatten_safetensors(flat, meta))


# --------------------------------------------------------------------------- torch.distributed.checkpoint

class DcpSave(Peer):
    name = "dcp_save"
    blocking = True
    calls = ("torch.distributed.checkpoint.save({model,optim state_dict()}, checkpoint_id=dir, "
             "no_dist=True) - default FileSystemWriter (sync_files=True, 1 thread), no process group")
    durability = ("FileSystemWriter fsyncs its data and .metadata files; the benchmark adds the "
                  "directory fsyncs DCP leaves out")

    def save(self, step: int, state_fn: StateFn) -> None:
        import torch.distributed.checkpoint as dcp

        path = self._new_path(step)
        with quiet_dcp():
            dcp.save(plain_state_dict(state_fn()), checkpoint_id=str(path), no_dist=True)
        fsync_path(path)
        fsync_path(path.parent)

    def restore(self, into: dict[str, Any]) -> int:
        import torch.distributed.checkpoint as dcp

        assert self._latest is not None
        sd = plain_state_dict({**into, "step": 0})
        with quiet_dcp():
            dcp.load(sd, checkpoint_id=str(self._latest), no_dist=True)
        return load_plain(into, sd)


class DcpAsyncSave(DcpSave):
    name = "dcp_async_save"
    blocking = False
    calls = ("torch.distributed.checkpoint.async_save(..., checkpoint_id=dir, no_dist=True): "
             "works without init_process_group in torch 2.13; default stager copies to CPU on the "
             "caller thread, upload on a thread; future.result() for durable")
    durability = ("FileSystemWriter fsyncs data and .metadata; the benchmark fsyncs the "
                  "directories in wait_durable()")

    def open(self, root: Path) -> None:
        super().open(root)
        self._future: Optional[Future] = None
        self._pending_path: Optional[Path] = None

    def save(self, step: int, state_fn: StateFn) -> None:
        import torch.distributed.checkpoint as dcp

        # one upload in flight at a time, as torchtitan does: wait for the previous one first
        self.wait_durable()
        path = self._new_path(step)
        with quiet_dcp():
            resp = dcp.async_save(plain_state_dict(state_fn()), checkpoint_id=str(path), no_dist=True)
        # torch >= 2.9 may return AsyncSaveResponse(staging_completion, upload_completion)
        self._future = cast(Future, getattr(resp, "upload_completion", resp))
        self._pending_path = path

    def wait_durable(self) -> None:
        if self._future is not None:
            self._future.result()
            self._future = None
        if self._pending_path is not None:
            fsync_path(self._pending_path)
            fsync_path(self._pending_path.parent)
            self._pending_path = None

    def close(self) -> None:
        self.wait_durable()


# --------------------------------------------------------------------------- torchsnapshot

class TorchSnapshot(Peer):
    name = "torchsnapshot"
    calls = ("torchsnapshot.Snapshot.async_take(dir, app_state={model, optim}) -> "
             "PendingSnapshot.wait(); Snapshot(dir).restore(app_state)")
    durability = ("torchsnapshot 0.1.0 writes with aiofiles and never fsyncs; the benchmark "
                  "fsyncs every file and directory of the snapshot in wait_durable()")
    overlaps_snapshot = False  # async_take returns after staging (checked by the restore fingerprint)

    def check(self, target: str) -> None:
        super().check(target)
        try:
            import torchsnapshot  # noqa: F401
        except Exception as e:  # ImportError, or an incompatibility raised at import
            raise PeerUnavailable(f"torchsnapshot cannot be imported: {type(e).__name__}: {e} "
                                  "(pip install torchsnapshot==0.1.0)") from e

    def open(self, root: Path) -> None:
        super().open(root)
        self._pending: Any = None
        self._pending_path: Optional[Path] = None

    def save(self, step: int, state_fn: StateFn) -> None:
        import torchsnapshot

        self.wait_durable()  # one snapshot in flight at a time
        path = self._new_path(step)
        st = state_fn()
        self._pending = torchsnapshot.Snapshot.async_take(
            str(path), app_state={"model": st["model"], "optim": st["optim"]})
        self._pending_path = path
        self._step = st["step"]

    def wait_durable(self) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        if self._pending_path is not None:
            fsync_tree(self._pending_path)
            self._pending_path = None

    def restore(self, into: dict[str, Any]) -> int:
        import torchsnapshot

        assert self._latest is not None
        torchsnapshot.Snapshot(str(self._latest)).restore(
            app_state={"model": into["model"], "optim": into["optim"]})
        return int(self._latest.name.split("_")[-1])

    def close(self) -> None:
        self.wait_durable()


# --------------------------------------------------------------------------- nebula_ckpt

class Nebula(Peer):
    """nebula_ckpt with its default tiers (memory tier in /dev/shm + the local root)."""

    name = "nebula"
    calls = ("nc.Checkpointer(root) (default tiers: /dev/shm memory tier + root); "
             "h = ck.save_async(step, {model, optim, step}); h.wait_snapshot(); h.result(); "
             "ck.load_latest(into=...)")
    durability = "nebula_ckpt's own: result() returns once every tier has committed"
    overlaps_snapshot = True
    local_only = False

    def check(self, target: str) -> None:
        try:
            import nebula_ckpt as nc

            nc.Checkpointer  # noqa: B018
        except (ImportError, AttributeError) as e:
            raise PeerUnavailable(f"nebula_ckpt.Checkpointer is not available: {e}") from e
        if self.local_only and "://" in target and not target.startswith("file://"):
            raise PeerUnavailable(f"{self.name} needs a local path; target {target} is a URL")

    def open(self, root: Path | str) -> None:
        import nebula_ckpt as nc

        self.root = root if isinstance(root, Path) else None
        self.url = str(root)
        if isinstance(root, Path):
            root.mkdir(parents=True, exist_ok=True)
        tiers = [nc.LocalTier(str(root))] if self.local_only else None
        self.ck = nc.Checkpointer(str(root), tiers=tiers)
        self._handle: Any = None
        self._handles: list[Any] = []

    def save(self, step: int, state_fn: StateFn) -> None:
        self._handle = self.ck.save_async(step, state_fn())
        self._handles.append(self._handle)

    def reset_counters(self) -> None:
        self._handles = []

    def counters(self) -> dict[str, Any]:
        # A busy tier drops a save rather than queueing it (SaveHandle.tiers_dropped): cheaper
        # for the training loop, and the report must say so.
        hs = self._handles
        return {"saves_seen": len(hs),
                "tiers_dropped": sum(len(getattr(h, "tiers_dropped", None) or []) for h in hs),
                "saves_skipped": sum(1 for h in hs if getattr(h, "skipped", None))}

    def wait_safe(self) -> None:
        if self._handle is not None:
            self._handle.wait_snapshot()

    def wait_durable(self) -> None:
        if self._handle is not None:
            self._handle.result()
            self._handle = None

    def restore(self, into: dict[str, Any]) -> int:
        step = self.ck.load_latest(into=into)
        if step is None:
            raise RuntimeError("nebula_ckpt load_latest() found no checkpoint")
        return int(step)

    def files(self) -> list[Path]:
        # the persistent tier: the newest committed step folder under the root
        if self.root is None or not self.root.exists():
            return []
        steps = [p for p in self.root.iterdir() if p.is_dir() and p.name.startswith("step-")
                 and p.name[5:].isdigit()]
        newest = max(steps, key=lambda p: int(p.name[5:]), default=None)
        return list_files(newest) if newest is not None else list_files(self.root)

    def prune(self) -> None:
        pass  # nebula_ckpt applies its own keep_last

    def memory_tier_dir(self) -> Optional[str]:
        """Folder of the memory tier (for its size), if this checkpointer has one."""
        for t in getattr(self.ck, "tiers", []) or []:
            if getattr(t, "kind", "") == "memory":
                return getattr(t, "path", None)
        return None

    def stats(self) -> dict[str, Any]:
        fn = getattr(self.ck, "stats", None)
        if fn is None:
            return {}
        try:
            return dict(fn())
        except Exception as e:  # stats are informative only; the report marks them n/a
            log.warning("nebula_ckpt stats() failed: %s", e)
            return {}

    def close(self) -> None:
        self.ck.close()


class NebulaLocal(Nebula):
    name = "nebula_local"
    calls = ("nc.Checkpointer(root, tiers=[nc.LocalTier(root)]); same calls as nebula")
    durability = "nebula_ckpt's own: result() returns once the local tier has committed"
    local_only = True


class SnapshotFloor(Peer):
    """A reference, not a checkpointer: the copy every host-memory snapshot has to make.

    The state's tensors go into one pre-faulted host buffer through nebula_ckpt's native copy
    engine (CRC32C taken while copying, as nebula_ckpt does), and nothing else: no files, no
    tiers. Its throughput overhead is the floor under any asynchronous checkpointer on this
    machine; what nebula_ckpt costs above it is its persist path.
    """

    name = "snapshot_floor"
    calls = "native copy of the state's tensors into one pre-faulted buffer; no I/O"
    durability = "none (nothing is written)"
    overlaps_snapshot = True

    def __init__(self) -> None:
        super().__init__()
        self._buf: Any = None
        self._job: Any = None

    def save(self, step: int, state_fn: StateFn) -> None:
        from nebula_ckpt.native import get_ops
        from nebula_ckpt.save.plan import make_plan

        plan = make_plan(step, state_fn())
        ops = get_ops()
        if self._buf is None or self._buf.numel() < plan.layout.total_bytes:
            # pinned for a GPU state, as nebula's own staging is: the floor is a DMA, not a pageable copy
            self._buf = ops.alloc(plan.layout.total_bytes, pinned=plan.sources.any_cuda())
        self._job = ops.enqueue_sources(plan.sources, self._buf)

    def wait_safe(self) -> None:
        if self._job is not None:
            self._job.wait()
            self._job = None

    def wait_durable(self) -> None:
        self.wait_safe()

    def close(self) -> None:
        self._buf = None


#: every system, in report order
PEERS: dict[str, type[Peer]] = {p.name: p for p in (
    TorchSave, TorchSaveThread, Safetensors, DcpSave, DcpAsyncSave, DcpAsyncSaveShared, TorchSnapshot,
    TorchCheckpointing, Nebula, NebulaLocal)}

#: systems of --quick (nebula and torch.save are always kept)
QUICK_PEERS = ("torch_save", "torch_save_thread", "nebula", "nebula_local")
