"""Internal: checkpoint health from the training signal: which committed steps a restore should trust.

``Checkpointer.report(step, loss=..., grad_norm=...)`` after each training step lets the
checkpointer mark its checkpoints: *healthy* once the loss stayed finite for ``healthy_after``
reported steps after a save, *suspect* when it turned bad soon after a restore from it (with the
steps saved since). ``load_latest`` restores the newest step not marked suspect, and says what it
skipped and why. The policy (:class:`HealthPolicy`, an optional :class:`SpikeRule`) and why its
defaults are what they are: ``docs/health.md``.

Modules: :mod:`~nebula_ckpt.health.policy` (the policy), :mod:`~nebula_ckpt.health.monitor`
(reports to marks, on the training thread), :mod:`~nebula_ckpt.health.book` (the records of a
root: read, fold, append); the records' format is :mod:`nebula_ckpt.format.health`.
"""

from nebula_ckpt.health.policy import HealthPolicy, SpikeRule

__all__ = ["HealthPolicy", "SpikeRule"]
