"""Fan-out: how one staged snapshot reaches each tier that takes it. All of it is here.

Two routes:

* **side by side** (the default): every tier reads the staging buffer (a :class:`SlotSource`,
  one reference to the staging slot each);
* **chained**: when the fastest tier links or writes a local file of the shard
  (``runtime.feeds_slower``, the memory tier) and the snapshot is not already staged in such a
  file, that tier goes first and, as soon as its shard is complete, hands the slower tiers its
  file (:class:`FileSource`) and gives the staging buffer back, so the next save can start while
  disk and remote tiers still drain. If it fails before its shard is complete, the slower tiers
  read the staging buffer instead.

A :class:`Delivery` is one snapshot on its way to one tier. Tier writers call ``shard_written``,
``finish`` and ``drop`` on it; they never route anything themselves.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Protocol

from nebula_ckpt.save.snapshot import FileSource, SlotSource, Snapshot

log = logging.getLogger(__name__)


class Target(Protocol):
    """What the fan-out uses of a tier writer (:class:`nebula_ckpt.save.writer.TierWriter`)."""

    name: str
    runtime: Any

    def offer(self, delivery: "Delivery") -> Any:
        """Queue ``delivery`` for this tier."""


class Delivery:
    """One snapshot on its way to one tier: the source it reads and the tiers it feeds.

    Args:
        snap: the snapshot.
        source: what the tier reads (owned: released exactly once).
        downstream: slower tiers this tier hands its shard file to once written.
    """

    def __init__(self, snap: Snapshot, source: Any, downstream: Optional[list["Target"]] = None) -> None:
        self.snap = snap
        self.source = source
        self.downstream = list(downstream or [])
        self._handed = False

    def shard_written(self, path: Optional[str]) -> None:
        """The tier's shard file at ``path`` is complete: feed the slower tiers from it."""
        if not self.downstream or self._handed:
            return
        assert path is not None, "a tier that feeds slower tiers writes a local file"
        for w in self.downstream:
            w.offer(Delivery(self.snap, FileSource(path, self.snap.nbytes)))
        self._handed = True
        self.source.release()  # the staging buffer goes back now

    def finish(self) -> None:
        """The tier is done (committed or failed): route what is left, release the source."""
        if self.downstream and not self._handed:
            # Failed before our shard was complete: the slower tiers read the staging buffer.
            self.snap.acquire(len(self.downstream))
            for w in self.downstream:
                w.offer(Delivery(self.snap, SlotSource(self.snap)))
            self._handed = True
        self.source.release()

    def drop(self, writer_name: str, why: str) -> None:
        """The tier skips this snapshot (a newer one came while it was busy): so do its feeds."""
        log.info("nebula_ckpt: tier %s dropped step %d (%s)", writer_name, self.snap.step, why)
        for name in [writer_name, *(w.name for w in self.downstream)]:
            self.snap.handle.progress.tier_done(name, dropped=True)
        self.source.release()


def fan_out(snap: Snapshot, targets: list["Target"]) -> None:
    """Offer ``snap`` (holding one staging reference, which this takes over) to its tiers."""
    first, rest = targets[0], targets[1:]
    if rest and first.runtime.feeds_slower and snap.slot.path is None:
        first.offer(Delivery(snap, SlotSource(snap), rest))
        return
    snap.acquire(len(targets) - 1)
    for t in targets:
        t.offer(Delivery(snap, SlotSource(snap)))
