"""Internal: what the :class:`~nebula_ckpt.checkpointer.Checkpointer` checks before it touches anything: the
constructor's arguments, and a restore's (``map_location``, ``strict``) before any tier is read, so
that a mistake of the caller is a :class:`ValidationError`, never a checkpoint reported damaged."""

from __future__ import annotations

from typing import Any, Optional

from nebula_ckpt import knobs
from nebula_ckpt.errors import ValidationError
from nebula_ckpt.format.names import check_step, check_tag
from nebula_ckpt.health.policy import HealthPolicy
from nebula_ckpt.storage.urls import refuse_url_credentials


def check_arguments(root: Any, keep_last: Any, host_memory_budget: Any, on_full: Any, on_persist_error: Any,
                    snapshot: Any, incremental: Any, health: Any = None, **flags: Any) -> None:
    """The :class:`~nebula_ckpt.checkpointer.Checkpointer` constructor's validation, all before anything
    is touched: a bad value raises :class:`ValidationError` naming it."""
    if not isinstance(root, str) or not root:
        raise ValidationError(f"root must be a non-empty path or URL string, got {root!r}")
    refuse_url_credentials(root)  # before the root is parsed, logged or written anywhere
    if not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1:
        raise ValidationError(f"keep_last must be an int >= 1 (the newest checkpoint is always kept), "
                              f"got {keep_last!r}")
    check_budget(host_memory_budget)
    if on_full not in ("wait", "skip"):
        raise ValidationError(f"on_full must be 'wait' or 'skip', got {on_full!r}")
    if on_persist_error not in ("raise", "log"):
        raise ValidationError(f"on_persist_error must be 'raise' or 'log', got {on_persist_error!r}")
    if snapshot not in ("auto", "sync", "async"):
        raise ValidationError(f"snapshot must be 'auto', 'sync' or 'async', got {snapshot!r}")
    for name, value in {"incremental": incremental, **flags}.items():  # "False" is truthy: never taken as True
        if not isinstance(value, bool):
            raise ValidationError(f"{name} must be True or False, got {value!r}")
    if health is not None:
        if not isinstance(health, HealthPolicy):
            raise ValidationError(f"health must be a nebula_ckpt.health.HealthPolicy or None, got "
                                  f"{type(health).__name__}")
        health.check()
    knobs.check_all()  # a knob set out of range (environment or override) fails here, not mid-run


def check_budget(value: object) -> None:
    """Refuse a ``host_memory_budget`` that is not a positive int (bytes), a float in (0, 1] (a
    share of the machine's memory) or None (what is free), naming it and what it takes."""
    ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0) or \
        (isinstance(value, float) and 0.0 < value <= 1.0)
    if not ok:
        raise ValidationError(f"host_memory_budget must be a positive int (bytes), a float in (0, 1] (a share of "
                              f"this machine's memory) or None (what is free, the default), got {value!r}")


def check_restore_arguments(map_location: Any, strict: Any) -> None:
    """A restore's own arguments, checked before any tier is read: ``strict`` is a bool, and
    ``map_location`` (as :func:`torch.load` takes it: ``None``, a device or its name, a dict of
    saved location -> device, or a callable) names devices that exist on this machine.

    Raises:
        ValidationError: naming the argument, what is wrong and what to pass instead; the
            checkpoints are not looked at (they are not what is wrong).
    """
    if not isinstance(strict, bool):
        raise ValidationError(f"strict must be True or False, got {strict!r}")
    if map_location is None or callable(map_location):
        return  # a callable is asked per tensor; what it raises is reported as its own error
    if isinstance(map_location, dict):
        for saved, dev in map_location.items():
            if dev is not None:  # only named here: it matters only if a tensor was saved on ``saved``
                check_device(dev, f"map_location[{saved!r}]", here=False)
        return
    check_device(map_location, "map_location")


def check_device(value: Any, what: str, here: bool = True) -> None:
    """``value`` is a device (or its name) and, ``here``, one this process can put tensors on
    (the restore checks a dict's entry so once a tensor is mapped by it).

    Raises:
        ValidationError: naming ``what``.
    """
    import torch

    if not isinstance(value, (str, torch.device)):
        raise ValidationError(f"{what} must be a device ('cpu', 'cuda', 'cuda:1', a torch.device), a dict of saved "
                              f"location -> device, or a callable (as torch.load takes it), got {value!r}")
    try:
        dev = torch.device(value)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValidationError(f"{what}={value!r} is not a device ({e}); pass e.g. 'cpu' or 'cuda:0'") from None
    if not here:
        return
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValidationError(f"{what}={value!r}, but this machine has no usable CUDA device "
                                  "(torch.cuda.is_available() is False): restore with map_location='cpu', or on "
                                  "a machine with a GPU (the checkpoints are not damaged)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValidationError(f"{what}={value!r}, but this machine has {torch.cuda.device_count()} CUDA "
                                  f"device(s) (0..{torch.cuda.device_count() - 1}): pick one of those")
    elif dev.type not in ("cpu", "meta"):
        try:
            torch.empty(0, device=dev)
        except Exception as e:  # the device type exists in torch, but not on this machine
            raise ValidationError(f"{what}={value!r}: tensors cannot be put on {dev} here ({type(e).__name__}: "
                                  f"{e}); restore with map_location='cpu' (the checkpoints are not damaged)") from None


def check_step_or_tag(what: str, step: Optional[int], tag: Optional[str]) -> None:
    """The ``step`` / ``tag`` pair of ``load`` / ``read`` / ``remove``: exactly one of them, well formed."""
    if (step is None) == (tag is None):
        raise ValidationError(f"{what}(): give either step or tag (exactly one of them), got step={step!r}, "
                              f"tag={tag!r}")
    if step is not None:
        check_step(step)
    else:
        check_tag(tag)


def check_timeout(timeout: Any) -> None:
    """Refuse a ``timeout`` that is not None (no limit) or a number of seconds >= 0, naming it."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout >= 0):
        raise ValidationError(f"timeout must be None (no limit) or a number of seconds >= 0, got {timeout!r}")
