"""Drop-in APIs of other checkpointing tools, over :class:`~nebula_ckpt.Checkpointer`.

* :mod:`nebula_ckpt.compat.torch_nebula` — Azure ML Nebula's ``torch_nebula`` / ``nebulaml`` API
  (``init``, ``Checkpoint(tag, num_of_files).save(name, obj)`` / ``commit()``,
  ``get_latest_checkpoint().load(name)``, ``list_checkpoints``, ``get_checkpoint(tag=...)``,
  the checkpoint histories)::

      import nebula_ckpt.compat.torch_nebula as tn     # was: import torch_nebula as tn

  :func:`install_aliases` makes the original imports (``import torch_nebula``,
  ``import nebulaml``) resolve to it, for scripts that are not to be edited.
"""

from __future__ import annotations

import sys
from typing import Sequence

from nebula_ckpt.errors import NebulaError

__all__ = ["install_aliases"]

#: the module names Azure ML Nebula was imported under (old and new documentation)
NEBULA_MODULE_NAMES = ("torch_nebula", "nebulaml")


def install_aliases(names: Sequence[str] = NEBULA_MODULE_NAMES) -> None:
    """Make ``import torch_nebula`` / ``import nebulaml`` give :mod:`nebula_ckpt.compat.torch_nebula`.

    Call it once, before the code that imports Nebula runs (an unchanged training script, or a
    framework that imports ``torch_nebula`` itself). Idempotent.

    Raises:
        NebulaError: a different module is already imported under one of ``names`` (the real
            Nebula package): nothing is replaced.
    """
    import importlib

    torch_nebula = importlib.import_module(__name__ + ".torch_nebula")

    for name in names:
        present = sys.modules.get(name)
        if present is not None and present is not torch_nebula:
            raise NebulaError(f"module {name!r} is already imported ({getattr(present, '__file__', present)!r}); "
                              "install_aliases() does not replace it: call it before anything imports "
                              f"{name}, or import nebula_ckpt.compat.torch_nebula directly")
    for name in names:
        sys.modules[name] = torch_nebula
