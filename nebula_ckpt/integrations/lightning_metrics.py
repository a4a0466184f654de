"""A Lightning callback that logs what each save through
:class:`~nebula_ckpt.integrations.lightning.NebulaCheckpointIO` cost to the Trainer's loggers.

::

    io = NebulaCheckpointIO("/ckpt/run-42")
    trainer = Trainer(plugins=[io], callbacks=[NebulaSaveMetrics(io), ModelCheckpoint(...)])

Per save, at the Lightning global step it was taken (``trainer.loggers``' ``log_metrics``):
``nebula/blocked_s`` (what the training loop lost), ``nebula/snapshot_s`` (until the copy into
host memory was done), ``nebula/bytes``, and per tier (``memory``, ``local``, ``remote``)
``nebula/durable_s/<tier>`` (until committed there) and ``nebula/throughput_MBps/<tier>``. A save
is logged once it is over on every tier: at the end of the next training batch, of the epoch, or
of ``fit`` (which waits for the save in flight).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Optional, Protocol

from nebula_ckpt import SaveMetrics


class MetricsSource(Protocol):
    """What the callback reads of the plugin (:class:`~nebula_ckpt.integrations.lightning.NebulaCheckpointIO`)."""

    @property
    def checkpointer(self) -> Any:
        """The plugin's :class:`~nebula_ckpt.Checkpointer`."""

    def wait(self) -> None:
        """Wait until every save is durable."""

    def take_metrics(self) -> list[tuple[Optional[int], SaveMetrics]]:
        """The metrics of the saves finished since the last call."""

    def tier_kinds(self) -> dict[str, str]:
        """Each tier's kind, by name."""


def _callback_base() -> Any:
    """Lightning's ``Callback`` (``pytorch_lightning`` first, as the Trainer most tests use, else ``lightning``)."""
    for mod in ("pytorch_lightning", "lightning.pytorch"):
        try:
            return importlib.import_module(mod).Callback
        except ImportError:
            continue
    raise ImportError("NebulaSaveMetrics needs PyTorch Lightning: pip install 'nebula_ckpt[lightning]'")


if TYPE_CHECKING:
    from pytorch_lightning import Callback as _Callback
else:
    _Callback = _callback_base()


def save_metrics(m: SaveMetrics, kinds: dict[str, str], prefix: str = "nebula/") -> dict[str, float]:
    """The scalars logged for one save (``kinds``: tier name -> the short name in the keys)."""
    out: dict[str, float] = {f"{prefix}bytes": float(m.bytes)}
    if m.blocked_s is not None:
        out[f"{prefix}blocked_s"] = m.blocked_s
    if m.snapshot_s is not None:
        out[f"{prefix}snapshot_s"] = m.snapshot_s
    for tier, secs in m.durable_s.items():
        name = kinds.get(tier, tier)
        out[f"{prefix}durable_s/{name}"] = secs
        rate = m.throughput(tier)
        if rate is not None:
            out[f"{prefix}throughput_MBps/{name}"] = rate / 1e6
    return out


class NebulaSaveMetrics(_Callback):
    """Logs each save's metrics (see the module docstring) to ``trainer.loggers``.

    Args:
        io: the plugin given to the Trainer.
        prefix: the start of every metric's name.

    Attributes:
        logged: ``(global_step, metrics)`` of every save logged so far (also without a logger).
    """

    def __init__(self, io: MetricsSource, prefix: str = "nebula/") -> None:
        super().__init__()
        self.io, self.prefix = io, prefix
        self.logged: list[tuple[Optional[int], dict[str, float]]] = []

    def flush(self, trainer: Any) -> None:
        """Log the saves finished since the last call."""
        kinds = self.io.tier_kinds()
        for step, m in self.io.take_metrics():
            values = save_metrics(m, kinds, self.prefix)
            self.logged.append((step, values))
            for logger in getattr(trainer, "loggers", None) or ():
                logger.log_metrics(values, step=step if step is not None else trainer.global_step)

    def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        """A save made at the previous step may be over by now; the batch's loss goes to
        :meth:`~nebula_ckpt.Checkpointer.report` on rank 0, which saves (the checkpoints' health)."""
        self.flush(trainer)
        outputs = args[1] if len(args) > 1 else kwargs.get("outputs")
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None and getattr(trainer, "is_global_zero", True):
            self.io.checkpointer.report(int(trainer.global_step), loss=loss)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """Saves made at the end of the epoch (``ModelCheckpoint``) may be over by now."""
        self.flush(trainer)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        """Wait for the save in flight, then log it."""
        self.io.wait()
        self.flush(trainer)
