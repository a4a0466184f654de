"""What a DCP save carries through DCP's plans and write results (pickled by DCP's collectives)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from nebula_ckpt.format.tree import Node

Held = tuple[str, Optional[tuple[int, ...]]]   # (fqn, chunk offsets) of a tensor item; offsets None: a value
#: a tensor a rank stores: (manifest key, its record, its bytes, their version counter)
Stored = tuple[str, dict[str, Any], torch.Tensor, int]


@dataclasses.dataclass(frozen=True)
class LocalPlanData:
    """``SavePlan.storage_data`` of a rank's local plan: every item it holds, before DCP's dedup."""

    held: tuple[Held, ...]


@dataclasses.dataclass(frozen=True)
class GlobalPlanData:
    """``SavePlan.storage_data`` of the global plan: where and as whom a rank writes."""

    step: int
    generation: int
    world: int
    rank: int
    save_id: str


@dataclasses.dataclass(frozen=True)
class Written:
    """``WriteResult.storage_data``: one item a rank wrote. ``shard`` is the same dict for every
    item of a rank (pickled once)."""

    save_id: str
    rank: int
    fqn: str
    offsets: Optional[tuple[int, ...]]       # tensor items: chunk offsets; None: a value
    key: str                                 # the key the rank stores it under
    record: Optional[dict[str, Any]]         # the tensor record; None: a value or an alias
    alias_of: Optional[str]                  # a tensor tied to another one this rank stored
    node: Optional[Node]                     # a value: its typed-JSON node
    shard: dict[str, Any]                    # {"file", "bytes", "storage"} of the rank's shard
