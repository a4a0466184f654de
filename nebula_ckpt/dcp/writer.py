"""Write nebula_ckpt checkpoints with ``torch.distributed.checkpoint`` (DCP).

:class:`NebulaStorageWriter` is a DCP ``StorageWriter``: ``dcp.save`` and ``dcp.async_save``
write a normal nebula_ckpt checkpoint, on one process or on N ranks::

    import torch.distributed.checkpoint as dcp
    from nebula_ckpt.dcp import NebulaStorageWriter

    dcp.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 100},
             storage_writer=NebulaStorageWriter("/ckpt/run-42", step=100))

What lands on storage is the layout of :mod:`nebula_ckpt.format.manifest`: every rank writes its
share ``step-N/shard-g<G>-r<R>.safetensors`` (fsync'd, CRC32C of every tensor), and the
coordinator rank writes ``manifest.json`` and the ``COMMIT`` marker in :meth:`finish`, which DCP
calls only after every rank's ``write_data`` returned, i.e. after every shard is durable. So
``Checkpointer(root).load_latest`` (same world size, or resharded) and
:class:`~nebula_ckpt.dcp.reader.NebulaStorageReader` (any world size) read it, and
``nebula-ckpt verify`` checks it.

How DCP's items map onto the format:

* **keys**: DCP flattens a nested state dict to dotted FQNs and records each one's path
  (``planner_data``); the manifest stores the *path* joined with ``/`` (``"model/0.weight"``,
  ``"optim/state/0/exp_avg"``): the same keys ``Checkpointer.save`` gives the same state, and the
  typed tree is rebuilt from the paths. DCP turns every dict key into a string; the one int-keyed
  dict of real state dicts, a ``torch.optim`` state dict's ``state``, is recognised (its keys are
  the ints of ``param_groups[*]["params"]``) and gets its int keys back. Without path
  information (a planner that does not flatten) every FQN is a top-level key.
* **tensors** (``TENSOR`` items) are stored like any tensor; DCP stores a tensor every rank holds
  once (its dedup), and the other ranks' keys are aliases of that copy (DCP semantics: one value
  per non-DTensor key). Tensors tied within one rank are stored once.
* **DTensor shards** (``SHARD`` items) become the rank's local shard with a ``dtensor`` record:
  global shape, the chunk's offsets, placements and mesh shape from the DTensor (``Shard`` /
  ``Replicate`` only: other placements are refused naming the key; a legacy ``ShardedTensor``
  chunk gets a one-dimensional placement derived from the chunk).
  Replicated chunks DCP writes once are aliases on the other ranks.
* **non-tensor values** (``BYTE_IO`` items, which DCP serialises with ``torch.save``) are
  loaded back with ``weights_only=True`` and stored in the typed tree when they are plain values
  (numbers, strings, bools, None, dtypes, devices, lists / tuples / dicts of them): no pickle.
  Anything else is refused (``ValidationError`` naming the key) unless
  ``allow_pickle=True``, which stores it as a pickled leaf of the tree; reading it back then
  needs ``allow_pickle=True`` as well (``Checkpointer(..., allow_pickle=True)``,
  ``NebulaStorageReader(..., allow_pickle=True)``). Empty dicts and lists leave no item in DCP's
  plan and so are not stored (as with DCP's own format).

Commit protocol and crash safety: the coordinator refuses a step that is already committed,
takes a writer generation on the root (once per process and root, :mod:`nebula_ckpt.ranks.fencing`:
a newer writer on the same root fences this one), removes leftovers of failed writes, and hands
every rank ``(step, generation)`` through DCP's global plan. Each rank writes its shard and
returns one record per item (offsets, CRC32C taken before and re-checked after the write). In
:meth:`finish` the coordinator checks every rank's shard is there with its size, builds and
strictly re-parses the manifest, checks that a :class:`~nebula_ckpt.dcp.reader.NebulaStorageReader`
accepts it, then writes ``manifest.json`` and the create-only ``COMMIT`` last. A failure on any
rank means DCP never calls :meth:`finish`: no ``COMMIT``, the step stays invisible; the failing
rank removes its own shard at once (and the step folder, if that emptied it), the others' are
removed by this process's next DCP save on the root (or by any later writer of a newer
generation, ``Checkpointer`` retention included). A ``COMMIT`` write that reports an error may
still have created the marker (a lost response on a blob store): then nothing of the step is
removed, and the error says the step may have committed.

A job that resumes with ``Checkpointer`` and saves with DCP (or saves with both) shares one
generation in each process: they do not fence each other. Do not run a ``Checkpointer`` save and
a DCP save of the same root at the same moment.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
import os
import re
import socket
import threading
import uuid
from typing import Any, Callable, Optional, Union

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from nebula_ckpt.errors import ConsistencyError, FencedError, NebulaError, PersistError, ValidationError
from nebula_ckpt.format import manifest as mf
from nebula_ckpt.format.commit import Commit, step_dirs
from nebula_ckpt.format.dtypes import TENSOR_DTYPES, dtype_name
from nebula_ckpt.format.header import safetensors_header
from nebula_ckpt.format.names import (
    COMMIT,
    MANIFEST,
    WRITERS_DIR,
    parse_step_dir,
    shard_name,
    shard_owner,
    step_dir,
)
from nebula_ckpt.format.tree import MAX_DEPTH, MAX_INT_BITS, Node, encode_leaf
from nebula_ckpt.native import byte_view, get_ops
from nebula_ckpt.ranks.coordinator import LocalCoordinator
from nebula_ckpt.ranks.fencing import Fence
from nebula_ckpt.save.plan import check_step, placement_codes
from nebula_ckpt.storage.base import Storage, never_created
from nebula_ckpt.storage.urls import refuse_url_credentials

log = logging.getLogger(__name__)

StepId = Union[int, str, "os.PathLike[str]"]
Held = tuple[str, Optional[tuple[int, ...]]]   # (fqn, chunk offsets) of a tensor item; offsets None: a value

_RESERVED = frozenset({"__metadata__"})
_WRITER_RE = re.compile(r"g-([0-9]+)\.json")
#: a tensor a rank stores: (manifest key, its record, its bytes, their version counter)
_Stored = tuple[str, dict[str, Any], torch.Tensor, int]


# -- what travels through DCP's plans and write results (pickled by DCP's collectives) ----------------

@dataclasses.dataclass(frozen=True)
class _LocalPlanData:
    """``SavePlan.storage_data`` of a rank's local plan: every item it holds, before DCP's dedup."""

    held: tuple[Held, ...]


@dataclasses.dataclass(frozen=True)
class _GlobalPlanData:
    """``SavePlan.storage_data`` of the global plan: where and as whom a rank writes."""

    step: int
    generation: int
    world: int
    rank: int
    save_id: str


@dataclasses.dataclass(frozen=True)
class _Written:
    """``WriteResult.storage_data``: one item a rank wrote. ``shard`` is the same dict for every
    item of a rank (pickled once)."""

    save_id: str
    rank: int
    fqn: str
    offsets: Optional[tuple[int, ...]]       # tensor items: chunk offsets; None: a value
    key: str                                 # the manifest key (rank prefix included)
    record: Optional[dict[str, Any]]         # the tensor record; None: a value or an alias
    alias_of: Optional[str]                  # a tensor tied to another one this rank stored
    node: Optional[Node]                     # a value: its typed-JSON node
    shard: dict[str, Any]                    # {"file", "bytes", "storage"} of the rank's shard


# -- keys and values -----------------------------------------------------------------------------------

def _paths(planner_data: Any) -> dict[str, tuple[Any, ...]]:
    """FQN -> its path in the nested state dict (DCP's flattening mappings), when there are any."""
    if not isinstance(planner_data, dict):
        return {}
    return {k: tuple(v) for k, v in planner_data.items() if isinstance(k, str) and isinstance(v, (tuple, list)) and v}


def _key(fqn: str, paths: dict[str, tuple[Any, ...]]) -> str:
    return "/".join(str(p) for p in paths.get(fqn, (fqn,)))


def _check_keys(fqns: list[str], paths: dict[str, tuple[Any, ...]]) -> None:
    """Every FQN gets a distinct, storable manifest key (raised before anything is written)."""
    seen: dict[str, str] = {}
    for fqn in fqns:
        key = _key(fqn, paths)
        if not key or key in _RESERVED:
            raise ValidationError(f"NebulaStorageWriter: state key '{fqn}' maps to the key {key!r}, which the "
                                  "format cannot store (empty, or reserved by safetensors); rename it")
        other = seen.setdefault(key, fqn)
        if other != fqn:
            raise ValidationError(f"NebulaStorageWriter: state keys '{other}' and '{fqn}' both become '{key}' "
                                  "(paths are joined with '/'): rename one of them")


class _NotPlain(Exception):
    """A value typed JSON cannot hold (the message says why)."""


def _encode_plain(value: Any, path: str, depth: int = 0) -> Node:
    """Typed JSON of a plain value (no tensors, no pickle); :class:`_NotPlain` otherwise."""
    if depth > MAX_DEPTH:
        raise _NotPlain(f"nested more than {MAX_DEPTH} levels")
    if isinstance(value, torch.Tensor):
        raise _NotPlain("it holds a tensor")
    if isinstance(value, dict):
        items = []
        for k, v in value.items():
            if type(k) is str:
                kn: Node = {"t": "str", "v": k}
            elif type(k) is int and k.bit_length() <= MAX_INT_BITS:
                kn = {"t": "int", "v": k}
            else:
                raise _NotPlain(f"dict key {k!r} of type {type(k).__name__}")
            items.append([kn, _encode_plain(v, f"{path}/{k}", depth + 1)])
        return {"t": "odict" if type(value) is not dict else "dict", "v": items}
    if isinstance(value, torch.Size):
        return {"t": "size", "v": list(value)}
    if type(value) in (list, tuple):
        return {"t": "list" if type(value) is list else "tuple",
                "v": [_encode_plain(v, f"{path}/{i}", depth + 1) for i, v in enumerate(value)]}
    if isinstance(value, (list, tuple)):
        raise _NotPlain(f"{type(value).__name__} (a subclass of list / tuple) would come back as a plain one")
    if type(value) is int and value.bit_length() > MAX_INT_BITS:
        raise _NotPlain(f"an int of {value.bit_length()} bits")
    try:
        return encode_leaf(value, path, False)
    except ValidationError:
        raise _NotPlain(f"a value of type {type(value).__module__}.{type(value).__qualname__}") from None


def _encode_value(fqn: str, data: Any, allow_pickle: bool) -> Node:
    """The typed-JSON node of a DCP bytes item (``torch.save`` bytes of the value)."""
    raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
    try:
        value = torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as e:
        if not allow_pickle:
            raise ValidationError(
                f"NebulaStorageWriter: state key '{fqn}' is not a plain value (torch.load(weights_only=True) "
                f"refuses it: {type(e).__name__}: {str(e)[:200]}); typed JSON cannot hold it. Convert it, or pass "
                "NebulaStorageWriter(..., allow_pickle=True) to store it with pickle (reading it back will need "
                "allow_pickle=True too)") from None
        # our own bytes, made from the live object a moment ago in this process
        value = torch.load(io.BytesIO(raw), weights_only=False)
    try:
        return _encode_plain(value, fqn)
    except _NotPlain as why:
        if not allow_pickle:
            raise ValidationError(
                f"NebulaStorageWriter: state key '{fqn}' cannot be stored as typed JSON ({why}). Convert it, or "
                "pass NebulaStorageWriter(..., allow_pickle=True) to store it with pickle (reading it back will "
                "need allow_pickle=True too)") from None
        return encode_leaf(value, fqn, True)


# -- the typed tree from DCP's paths -------------------------------------------------------------------

class _Box:
    """A container being rebuilt from paths: ``kind`` "dict" or "list", children by key / index."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.items: dict[Any, Any] = {}     # key -> _Box or a leaf (node, value)


_Leaf = tuple[Node, Any]   # (typed-JSON node, python value for values / None for tensors)


def _insert(root: _Box, path: tuple[Any, ...], leaf: _Leaf, fqn: str) -> None:
    box = root
    for i, part in enumerate(path):
        last = i == len(path) - 1
        want = "list" if type(part) is int else "dict"
        if box.kind != want:
            raise ValidationError(f"NebulaStorageWriter: state key '{fqn}': its path {list(path)} mixes list "
                                  "indices and dict keys at one level")
        if last:
            if part in box.items:
                raise ValidationError(f"NebulaStorageWriter: state key '{fqn}' occurs twice in the state")
            box.items[part] = leaf
            return
        nxt = box.items.get(part)
        if nxt is None:
            nxt = box.items[part] = _Box("list" if type(path[i + 1]) is int else "dict")
        elif not isinstance(nxt, _Box):
            raise ValidationError(f"NebulaStorageWriter: state key '{fqn}' lies under another value's key")
        box = nxt


def _params_of(groups: Any) -> Optional[list[Any]]:
    """The ``params`` of every ``param_groups`` entry (a torch.optim state dict), or None."""
    if not isinstance(groups, _Box) or groups.kind != "list" or not groups.items:
        return None
    out: list[Any] = []
    for g in groups.items.values():
        params = g.items.get("params") if isinstance(g, _Box) and g.kind == "dict" else None
        if params is None or isinstance(params, _Box):
            return None
        value = params[1]
        if not isinstance(value, list):
            return None
        out.extend(value)
    return out


def _optimizer_keys(box: _Box) -> None:
    """Give a torch.optim state dict's ``state`` its int keys back (DCP made them strings), and
    its ``state`` back when it was empty (DCP stores no item for an empty dict)."""
    for child in box.items.values():
        if isinstance(child, _Box):
            _optimizer_keys(child)
    if box.kind != "dict":
        return
    params = _params_of(box.items.get("param_groups"))
    if params is None:
        return
    state = box.items.get("state")
    if state is None:
        new = _Box("dict")
        box.items = {"state": new, **box.items}
        return
    if not isinstance(state, _Box) or state.kind != "dict":
        return
    ints = {str(p): p for p in params if type(p) is int}
    if ints and state.items and all(type(k) is str and k in ints for k in state.items):
        state.items = {ints[k]: v for k, v in state.items.items()}


def _to_node(box: _Box) -> Node:
    if box.kind == "list":
        n = max(box.items) + 1 if box.items else 0
        return {"t": "list", "v": [_child(box.items[i]) if i in box.items else {"t": "none"} for i in range(n)]}
    return {"t": "dict", "v": [[{"t": "int" if type(k) is int else "str", "v": k}, _child(v)]
                               for k, v in box.items.items()]}


def _child(v: Any) -> Node:
    return _to_node(v) if isinstance(v, _Box) else v[0]


# -- tensors ---------------------------------------------------------------------------------------------

def _crc(b: torch.Tensor) -> int:
    return get_ops().crc32c(b, [0], [b.numel()])[0] if b.numel() else 0


def _placements(obj: Any, fqn: str, item: WriteItem, world: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Placements and mesh shape of the DTensor behind a SHARD item (derived from the chunk for
    other sharded tensors: ``S(d)`` on the first dimension it does not span, over ``world``)."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        codes = placement_codes(obj.placements, f"NebulaStorageWriter: state key '{fqn}'")
        return codes, tuple(int(n) for n in obj.device_mesh.shape)
    td = item.tensor_data
    assert td is not None and td.chunk is not None
    dims = [d for d, (n, g) in enumerate(zip(td.chunk.sizes, td.size, strict=True)) if n != g]
    return (f"S({dims[0]})" if dims else "R",), (max(1, world),)


# -- the writer --------------------------------------------------------------------------------------------

#: writer generation per (process, root): one job writing many steps keeps one generation
_GENERATIONS: dict[str, int] = {}
#: steps whose save this process (the coordinator) planned on a root and did not finish: DCP runs
#: one save at a time per process group, so when the next one is planned these have failed
_UNFINISHED: dict[str, set[int]] = {}
_GEN_LOCK = threading.Lock()


def _process_start() -> float:
    """When this process started (seconds since the epoch); +inf where it cannot be told."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])   # field 22: starttime, in clock ticks
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return math.inf


def _generations(storage: Storage) -> list[int]:
    return sorted(int(m.group(1)) for m in (_WRITER_RE.fullmatch(n) for n in storage.list(WRITERS_DIR)) if m)


def _taken_here(storage: Storage, g: int) -> bool:
    """Whether generation ``g`` was taken by this very process (a Checkpointer of it, say)."""
    try:
        rec = json.loads(storage.read_small(f"{WRITERS_DIR}/g-{g}.json"))
    except (OSError, ValueError):
        return False
    return isinstance(rec, dict) and rec.get("host") == socket.gethostname() and rec.get("pid") == os.getpid() \
        and isinstance(rec.get("time"), (int, float)) and rec["time"] >= _process_start() - 1.0


class _ProcessGeneration(LocalCoordinator):
    """Hands :class:`Fence` this process's generation on the root: the one it took before, or the
    newest one when this process took it (a ``Checkpointer`` of the same job: they share it
    rather than fence each other), else a new one."""

    def __init__(self, storage: Storage, fixed: Optional[int] = None) -> None:
        self.storage = storage
        self.fixed = fixed

    def shared_generation(self, take: Callable[[], int]) -> int:
        if self.fixed is not None:
            return self.fixed
        st = self.storage
        with _GEN_LOCK:
            g = _GENERATIONS.get(st.display_url)
            gens = _generations(st)
            if gens and (g is None or gens[-1] > g) and _taken_here(st, gens[-1]):
                g = gens[-1]
            if g is None or g not in gens:  # none yet, or the root was deleted and made again
                g = take()
            _GENERATIONS[st.display_url] = g
            return g


def _split_id(checkpoint_id: StepId) -> tuple[Optional[str], Optional[int]]:
    """``7`` / ``"step-7"`` -> ``(None, 7)``; ``"<root>/step-7"`` -> ``(root, 7)``; a root -> ``(root, None)``."""
    if isinstance(checkpoint_id, bool):
        raise ValidationError(f"NebulaStorageWriter: checkpoint_id must be a step or a path, got {checkpoint_id!r}")
    if isinstance(checkpoint_id, int):
        return None, check_step(checkpoint_id)
    text: Any = os.fspath(checkpoint_id)
    if not isinstance(text, str):
        raise ValidationError(f"NebulaStorageWriter: checkpoint_id must be a str path, got {type(text).__name__}")
    text = text.rstrip("/")
    step = parse_step_dir(text)
    if step is not None:
        return None, step
    head, _, tail = text.rpartition("/")
    step = parse_step_dir(tail) if head else None
    return (head, step) if step is not None else (text, None)


class NebulaStorageWriter(StorageWriter):
    """A DCP ``StorageWriter`` that writes one nebula_ckpt checkpoint (any world size).

    Args:
        root: the checkpoint root (a path or fsspec URL), or ``"<root>/step-N"``.
        step: the step to write; or give it as ``checkpoint_id`` to ``dcp.save`` (an int,
            ``"step-N"`` or ``"<root>/step-N"``), or in ``root``.
        storage_options: fsspec options for a remote root.
        allow_pickle: store values typed JSON cannot hold with pickle (see the module docstring).

    Construct it on every rank with the same arguments. A step that is already committed under
    the root is refused (:class:`ValidationError` naming it); use a new writer, or pass a new
    ``checkpoint_id``, for every save. Errors raised inside DCP's phases reach the caller
    wrapped in DCP's ``CheckpointException`` (its ``failures`` hold each rank's error).
    """

    def __init__(self, root: Union[str, "os.PathLike[str]"], step: Optional[int] = None, *,
                 storage_options: Optional[dict[str, Any]] = None, allow_pickle: bool = False) -> None:
        super().__init__()
        self.allow_pickle = allow_pickle
        self._storage_options = storage_options
        self._storage: Optional[Storage] = None
        self._root: Optional[str] = None
        self.step: Optional[int] = None if step is None else check_step(step)
        self.rank = 0
        self.is_coordinator = True
        self.save_id = uuid.uuid4().hex
        self._held: list[tuple[Held, ...]] = []
        self._keys: list[dict[str, str]] = []
        self._paths_of: list[dict[str, tuple[Any, ...]]] = []
        self._gen: Optional[int] = None
        self._wrote_manifest = False
        self._set_root_and_step(root, step)

    # -- where -----------------------------------------------------------------------------------

    def _set_root_and_step(self, root: Optional[StepId], step: Optional[int]) -> None:
        refuse_url_credentials(root)  # before it is parsed or shown in any message
        id_root, id_step = _split_id(root) if root is not None else (None, None)
        if step is not None and id_step is not None and id_step != step:
            raise ValidationError(f"NebulaStorageWriter: {root!r} names step {id_step}, but step={step} was given")
        if id_step is not None:
            self.step = id_step
        if id_root is not None and id_root != self._root:
            from nebula_ckpt.dcp.reader import _storage_for

            storage = _storage_for(id_root, self._storage_options)
            self.close()
            self._storage, self._root = storage, id_root
        if self._storage is None:
            raise ValidationError(f"NebulaStorageWriter: {root!r} names a step but no root; pass the root first")

    @property
    def storage(self) -> Storage:
        """The root's storage."""
        assert self._storage is not None
        return self._storage

    @property
    def checkpoint_id(self) -> Optional[str]:
        """``<root>/step-N`` (display form, never with credentials); None before a step is set."""
        if self.step is None:
            return None
        return f"{self.storage.display_url.rstrip('/')}/{step_dir(self.step)}"

    @property
    def where(self) -> str:
        return f"{self.storage.display_url} step {self.step}"

    def close(self) -> None:
        """Release the root's storage (connections of a remote root)."""
        if self._storage is not None:
            self._storage.close()
            self._storage = None
            self._root = None

    def __enter__(self) -> "NebulaStorageWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the StorageWriter protocol --------------------------------------------------------------

    def reset(self, checkpoint_id: Optional[StepId] = None) -> None:
        """Start a new save; ``checkpoint_id``: the step (an int or ``"step-N"``) or ``"<root>/step-N"``
        (a bare root keeps the step given before)."""
        if checkpoint_id is not None:
            self._set_root_and_step(checkpoint_id, None)
        self.save_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: StepId) -> bool:
        """Whether ``checkpoint_id`` names a step (an int, ``"step-N"`` or ``"<path>/step-N"``)."""
        try:
            return _split_id(checkpoint_id)[1] is not None
        except (ValidationError, TypeError):
            return False

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Take this rank's role; refuse DCP's experimental saves without collectives."""
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0) or 0)
        if not kwargs.get("use_collectives", True):
            raise ValidationError("NebulaStorageWriter needs DCP's collectives (use_collectives=True): the "
                                  "coordinator commits one checkpoint for every rank")
        if self.step is None:
            raise ValidationError(f"NebulaStorageWriter({self.storage.display_url}): no step to write; pass "
                                  "step=N, or checkpoint_id=N (or 'step-N') to dcp.save")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Check the keys; record what this rank holds (before DCP drops its duplicates)."""
        paths = _paths(plan.planner_data)
        fqns: list[str] = []
        held: list[Held] = []
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                held.append((fqn, None))
            else:
                td = item.tensor_data
                if td is None or td.chunk is None:
                    raise ValidationError(f"NebulaStorageWriter: state key '{fqn}': a tensor item without bounds")
                dt = dtype_name(td.properties.dtype)
                if dt not in TENSOR_DTYPES:
                    raise ValidationError(f"NebulaStorageWriter: state key '{fqn}': dtype {dt} cannot be stored "
                                          "(quantized, or without a byte size)")
                held.append((fqn, tuple(int(o) for o in td.chunk.offsets)))
            fqns.append(fqn)
        counts: dict[str, int] = {}
        for f, _ in held:
            counts[f] = counts.get(f, 0) + 1
        dup = sorted(f for f, n in counts.items() if n > 1)
        if dup:
            raise ValidationError(f"NebulaStorageWriter: state key '{dup[0]}' has several chunks on rank {self.rank} "
                                  "(a ShardedTensor with several local shards?); one chunk per rank and key is "
                                  "supported")
        _check_keys(fqns, paths)
        return dataclasses.replace(plan, storage_data=_LocalPlanData(tuple(held)))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """The coordinator: refuse a committed step, take the generation, clear leftovers, and
        tell every rank what to write."""
        step = self.step
        assert step is not None
        self._held = []
        self._keys = []
        self._paths_of = []
        for r, p in enumerate(plans):
            if not isinstance(p.storage_data, _LocalPlanData):
                raise ValidationError(f"NebulaStorageWriter: rank {r}'s plan was not prepared by a NebulaStorageWriter "
                                      "(every rank must save with one)")
            self._held.append(p.storage_data.held)
            paths = _paths(p.planner_data)
            self._paths_of.append(paths)
            self._keys.append({f: _key(f, paths) for f, _ in p.storage_data.held})
        st = self.storage
        d = step_dir(step)
        self._refuse_committed()
        fence = Fence(st, _ProcessGeneration(st))
        gen = self._gen = fence.generation
        fence.for_tier(st).check(f"write step {step}")
        for name in st.list(d):  # leftovers of failed writes of this step (older, or ours)
            owner = shard_owner(name)
            if owner is None or owner[0] <= gen:
                st.remove(f"{d}/{name}")
        self._sweep(gen, step)
        with _GEN_LOCK:
            _UNFINISHED.setdefault(st.display_url, set()).add(step)
        save_id = uuid.uuid4().hex
        world = len(plans)
        return [dataclasses.replace(p, storage_data=_GlobalPlanData(step, gen, world, r, save_id))
                for r, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's shard (durable on return) and describe every item in it."""
        info = plan.storage_data
        if not isinstance(info, _GlobalPlanData):
            raise ValidationError("NebulaStorageWriter: the plan carries no write instructions of the coordinator "
                                  "(a cached plan? DefaultSavePlanner(enable_plan_caching=True) is not supported)")
        if info.step != self.step or (info.rank != self.rank and info.world > 1):
            raise ValidationError(f"NebulaStorageWriter: rank {self.rank} was told to write step {info.step} as rank "
                                  f"{info.rank}, but it saves step {self.step} (a cached plan? plan caching is not "
                                  "supported)")
        if getattr(planner, "_enable_plan_caching", False):
            raise ValidationError("NebulaStorageWriter does not support DCP's plan caching "
                                  "(DefaultSavePlanner(enable_plan_caching=True))")
        st = self.storage
        d = step_dir(info.step)
        if st.exists(f"{d}/{COMMIT}"):
            raise ValidationError(f"NebulaStorageWriter: step {info.step} was committed under {st.display_url} "
                                  "while this save ran; nothing is overwritten")
        prefix = f"r{info.rank}/" if info.world > 1 else ""
        paths = _paths(plan.planner_data)
        name = shard_name(info.generation, info.rank)
        shard: dict[str, Any] = {"file": name}
        out: list[tuple[WriteItem, _Written, int]] = []
        # values first: a value that cannot be stored fails the save before any byte is written
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                node = _encode_value(item.index.fqn, planner.resolve_data(item), self.allow_pickle)
                out.append((item, _Written(info.save_id, info.rank, item.index.fqn, None,
                                           prefix + _key(item.index.fqn, paths), None, None, node, shard), 0))
        tensors = self._tensor_parts(plan, planner, info, prefix, paths, shard, out)
        rel = f"{d}/{name}"
        try:
            shard.update(self._write_shard(rel, tensors))
        except BaseException:
            try:  # DCP never calls finish() now: no COMMIT can come; the last rank out removes the folder
                st.remove(rel)
                st.remove_empty_dir(d)
            except Exception as e:
                log.warning("nebula_ckpt: %s: cannot remove the failed shard %s: %s", self.where, name, e)
            raise
        fut: Future[list[WriteResult]] = Future()
        fut.set_result([WriteResult(index=item.index, size_in_bytes=n, storage_data=w) for item, w, n in out])
        return fut

    def _tensor_parts(self, plan: SavePlan, planner: SavePlanner, info: _GlobalPlanData, prefix: str,
                      paths: dict[str, tuple[Any, ...]], shard: dict[str, Any],
                      out: list[tuple[WriteItem, _Written, int]]) -> list[_Stored]:
        """Resolve the tensor items: ``(key, record, source bytes, version)`` of each tensor stored;
        appends every item's result to ``out`` (records are completed when the shard is written)."""
        objects = getattr(planner, "state_dict", None)
        stored: list[_Stored] = []
        tied: dict[tuple[Any, ...], str] = {}
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                continue
            fqn = item.index.fqn
            td = item.tensor_data
            assert td is not None and td.chunk is not None
            t = planner.resolve_data(item)
            if not isinstance(t, torch.Tensor):
                raise ValidationError(f"NebulaStorageWriter: state key '{fqn}': the planner resolved a tensor item "
                                      f"to a {type(t).__name__}")
            if type(t).__name__ == "DTensor":
                t = t.to_local()  # type: ignore[attr-defined]
            sizes = tuple(int(n) for n in td.chunk.sizes)
            if tuple(t.shape) != sizes:
                raise ValidationError(f"NebulaStorageWriter: state key '{fqn}': the planner resolved a tensor of shape "
                                      f"{list(t.shape)} for a chunk of shape {list(sizes)}")
            if t.dtype != td.properties.dtype:
                raise ValidationError(f"NebulaStorageWriter: state key '{fqn}': the tensor is {t.dtype}, its item "
                                      f"says {td.properties.dtype}")
            if t.layout != torch.strided or t.is_quantized or getattr(t, "is_nested", False) or \
                    t.device.type == "meta":
                raise ValidationError(f"NebulaStorageWriter: state key '{fqn}': {t.layout} / quantized / nested / "
                                      "meta tensors cannot be stored; convert it to a dense tensor with data")
            offsets = tuple(int(o) for o in td.chunk.offsets)
            key = prefix + _key(fqn, paths)
            rec: dict[str, Any] = {"dtype": dtype_name(t.dtype), "shape": list(sizes),
                                   "device": f"cuda:{t.get_device()}" if t.is_cuda else "cpu"}
            if item.type == WriteItemType.SHARD:
                obj = objects.get(fqn) if isinstance(objects, dict) else None
                placements, mesh = _placements(obj, fqn, item, info.world)
                rec["dtensor"] = {"shape": [int(n) for n in td.size], "offsets": list(offsets),
                                  "placements": list(placements), "mesh": list(mesh)}
            n = t.numel() * t.element_size()
            ident = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.device, json.dumps(rec, sort_keys=True)) \
                if n else None
            first = tied.get(ident) if ident is not None else None
            if first is not None:  # tied to a tensor this rank stores already: stored once
                out.append((item, _Written(info.save_id, info.rank, fqn, offsets, key, None, first, None, shard), n))
                continue
            if ident is not None:
                tied[ident] = key
            data = byte_view(t.cpu())  # a view of a contiguous CPU tensor
            stored.append((key, rec, data, data._version))
            out.append((item, _Written(info.save_id, info.rank, fqn, offsets, key, rec, None, None, shard), n))
        return stored

    def _write_shard(self, rel: str, tensors: list[_Stored]) -> dict[str, Any]:
        """The rank's safetensors image, written straight from the tensors' memory and fsync'd;
        each tensor's CRC32C is taken before the write and checked again after it."""
        order = sorted(range(len(tensors)), key=lambda i: -TENSOR_DTYPES[tensors[i][1]["dtype"]].itemsize)
        head, spans = safetensors_header([(tensors[i][0], TENSOR_DTYPES[tensors[i][1]["dtype"]],
                                           tuple(tensors[i][1]["shape"]), tensors[i][2].numel()) for i in order])
        parts: list[memoryview] = [memoryview(head)]
        for i, (a, b) in zip(order, spans, strict=True):
            key, rec, data, _ = tensors[i]
            rec["offsets"] = [len(head) + a, len(head) + b]
            rec["crc32c"] = _crc(data)
            if data.numel():
                parts.append(memoryview(data.numpy()))  # type: ignore[arg-type]
        nbytes = len(head) + (spans[-1][1] if spans else 0)
        storage_info = self.storage.write_parts(rel, parts)
        for key, rec, data, version in tensors:  # a tensor changed while written: its bytes may not match
            if _crc(data) != rec["crc32c"] or data._version != version:
                raise ConsistencyError(f"{self.where}: tensor '{key}' was modified while it was being written; "
                                       "the save is abandoned (nothing is committed)")
        return {"bytes": nbytes, "storage": storage_info}

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The coordinator, once every rank's shard is durable: manifest, then ``COMMIT``, last."""
        try:
            self._finish(metadata, results)
        finally:
            with _GEN_LOCK:
                _UNFINISHED.get(self.storage.display_url, set()).discard(self.step or 0)

    def _finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        step = self.step
        assert step is not None and self._held
        world = len(results)
        if world != len(self._held):
            raise PersistError(f"{self.where}: {world} ranks reported writes, {len(self._held)} planned")
        d = step_dir(step)
        st = self.storage
        self._wrote_manifest = False
        try:
            man = self._manifest(metadata, results)
            mbytes = json.dumps(man, separators=(",", ":"), allow_nan=False).encode()
            parsed = mf.Manifest.parse(mbytes, self.where, step)
            from nebula_ckpt.dcp.reader import NebulaStorageReader

            NebulaStorageReader(st, step, manifest=parsed, verify=False).close()  # DCP can read it back
        except NebulaError as e:
            self._abandon(d)
            raise PersistError(f"{self.where}: not committed: {e}") from e
        except BaseException:
            self._abandon(d)
            raise
        gen = man["generation"]
        fence = Fence(st, _ProcessGeneration(st, gen)).for_tier(st)
        rel = f"{d}/{COMMIT}"
        try:
            self._refuse_committed()
            fence.check(f"commit step {step}")
            self._wrote_manifest = True
            st.write_small(f"{d}/{MANIFEST}", mbytes)
            fence.check(f"commit step {step}")
        except BaseException:
            self._abandon(d)
            raise
        commit = Commit(step, gen, len(mbytes), get_ops().crc32c_bytes(mbytes))
        try:
            st.write_small(rel, commit.to_bytes(), create_only=True)
        except FileExistsError:
            raise ValidationError(f"NebulaStorageWriter: step {step} was committed under {st.display_url} by another "
                                  "writer while this save ran; its checkpoint is left as it is") from None
        except BaseException as e:
            if not never_created(st, rel):  # the marker may exist, or still land: nothing of the step goes
                raise PersistError(f"{self.where}: step {step} may have committed: the write of its COMMIT reported "
                                   f"an error ({type(e).__name__}: {e}); its files are kept (a later save of a newer "
                                   "job removes them if it never committed)") from e
            self._abandon(d)
            raise
        log.info("nebula_ckpt: DCP save of step %d committed under %s (%d rank(s), %.1f MiB)", step, st.display_url,
                 world, sum(man["stats"].get("ranks_bytes", [0])) / 2**20 if world > 1 else
                 man["shards"][0]["bytes"] / 2**20)

    # -- the manifest ----------------------------------------------------------------------------

    def _manifest(self, metadata: Metadata, results: list[list[WriteResult]]) -> dict[str, Any]:
        step = self.step
        assert step is not None
        world = len(results)
        multi = world > 1
        written: list[list[_Written]] = []
        save_id: Optional[str] = None
        for r, wrs in enumerate(results):
            mine = []
            for wr in wrs:
                w = wr.storage_data
                if not isinstance(w, _Written) or w.rank != r or (save_id is not None and w.save_id != save_id):
                    raise PersistError(f"{self.where}: rank {r} reported a write of another save (cached plans are "
                                       "not supported)")
                save_id = w.save_id
                mine.append(w)
            written.append(mine)
        gen = self._generation()
        empty = len(safetensors_header([])[0])
        shards: list[dict[str, Any]] = []
        for r in range(world):
            sh: dict[str, Any] = written[r][0].shard if written[r] else {"file": shard_name(gen, r), "bytes": empty,
                                                          "storage": {"stored_bytes": empty}}
            if sh.get("file") != shard_name(gen, r) or "bytes" not in sh:
                raise PersistError(f"{self.where}: rank {r} wrote {sh.get('file')!r}, expected "
                                   f"{shard_name(gen, r)} (another save's plan?)")
            try:
                size = self.storage.size(f"{step_dir(step)}/{sh['file']}")
            except FileNotFoundError:
                raise PersistError(f"{self.where}: rank {r}'s shard {sh['file']} is not under "
                                   f"{self.storage.display_url}: every rank must write to the same root (a path "
                                   "every node mounts, or a URL)") from None
            info = sh.get("storage")
            stored = int(info.get("stored_bytes", sh["bytes"])) if isinstance(info, dict) else int(sh["bytes"])
            if size != stored:
                raise PersistError(f"{self.where}: rank {r}'s shard {sh['file']} has {size} bytes, {stored} written")
            shards.append({"file": sh["file"], "bytes": sh["bytes"], "storage": sh.get("storage")})
        # what every stored piece is: (fqn, offsets) -> (rank, stored key); values by fqn
        pieces: dict[Held, tuple[int, str]] = {}
        values: dict[str, tuple[Node, Any]] = {}
        tensors: dict[str, dict[str, Any]] = {}
        aliases: dict[str, str] = {}
        for r, mine in enumerate(written):
            for w in mine:
                if w.node is not None:
                    values[w.fqn] = (w.node, _decoded(w.node))
                    continue
                target = w.alias_of or w.key
                if w.alias_of is not None:
                    aliases[w.key] = w.alias_of
                else:
                    assert w.record is not None
                    tensors[w.key] = dict(w.record, shard=r) if r else dict(w.record)
                pieces[(w.fqn, w.offsets)] = (r, target)
        self._check_coverage(metadata, pieces, values)
        trees: list[Node] = []
        seen: dict[str, int] = {}
        rank_tree: dict[int, int] = {}
        for r in range(world):
            prefix = f"r{r}/" if multi else ""
            root = _Box("dict")
            paths = self._paths_of[r]
            for fqn, offsets in self._held[r]:
                key = self._keys[r][fqn]
                if offsets is None:
                    if fqn not in values:
                        raise PersistError(f"{self.where}: no rank wrote the value of '{fqn}'")
                    leaf: _Leaf = values[fqn]
                else:
                    owner = pieces.get((fqn, offsets))
                    if owner is None:
                        raise PersistError(f"{self.where}: no rank wrote '{fqn}' at offsets {list(offsets)}")
                    if owner[0] != r or owner[1] != prefix + key:
                        aliases[prefix + key] = owner[1]
                    leaf = ({"t": "tensor", "k": key}, None)
                _insert(root, paths.get(fqn, (fqn,)), leaf, fqn)
            _optimizer_keys(root)
            node = _to_node(root)
            text = json.dumps(node, sort_keys=True)
            rank_tree[r] = seen.setdefault(text, len(trees))
            if rank_tree[r] == len(trees):
                trees.append(node)
        for a in [a for a in aliases if a in tensors]:
            del aliases[a]  # a rank's own copy (a tensor DCP did not deduplicate) is no alias
        tensor_bytes = sum(int(r["offsets"][1]) - int(r["offsets"][0]) for r in tensors.values())
        stats: dict[str, Any] = {"tensor_bytes": tensor_bytes, "writer": "torch.distributed.checkpoint",
                                 "dcp_save_id": save_id or ""}
        if not multi:
            return mf.build_manifest(step=step, generation=gen, shards=shards, tensors=tensors, aliases=aliases,
                                     tree=trees[0], stats=stats)
        stats["ranks_bytes"] = [s["bytes"] for s in shards]
        return mf.build_manifest(step=step, generation=gen, shards=shards, tensors=tensors, aliases=aliases,
                                 tree={"t": "list", "v": trees}, stats=stats,
                                 ranks={"world_size": world, "ranks": list(range(world)),
                                        "rank_tree": {str(r): i for r, i in rank_tree.items()}})

    def _check_coverage(self, metadata: Metadata, pieces: dict[Held, tuple[int, str]],
                        values: dict[str, Any]) -> None:
        """Every item of DCP's global metadata was written by some rank."""
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                if fqn not in values:
                    raise PersistError(f"{self.where}: no rank wrote the value of '{fqn}'")
            elif isinstance(md, TensorStorageMetadata):
                for c in md.chunks:
                    if (fqn, tuple(int(o) for o in c.offsets)) not in pieces:
                        raise PersistError(f"{self.where}: no rank wrote '{fqn}' at offsets {list(c.offsets)}")

    def _generation(self) -> int:
        g = self._gen
        if g is None:
            raise PersistError(f"{self.where}: finish() without a generation (prepare_global_plan did not run)")
        return g

    # -- housekeeping --------------------------------------------------------------------------------

    def _refuse_committed(self) -> None:
        st = self.storage
        if st.exists(f"{step_dir(self.step or 0)}/{COMMIT}"):
            raise ValidationError(
                f"NebulaStorageWriter: step {self.step} is already committed under {st.display_url} "
                f"({step_dir(self.step or 0)}/{COMMIT}); a committed checkpoint is never overwritten: save "
                "another step, or delete that one first")

    def _abandon(self, d: str) -> None:
        """After a failed commit: remove this save's files of the step (its generation's shards, the
        manifest it wrote), never a committed step's nor another writer's."""
        st = self.storage
        try:
            names = st.list(d)
            if COMMIT in names:
                return
            for n in names:
                owner = shard_owner(n)
                if (owner is not None and owner[0] == self._gen) or (n == MANIFEST and self._wrote_manifest):
                    st.remove(f"{d}/{n}")
            st.remove_empty_dir(d)
        except Exception as e:
            log.warning("nebula_ckpt: %s: cannot remove the files of the failed save: %s", self.where, e)

    def _sweep(self, gen: int, step: int) -> None:
        """Remove uncommitted step folders of failed saves: those holding only files of older
        writers, and those of this process's earlier saves that never reached :meth:`finish`."""
        st = self.storage
        with _GEN_LOCK:
            failed = _UNFINISHED.pop(st.display_url, set()) - {step}
        try:
            for s in step_dirs(st):
                d = step_dir(s)
                if s == step or st.exists(f"{d}/{COMMIT}"):
                    continue
                names = st.list(d)
                owners = [shard_owner(n) for n in names]
                if s in failed or all(o is None and n == MANIFEST or o is not None and o[0] < gen for n, o in
                                      zip(names, owners, strict=True)):
                    log.info("nebula_ckpt: %s: removing uncommitted leftovers of step %d", st.display_url, s)
                    st.remove_dir(d)
        except FencedError:
            raise
        except Exception as e:  # best effort: the save itself goes on
            log.warning("nebula_ckpt: %s: cannot remove uncommitted leftovers: %s", st.display_url, e)


def _decoded(node: Node) -> Any:
    """The python value of a typed-JSON value node (pickled leaves stay undecoded: None)."""
    from nebula_ckpt.format.tree import decode

    try:
        return decode(node, lambda k: None, False)
    except NebulaError:
        return None
