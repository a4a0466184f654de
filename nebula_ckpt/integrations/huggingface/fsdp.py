"""FSDP's sharded state as part of one nebula_ckpt checkpoint (torch FSDP2 ``fully_shard``; any
model whose ``get_state_dict`` gives DTensors on a 1-D mesh): what a Hugging Face ``Trainer``
under accelerate's FSDP plugin saves and resumes, as plain functions of a model and an optimizer.

Every rank saves its own shards: :func:`sharded_state` is
``torch.distributed.checkpoint.state_dict.get_state_dict`` (model and optimizer state by
parameter name, each value a DTensor holding this rank's shard), stored under the checkpoint key
:data:`KEY` as DTensors (their global shape, offsets and mesh are recorded: ``nebula-ckpt export``
gathers them whole). A resume needs the world size and the 1-D mesh of every rank it was saved
with. A resume reads the checkpoint with
:func:`read_sharded` before the model is wrapped (a Trainer needs its trainer state that early)
and :func:`load_sharded` copies the shards into the wrapped model and optimizer through
``set_state_dict`` once they exist.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

import nebula_ckpt as nc

#: the checkpoint key of the FSDP state: ``{"model": ..., "optimizer": ...}`` (optimizer absent
#: with ``save_only_model``)
KEY = "fsdp"
#: a key of the tree :func:`read_sharded` restores into that no checkpoint holds (see there)
_PROBE = "\0mesh"


def raw_optimizer(optimizer: Any) -> Any:
    """The torch optimizer under accelerate's ``AcceleratedOptimizer`` (itself when not wrapped)."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=False, cpu_offload=False)


def sharded_state(model: torch.nn.Module, optimizer: Any = None) -> dict[str, Any]:
    """This rank's shards of ``model`` (and ``optimizer``, when given) as
    ``{"model": state dict, "optimizer": state dict}`` keyed by parameter name (``get_state_dict``).

    The tensors are the live ones (no copy): save them before training goes on. An optimizer
    without state yet gets it (one step with zero gradients at learning rate 0: ``get_state_dict``'s
    rule), so a resume has tensors to fill.

    Raises:
        NebulaError: a value is a ``ShardedTensor`` (FSDP1 without a device mesh), which a
            checkpoint cannot hold as shards.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    out: dict[str, Any]
    if optimizer is None:
        out = {"model": get_model_state_dict(model, options=_options())}
    else:
        msd, osd = get_state_dict(model, raw_optimizer(optimizer), options=_options())
        out = {"model": msd, "optimizer": osd}
    _refuse_sharded_tensors(out, KEY)
    return out


def _refuse_sharded_tensors(tree: Any, path: str) -> None:
    if isinstance(tree, dict):
        for k, v in tree.items():
            _refuse_sharded_tensors(v, f"{path}/{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            _refuse_sharded_tensors(v, f"{path}/{i}")
    elif type(tree).__name__ == "ShardedTensor":
        raise nc.NebulaError(f"nebula_ckpt: the FSDP state holds a ShardedTensor at '{path}' (FSDP1 without a "
                             "device mesh); nebula_ckpt stores DTensor shards: train with FSDP2 (transformers: "
                             "fsdp_config={'version': 2}) or give FSDP1 a device mesh")


def _probe(world: int) -> torch.Tensor:
    """An empty DTensor on a CPU mesh of every rank: in the tree a checkpoint is restored into, it
    gives the restore the mesh to put the saved DTensors on (no collective: ``run_check=False``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    mesh = init_device_mesh("cpu", (world,))
    return DTensor.from_local(torch.empty(0), mesh, [Replicate()], run_check=False)


def read_sharded(ck: nc.Checkpointer, step: Optional[int] = None, tag: Optional[str] = None) -> tuple[int, Any]:
    """``(step, tree)`` of the checkpoint of ``step``, tagged ``tag`` or (neither) the newest
    healthy one, read before the model is sharded: its DTensors come back on a CPU mesh of every
    rank (``Checkpointer.read`` needs the live ones), to be handed to :func:`load_sharded`.

    Raises:
        ValidationError: the checkpoint holds no FSDP state this job can read: saved by another
            number of ranks, or its DTensors on a mesh of more than one dimension.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return ck.read(step, tag=tag)  # no DTensor can have been saved by this process's kind of job
    world = dist.get_world_size()
    into: dict[str, Any] = {_PROBE: _probe(world)}
    try:
        if step is None and tag is None:
            got = ck.load_latest(into, strict=False)
            if got is None:
                raise nc.NotFoundError("no committed checkpoint to resume from")
        else:
            got = ck.load(step, into, strict=False, tag=tag)
    except nc.ValidationError as e:
        raise nc.ValidationError(f"{e} (an FSDP checkpoint is read before the model is sharded, onto a 1-D mesh of "
                                 f"all {world} ranks: resume with the world size it was saved with, on FSDP's "
                                 "default 1-D mesh)") from e
    del into[_PROBE]
    if KEY not in into:  # a job of another size reshards what it can into `into`: the shards are not among it
        saved = into.get("hf", {}).get("world_size") if isinstance(into.get("hf"), dict) else None
        raise nc.ValidationError(
            f"step {got}: no '{KEY}' state this job of {world} rank(s) can resume (keys read: {sorted(into)[:8]}"
            + (f"; saved by {saved} rank(s)" if saved else "") + "): resume an FSDP checkpoint with the world "
            "size it was saved with, or gather its weights with `nebula-ckpt export ROOT --key fsdp/model`")
    return got, into


def load_sharded(model: torch.nn.Module, optimizer: Any, saved: dict[str, Any]) -> None:
    """Copy ``saved`` (what :func:`sharded_state` gave at the save, as :func:`read_sharded` reads
    it) into this rank's shards of ``model`` and, when ``saved`` holds it, ``optimizer``
    (``set_state_dict``).

    Raises:
        ValidationError: the keys, global shapes, shardings or dtypes differ (another model, or
            another sharding), before anything is loaded.
    """
    from torch.distributed.checkpoint.state_dict import set_state_dict

    with_opt = "optimizer" in saved and optimizer is not None
    live = sharded_state(model, optimizer if with_opt else None)
    filled = _fill(saved, live, KEY)
    set_state_dict(model, raw_optimizer(optimizer) if with_opt else [], model_state_dict=filled["model"],
                   optim_state_dict=filled.get("optimizer", {}), options=_options())


def _fill(saved: Any, live: Any, path: str) -> Any:
    """``live`` with ``saved``'s values: tensors copied into (a DTensor's local shard), other
    values replaced. Checked whole first: nothing is written when anything differs."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    out = _pair(saved, live, path, pairs)
    with torch.no_grad():
        for src, dest in pairs:
            dest.copy_(src)
    return out


def _pair(saved: Any, live: Any, path: str, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    if isinstance(live, torch.Tensor):
        if not isinstance(saved, torch.Tensor):
            raise nc.ValidationError(f"resume: '{path}' is a tensor in the model but {type(saved).__name__} in the "
                                     "checkpoint: was it saved from another model?")
        src, dest = _local(saved), _local(live)
        if saved.shape != live.shape or src.shape != dest.shape or saved.dtype != live.dtype:
            raise nc.ValidationError(
                f"resume: '{path}': the checkpoint holds {saved.dtype} {tuple(saved.shape)} (this rank's shard "
                f"{tuple(src.shape)}), the model {live.dtype} {tuple(live.shape)} (shard {tuple(dest.shape)}): "
                "resume with the model, world size and FSDP sharding it was saved with")
        pairs.append((src, dest))
        return live
    if isinstance(live, dict) and isinstance(saved, dict):
        if set(live) != set(saved):
            only_saved = sorted(map(str, set(saved) - set(live)))[:5]
            only_live = sorted(map(str, set(live) - set(saved)))[:5]
            raise nc.ValidationError(f"resume: '{path}': keys only in the checkpoint {only_saved}, only in the model "
                                     f"{only_live}: resume with the model and optimizer it was saved with")
        for k in live:
            live[k] = _pair(saved[k], live[k], f"{path}/{k}", pairs)
        return live
    if isinstance(live, list) and isinstance(saved, list) and len(live) == len(saved):
        return [_pair(s, v, f"{path}/{i}", pairs) for i, (s, v) in enumerate(zip(saved, live, strict=True))]
    return saved


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t
