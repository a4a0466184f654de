"""The health policy a :class:`~nebula_ckpt.checkpointer.Checkpointer` applies to the training signal.

Why these defaults (the whole policy is in ``docs/health.md``):

- ``healthy_after=2``: a checkpoint is confirmed once two reported steps after it had a finite
  loss. One step can pass by luck (the first forward after a bad update can still be finite); two
  are rare to pass by luck and cost almost nothing to wait for.
- ``suspect_within=50``: a loss that turns non-finite within 50 reported steps after a restore
  blames the step restored (a corrupt or diverging state blows up within a few steps: three in
  the restart loop this guards against); later than that, the data or the code at that step is
  the likelier cause, and blaming the checkpoint would throw away good work.
- no spike rule by default: only a non-finite loss is certain; what counts as a spike depends on
  the model, so it is the user's to say (:class:`SpikeRule` is one ready rule).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

from nebula_ckpt.errors import ValidationError

#: ``rule(step, loss, grad_norm)``: a reason (str) when this finite loss is bad, else None
Rule = Callable[[int, float, Optional[float]], Optional[str]]


@dataclass(frozen=True)
class HealthPolicy:
    """How reports (:meth:`~nebula_ckpt.checkpointer.Checkpointer.report`) mark checkpoints.

    Args:
        healthy_after: a checkpoint is marked *healthy* once this many reported steps after it
            had a finite loss (``k``; default 2).
        suspect_within: a bad loss reported within this many reported steps after a restore
            marks the step restored *suspect* (``N``; default 50), with the steps saved since.
        rule: optional ``rule(step, loss, grad_norm) -> reason or None`` called with every finite
            loss; a reason makes that report count as bad, like a non-finite loss (e.g.
            :class:`SpikeRule`). It runs on the training thread: keep it cheap.

    Example::

        from nebula_ckpt.health import HealthPolicy, SpikeRule

        ckpt = nc.Checkpointer("/ckpt/run-42", health=HealthPolicy(rule=SpikeRule(factor=10)))
    """

    healthy_after: int = 2
    suspect_within: int = 50
    rule: Optional[Rule] = None

    def check(self) -> None:
        """Raise :class:`ValidationError` naming a bad field."""
        for name, v in (("healthy_after", self.healthy_after), ("suspect_within", self.suspect_within)):
            if type(v) is not int or not 1 <= v <= 1_000_000:
                raise ValidationError(f"HealthPolicy.{name} must be an int in [1, 1000000], got {v!r}")
        if self.rule is not None and not callable(self.rule):
            raise ValidationError(f"HealthPolicy.rule must be callable (step, loss, grad_norm) -> reason or None, "
                                  f"got {type(self.rule).__name__}")


class SpikeRule:
    """A loss spike rule: a finite loss above ``factor`` times the median of the last ``window``
    finite losses (once ``warmup`` of them were seen) counts as bad. Spikes are not added to the
    history, so a run that stays up keeps failing the rule.

    Args:
        factor: how many times the median a spike is (> 1).
        window: how many recent losses the median is taken over.
        warmup: losses seen before the rule judges any.
    """

    def __init__(self, factor: float = 10.0, window: int = 100, warmup: int = 20) -> None:
        if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 1):
            raise ValidationError(f"SpikeRule factor must be a finite number > 1, got {factor!r}")
        if type(window) is not int or window < 1 or type(warmup) is not int or not 1 <= warmup <= window:
            raise ValidationError(f"SpikeRule window must be an int >= 1 and warmup an int in [1, window], got "
                                  f"window={window!r}, warmup={warmup!r}")
        self.factor = float(factor)
        self.warmup = warmup
        self._recent: deque[float] = deque(maxlen=window)

    def __call__(self, step: int, loss: float, grad_norm: Optional[float]) -> Optional[str]:
        """The reason when ``loss`` is a spike, else None (and ``loss`` joins the history)."""
        if len(self._recent) >= self.warmup:
            median = statistics.median(self._recent)
            if median > 0 and loss > self.factor * median:
                return f"loss {loss:.4g} is over {self.factor:g}x the median {median:.4g} of the last " \
                       f"{len(self._recent)} reported losses"
        self._recent.append(loss)
        return None
