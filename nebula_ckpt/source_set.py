"""Internal: the tensors of one save, as the copy primitives take them (:mod:`nebula_ckpt.native`).

A *source set* holds a save's tensors in layout order, the shard offset of each one's bytes and
each one's version counter when the set was made (the consistency check compares them after the
copy). The native path keeps them in C++ (``nebula_ckpt._C.SourceSet``): the plan cache's check
makes them there and the copy engine reads them there, so a save touches no tensor from Python.
:class:`PySourceSet` is the pure-PyTorch path's.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch


class SourceSet(Protocol):
    """The tensors one save copies, in layout order, with the shard offset of each and its
    version counter when the set was made (``source_set``)."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> torch.Tensor: ...

    def __setitem__(self, i: int, t: torch.Tensor) -> None:
        """Replace tensor ``i`` (a copy taken on the training thread); its version is recorded now."""

    def any_cuda(self) -> bool:
        """Whether any tensor is on a CUDA device."""

    def changed(self) -> list[int]:
        """Indices whose version counter differs from the one recorded."""

    def clear(self) -> None:
        """Drop every tensor reference."""

    def tensors(self) -> list[torch.Tensor]:
        """The tensors."""

    def offsets(self) -> list[int]:
        """The shard offset of each tensor's bytes."""


def version_of(t: torch.Tensor) -> int:
    """``t``'s version counter, or -1 for an inference tensor (which has none)."""
    return -1 if t.is_inference() else int(t._version)


class PySourceSet:
    """:class:`SourceSet` of the pure-PyTorch path."""

    def __init__(self, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
        if len(tensors) != len(offsets):
            raise ValueError(f"SourceSet: {len(tensors)} tensors but {len(offsets)} offsets")
        self._tensors = list(tensors)
        self._offsets = list(offsets)
        self._versions = [version_of(t) for t in self._tensors]

    def __len__(self) -> int:
        return len(self._tensors)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self._tensors[i]

    def __setitem__(self, i: int, t: torch.Tensor) -> None:
        self._tensors[i], self._versions[i] = t, version_of(t)

    def any_cuda(self) -> bool:
        return any(t.is_cuda for t in self._tensors)

    def changed(self) -> list[int]:
        return [i for i, (t, v) in enumerate(zip(self._tensors, self._versions, strict=True))
                if v >= 0 and t._version != v]

    def clear(self) -> None:
        self._tensors, self._offsets, self._versions = [], [], []

    def tensors(self) -> list[torch.Tensor]:
        return list(self._tensors)

    def offsets(self) -> list[int]:
        return list(self._offsets)
