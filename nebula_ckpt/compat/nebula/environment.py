"""Azure ML Nebula's environment variables, read as its ``torch_nebula.init`` read them.

These belong to the product this package stands in for, not to nebula_ckpt: they are not knobs
(:mod:`nebula_ckpt.knobs`), and only :func:`torch_nebula.init <nebula_ckpt.compat.nebula.session.init>`
reads them, each only when the matching argument is not given:

- ``NEBULA_PERSISTENT_STORAGE_PATH``: the checkpoint root (``persistent_storage_path``);
- ``NEBULA_PERSISTENT_TIME_INTERVAL``: seconds between persisted checkpoints
  (``persistent_time_interval``);
- ``NEBULA_MEMORY_BUFFER_SIZE``: Nebula's streaming buffer size; nebula_ckpt stages whole
  checkpoints (capped by ``host_memory_budget``), so ``init`` warns that it is ignored.

This module and :mod:`nebula_ckpt.knobs` are the only readers of the environment
(``tests/api/test_architecture.py``).
"""

from __future__ import annotations

import os
from typing import Optional

STORAGE_PATH = "NEBULA_PERSISTENT_STORAGE_PATH"
TIME_INTERVAL = "NEBULA_PERSISTENT_TIME_INTERVAL"
MEMORY_BUFFER_SIZE = "NEBULA_MEMORY_BUFFER_SIZE"


def _read(name: str) -> Optional[str]:
    return os.environ.get(name) or None


def storage_path() -> Optional[str]:
    """``NEBULA_PERSISTENT_STORAGE_PATH``, or None when unset or empty."""
    return _read(STORAGE_PATH)


def time_interval() -> Optional[str]:
    """``NEBULA_PERSISTENT_TIME_INTERVAL`` (unparsed: ``init`` checks it as it checks the argument),
    or None when unset or empty."""
    return _read(TIME_INTERVAL)


def memory_buffer_size() -> Optional[str]:
    """``NEBULA_MEMORY_BUFFER_SIZE``, or None when unset or empty."""
    return _read(MEMORY_BUFFER_SIZE)
