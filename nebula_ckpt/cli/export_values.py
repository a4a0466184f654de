"""What ``nebula-ckpt export`` writes besides tensors, and what it says about it.

* A ``.pt`` file is read by plain ``torch.load`` (``weights_only=True``, torch's default): NumPy
  arrays become tensors of the same dtype and shape and NumPy scalars Python numbers (an RNG
  state saved as ``np.random.get_state()`` among them), and the export names them; a leaf that
  only pickle restores (``--allow-pickle``) is named too, since that file then needs
  ``weights_only=False``.
* A safetensors file holds tensors only: the export names every other value it leaves out.
* The Hugging Face config note (``from_pretrained`` needs a ``config.json``) is for a Hugging Face
  model, not for every module exported with ``--key``.
"""

from __future__ import annotations

import collections
from typing import Any, Mapping, Optional

import numpy as np
import torch

__all__ = ["weights_only", "values_left_out", "shown", "is_hugging_face"]

#: how many keys a note names before it counts the rest
SHOWN = 8


def _tensor(a: np.ndarray) -> torch.Tensor:
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    return torch.from_numpy(np.ascontiguousarray(a)).clone()


def weights_only(tree: Any, path: str = "") -> tuple[Any, list[str], list[str]]:
    """``tree`` as ``torch.load(weights_only=True)`` reads it back: ``(tree, converted, pickled)``,
    the key paths of the NumPy values turned into tensors / Python numbers, and of the values
    only pickle restores (left as they are)."""
    converted: list[str] = []
    pickled: list[str] = []

    def walk(x: Any, at: str) -> Any:
        if isinstance(x, np.ndarray):
            converted.append(at or "<state>")
            return _tensor(x)
        if isinstance(x, np.generic):
            converted.append(at or "<state>")
            return x.item()
        if isinstance(x, torch.Tensor) or x is None or isinstance(x, (bool, int, float, complex, str, bytes)):
            return x
        if isinstance(x, (torch.dtype, torch.device, torch.Size)):
            return x
        if isinstance(x, dict):
            items = [(k, walk(v, f"{at}/{k}" if at else str(k))) for k, v in x.items()]
            return collections.OrderedDict(items) if isinstance(x, collections.OrderedDict) else dict(items)
        if isinstance(x, (list, tuple)):
            vals = [walk(v, f"{at}/{i}" if at else str(i)) for i, v in enumerate(x)]
            return vals if isinstance(x, list) else tuple(vals)
        pickled.append(at or "<state>")
        return x

    return walk(tree, path), converted, pickled


def values_left_out(node: Mapping[str, Any], at: str = "") -> list[str]:
    """Key paths of the non-tensor values under the typed-tree ``node`` (what a safetensors file,
    which holds tensors only, leaves out)."""
    t = node["t"]
    if t == "stateful":
        return values_left_out(node["state"], at)
    if t in ("dict", "odict"):
        return [p for k, v in node["v"] for p in values_left_out(v, f"{at}/{k['v']}" if at else str(k["v"]))]
    if t in ("list", "tuple"):
        return [p for i, v in enumerate(node["v"]) for p in values_left_out(v, f"{at}/{i}" if at else str(i))]
    if t in ("tensor", "ndarray"):
        return []
    return [at or "<state>"]


def shown(keys: list[str]) -> str:
    """``a, b, c`` (the first :data:`SHOWN`, then how many more)."""
    more = f", ... ({len(keys) - SHOWN} more)" if len(keys) > SHOWN else ""
    return ", ".join(keys[:SHOWN]) + more


def is_hugging_face(node: Mapping[str, Any]) -> Optional[bool]:
    """Whether the object saved at ``node`` is a Hugging Face model (its class comes from
    ``transformers`` or ``peft``); None when the checkpoint does not say (a plain dict)."""
    if node["t"] != "stateful" or not isinstance(node.get("cls"), str):
        return None
    return str(node["cls"]).split(".", 1)[0] in ("transformers", "peft")
