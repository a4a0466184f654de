"""What the plan's walk records of a state's structure, for the plan cache.

:class:`Recording` is filled by :func:`nebula_ckpt.save.plan.plan_and_record` and compiled by
:mod:`nebula_ckpt.save.plan_cache` (with :mod:`nebula_ckpt.save.plan_model`) into the native
check ``csrc/plan_guard.cpp``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from nebula_ckpt.format.tree import numpy_code


def copy_ndarray(a: Any) -> Optional[tuple[str, torch.Tensor]]:
    """A NumPy array as the walk stores it: its dtype code and a tensor made from a C-contiguous
    copy in native byte order (taken now); None for a dtype stored otherwise (pickle or an error)."""
    code = numpy_code(a.dtype)
    if code is None:
        return None
    import numpy as np

    copy = np.array(a, dtype=a.dtype.newbyteorder("="), order="C", copy=True)
    return code, torch.from_numpy(copy)


@dataclass
class Recording:
    """The structure of a state as the walk met it, for :mod:`nebula_ckpt.save.plan_cache`.

    ``program`` is the root's node; nodes are tuples, first item a tag:

    * ``("T", slot, tensor)`` a tensor leaf (``slot``: its place among :attr:`slot_keys`);
    * ``("N", slot, code, tensor)`` a NumPy array stored as the tensor of a copy;
    * ``("L", leaf, value)`` a non-tensor leaf (``leaf``: its place among :attr:`leaves`);
    * ``("C", value)`` a value that must stay equal (``torch.Size``);
    * ``("D", type, keys, values)`` a dict (of that exact type), ``("S", type, items)`` a list or tuple;
    * ``("F", obj, node)`` an object whose ``state_dict()`` returned what ``node`` describes.
    """

    program: Any = None
    #: the key of every tensor leaf, tied keys too, by slot
    slot_keys: list[str] = field(default_factory=list)
    #: (path in the tree, state key) of every non-tensor leaf
    leaves: list[tuple[tuple[Any, ...], str]] = field(default_factory=list)
    #: (object saved, optimizer hooked for it) where they differ (wrappers)
    wrappers: list[tuple[Any, Any]] = field(default_factory=list)
    #: why the structure cannot be checked natively (a DTensor), or None
    uncacheable: Optional[str] = None
