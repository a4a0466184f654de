"""Restore an opened checkpoint into ``into`` in place: match, validate, copy, then apply.

:func:`stage_apply` walks the saved tree against ``into`` (:class:`~nebula_ckpt.restore.walk.TreeWalk`):
keys, shapes and dtypes are checked and every owned copy is made (checksums checked while
copying) before anything in ``into`` changes; what it returns makes the changes: the optimizers
load first, then the rest in the tree's order (:class:`ObjectLoads`). Modules load zero-copy views
of the mapped shard bytes (each submodule's source pages unmapped once loaded); optimizers and new
values get owned copies (:mod:`nebula_ckpt.restore.copies`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, NoReturn, Optional

import torch

from nebula_ckpt.errors import NebulaError, ValidationError
from nebula_ckpt.format.records import TensorRecord
from nebula_ckpt.format.tree import decode
from nebula_ckpt.native import get_ops
from nebula_ckpt.restore.copies import all_cpu, owned, owned_batch
from nebula_ckpt.restore.inplace import (
    SavedOptimizer,
    check_module_not_meta,
    check_module_state,
    check_not_meta,
    check_not_overlapping,
    check_optimizer_not_meta,
    check_optimizer_state,
    live_destinations,
    module_destinations,
    read_optimizer,
    refill,
)
from nebula_ckpt.restore.open import OpenCheckpoint
from nebula_ckpt.restore.walk import Thunk, TreeWalk, tensor_keys

log = logging.getLogger("nebula_ckpt")


def stage_restore(into: Any, *, map_location: Any = None, strict: bool = True,
                  allow_pickle: bool = False, adopt: Optional[Callable[[OpenCheckpoint], Any]] = None
                  ) -> Callable[[OpenCheckpoint], None]:
    """A ``stage`` for :func:`~nebula_ckpt.restore.select.find_and_open` that prepares restoring
    each candidate into ``into``.

    Sets ``ck.pending`` to what applies it (same layout), after :func:`stage_apply` read and
    verified everything; for a checkpoint of another layout, or one whose DTensors ``into`` lays
    out otherwise (:attr:`~nebula_ckpt.restore.open.OpenCheckpoint.other_layout`), it only
    verifies (resharding reads what it needs itself). ``adopt(ck)``: the
    :class:`~nebula_ckpt.tiers.memory.adopt.Adoption` of a candidate whose pages may be handed over
    instead of copied, or None.
    """
    def stage(ck: OpenCheckpoint) -> None:
        if ck.same_layout:
            if adopt is not None and all_cpu(map_location):
                ck.adoption = adopt(ck)
            pending = stage_apply(ck, into, map_location=map_location, strict=strict, allow_pickle=allow_pickle)
            if ck.same_layout:
                ck.pending = pending
                return
            # a DTensor of `into` is laid out otherwise than stored: resharded (on every rank alike,
            # agreed by select.open_agreed, which opens the whole job's checkpoint for it)
        ck.verify_rest()
    return stage


def apply(ck: OpenCheckpoint, into: Any, *, map_location: Any = None, strict: bool = True,
          allow_pickle: bool = False) -> None:
    """Restore ``ck`` into ``into`` in place (same tree shape as what was saved)."""
    stage_apply(ck, into, map_location=map_location, strict=strict, allow_pickle=allow_pickle)()


def stage_apply(ck: OpenCheckpoint, into: Any, *, map_location: Any = None, strict: bool = True,
                allow_pickle: bool = False) -> Callable[[], None]:
    """Everything of a restore of ``ck`` into ``into`` but the changes; returns what makes them.

    Matches the checkpoint's tree against ``into`` (keys, shapes, dtypes, a destination on the meta
    device: ``ValidationError``), makes the owned copies (optimizer state, new tensors) in parallel
    while checking their checksums, and checks the checksums of the bytes that will be copied into existing tensors
    (``CorruptCheckpointError``). Nothing in ``into`` has changed when this returns or raises;
    the returned function applies it: every optimizer's ``load_state_dict`` first, then the rest
    in the tree's order. A ``load_state_dict`` that raises all the same (a custom loading) is an
    error naming its key in ``into`` and saying what holds (:class:`ObjectLoads`): an optimizer's
    failure puts the optimizers back as they were, nothing else having changed; a later one may
    leave the objects loaded before it, and itself, partly restored.
    """
    dtensors = any(r.dtensor is not None for r in ck.manifest.tensors.values())
    if dtensors:
        ck.meshes.update(meshes(into))
    st = Staged(ck, map_location, allow_pickle)
    try:
        walk = RestoreWalk(st, strict, dtensors)
        run = walk.walk(ck.tree, into, "")
        if strict:
            walk.unmatched.check(f"restore: the checkpoint of step {ck.step}")
        if ck.other_layout is not None:
            return _reshard_instead(ck)
        st.materialize()
        ck.verify_rest()
        if ck.adoption is not None and not ck.adoption.give_up():
            # the claim was not won: never write through the file, copy (checked) what it would hand out
            st.own_adopted(ck.adoption.adopted)
    except BaseException:
        if ck.adoption is not None:
            ck.adoption.finish()  # nothing was handed over: the tier keeps its checkpoint
        raise

    def go() -> None:
        adoption = ck.adoption
        try:
            walk.loads.run_first()
            run()
        finally:
            if adoption is not None:
                adoption.finish()
        ck.pending = None
    return go


def _reshard_instead(ck: OpenCheckpoint) -> Callable[[], None]:
    """What :func:`stage_apply` returns when ``into`` lays a tensor out otherwise than stored
    (:attr:`~nebula_ckpt.restore.open.OpenCheckpoint.other_layout`): nothing is copied, the
    checkpoint is resharded instead (:func:`stage_restore`), which applying it alone cannot do."""
    if ck.adoption is not None:
        ck.adoption.finish()  # nothing was handed over: the tier keeps its checkpoint
        ck.adoption = None

    def refuse() -> None:
        raise ValidationError(f"restore (step {ck.step}): {ck.other_layout}; restore it with "
                              "Checkpointer.load_latest(into=...) or load(), which reshard it")
    return refuse


def meshes(into: Any) -> dict[tuple[int, ...], Any]:
    """Device meshes of the DTensors in ``into`` (parameters of modules and optimizers, leaves)."""
    out: dict[tuple[int, ...], Any] = {}
    stack, seen = [into], set()
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            mesh = getattr(x, "device_mesh", None)
            if mesh is not None:
                out.setdefault(tuple(mesh.shape), mesh)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, torch.nn.Module):
            stack.extend(x.parameters())
        elif isinstance(x, torch.optim.Optimizer):
            stack.extend(p for g in x.param_groups for p in g["params"])
    return out


def materialize(ck: OpenCheckpoint, *, map_location: Any = None, allow_pickle: bool = False) -> Any:
    """Decode the whole checkpoint as a fresh tree of owned tensors and plain values."""
    st = Staged(ck, map_location, allow_pickle)
    tree = st.decode_owned(ck.tree, "")
    st.materialize()
    ck.verify_rest()
    return tree()


class Staged:
    """The owned copies a restore makes: registered while planning, made at once, then decoded."""

    def __init__(self, ck: OpenCheckpoint, map_location: Any, allow_pickle: bool) -> None:
        self.ck = ck
        self.map_location = map_location
        self.allow_pickle = allow_pickle
        self._groups: list[list[str]] = []
        self._owned: list[dict[str, torch.Tensor]] = []

    def decode_owned(self, node: Mapping[str, Any], path: str,
                     live: Optional[Mapping[str, torch.Tensor]] = None) -> Callable[[], Any]:
        """Register the tensors of ``node`` for owned copies; return what decodes ``node`` with them.

        Each node gets buffers of its own (an optimizer's state never shares a storage with
        another object's, so saving one never writes the other's bytes). ``live``: keys whose
        bytes are copied into these existing tensors instead, when the decoding runs (the
        restore is applied: :mod:`~nebula_ckpt.restore.inplace`).
        """
        i = len(self._groups)
        into = dict(live or {})
        self._groups.append([k for k in tensor_keys(node, []) if k not in into])

        def decoded() -> Any:
            made = self._owned[i]
            if into:
                refill(self.ck, into)
            return decode(node, lambda k: self.ck.as_saved(k, into[k] if k in into else made[k]),
                          self.allow_pickle, path)
        return decoded

    def materialize(self) -> None:
        """Make every registered owned copy (checksums checked while copying)."""
        self._owned = [owned_batch(self.ck, keys, self.map_location) for keys in self._groups]

    def own_adopted(self, adopted: Mapping[int, TensorRecord]) -> None:
        """Replace the tensors adopted from the memory tier (ids in ``adopted``, with their
        records) by owned copies, their checksums checked: the claim on the tier's file was not
        won, so it must never be written through them.

        Raises:
            CorruptCheckpointError: a copy's bytes differ from the manifest's checksum.
        """
        copies: dict[int, torch.Tensor] = {}
        for made in self._owned:
            for k, t in made.items():
                if id(t) in adopted:
                    if id(t) not in copies:
                        copies[id(t)] = owned(t, None)
                    made[k] = copies[id(t)]
        ops = get_ops()
        for i, c in copies.items():
            raw = c.reshape(-1).view(torch.uint8)
            self.ck.verified_by_copy([adopted[i]], ops.crc32c(raw, [0], [raw.numel()]))



class ObjectLoads:
    """The ``load_state_dict`` calls of a restore, made once everything was read and checked:
    the optimizers' first (torch checks an optimizer's state only as it loads it, after the
    objects before it in ``into`` were loaded), then the others in the tree's order.

    A load that raises all the same (a custom ``__setstate__`` or load hook, a state no check
    foresaw) is raised again as a :class:`ValidationError` (a :class:`NebulaError` keeps its
    class) naming the object's key in ``into``, the error, and what holds:

    - an optimizer's: it and the optimizers loaded before it get their attributes back as they
      were (``state`` and ``param_groups``: what torch's ``load_state_dict`` replaces), and
      nothing else has changed yet: ``into`` is untouched. Except where an optimizer loads
      otherwise than through torch's ``Optimizer.load_state_dict`` (a wrapper's changes the
      optimizer it wraps), or had its tensors refilled with the checkpoint's values before it
      loaded (only where its loading is torch's own, of a state of the keys it holds:
      :func:`~nebula_ckpt.restore.inplace.live_destinations`; one loaded so is kept loaded, the
      checkpoint's state whole): the error then names those, as possibly partly restored;
    - any other object's (a module, a scheduler): the objects loaded before it hold the
      checkpoint's state and it may be partly restored; the error names them.
    """

    def __init__(self, step: int) -> None:
        self.step = step
        self._first: list[tuple[str, Any, Thunk, bool]] = []
        #: keys in ``into`` of the objects loaded so far
        self.done: list[str] = []

    def first(self, shown: str, target: Any, load: Thunk, refilled: bool) -> Thunk:
        """Have the optimizer ``target`` (at ``shown``) loaded by ``load`` before the rest
        (``refilled``: its tensors are refilled in place first); returns its thunk in the tree."""
        self._first.append((shown, target, load, refilled))
        return lambda: target

    def run_first(self) -> None:
        """Load the optimizers; on a failure put them back (see the class) and raise."""
        before: list[tuple[str, Any, dict[str, Any], bool]] = []
        for shown, target, load, refilled in self._first:
            before.append((shown, target, dict(target.__dict__), refilled))
            try:
                load()
            except BaseException as e:
                # put back what has its old tensors still (one refilled and loaded keeps the checkpoint's state whole)
                kept = [k for k, _, _, r in before[:-1] if r]
                for k, obj, attrs, _ in reversed(before):
                    if k not in kept:
                        obj.__dict__.clear()
                        obj.__dict__.update(attrs)
                if not isinstance(e, Exception):
                    raise
                own = torch.optim.Optimizer.load_state_dict
                self._raise(shown, target, e, kept + [k for k, obj, _, r in before
                                                      if k not in kept and (r or type(obj).load_state_dict is not own)])
            self.done.append(shown)

    def guarded(self, shown: str, target: Any, load: Thunk) -> Thunk:
        """``load`` (of the object ``target`` at ``shown``), its failure named (see the class)."""
        def run() -> Any:
            try:
                out = load()
            except Exception as e:
                self._raise(shown, target, e, [*self.done, shown])
            self.done.append(shown)
            return out
        return run

    def _raise(self, shown: str, target: Any, e: Exception, partly: list[str]) -> NoReturn:
        msg = (f"restore: the checkpoint of step {self.step} was read and checked, but loading it into the "
               f"{type(target).__name__} under '{shown}' failed ({type(e).__name__}: {e}); ")
        if partly:
            msg += (f"the live objects under {partly} may be partly restored; the saved state does not fit "
                    f"'{shown}': restore again into objects built as the ones that saved it (the same classes and "
                    f"settings), or leave '{shown}' out of `into` and pass strict=False")
        else:
            msg += (f"nothing in `into` changed (the optimizers were put back as they were); the saved state does not "
                    f"fit it: restore into an object built as the one that saved it (the same class and settings), or "
                    f"leave '{shown}' out of `into` and pass strict=False")
        if isinstance(e, NebulaError):
            e.args = (msg,)
            raise e
        raise ValidationError(msg) from e


def drop_after_each_submodule(ck: OpenCheckpoint, module: torch.nn.Module, state: Mapping[str, Any]) -> list[Any]:
    """Post hooks on ``module`` and its submodules that unmap the source pages of their own
    parameters and buffers as soon as ``load_state_dict`` has copied them (so a model's restore
    never has its whole mapped source resident). Keys it cannot match are dropped by the caller
    after the load."""
    recs: dict[str, TensorRecord] = {}
    if state.get("t") in ("dict", "odict"):
        for k_node, v_node in state["v"]:
            if isinstance(v_node, dict) and v_node.get("t") == "tensor" and isinstance(k_node, dict) \
                    and k_node.get("t") == "str":
                recs[k_node["v"]] = ck.resolve(v_node["k"])
    hooks = []
    for name, sub in module.named_modules():
        own = [n for n, _ in sub.named_parameters(recurse=False, remove_duplicate=False)]
        own += [n for n, _ in sub.named_buffers(recurse=False, remove_duplicate=False)]
        mine = [recs[f"{name}.{n}" if name else n] for n in own if (f"{name}.{n}" if name else n) in recs]
        if mine:
            hooks.append(sub.register_load_state_dict_post_hook(lambda _m, _k, mine=mine: ck.drop(mine)))
    return hooks


#: tensor types whose layout is their shape (no DTensor): checked by shape and dtype alone
_PLAIN = (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer)


class RestoreWalk(TreeWalk[Thunk]):
    """The walk of a restore in place: each node of the saved tree gives what restores it into
    its part of ``into`` (validated now; the owned copies it needs registered with ``st``)."""

    def __init__(self, st: Staged, strict: bool, dtensors: bool = False) -> None:
        super().__init__(strict, f"restore (step {st.ck.step})")
        self.st = st
        self.ck = st.ck
        #: the checkpoint holds DTensors: the objects' tensors are checked to hold the same pieces
        self.dtensors = dtensors
        #: the objects' loads, optimizers first, each failure named (see :class:`ObjectLoads`)
        self.loads = ObjectLoads(st.ck.step)

    def is_object(self, node: Mapping[str, Any], target: Any) -> bool:
        # a state dict saved as a plain dict (DCP's writer, a framework's dict) restored into the
        # object it came from is loaded into the object, never replaces it
        return node["t"] == "stateful" or node["t"] in ("dict", "odict") and not isinstance(target, dict) \
            and callable(getattr(target, "load_state_dict", None))

    def on_object(self, node: Mapping[str, Any], target: Any, path: str) -> Thunk:
        saved_cls = node.get("cls") if node["t"] == "stateful" else None  # a plain dict: not known
        if node["t"] != "stateful":
            node = {"t": "stateful", "cls": type(target).__name__, "state": node}
        shown = path or "<root>"
        if not callable(getattr(target, "load_state_dict", None)):
            fix = _object_fix(node, target, shown)
            if target is None or not self.strict:
                if fix:  # the dict is replaced; the object its tensors came from is not changed
                    log.warning("nebula_ckpt: restore (strict=False): `into` key '%s' was replaced by the saved "
                                "%s state; nothing was restored into the object it came from. %s", shown,
                                node.get("cls"), fix)
                return self.st.decode_owned(node, path)
            raise ValidationError(f"restore: checkpoint key '{shown}' holds a {node.get('cls')} state, but "
                                  f"the object given in `into` ({type(target).__name__}) has no load_state_dict()."
                                  f" {fix or 'Pass the object that was saved there.'}")
        if isinstance(target, torch.nn.Module):
            check_module_not_meta(self.ck, node["state"], target, shown, self.where)
            check_module_state(self.ck, node["state"], target, shown, self.strict)
            if self.dtensors:
                self._check_module_layout(node["state"], target, shown)
            return self.loads.guarded(shown, target, self._load_module(node["state"], target, path))
        # Optimizers etc. keep the tensors they are given: hand them owned copies, or their own
        # tensors refilled where load_state_dict keeps those as they are
        check_optimizer_not_meta(target, shown, self.where)
        saved = read_optimizer(node["state"], target, self.ck.view, self.ck.step, shown)
        check_optimizer_state(saved, target, shown, saved_cls)
        if self.dtensors and saved is not None:
            self._check_state_layout(saved, target, shown)
        live = live_destinations(self.ck, saved, target) if all_cpu(self.st.map_location) else {}
        state = self.st.decode_owned(node["state"], path, live)

        def load_object() -> Any:
            target.load_state_dict(state())
            return target
        if isinstance(target, torch.optim.Optimizer):
            return self.loads.first(shown, target, load_object, refilled=bool(live))
        return self.loads.guarded(shown, target, load_object)

    def _check_module_layout(self, state: Mapping[str, Any], target: torch.nn.Module, shown: str) -> None:
        """Each saved tensor of a module against the parameter or buffer it goes into
        (:meth:`~nebula_ckpt.restore.open.OpenCheckpoint.fits`: the same piece, or resharded)."""
        if state.get("t") not in ("dict", "odict"):
            return
        want = target.state_dict(keep_vars=True)
        for k_node, v_node in state["v"]:
            if isinstance(v_node, dict) and v_node.get("t") == "tensor":
                k = decode(k_node, self.ck.view, False, shown)
                if isinstance(want.get(k), torch.Tensor):
                    self.ck.fits(v_node["k"], want[k], f"{shown}/{k}")

    def _check_state_layout(self, saved: SavedOptimizer, target: Any, shown: str) -> None:
        """Each saved tensor of an optimizer's state against the live one it replaces, where it
        has state (:meth:`~nebula_ckpt.restore.open.OpenCheckpoint.fits`)."""
        by_id = saved.by_param(target) or {}
        for pid, named in saved.states:
            live = target.state.get(by_id.get(pid, (-1, None))[1]) if pid in by_id else None
            for k, nv in named:
                have = live.get(k) if isinstance(live, dict) else None
                if isinstance(nv, dict) and nv.get("t") == "tensor" and isinstance(have, torch.Tensor):
                    self.ck.fits(nv["k"], have, f"{shown}/state/{pid}/{k}")

    def _load_module(self, state_node: Mapping[str, Any], target: torch.nn.Module, path: str) -> Thunk:
        ck, strict, allow_pickle = self.ck, self.strict, self.st.allow_pickle
        keys = tensor_keys(state_node, [])
        live = module_destinations(ck, state_node, target, path or "<root>")

        def load_module() -> Any:
            # The parameters and buffers torch's loading copies into are refilled first, and
            # given to it as the values (each copied onto itself: nothing); the others are
            # zero-copy views, copied by load_state_dict, each submodule's source pages
            # unmapped once it is loaded.
            refill(ck, live)
            state = decode(state_node, lambda k: live[k] if k in live else ck.as_saved(k, ck.view(k)),
                           allow_pickle, path)
            hooks = drop_after_each_submodule(ck, target, state_node)
            try:
                target.load_state_dict(state, strict=strict)
            finally:
                for h in hooks:
                    h.remove()
            del state
            ck.drop([ck.resolve(k) for k in keys])
            return target
        return load_module

    def on_tensor(self, node: Mapping[str, Any], target: Any, path: str) -> Thunk:
        if not isinstance(target, torch.Tensor):
            return self.replace(node, target, path)
        check_not_meta(target, path or "<root>", self.where)
        ck = self.ck
        src = ck.view(node["k"])
        dest = target
        if type(target) not in _PLAIN or ck.resolve(node["k"]).dtensor is not None:
            if not ck.fits(node["k"], target, path or "<root>"):
                return lambda: target  # laid out otherwise: resharded instead (stage_apply)
            if hasattr(target, "to_local"):
                dest = target.to_local()  # a DTensor: this rank's shard is restored into its local part
        if tuple(dest.shape) != tuple(src.shape) or dest.dtype != src.dtype:
            raise ValidationError(
                f"restore: key '{path or '<root>'}': checkpoint has {src.dtype} {tuple(src.shape)}, the tensor in "
                f"`into` is {dest.dtype} {tuple(dest.shape)}; pass a matching tensor"
                + ("" if ck.manifest.multi_rank else " or use read()"))
        check_not_overlapping(dest, path or "<root>", self.where)
        as_bytes = dest.element_size() == 1 and not dest.is_neg()  # torch cannot copy_ int1..7 / uint1..7

        def copy_into() -> Any:
            with torch.no_grad():
                (dest.view(torch.uint8) if as_bytes else dest).copy_(src.view(torch.uint8) if as_bytes else src)
            ck.drop([ck.resolve(node["k"])])
            return target
        return copy_into

    def on_dict(self, node: Mapping[str, Any], target: dict[Any, Any], children: list[tuple[Any, Thunk]],
                path: str) -> Thunk:
        def fill() -> Any:
            for k, f in children:
                target[k] = f()
            return target
        return fill

    def on_sequence(self, node: Mapping[str, Any], target: Any, children: list[Thunk], path: str) -> Thunk:
        if node["t"] == "tuple":  # immutable: restore what can be restored in place, rebuild the tuple
            return lambda: tuple(f() for f in children)

        def fill_list() -> Any:
            for i, f in enumerate(children):
                target[i] = f()
            return target
        return fill_list

    def on_value(self, node: Mapping[str, Any], target: Any, path: str) -> Thunk:
        return self.st.decode_owned(node, path)

    def refuse(self, node: Mapping[str, Any], target: Any, path: str) -> bool:
        # at the root, any object would be dropped for the saved value
        return self.strict and (not path and target is not None or super().refuse(node, target, path))


def _object_fix(node: Mapping[str, Any], target: Any, shown: str) -> str:
    """The fix when an object's state was saved at ``shown`` and ``into`` holds a dict there (the
    ``torch.load`` habit ``into={"model": model.state_dict()}``); "" for any other target."""
    if not isinstance(target, Mapping):
        return ""
    cls = str(node.get("cls") or "object").rsplit(".", 1)[-1]
    return (f"Pass the {cls} itself (into={{..., '{shown.rsplit('/', 1)[-1]}': <the "
            "object>}): its load_state_dict() is called, as a state_dict() copy never reaches it; or take the "
            "saved state dict with ck.read() and load it yourself.")
