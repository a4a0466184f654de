"""One commit of ``torch_nebula``: a checkpoint's parts saved as one nebula_ckpt checkpoint with the
next step number, and its history entry, filled in once the save is over."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from nebula_ckpt import SaveHandle
from nebula_ckpt.compat.nebula.session import Parts, Session


def _nbytes(obj: Any) -> int:
    """Bytes of the tensors and arrays in ``obj`` (objects with ``state_dict()`` through it)."""
    total, stack, seen = 0, [obj], set()
    views: set[tuple[Any, ...]] = set()
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            try:  # tied weights: one storage under several keys is stored (and counted) once
                view = (o.untyped_storage().data_ptr(), o.storage_offset(), tuple(o.shape), o.dtype)
            except Exception:
                view = (id(o), 0, (), o.dtype)
            if view not in views:
                views.add(view)
                total += o.numel() * o.element_size()
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif hasattr(o, "nbytes") and hasattr(o, "dtype"):  # NumPy
            total += int(o.nbytes)
        elif callable(getattr(o, "state_dict", None)):
            try:
                stack.append(o.state_dict())
            except Exception:  # measuring never fails a save
                pass
    return total


def commit_parts(s: Session, p: Parts) -> None:
    """Save ``p``'s parts as one checkpoint with the next step (caller holds ``s.lock``)."""
    step = s.next_step
    tag = p.tag if p.tag is not None else f"step-{step}"
    state = {name: p.parts[name] for name in p.names}
    size = _nbytes(state)
    start = time.time()
    t0 = time.perf_counter()
    _first_tier_took_the_last(s)
    handle = s.ck.save_async(step, state, tag=tag)  # raises before anything is written on bad input
    s.last_handle = handle
    blocking = time.perf_counter() - t0
    s.next_step = step + 1
    p.tag, p.step, p.handle, p.parts = tag, step, handle, {}
    if s.pending.get(tag) is p:
        del s.pending[tag]
    entry: dict[str, Any] = {"tag": tag, "step": step, "parts": list(p.names), "size_bytes": size,
                             "start_time": start, "blocking_seconds": blocking, "duration_seconds": None,
                             "throughput_bytes_per_second": None, "tiers": [], "tiers_dropped": [],
                             "status": "pending"}
    s.histories.append(entry)
    w = threading.Thread(target=_watch, args=(s, handle, entry, t0), name=f"torch_nebula-history-{step}",
                         daemon=True)
    w.start()
    s.watchers = [t for t in s.watchers if t.is_alive()] + [w]


def _first_tier_took_the_last(s: Session) -> None:
    """Wait until the previous commit is written on the fastest tier (the memory tier: a few ms
    after its copy). A tier drops a save it has not started when a newer one arrives; Nebula
    kept every commit in memory, so a commit must never be dropped there."""
    prev = s.last_handle
    if prev is None or not s.ck.tiers:
        return
    first = s.ck.tiers[0].name
    while not prev.done() and first not in prev.tiers_written and first not in prev.tiers_dropped:
        prev.wait(0.002)


def _watch(s: Session, handle: SaveHandle, entry: dict[str, Any], t0: float) -> None:
    """Fill in a history entry once its save is over (never raises: the error stays the handle's)."""
    handle.wait()  # not result(): a failure stays unseen, so the next call raises it
    duration = time.perf_counter() - t0
    err = handle.error()
    with s.lock:
        entry["duration_seconds"] = duration
        entry["tiers"] = list(handle.tiers_written)
        entry["tiers_dropped"] = list(handle.tiers_dropped)
        if handle.skipped:
            entry["status"] = f"skipped: {handle.skipped}"
        elif err is not None:
            entry["status"] = f"failed: {type(err).__name__}: {err}"
        else:
            entry["status"] = "ok"
            entry["throughput_bytes_per_second"] = entry["size_bytes"] / duration if duration > 0 else None
