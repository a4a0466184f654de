"""A storage that records what it reads: mixed into a backend (``class C(CountingReads,
LocalStorage)``), each look-up and read lands in ``reads`` (a remote backend's: one request or
more each), so a test can say how many reads an operation makes and of what."""

from __future__ import annotations

from typing import Any


class CountingReads:
    """Mixed in before a :class:`~nebula_ckpt.storage.base.Storage` backend: ``read_small``,
    ``list``, ``exists`` and ``size`` record their path in ``reads`` (a listing as ``list DIR``)."""

    reads: list[str]

    def read_small(self, rel: str, *a: Any, **k: Any) -> bytes:
        self.reads.append(rel)
        return super().read_small(rel, *a, **k)  # type: ignore[misc]

    def list(self, rel_dir: str = "") -> list[str]:
        self.reads.append(f"list {rel_dir}")
        return super().list(rel_dir)  # type: ignore[misc]

    def exists(self, rel: str) -> bool:
        self.reads.append(rel)
        return super().exists(rel)  # type: ignore[misc]

    def size(self, rel: str) -> int:
        self.reads.append(rel)
        return super().size(rel)  # type: ignore[misc]


def reads_per_save(ck: Any, tier: Any, steps: Any) -> dict[int, list[str]]:
    """Save ``steps`` with ``ck`` (a state of one tensor), each waited for: what each save read of
    ``tier``'s counting storage (``tier.storage``, once opened), its retention included."""
    import torch

    state = {"w": torch.zeros(64)}
    out = {}
    for s in steps:
        state["w"].fill_(float(s))
        if tier.storage is not None:
            tier.storage.reads.clear()
        ck.save(s, state)
        ck.wait()
        assert tier.storage is not None
        out[s] = list(tier.storage.reads)
    return out
