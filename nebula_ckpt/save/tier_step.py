"""One step on its way to one tier: what a tier writer (:mod:`nebula_ckpt.save.writer`) commits,
and the writing of its shard (an incremental step written whole where its tier has no room for it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from nebula_ckpt.save.tier_image import TierImage

if TYPE_CHECKING:
    from nebula_ckpt.tiers.runtime import TierRuntime


@dataclass(frozen=True)
class TierStep:
    """One step to commit on a tier: what is written (decided, data) and the one effect before its
    commit (``before_commit``: waits for the snapshot's confirmation; raises if it must not commit).

    ``image``: what the tier writes (:func:`~nebula_ckpt.save.tier_image.tier_image`; None on a
    shared tier of several ranks, whose rounds decide it, :mod:`nebula_ckpt.save.rounds`);
    ``whole``: the whole image written instead where an incremental one's shard fails;
    ``manifest``: the step's manifest but for its generation, shards and tensors, filled at the
    commit (:func:`~nebula_ckpt.format.manifest.finish_manifest`; ``restamp``: with the commit's
    time, else a copy keeps its source's).
    """

    step: int
    source: Any                                               # has .view() -> memoryview (None: a copy)
    before_commit: Callable[[], None]                         # an effect: raises if it must not commit
    image: Optional[TierImage] = None
    whole: Optional[TierImage] = None
    manifest: Optional[dict[str, Any]] = None
    restamp: bool = True
    index: int = 0                                            # the save's number in the job
    meta: Optional[dict[str, Any]] = None                     # multi-rank: tensors, aliases, tree, stats
    tag: Optional[str] = None                                 # multi-rank: the checkpoint's tag
    hashes: Optional[dict[str, str]] = None                   # multi-rank: SHA-256 of staged tensors
    origin: Optional[str] = None                              # the snapshot's write_id (None: a copy)
    save: Optional[int] = None                                # which write: the save number its COMMIT names


def write_image(runtime: "TierRuntime", rel: str, step: TierStep) -> tuple[dict[str, Any], TierImage]:
    """Write ``step``'s shard at ``rel`` on ``runtime``'s tier; return its storage info and the image
    as written. An incremental step whose own shard fails (the memory tier out of room beside its
    staged copy) is written whole instead where the tier can
    (:meth:`~nebula_ckpt.tiers.runtime.TierRuntime.write_whole_instead`); else its error stands."""
    image = step.image
    assert image is not None, "a shared tier's share is written by its rounds"
    if image.parts is None:
        return runtime.write_shard(rel, step.source), image
    try:
        return runtime.write_parts(rel, list(image.parts)), image
    except OSError as e:
        if step.whole is None:
            raise
        info = runtime.write_whole_instead(rel, step.source, e)
        if info is None:
            raise
        return info, step.whole
