"""Plan cache: reuse the previous save's plan while the state keeps its structure.

Planning a save walks the whole state in Python (``state_dict()`` of every module and optimizer,
a check of every tensor): microseconds per tensor, on the training thread, at every save, for a
structure that almost never changes between saves. :class:`PlanCache` plans a state once
(:func:`~nebula_ckpt.save.plan.plan_and_record`), compiles the recorded structure into a native
check (``nebula_ckpt._C.PlanGuard``, ``csrc/plan_guard.cpp``; modules and optimizers that save
through PyTorch's own ``state_dict()`` are read through their registries:
:mod:`nebula_ckpt.save.plan_model`) and, at the next save, runs that check instead of the walk.
The check costs a few comparisons per tensor in C++, never calls a stock module's or
optimizer's ``state_dict()`` (on CPython 3.11, a module whose instance dict and registries keep
their address and version tag since the last hit has only its tensors and hook counts read), and
on a hit returns:

* the live tensors in layout order, read from the live objects at this save (so a parameter
  replaced with ``p.data = ...`` or ``module.weight = Parameter(...)`` is copied from its new
  memory), with their version counters;
* the non-tensor leaves whose value changed (a learning rate, a step count; a float is compared bit
  for bit, so one NaN is not another), which are encoded again here, and refused as the walk refuses
  them (an int that became an ``IntEnum``), and patched into a copy of the cached tree (the
  containers on their paths are copied, never changed: a tree handed to an earlier save stays as it was).

Everything else the plan depends on must be what it was, or the check misses and the state is
planned again (and recorded again): the containers (exact types, keys and their order, lengths),
every tensor's Python type, dtype, device, shape, strides and conj/neg bits, which keys are tied
to one memory (and that no two others became the same view), the identity of every module,
optimizer and other object with ``state_dict()``, the parameters of each optimizer group and
the parameters with state (by identity, in order), the classes' and instances' ``state_dict``
machinery and hooks, and that no leaf became a container, tensor or array. Objects that are not
stock modules or optimizers (schedulers, ``GradScaler``, wrappers) have their ``state_dict()``
called and its result checked the same way. States holding a DTensor are planned at every save.

The cache holds the last plan, so the modules and optimizers of the last state saved stay
referenced until the next save with another structure or the checkpointer's close. It runs on
the native path only; the pure-PyTorch path plans every save.
"""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass
from typing import Any, Optional

from nebula_ckpt.format.names import check_step, check_tag
from nebula_ckpt.format.tree import Node, encode_leaf
from nebula_ckpt.native import get_ops
from nebula_ckpt.save import plan_model
from nebula_ckpt.save.plan import Plan, Recording, copy_ndarray, inner_optimizer, plan_and_record

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    """The cached plan of one state structure."""

    guard: Any                              # nebula_ckpt._C.PlanGuard
    plan: Plan                              # the plan it was made with (sources released)
    tree: Node                              # the newest tree (leaves patched in copies)
    leaf_paths: list[tuple[Any, ...]]
    leaf_keys: list[str]
    wrappers: list[tuple[Any, Any]]


def _patched(tree: Node, patches: list[tuple[tuple[Any, ...], Node]]) -> Node:
    """``tree`` with each (path, node) put in place: the containers on the paths are copied (each
    once), every other part shared. A path is the keys / indices from the root to the leaf."""
    if any(not path for path, _ in patches):
        return next(node for path, node in patches if not path)  # the state is one leaf
    root: Any = dict(tree)
    made: dict[tuple[Any, ...], Any] = {(): root}
    for path, node in patches:
        cur = root
        for d in range(len(path) - 1):
            nxt = made.get(path[:d + 1])
            if nxt is None:
                child = cur[path[d]]
                nxt = dict(child) if isinstance(child, dict) else list(child)
                cur[path[d]] = nxt
                made[path[:d + 1]] = nxt
            cur = nxt
        cur[path[-1]] = node
    return root


class PlanCache:
    """The plans of one checkpointer's saves (see the module docstring).

    Args:
        allow_pickle: as for the checkpointer (leaves typed JSON cannot hold).
    """

    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self._entry: Optional[_Entry] = None
        self._lock = threading.Lock()
        self._warned = False
        #: saves whose plan was reused / made by walking the state
        self.hits = 0
        self.misses = 0
        #: why the last save was planned again (None: it was not, or the cache never had a plan)
        self.last_miss: Optional[str] = None

    def plan(self, step: Any, state: Any, tag: Optional[str] = None) -> Plan:
        """The plan of saving ``state`` as ``step``: reused when the state has the structure of
        the previous one, else made (and recorded for the next).

        Raises:
            ValidationError: bad input, naming the key (nothing is cached from it).
        """
        step = check_step(step)
        tag = check_tag(tag)
        with self._lock:
            e = self._entry
            if e is not None:
                got = e.guard.check(state)
                plan = self._reuse(e, step, tag, *got) if got is not None else None
                if plan is not None:
                    self.hits += 1
                    return plan
                self.misses += 1
                self.last_miss = e.guard.miss_reason if got is None else "an optimizer wrapper changed"
                log.debug("nebula_ckpt: step %d planned again: %s", step, self.last_miss)
            self._entry = None  # a state that fails to plan leaves nothing cached
            plan, rec = plan_and_record(step, state, allow_pickle=self.allow_pickle, tag=tag)
            self._entry = self._compile(plan, rec)
            return plan

    def _reuse(self, e: _Entry, step: int, tag: Optional[str], sources: Any,
               dirty: list[tuple[int, Any]]) -> Optional[Plan]:
        if any(inner_optimizer(w) is not inner for w, inner in e.wrappers):
            return None
        tree = e.tree
        if dirty:
            patches = [(e.leaf_paths[i], encode_leaf(v, e.leaf_keys[i], self.allow_pickle)) for i, v in dirty]
            tree = _patched(tree, patches)
            e.guard.commit(dirty)
            e.tree = tree
        p = e.plan
        return Plan(step=step, layout=p.layout, sources=sources, tree=tree, aliases=p.aliases, devices=p.devices,
                    optimizers=p.optimizers, modules_with_buffers=p.modules_with_buffers, dtensors=p.dtensors,
                    tag=tag, unguarded=p.unguarded)

    def _compile(self, plan: Plan, rec: Recording) -> Optional[_Entry]:
        """The cache entry of ``plan`` (None when its structure cannot be checked natively)."""
        if rec.uncacheable is not None:
            log.debug("nebula_ckpt: this state is planned at every save: %s", rec.uncacheable)
            return None
        keys = [e.key for e in plan.layout.entries]
        pos = {k: i for i, k in enumerate(keys)}
        slot_of = {k: s for s, k in enumerate(rec.slot_keys) if k in pos}
        slot_layout = tuple(pos.get(k, -1) for k in rec.slot_keys)
        alias_of = tuple(slot_of[plan.aliases[k]] if k in plan.aliases else -1 for k in rec.slot_keys)
        try:
            guard = get_ops().plan_guard((len(rec.leaves), plan_model.model(rec.program)), slot_layout, alias_of,
                                         tuple(e.offset for e in plan.layout.entries), plan_model.stock_functions(),
                                         _ndarray_type(), copy_ndarray)
        except Exception as e:  # a defect of the cache: the save goes on, planned at every save
            log.log(logging.DEBUG if self._warned else logging.WARNING, "nebula_ckpt: the plan cache cannot "
                    "check this state (%s: %s); it is planned at every save", type(e).__name__, e)
            self._warned = True
            return None
        if guard is None:
            return None  # the pure-PyTorch path
        shared = Plan(step=plan.step, layout=plan.layout, sources=None, tree=plan.tree, aliases=plan.aliases,
                      devices=plan.devices, optimizers=plan.optimizers,
                      modules_with_buffers=plan.modules_with_buffers, dtensors=plan.dtensors, tag=None,
                      unguarded=plan.unguarded)
        return _Entry(guard, shared, plan.tree, [p for p, _ in rec.leaves], [k for _, k in rec.leaves],
                      rec.wrappers)

    def clear(self) -> None:
        """Forget the cached plan (and with it the modules and optimizers it refers to)."""
        with self._lock:
            self._entry = None

    def stats(self) -> dict[str, Any]:
        """``{"hits", "misses", "last_miss"}`` (see the attributes)."""
        return {"hits": self.hits, "misses": self.misses, "last_miss": self.last_miss}


def _ndarray_type() -> Any:
    np = sys.modules.get("numpy")
    return np.ndarray if np is not None else plan_model.optional_numpy_type()
