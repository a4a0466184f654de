"""Exceptions raised by nebula_ckpt.

Every error says what went wrong, for which key / path / tier, and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "NebulaError", "ValidationError", "ConsistencyError", "PersistError", "FencedError",
    "CorruptCheckpointError", "NotFoundError", "PickleNotAllowedError", "OtherRanksError",
]


class NebulaError(Exception):
    """Base class of every error this library raises on purpose."""


class ValidationError(NebulaError, ValueError):
    """Bad input to ``save_async`` / ``Checkpointer``; raised before anything is written."""


class ConsistencyError(NebulaError):
    """A tensor was modified in place while its snapshot was being taken.

    The checkpoint would not be the state at the moment ``save_async`` was called, so it is
    not written. Call ``handle.wait_snapshot()`` before changing tensors in place outside
    ``optimizer.step()``.
    """


class PersistError(NebulaError):
    """Writing a checkpoint to one or more tiers failed.

    ``failures`` maps a tier name to the exception it raised; the original exception of the
    first failure is chained as ``__cause__``.
    """

    def __init__(self, message: str, failures: dict[str, BaseException] | None = None) -> None:
        super().__init__(message)
        self.failures: dict[str, BaseException] = dict(failures or {})


class FencedError(PersistError):
    """A newer writer took over this checkpoint root; this (stale) writer may not commit.

    A :class:`PersistError`, so ``except PersistError`` still sees it; ``result()`` / ``wait()``
    raise it as a ``FencedError`` whenever one of the tiers was fenced.
    """


class CorruptCheckpointError(NebulaError):
    """A checkpoint failed verification (missing file, size or checksum mismatch, bad manifest)."""


class NotFoundError(NebulaError, FileNotFoundError):
    """The requested step does not exist (committed) on any tier."""


class PickleNotAllowedError(NebulaError):
    """A value needs pickle to be saved or loaded and ``allow_pickle=True`` was not given."""


class OtherRanksError(NotFoundError, ValidationError):
    """A healthy checkpoint saved by several ranks that this process cannot read alone (it holds
    other ranks' parts, or every rank's, where one rank's state was asked for). The message names
    the checkpoint and how to read it (with the ranks that saved it, resharded, or exported).

    A :class:`NotFoundError` (nothing this process can restore is there) and a
    :class:`ValidationError` (the call does not fit the checkpoint), so either ``except`` sees it.
    """
