"""Restore an optimizer's state into the tensors it already holds, instead of new ones.

A job that restores into a running optimizer (a rollback, an evaluation loop, the benchmark's
in-process restore) already has its state tensors: same shapes, dtypes and device, every page
faulted in. ``torch.optim.Optimizer.load_state_dict`` keeps the tensors it is given when their
dtype and device already suit their parameter, so handing it those very tensors, refilled, costs
one copy of the checked bytes into memory that is resident already: no allocation, no page
fault per 4 KiB, and the state keeps its storages (a later save plans the same layout).

Only where ``load_state_dict`` is torch's own (no hooks, no override) and each live tensor is a
plain contiguous CPU tensor of the saved dtype and shape, held by no other destination, and each
saved tensor is named once; every other tensor gets an owned copy as before. The copies run
when the restore is applied, after every checksum of the checkpoint was checked
(:func:`~nebula_ckpt.restore.apply.stage_apply`): nothing changes before.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from nebula_ckpt.format.tree import decode
from nebula_ckpt.restore.open import OpenCheckpoint, chunks

_HOOKS = ("_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks",
          "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks")


def live_destinations(ck: OpenCheckpoint, state: Mapping[str, Any], target: Any, shown: str) -> dict[str, torch.Tensor]:
    """Tensor key of the saved optimizer ``state`` -> the tensor ``target`` holds for it now, for
    the keys that may be refilled in place (see the module docstring); empty when none may."""
    opt = torch.optim.Optimizer
    if not isinstance(target, opt) or type(target).load_state_dict is not opt.load_state_dict or \
            type(target).state_dict is not opt.state_dict or any(getattr(target, h, None) for h in _HOOKS) or \
            state.get("t") not in ("dict", "odict") or not target.state:
        return {}
    entries = {decode(k, ck.view, False, shown): v for k, v in state["v"]}
    saved_state, groups = entries.get("state"), entries.get("param_groups")
    if not isinstance(saved_state, dict) or saved_state.get("t") not in ("dict", "odict") or groups is None:
        return {}
    try:
        saved_ids = [i for g in decode(groups, ck.view, False, shown) for i in g["params"]]
    except Exception:  # not the layout torch writes: owned copies, as load_state_dict takes them
        return {}
    params = [p for g in target.param_groups for p in g["params"]]
    if len(saved_ids) != len(params):
        return {}
    by_id = dict(zip(saved_ids, params, strict=True))
    out: dict[str, torch.Tensor] = {}
    for pk, pv in saved_state["v"]:
        param = by_id.get(decode(pk, ck.view, False, shown))
        live = target.state.get(param) if param is not None else None
        if not isinstance(live, dict) or pv.get("t") not in ("dict", "odict"):
            continue
        for nk, nv in pv["v"]:
            have = live.get(decode(nk, ck.view, False, shown))
            if nv.get("t") == "tensor" and isinstance(have, torch.Tensor) and _suits(have, ck, nv["k"]):
                out[nv["k"]] = have
    return _distinct(ck, out)


def _suits(have: torch.Tensor, ck: OpenCheckpoint, key: str) -> bool:
    """Whether the live tensor ``have`` can take the saved tensor ``key``'s bytes as they are."""
    rec = ck.resolve(key)
    return type(have) is torch.Tensor and have.device.type == "cpu" and not have.requires_grad and \
        have.is_contiguous() and have.dtype == rec.torch_dtype and tuple(have.shape) == tuple(rec.shape) and \
        rec.dtensor is None and have.numel() > 0


def _distinct(ck: OpenCheckpoint, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``out`` without destinations that share a storage, or saved tensors named more than once
    (tied in the checkpoint: ``load_state_dict`` would give them one tensor)."""
    storages: dict[int, int] = {}
    records: dict[str, int] = {}
    for k, t in out.items():
        ptr = t.untyped_storage().data_ptr()
        storages[ptr] = storages.get(ptr, 0) + 1
        records[ck.resolve(k).key] = records.get(ck.resolve(k).key, 0) + 1
    return {k: t for k, t in out.items()
            if storages[t.untyped_storage().data_ptr()] == 1 and records[ck.resolve(k).key] == 1}


def refill(ck: OpenCheckpoint, dests: Mapping[str, torch.Tensor]) -> None:
    """Copy the checked bytes of each key of ``dests`` into its live tensor, in shard order a
    chunk at a time (each chunk's mapped pages read in one call, dropped once copied)."""
    by_rec = {ck.resolve(k).key: (k, t) for k, t in dests.items()}
    with torch.no_grad():
        for group in chunks([ck.resolve(k) for k in dests]):
            ck.populate(group)
            for r in group:
                k, t = by_rec[r.key]
                t.copy_(ck.view(k))
            ck.drop(group)
