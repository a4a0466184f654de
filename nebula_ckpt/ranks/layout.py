"""Transitional: :func:`first_of_class` and :func:`signature` are in :mod:`nebula_ckpt.ranks.split`,
the multi-rank commit's builder. This module goes once ``save/rounds.py`` imports them from there."""

from __future__ import annotations

from nebula_ckpt.ranks.split import first_of_class, signature

__all__ = ["first_of_class", "signature"]
