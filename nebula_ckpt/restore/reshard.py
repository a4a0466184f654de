"""Restore a multi-rank checkpoint into another layout: other world size or mesh, or one process.

:func:`load_resharded` walks ``into`` the way the saver walks a state (dicts, lists and tuples
keyed by their path joined with ``/``; tensors and DTensors as leaves; objects with
``state_dict()`` replaced by their state dict and given it back with ``load_state_dict`` once
filled), hands the tensor leaves to ``torch.distributed.checkpoint.load`` through
:class:`~nebula_ckpt.restore.dcp_reader.NebulaStorageReader` (DCP's planner computes which stored pieces each
rank's tensors overlap, so DTensor local shards are filled in place), then sets the non-tensor
leaves (ints, learning rates, param_groups, ...) from the saved tree of the lowest rank.

Nothing in ``into`` changes before every key has been matched: a mismatch raises
:class:`~nebula_ckpt.errors.ValidationError` naming the key first.

:func:`gather_full` gathers every logical tensor as one full CPU tensor (the CLI's ``export``).
"""

from __future__ import annotations

import logging
import warnings
from contextlib import nullcontext
from typing import Any, ContextManager, Mapping, Optional

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from nebula_ckpt.errors import CorruptCheckpointError, NebulaError, ValidationError
from nebula_ckpt.format import manifest as mf
from nebula_ckpt.format.tree import decode, held_by_some, merged
from nebula_ckpt.ranks.distributed import meeting
from nebula_ckpt.restore.dcp_reader import NebulaStorageReader
from nebula_ckpt.restore.inplace import (
    check_not_meta,
    check_not_overlapping,
    check_optimizer_not_meta,
    check_optimizer_state,
    read_optimizer,
)
from nebula_ckpt.restore.walk import Thunk, TreeWalk, describe, tensor_keys
from nebula_ckpt.storage.base import Storage

log = logging.getLogger(__name__)


_OPTIM_HINT = ("if it is optimizer state of DTensor parameters, `into`'s optimizer has none yet: create it "
               "first (e.g. one optimizer.step() with zero gradients), or restore DCP-style state dicts from "
               "torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)")


def _creates_state(obj: Any) -> bool:
    """Whether ``obj`` is an optimizer whose ``load_state_dict`` makes the state it lacks from full
    tensors: one whose parameters are all plain tensors (a DTensor parameter's state must be a
    DTensor of its layout, which only an existing state shows)."""
    groups = getattr(obj, "param_groups", None)
    if not isinstance(groups, list) or not callable(getattr(obj, "load_state_dict", None)):
        return False
    params = [p for g in groups if isinstance(g, dict) for p in g.get("params", ())]
    return all(type(p) in (torch.Tensor, torch.nn.Parameter) for p in params)


def _dcp_load(flat: dict[str, Any], reader: NebulaStorageReader, process_group: Any, no_dist: bool) -> None:
    """``dcp.load`` of ``flat``; a failure on any rank is raised as the library error it was, and a
    rank that died or stalled in DCP's collectives as the :class:`PersistError` of the protocol's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings(), _collective(process_group, no_dist, f"resharded restore of {reader.where}"):
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(flat, storage_reader=reader, process_group=process_group, no_dist=no_dist)
    except CheckpointException as e:  # a BaseException: raised by DCP when some rank failed
        failures = sorted(e.failures.items())
        for rank, (exc, _) in failures:
            if isinstance(exc, NebulaError):
                raise type(exc)(f"rank {rank}: {exc}") from e
        rank, (exc, _) = failures[0] if failures else (-1, (e, None))
        raise NebulaError(f"resharded restore of {reader.where} failed on rank {rank}: "
                          f"{type(exc).__name__}: {exc}") from e


def _collective(process_group: Any, no_dist: bool, during: str) -> ContextManager[None]:
    """Where the ranks meet in a collective: a peer that died or stalled (gloo's ``RuntimeError``)
    is the :class:`PersistError` naming this rank that every other collective of ``load_latest``
    raises (in one process: nothing to meet, nothing converted)."""
    if no_dist:
        return nullcontext()
    import torch.distributed as dist

    return meeting(dist.get_rank(process_group), "within the timeout of its process group", during)


class _Matcher(TreeWalk[Optional[Thunk]]):
    """Matches a saved tree against ``into`` without changing anything: collects the tensors to
    fill (``flat``) and the deferred assignments / ``load_state_dict`` calls (``actions``).

    Each node gives a thunk making the value that replaces its part of ``into`` in the parent,
    or None when that part stays (filled in place)."""

    exact_sequences = False

    def __init__(self, reader: NebulaStorageReader, strict: bool, allow_pickle: bool) -> None:
        super().__init__(strict, f"reshard ({reader.where})")
        self.md = reader.metadata.state_dict_metadata
        self.src = reader.where
        self.step = reader.step
        self.allow_pickle = allow_pickle
        self.flat: dict[str, Any] = {}
        self.actions: list[Thunk] = []
        self._objects: list[Any] = []  # the objects being walked, innermost last

    def _decoded(self, node: Mapping[str, Any], path: str) -> Thunk:
        def make() -> Any:
            return decode(node, self._no_tensor, self.allow_pickle, path)
        return make

    @staticmethod
    def _no_tensor(key: str) -> Any:
        raise AssertionError(f"tensor {key} in a subtree without tensors")  # guarded by tensor_keys

    def _missing(self, node: Mapping[str, Any], path: str, why: str) -> Optional[Thunk]:
        """``node`` (saved) has nowhere to go in ``into``: a plain value replaces; tensors are an
        error (strict) or left out (logged)."""
        keys = tensor_keys(node, [])
        if not keys:
            return self._decoded(node, path)
        if len(_ndarray_keys(node, [])) == len(keys):  # NumPy values only (an RNG state): values
            return self._values(node, path)
        if self._objects and _creates_state(self._objects[-1]):
            # an optimizer of plain parameters without state yet (created, never stepped): its
            # load_state_dict makes the state from the full tensors, as at the same world size
            return self._values(node, path)
        if self.strict:
            raise ValidationError(f"{self.where}: checkpoint key '{keys[0]}' has no tensor to be "
                                  f"restored into: {why}. Build `into` like the saved state ({_OPTIM_HINT}), "
                                  "or pass strict=False to skip it")
        log.warning("nebula_ckpt: reshard (%s): not restoring %d tensor(s) under '%s' (%s)", self.src, len(keys),
                    path or "<root>", why)
        return None

    def is_object(self, node: Mapping[str, Any], target: Any) -> bool:
        inner = node["state"] if node["t"] == "stateful" else node
        return not isinstance(target, (torch.Tensor, dict, list, tuple)) \
            and callable(getattr(target, "state_dict", None)) and callable(getattr(target, "load_state_dict", None)) \
            and inner["t"] in ("dict", "odict")

    def on_object(self, node: Mapping[str, Any], target: Any, path: str) -> Optional[Thunk]:
        """The object's state dict is filled like a dict, then given back with ``load_state_dict``;
        an optimizer is first checked as a restore in place checks it (another kind's state is
        refused, strict or not: :func:`~nebula_ckpt.restore.inplace.check_optimizer_state`)."""
        shown = path or "<root>"
        check_optimizer_not_meta(target, shown, self.where)
        # the check reads keys and counts only: a tensor leaf of the groups (a tensor lr) is not read
        saved = read_optimizer(self.unwrap(node), target, lambda key: None, self.step, shown)
        check_optimizer_state(saved, target, shown, node.get("cls") if node["t"] == "stateful" else None)
        sd = target.state_dict()
        self.inside_object += 1
        self._objects.append(target)
        try:
            repl = self.walk(self.unwrap(node), sd, path)
        finally:
            self._objects.pop()
            self.inside_object -= 1
        self.actions.append(lambda: target.load_state_dict(sd if repl is None else repl()))
        return None

    def unwrap(self, node: Mapping[str, Any]) -> Mapping[str, Any]:
        return node["state"] if node["t"] == "stateful" else node

    def on_tensor(self, node: Mapping[str, Any], target: Any, path: str) -> Optional[Thunk]:
        key = node["k"]
        if target is None:  # nothing there yet: the saved tensor replaces it, as at the same layout
            return self._values(node, path)
        if not isinstance(target, torch.Tensor):
            return self._missing({"t": "tensor", "k": key}, path,
                                 f"`into` holds {type(target).__name__} at '{path or '<root>'}'")
        check_not_meta(target, path or "<root>", self.where)
        md = self.md.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise CorruptCheckpointError(f"{self.src}: the saved tree names tensor '{key}', which no rank stored")
        if tuple(target.shape) != tuple(md.size) or target.dtype != md.properties.dtype:
            raise ValidationError(
                f"{self.where}: key '{key}': checkpoint has {md.properties.dtype} of global shape "
                f"{tuple(md.size)}, `into` holds {target.dtype} {tuple(target.shape)}; build `into` with the "
                "saved model and dtypes (the layout may differ, the global shapes may not)")
        check_not_overlapping(target, path or "<root>", self.where)
        self.flat[key] = target
        return None

    def _buffer(self, key: str) -> torch.Tensor:
        """A tensor the load fills with stored tensor ``key`` whole (the one already planned, if any)."""
        md = self.md.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise CorruptCheckpointError(f"{self.src}: the saved tree names tensor '{key}', which no rank stored")
        buf = self.flat.get(key)
        if not isinstance(buf, torch.Tensor):
            buf = self.flat[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        return buf

    def _values(self, node: Mapping[str, Any], path: str) -> Thunk:
        """``node`` decoded as a value (its tensors read whole into buffers) that replaces ``into``'s."""
        bufs = {k: self._buffer(k) for k in tensor_keys(node, [])}
        return lambda: decode(node, bufs.__getitem__, self.allow_pickle, path)

    def on_missing(self, node: Mapping[str, Any], path: str) -> Optional[Thunk]:
        return self._missing(node, path, f"`into` has no entry '{path}'")

    def on_dict(self, node: Mapping[str, Any], target: dict[Any, Any], children: list[tuple[Any, Optional[Thunk]]],
                path: str) -> Optional[Thunk]:
        for k, repl in children:
            if repl is not None:
                self.actions.append(_setter(target, k, repl))
        return None

    def on_sequence(self, node: Mapping[str, Any], target: Any, children: list[Optional[Thunk]],
                    path: str) -> Optional[Thunk]:
        if isinstance(target, list):
            for i, repl in enumerate(children):
                if repl is not None:
                    self.actions.append(_setter(target, i, repl))
            return None
        if all(r is None for r in children):
            return None
        return lambda: tuple(target[i] if r is None else r() for i, r in enumerate(children))

    def on_value(self, node: Mapping[str, Any], target: Any, path: str) -> Optional[Thunk]:
        t = node["t"]
        if t == "ndarray":  # a NumPy leaf: its tensor is read into a buffer, then replaces `target`
            return self._values(node, path)
        if t in ("dict", "odict", "list", "tuple"):
            if target is None:  # `into` holds nothing there yet (a LoopState before its first epoch)
                return self._values(node, path)  # the saved value replaces it, as at the same layout
            if not tensor_keys(node, []):
                return self._missing(node, path, f"`into` holds {type(target).__name__} at '{path or '<root>'}'")
            raise ValidationError(f"{self.where}: '{path or '<root>'}' is a {t} of {len(node['v'])} "
                                  f"item(s) holding tensors in the checkpoint, `into` holds {describe(target)}; "
                                  "build `into` like the saved state")
        return self._decoded(node, path)  # a plain value: the saved one replaces what `into` holds


def _ndarray_keys(node: Any, out: list[str]) -> list[str]:
    """The tensor keys under ``node`` that NumPy ``ndarray`` nodes reference."""
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            if n.get("t") == "ndarray" and isinstance(n.get("v"), dict):
                out.append(n["v"].get("k"))
            else:
                stack.extend(v for v in n.values() if isinstance(v, (dict, list)))
        elif isinstance(n, list):
            stack.extend(n)
    return out


def _setter(container: Any, key: Any, make: Thunk) -> Thunk:
    def act() -> None:
        container[key] = make()
    return act


def _dist_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def load_resharded(storage: Storage, step: int, manifest: mf.Manifest, into: Any, *, process_group: Any = None,
                   strict: bool = True, allow_pickle: bool = False) -> None:
    """Restore checkpoint ``step`` (saved by any number of ranks) into ``into``, in place.

    Every rank of the current job calls it with the same structure of ``into`` (DCP's load is a
    collective over ``process_group``); in one process (no process group initialised) it runs alone.

    Args:
        storage: where the checkpoint lies (a tier holding every rank: the shared root).
        step: its step.
        manifest: its validated manifest (``Manifest.parse``).
        into: the state to fill: the same tree as saved (model, optimizer, values, ...), in any
            layout: DTensors of another mesh, plain full tensors, ...
        process_group: the group of the ranks restoring (None: the default group, if any).
        strict: a saved key a dict of ``into`` lacks, a key of ``into`` the checkpoint lacks, a
            saved tensor without a tensor to go into, or a tensor / object of ``into`` where the
            checkpoint holds something else raises :class:`ValidationError` naming the keys,
            before anything changes (else: a saved value is put in place, tensors without a place
            are logged and skipped, keys only ``into`` has are left as they are).
        allow_pickle: decode values stored with pickle (trusted checkpoints only).

    Raises:
        ValidationError: ``into`` does not match the saved state, or a tensor it would fill is on
            the meta device, strict or not (named key, and how to fix it).
        CorruptCheckpointError: the checkpoint is damaged (named key and file).
        PersistError: another rank died or stalled (gloo's closed connection or timeout) while
            the ranks matched ``into`` or inside DCP's load, naming this rank; the values of
            ``into`` are not set.
    """
    no_dist = process_group is None and not _dist_ready()
    error: Optional[Exception] = None
    try:
        reader = NebulaStorageReader(storage, step, manifest=manifest, allow_pickle=allow_pickle)
        matcher = _match(reader, manifest, into, strict, allow_pickle)
    except Exception as e:  # this rank's: every rank hears of it before DCP's collectives
        error = e
    if not no_dist:
        _agree(error, process_group, f"{storage.display_url} step {step}")
    if error is not None:
        raise error
    log.info("nebula_ckpt: resharding %s: %d tensor(s) of %d saved rank(s)", reader.where, len(matcher.flat),
             manifest.world_size)
    _dcp_load(matcher.flat, reader, process_group, no_dist=no_dist)
    for act in matcher.actions:
        act()


def _match(reader: NebulaStorageReader, manifest: mf.Manifest, into: Any, strict: bool,
           allow_pickle: bool) -> _Matcher:
    """Every key of the checkpoint matched against ``into``, nothing changed yet.

    Raises:
        ValidationError: ``into`` does not match (named key, and how to fix it).
    """
    trees = manifest.distinct_trees()
    matcher = _Matcher(reader, strict, allow_pickle)
    matcher.others = frozenset(held_by_some(trees))  # the ranks saved different state: pipeline stages
    repl = matcher.walk(merged(trees), into, "")
    if strict:
        matcher.unmatched.check(f"reshard ({reader.where}): the checkpoint")
    if repl is not None:
        raise ValidationError(f"reshard ({reader.where}): `into` ({describe(into)}) cannot be filled in place; "
                              "pass a dict, list, model or optimizer")
    return matcher


def _agree(error: Optional[Exception], process_group: Any, where: str) -> None:
    """The ranks of ``process_group`` tell each other whether their ``into`` matched before any
    enters DCP's collectives (a rank that stayed out would leave the others waiting there).

    Raises:
        ValidationError: on a rank whose ``into`` matched while another's did not, naming that
            rank and its error (nothing was restored); a :class:`CorruptCheckpointError` or
            :class:`NebulaError` where that rank's error was one.
        PersistError: a rank died or stalled before every rank was heard (naming this rank).
    """
    import torch.distributed as dist

    said: Optional[tuple[str, str]] = None if error is None else (type(error).__name__, str(error))
    heard: list[Optional[tuple[str, str]]] = [None] * dist.get_world_size(process_group)
    with _collective(process_group, False, f"resharded restore of {where}: matching `into`"):
        dist.all_gather_object(heard, said, group=process_group)
    failed = [(r, s) for r, s in enumerate(heard) if s is not None]
    if error is not None or not failed:
        return
    kinds = {kind for _, (kind, _) in failed}
    cls = ValidationError if kinds == {"ValidationError"} else \
        CorruptCheckpointError if kinds == {"CorruptCheckpointError"} else NebulaError
    rank, (kind, msg) = failed[0]
    raise cls(f"reshard ({where}): rank(s) {[r for r, _ in failed]} could not restore it ({kind} on rank {rank}: "
              f"{msg}); every rank matches its `into` before any reads, so nothing was restored")


def gather_full(storage: Storage, step: int, manifest: mf.Manifest, *, verify: bool = True) -> dict[str, torch.Tensor]:
    """Every logical tensor of checkpoint ``step`` as one full, unsharded CPU tensor.

    Keys are the saved keys without the ``r<R>/`` prefix (``"model/0.weight"``); DTensors are
    assembled from every rank's shard; a plain tensor is the lowest rank's. Runs in this process
    alone (no collectives, even inside a distributed job).

    Raises:
        CorruptCheckpointError: the checkpoint is damaged (named key and file).
    """
    reader = NebulaStorageReader(storage, step, manifest=manifest, verify=verify)
    out = {}
    for k in reader.keys:
        md = reader.metadata.state_dict_metadata[k]
        assert isinstance(md, TensorStorageMetadata)  # reader.keys are its tensors
        out[k] = torch.empty(md.size, dtype=md.properties.dtype)
    _dcp_load(out, reader, None, no_dist=True)
    return out
