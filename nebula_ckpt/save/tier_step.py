"""One step on its way to one tier: what a tier writer (:mod:`nebula_ckpt.save.writer`) commits,
and the writing of its shard (an incremental step written whole where its tier has no room for it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from nebula_ckpt.tiers.runtime import TierRuntime


@dataclass(frozen=True)
class TierStep:
    """One step to commit on a tier: its bytes and how to build its manifest."""

    step: int
    nbytes: int
    source: Any                                               # has .view() -> memoryview
    make_manifest: Callable[[int, dict[str, Any]], dict[str, Any]]  # (generation, shard record)
    before_commit: Callable[[], None]                         # raises if it must not commit
    index: int = 0                                            # the save's number in the job
    meta: Optional[dict[str, Any]] = None                     # multi-rank: tensors, aliases, tree, stats
    tag: Optional[str] = None                                 # multi-rank: the checkpoint's tag
    parts: Optional[Callable[[], list[memoryview]]] = None    # an incremental save's own shard image
    full: bool = True                                         # whether the step refers to no other step
    hashes: Optional[dict[str, str]] = None                   # multi-rank: SHA-256 of staged tensors
    origin: Optional[str] = None                              # the snapshot's write_id (None: a copy)
    whole: Optional["TierStep"] = None                        # an incremental step written whole instead
    save: Optional[int] = None                                # which write: the save number its COMMIT names


def write_step_shard(runtime: "TierRuntime", rel: str, step: TierStep) -> tuple[dict[str, Any], TierStep]:
    """Write ``step``'s shard at ``rel`` on ``runtime``'s tier; return its storage info and the step
    as written. An incremental step whose own shard fails (the memory tier out of room beside its
    staged copy) is written whole instead where the tier can
    (:meth:`~nebula_ckpt.tiers.runtime.TierRuntime.write_whole_instead`); else its error stands."""
    if step.parts is None:
        return runtime.write_shard(rel, step.source), step
    try:
        return runtime.write_parts(rel, step.parts()), step
    except OSError as e:
        if step.whole is None:
            raise
        info = runtime.write_whole_instead(rel, step.whole.source, e)
        if info is None:
            raise
        return info, step.whole
