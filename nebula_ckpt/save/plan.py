"""Plan: turn a state tree into tensor entries, a byte layout and typed JSON for the rest.

This is the single validation point of a save: every problem with the state (meta or sparse
tensors, colliding keys, values JSON cannot hold or would bring back as another type, bad
steps) raises a :class:`~nebula_ckpt.errors.ValidationError` naming the key, before anything is
copied or written.

While walking it also notes, for the consistency rule of asynchronous snapshots, which tensors a
hook guards: those reached through a module or an optimizer (the next forward / ``step()`` waits
for the copy) and NumPy arrays (copied on the training thread); every other tensor (a plain dict
of live tensors such as ``model.state_dict()``) is *unguarded*, and
:class:`~nebula_ckpt.checkpointer.Checkpointer` takes such a save synchronously. Optimizer
wrappers (accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``,
DeepSpeed's ZeRO optimizers: an ``optimizer`` attribute, possibly nested) are saved through their
own ``state_dict()`` and hooked on the innermost ``torch.optim.Optimizer`` (:func:`inner_optimizer`).

The layout is the image of one safetensors file: an 8-byte header length, the JSON header
(padded so the data starts on a 4096-byte boundary), then the tensors back to back, ordered by
element size so each is naturally aligned. It depends only on (key, dtype, shape) of every
tensor, so it is cached and reused while the state keeps its shapes.

While walking, the flattener also records the state's structure as a *program* (a
:class:`~nebula_ckpt.save.plan_record.Recording`): what :mod:`nebula_ckpt.save.plan_cache`
compiles into a native check that tells, at the next save, whether that state still has this
structure, so the plan can be reused without walking it again.
"""

from __future__ import annotations

import collections
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from nebula_ckpt.errors import ValidationError
from nebula_ckpt.format.dtypes import TENSOR_DTYPES, dtype_name
from nebula_ckpt.format.header import RESERVED_KEYS, safetensors_header
from nebula_ckpt.format.names import check_step, check_tag
from nebula_ckpt.format.records import DTensorInfo
from nebula_ckpt.format.tree import MAX_DEPTH, Node, check_int, encode_leaf
from nebula_ckpt.native import get_ops
from nebula_ckpt.save.plan_record import Recording, copy_ndarray


@dataclass(frozen=True)
class TensorEntry:
    """One stored tensor: where its bytes live in the shard."""

    key: str
    dtype: str            # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int           # byte offset in the shard file
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """Byte layout of one shard file (safetensors image). Immutable and cached."""

    entries: tuple[TensorEntry, ...]
    header: bytes          # 8-byte length + JSON + padding; len(header) == data_start
    total_bytes: int       # whole file

    @property
    def data_start(self) -> int:
        """Offset of the first tensor byte."""
        return len(self.header)


@dataclass
class Plan:
    """What one save will write. Built on the training thread by :func:`make_plan` (or reused
    from the previous save's by :class:`~nebula_ckpt.save.plan_cache.PlanCache`)."""

    step: int
    layout: Layout
    #: the tensors to copy, one per layout entry, same order, with their version counters at
    #: ``save_async`` (consistency check): a source set of :func:`~nebula_ckpt.native.get_ops`
    sources: Any
    tree: Node                       # typed JSON of the whole state
    aliases: dict[str, str]          # tied key -> key stored
    devices: dict[str, str]          # key -> device it came from, for non-CPU tensors only
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    modules_with_buffers: list[torch.nn.Module] = field(default_factory=list)
    dtensors: dict[str, DTensorInfo] = field(default_factory=dict)  # key -> where its local shard lies
    tag: Optional[str] = None        # the checkpoint's name (save_async(tag=...)), validated
    #: indices into ``sources`` of tensors no hook guards (see the module docstring)
    unguarded: list[int] = field(default_factory=list)

    @property
    def tensor_bytes(self) -> int:
        """Bytes of tensor data."""
        return self.layout.total_bytes - self.layout.data_start

    def copy_unguarded(self, max_bytes: int) -> bool:
        """Replace the unguarded sources by copies taken now, when they are all on the CPU and
        ``max_bytes`` at most in all (an RNG state beside a model): the rest of the save may then
        overlap the training thread. Whether every unguarded source is now a copy (True when
        there is none)."""
        if not self.unguarded:
            return True
        srcs = [self.sources[i] for i in self.unguarded]
        if any(t.is_cuda for t in srcs) or sum(t.numel() * t.element_size() for t in srcs) > max_bytes:
            return False
        try:
            copies = [t.clone() for t in srcs]
        except Exception:  # a dtype without clone(): copied with the rest, synchronously
            return False
        for i, c in zip(self.unguarded, copies, strict=True):
            self.sources[i] = c  # its version counter is recorded now
        return True

    def release_sources(self) -> None:
        """Drop the references to the training tensors (the snapshot's verdict is settled)."""
        self.sources.clear()


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided
_STORABLE = frozenset(TENSOR_DTYPES.values())


def _check_tensor(t: torch.Tensor, path: str) -> None:
    # Fast path: the common case costs a handful of attribute reads.
    if type(t) in _PLAIN and t.layout is _STRIDED and (t.is_cpu or t.is_cuda) \
            and not t.is_nested and not t.is_quantized and t.dtype in _STORABLE:
        return
    if t.layout != torch.strided:
        hint = ".to_dense()" if t.layout in (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc,
                                             torch.sparse_bsr, torch.sparse_bsc) else "a dense tensor"
        raise ValidationError(f"state key '{path}': tensors with layout {t.layout} are not supported; "
                              f"convert with {hint} before saving")
    if getattr(t, "is_nested", False):
        raise ValidationError(f"state key '{path}': nested tensors are not supported; "
                              "save t.unbind() as a list instead")
    if t.is_quantized:
        raise ValidationError(f"state key '{path}': quantized tensors are not supported; "
                              "save t.int_repr() and the quantization parameters instead")
    dev = t.device.type
    if dev == "meta":
        raise ValidationError(f"state key '{path}': tensor is on the meta device and has no data; "
                              "materialise it (e.g. module.to_empty(device=...) and initialise) first")
    if dev not in ("cpu", "cuda"):
        raise ValidationError(f"state key '{path}': tensors on '{dev}' are not supported; "
                              "move them with .cpu() first")
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and not isinstance(t, torch.nn.Parameter):
        raise ValidationError(f"state key '{path}': tensor subclass {type(t).__name__} is not "
                              "supported (DTensor: save t.to_local())")
    try:
        t.element_size()
    except Exception:
        raise ValidationError(f"state key '{path}': dtype {t.dtype} has no byte size; "
                              "it cannot be stored") from None
    if t.dtype not in _STORABLE:  # a quantized dtype on a tensor that is not quantized (a view of bytes)
        raise ValidationError(f"state key '{path}': dtype {t.dtype} cannot be stored (a quantized dtype on a "
                              "tensor that is not quantized); save its bytes, t.view(torch.uint8), and view them "
                              f"as {t.dtype} after restoring")


def placement_codes(placements: Any, where: str) -> tuple[str, ...]:
    """DTensor placements as the manifest writes them: ``"R"`` for ``Replicate``, ``"S(d)"`` for
    ``Shard(d)``.

    Raises:
        ValidationError: another placement (``Partial``, strided shards), named with ``where``.
    """
    from torch.distributed.tensor import Replicate, Shard

    out = []
    for p in placements:
        if type(p) is Replicate:
            out.append("R")
        elif type(p) is Shard:
            out.append(f"S({p.dim})")
        else:
            raise ValidationError(f"{where}: DTensor placement {p} is not supported (only Shard and Replicate); "
                                  "redistribute it (e.g. t.redistribute(placements=[Replicate()])) or save "
                                  "t.full_tensor()")
    return tuple(out)


def _dtensor_parts(t: Any, key: str) -> tuple[torch.Tensor, DTensorInfo]:
    """A DTensor's local shard and where it lies in the global tensor (Shard / Replicate only)."""
    placements = placement_codes(t.placements, f"state key '{key}'")
    chunks = t.__create_chunk_list__()
    if len(chunks) != 1:
        raise ValidationError(f"state key '{key}': DTensor has {len(chunks)} local chunks; one is supported")
    local = t.to_local()
    info = DTensorInfo(tuple(t.shape), tuple(int(o) for o in chunks[0].offsets), placements,
                       tuple(int(n) for n in t.device_mesh.shape))
    return local, info


#: how deep a chain of optimizer wrappers (``.optimizer`` of ``.optimizer`` ...) is followed
_MAX_WRAPPERS = 8


def _schedulers() -> tuple[type, ...]:
    lr = torch.optim.lr_scheduler
    return tuple(c for c in (getattr(lr, "LRScheduler", None), getattr(lr, "ReduceLROnPlateau", None)) if c)


def inner_optimizer(obj: Any) -> Optional[torch.optim.Optimizer]:
    """The innermost ``torch.optim.Optimizer`` an object with ``state_dict()`` stands for, or None.

    An optimizer is its own answer unless it wraps another: accelerate's ``AcceleratedOptimizer``
    (an ``Optimizer`` subclass without PyTorch's hook machinery) and DeepSpeed's optimizer
    wrappers keep the real optimizer in ``.optimizer``, Lightning's ``LightningOptimizer`` in
    ``._optimizer``; wrappers may be nested. The chain is followed (at most
    :data:`_MAX_WRAPPERS` deep, never in a cycle) and the innermost optimizer in it returned: the
    one whose ``step()`` really changes the state, so the one to hook. Learning-rate schedulers
    (which also have ``.optimizer``) are not wrappers.
    """
    if isinstance(obj, _schedulers()) and not isinstance(obj, torch.optim.Optimizer):
        return None
    found = obj if isinstance(obj, torch.optim.Optimizer) else None
    seen = {id(obj)}
    cur = obj
    for _ in range(_MAX_WRAPPERS):
        nxt = None
        for attr in ("optimizer", "_optimizer"):
            try:
                cand = getattr(cur, attr, None)
            except Exception:  # a property that raises: not a wrapper through this attribute
                cand = None
            if cand is not None and id(cand) not in seen and not isinstance(cand, (type, str, int, float)):
                nxt = cand
                break
        if nxt is None:
            break
        seen.add(id(nxt))
        if isinstance(nxt, torch.optim.Optimizer):
            found = nxt
        cur = nxt
    return found


#: the containers stored as such (typed JSON brings each back as its own type), bases first
_CONTAINERS = (dict, list, tuple, collections.OrderedDict)


def _join(path: str, key: str) -> str:
    return f"{path}/{key}" if path else key


class _Flattener:
    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.tensors: dict[str, torch.Tensor] = {}
        self.aliases: dict[str, str] = {}
        self.seen: dict[tuple[Any, ...], str] = {}
        self.optimizers: list[torch.optim.Optimizer] = []
        self.modules: list[torch.nn.Module] = []
        self.dtensors: dict[str, DTensorInfo] = {}
        self.unguarded: set[str] = set()      # keys of tensors no hook guards
        self._guarded = 0                     # > 0 while inside a module / optimizer being hooked
        self._path_ids: dict[int, str] = {}  # id -> path of the containers being walked (cycles)
        self.rec = Recording()
        self._g: Any = None               # the recorded node of the value walked last
        self._tpath: list[Any] = []       # where in the tree the value being walked goes

    def _leaf(self, value: Any, path: str) -> Node:
        node = encode_leaf(value, path or "<root>", self.allow_pickle)
        self._g = ("L", len(self.rec.leaves), value)
        self.rec.leaves.append((tuple(self._tpath), path or "<root>"))
        return node

    def _claim(self, key: str) -> None:
        if key in self.tensors or key in self.aliases:
            raise ValidationError(
                f"state key '{key}' occurs twice after flattening (keys are joined with '/': "
                "e.g. {'a/b': x} and {'a': {'b': y}}, or int 0 and str '0' in one dict, collide); "
                "rename one of them")

    def walk(self, value: Any, path: str, depth: int = 0) -> Node:
        if isinstance(value, torch.Tensor):
            return self.tensor(value, path)
        np = sys.modules.get("numpy")  # only a state that holds NumPy values has it imported
        if np is not None and type(value) is np.ndarray:
            return self.ndarray(value, path)
        if isinstance(value, (dict, list, tuple)) or hasattr(value, "state_dict"):
            if depth >= MAX_DEPTH:
                raise ValidationError(f"state key '{path[:200]}': the state is nested more than {MAX_DEPTH} "
                                      "levels deep; flatten it (or save the deep part as a tensor or bytes)")
            first = self._path_ids.get(id(value))
            if first is not None:
                raise ValidationError(f"state key '{path[:200]}' refers back to its own container "
                                      f"'{first or '<root>'}' (a cycle); a checkpoint must be a tree: "
                                      "break the reference before saving")
            self._path_ids[id(value)] = path
            try:
                return self._walk_container(value, path, depth + 1)
            finally:
                del self._path_ids[id(value)]
        return self._leaf(value, path)

    def _walk_container(self, value: Any, path: str, depth: int) -> Node:
        if isinstance(value, torch.Size):
            self._g = ("C", value)
            return {"t": "size", "v": list(value)}
        if isinstance(value, (dict, list, tuple)) and type(value) not in _CONTAINERS:
            return self._subclass(value, path, depth)
        if isinstance(value, dict):
            return self._walk_dict(value, path, depth)
        if isinstance(value, (list, tuple)):
            tag = "tuple" if isinstance(value, tuple) else "list"
            nodes, gs = [], []
            for i, v in enumerate(value):
                self._tpath += ("v", i)
                nodes.append(self.walk(v, _join(path, str(i)), depth))
                gs.append(self._g)
                del self._tpath[-2:]
            self._g = ("S", type(value), tuple(gs))
            return {"t": tag, "v": nodes}
        sd = getattr(value, "state_dict", None)
        if callable(sd) and not isinstance(value, type):
            return self._walk_stateful(value, sd, path, depth)
        return self._leaf(value, path)

    def _subclass(self, value: Any, path: str, depth: int) -> Node:
        """A subclass of dict, list or tuple: it would come back as its base type (a namedtuple as a
        tuple, a Counter or a defaultdict as a dict, without its default factory), so it is refused,
        or pickled whole with ``allow_pickle``; one with ``state_dict()`` is saved through it."""
        sd = getattr(value, "state_dict", None)
        if callable(sd):
            return self._walk_stateful(value, sd, path, depth)
        if not self.allow_pickle:
            base = next(b for b in _CONTAINERS[::-1] if isinstance(value, b)).__name__
            kind = "a namedtuple or tuple subclass" if isinstance(value, tuple) else f"a {base} subclass"
            raise ValidationError(f"state key '{path or '<root>'}': {type(value).__module__}."
                                  f"{type(value).__qualname__} ({kind}) would come back as a plain {base}; "
                                  f"convert it ({base}(x)), or pass allow_pickle=True to save it with pickle "
                                  "(loading will then also need allow_pickle=True)")
        return self._leaf(value, path)

    def _walk_dict(self, value: dict[Any, Any], path: str, depth: int) -> Node:
        tag = "odict" if type(value) is collections.OrderedDict else "dict"
        items = []
        keys, gs = [], []
        prefix = f"{path}/" if path else ""
        for i, (k, v) in enumerate(value.items()):
            tk = type(k)
            if tk is str:
                knode: Node = {"t": "str", "v": k}
            elif tk is int:
                knode = {"t": "int", "v": check_int(k, path)}
            elif isinstance(k, (str, int)) and not isinstance(k, bool):
                # (an IntEnum or str-enum key would come back as a plain int / str)
                base = "str" if isinstance(k, str) else "int"
                raise ValidationError(f"state key '{path or '<root>'}': dict key {k!r} of type "
                                      f"{type(k).__module__}.{type(k).__qualname__} (a subclass of {base}) would "
                                      f"come back as a plain {base}; convert the key ({base}(k))")
            else:
                raise ValidationError(f"state key '{path}': dict key {k!r} of type {type(k).__name__} "
                                      "is not supported; use str or int keys")
            sub = f"{prefix}{k}"
            self._tpath += ("v", i, 1)
            vnode = self.tensor(v, sub) if type(v) in _PLAIN else self.walk(v, sub, depth)
            del self._tpath[-3:]
            items.append([knode, vnode])
            keys.append(k)
            gs.append(self._g)
        self._g = ("D", type(value), tuple(keys), tuple(gs))
        return {"t": tag, "v": items}

    def _walk_stateful(self, value: Any, sd: Any, path: str, depth: int) -> Node:
        hooked = isinstance(value, torch.nn.Module)
        if hooked:
            self.modules.append(value)
        else:
            # The wrapper's state_dict() is saved as asked; the hook goes on the optimizer
            # whose step() changes the tensors (accelerate, Lightning, DeepSpeed wrappers).
            inner = inner_optimizer(value)
            if inner is not None:
                self.optimizers.append(inner)
                hooked = True
                if inner is not value:
                    self.rec.wrappers.append((value, inner))
        try:
            state = sd()
        except Exception as e:
            raise ValidationError(f"state key '{path}': {type(value).__name__}.state_dict() raised "
                                  f"{type(e).__name__}: {e}") from e
        self._guarded += hooked
        self._tpath.append("state")
        try:
            node = self.walk(state, path, depth)
        finally:
            self._guarded -= hooked
        self._tpath.pop()
        self._g = ("F", value, self._g)
        return {"t": "stateful", "cls": f"{type(value).__module__}.{type(value).__qualname__}", "state": node}

    def ndarray(self, a: Any, path: str) -> Node:
        """A NumPy array: stored as a tensor made from a C-contiguous copy (taken now, so the saved
        values are those of this moment whatever happens to ``a`` later), in native byte order;
        the node records the dtype (byte order included) it comes back as."""
        made = copy_ndarray(a)
        if made is None:
            return self._leaf(a, path)  # object / str / structured: pickle or a clear error
        code, copy = made
        node = {"t": "ndarray", "dtype": code, "v": self.tensor(copy, path, owned=True)}
        self._g = ("N", self._g[1], code, copy)
        return node

    def tensor(self, t: torch.Tensor, path: str, owned: bool = False) -> Node:
        """A tensor leaf; ``owned``: a copy made by the walk (no one else can change it)."""
        key = path or "<root>"
        if key in RESERVED_KEYS:
            raise ValidationError(f"state key '{key}' is reserved by the safetensors format (its header "
                                  "uses it); rename it")
        if type(t).__name__ == "DTensor":  # its local shard is stored, with where it lies
            t, self.dtensors[key] = _dtensor_parts(t, key)
            self.rec.uncacheable = f"'{key}' is a DTensor"
        _check_tensor(t, key)
        if key in self.tensors or key in self.aliases:
            self._claim(key)
        self._g = ("T", len(self.rec.slot_keys), t)
        self.rec.slot_keys.append(key)
        # Tied weights (one Parameter under two keys) are the same view of the same memory:
        # store the bytes once and restore them tied. (x.conj() and x.neg() views share x's
        # memory but not its values.)
        if t.numel():
            ident = (t.data_ptr(), t.dtype, t.shape, t.stride(), t.is_conj(), t.is_neg())
            first = self.seen.get(ident)
            if first is not None:
                self.aliases[key] = first
                return {"t": "tensor", "k": key}
            self.seen[ident] = key
        self.tensors[key] = t
        if not (owned or self._guarded):
            self.unguarded.add(key)
        return {"t": "tensor", "k": key}


_layout_cache: "collections.OrderedDict[tuple[Any, ...], Layout]" = collections.OrderedDict()


def make_layout(tensors: dict[str, torch.Tensor]) -> tuple[Layout, list[str]]:
    """Return the (cached) layout for these tensors and the keys in layout order."""
    sig = tuple((k, t.dtype, tuple(t.shape)) for k, t in tensors.items())
    cached = _layout_cache.get(sig)
    if cached is not None:
        _layout_cache.move_to_end(sig)
        return cached, [e.key for e in cached.entries]
    # Largest element size first: every tensor then starts naturally aligned.
    keys = sorted(tensors, key=lambda k: -tensors[k].element_size())
    head, spans = safetensors_header([(k, tensors[k].dtype, tuple(tensors[k].shape),
                                       tensors[k].numel() * tensors[k].element_size()) for k in keys])
    data_start = len(head)
    pos = spans[-1][1] if spans else 0
    entries = tuple(TensorEntry(k, dtype_name(tensors[k].dtype), tuple(tensors[k].shape), data_start + p, e - p)
                    for k, (p, e) in zip(keys, spans, strict=True))
    layout = Layout(entries, head, data_start + pos)
    _layout_cache[sig] = layout
    if len(_layout_cache) > 16:
        _layout_cache.popitem(last=False)
    return layout, keys


def make_plan(step: Any, state: Any, *, allow_pickle: bool = False, tag: Optional[str] = None) -> Plan:
    """Flatten and validate ``state``; raise :class:`ValidationError` naming the key on bad input.

    (:func:`plan_and_record` is the same, and also returns the :class:`Recording` of the walk.)

    Args:
        step: non-negative int.
        state: a tree of dicts / lists / tuples whose leaves are tensors, NumPy arrays and
            scalars, plain values, or objects with ``state_dict()``.
        allow_pickle: store values typed JSON cannot hold with pickle.
        tag: the checkpoint's name, or None (see :func:`nebula_ckpt.format.names.check_tag`).

    Returns:
        The :class:`Plan`; nothing has been copied or written yet.
    """
    return plan_and_record(step, state, allow_pickle=allow_pickle, tag=tag)[0]


def plan_and_record(step: Any, state: Any, *, allow_pickle: bool = False,
                    tag: Optional[str] = None) -> tuple[Plan, Recording]:
    """:func:`make_plan`, and the :class:`Recording` of the state's structure."""
    step = check_step(step)
    tag = check_tag(tag)
    fl = _Flattener(allow_pickle)
    tree = fl.walk(state, "")
    fl.rec.program = fl._g
    layout, keys = make_layout(fl.tensors)
    modules = [m for m in fl.modules if any(True for _ in m.buffers())]
    tensors = [fl.tensors[k] for k in keys]
    devices = {k: f"cuda:{t.get_device()}" for k, t in zip(keys, tensors, strict=False) if t.is_cuda}
    sources = get_ops().source_set(tensors, [e.offset for e in layout.entries])
    plan = Plan(step=step, layout=layout, sources=sources, tree=tree, aliases=fl.aliases, devices=devices,
                optimizers=fl.optimizers, modules_with_buffers=modules, dtensors=fl.dtensors, tag=tag,
                unguarded=[i for i, k in enumerate(keys) if k in fl.unguarded])
    return plan, fl.rec

