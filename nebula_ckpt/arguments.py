"""What the :class:`~nebula_ckpt.checkpointer.Checkpointer` constructor checks before it touches anything."""

from __future__ import annotations

from typing import Any

from nebula_ckpt import knobs
from nebula_ckpt.errors import ValidationError
from nebula_ckpt.health.policy import HealthPolicy
from nebula_ckpt.save.budget import check_budget
from nebula_ckpt.storage.urls import refuse_url_credentials


def check_arguments(root: Any, keep_last: Any, host_memory_budget: Any, on_full: Any, on_persist_error: Any,
                    snapshot: Any, incremental: Any, health: Any = None) -> None:
    """The :class:`~nebula_ckpt.checkpointer.Checkpointer` constructor's validation, all before anything
    is touched: a bad value raises :class:`ValidationError` naming it."""
    if not isinstance(root, str) or not root:
        raise ValidationError(f"root must be a non-empty path or URL string, got {root!r}")
    refuse_url_credentials(root)  # before the root is parsed, logged or written anywhere
    if not isinstance(keep_last, int) or keep_last < 1:
        raise ValidationError(f"keep_last must be an int >= 1 (the newest checkpoint is always kept), "
                              f"got {keep_last!r}")
    check_budget(host_memory_budget)
    if on_full not in ("wait", "skip"):
        raise ValidationError(f"on_full must be 'wait' or 'skip', got {on_full!r}")
    if on_persist_error not in ("raise", "log"):
        raise ValidationError(f"on_persist_error must be 'raise' or 'log', got {on_persist_error!r}")
    if snapshot not in ("auto", "sync", "async"):
        raise ValidationError(f"snapshot must be 'auto', 'sync' or 'async', got {snapshot!r}")
    if not isinstance(incremental, bool):
        raise ValidationError(f"incremental must be True or False, got {incremental!r}")
    if health is not None:
        if not isinstance(health, HealthPolicy):
            raise ValidationError(f"health must be a nebula_ckpt.health.HealthPolicy or None, got "
                                  f"{type(health).__name__}")
        health.check()
    knobs.check_all()  # a knob set out of range (environment or override) fails here, not mid-run
