"""What a tier writer knows of its tier's committed steps: which write each one is, and which
earlier steps it refers to (what retention ranks and keeps, :meth:`~nebula_ckpt.save.writer.TierWriter.prune`).

A committed step does not change while this writer owns the tier, but through this process (a
newer writer generation fences it): every marker this process writes or removes moves the step's
mark in the marker journal (:mod:`nebula_ckpt.format.marker`). So a step is read once: when this
writer commits it, or at the first retention pass that needs it after the writer opened (its
marker and its manifest's references, :func:`~nebula_ckpt.format.commit.read_kept`); again only
when its mark moved (saved again, copied in by the drain, taken back) or it left the listing and
came back. A save's retention thus reads no step it knows, however many the tier keeps. This
module holds the bookkeeping only; the writer reads the tier.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Collection, Optional

from nebula_ckpt.format.commit import deletion_order, protected_steps
from nebula_ckpt.format.marker import Commit, Write, marker_marks, markers_listed
from nebula_ckpt.storage.base import Storage


@dataclass(frozen=True)
class Known:
    """One committed step as read under one mark of its marker."""

    write: Write
    references: frozenset[int]
    mark: int


class KeptSteps:
    """A tier writer's knowledge of the committed steps of its tier (``storage``)."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._known: dict[int, Known] = {}
        #: the references of steps whose markers could not be read (read again at every pass)
        self._unread: dict[int, set[int]] = {}
        #: retention (under the writer's deletion lock) and the writer's commits may run at once
        self._lock = threading.Lock()

    def current(self) -> set[int]:
        """The steps known whose markers did not change since they were read: committed, unless
        another process took them away (a newer writer's, which fences this one)."""
        marks = marker_marks(self.storage)
        with self._lock:
            return {s for s, k in self._known.items() if k.mark == marks.get(s, 0)}

    def listed(self, committed: list[int], uncommitted: Collection[int]) -> None:
        """A listing found these step folders: steps no longer committed are forgotten."""
        markers_listed(self.storage, set(committed).union(uncommitted))
        listed = set(committed)
        with self._lock:
            self._known = {s: k for s, k in self._known.items() if s in listed}
            self._unread.clear()

    def unknown(self, committed: list[int]) -> dict[int, int]:
        """The steps of ``committed`` to read (none known, or marker changed since), each with its
        mark now (taken before the read: a change meanwhile is seen at the next pass)."""
        marks = marker_marks(self.storage)
        with self._lock:
            return {s: marks.get(s, 0) for s in committed
                    if s not in self._known or self._known[s].mark != marks.get(s, 0)}

    def learn(self, step: int, mark: int, commit: Optional[Commit], references: set[int]) -> None:
        """What was read of committed ``step`` under ``mark`` (``commit`` None: its marker is
        unreadable, no write of anyone's; it is read again at the next pass)."""
        with self._lock:
            if commit is None:
                self._known.pop(step, None)
                self._unread[step] = set(references)
            else:
                self._known[step] = Known(commit.write, frozenset(references), mark)

    def committed(self, commit: Commit, references: set[int]) -> None:
        """This writer committed ``commit`` (a step that refers to ``references``)."""
        self.learn(commit.step, marker_marks(self.storage).get(commit.step, 0), commit, references)

    def ranked(self, committed: list[int]) -> list[int]:
        """``committed`` in a restore's order of preference, oldest first: by writer generation,
        then step (a step whose marker is unreadable as the newest: never deleted for it)."""
        with self._lock:
            gen = {s: self._known[s].write[0] for s in committed if s in self._known}
        return sorted(committed, key=lambda s: (gen.get(s, math.inf), s))

    def references(self, step: int) -> set[int]:
        """The steps committed ``step`` refers to (nothing known: none)."""
        with self._lock:
            k = self._known.get(step)
            return set(k.references) if k is not None else set(self._unread.get(step, ()))

    def doomed(self, ranked: list[int], keep_last: int, every: Optional[int], also: set[int], due: set[int],
               pinned: set[int]) -> list[int]:
        """The steps of ``ranked`` (the committed ones, :meth:`ranked`) that retention deletes, in
        :func:`~nebula_ckpt.format.commit.deletion_order`: all but the newest ``keep_last``, ``also``
        and every ``every``-th step (None or 0: none), but those of ``due`` (``remove()`` asked for them) go
        all the same; never one of ``pinned`` (the step just saved, what a save in flight builds
        on) nor one a kept step refers to (:func:`~nebula_ckpt.format.commit.protected_steps`)."""
        keep = set(ranked[-keep_last:]) | also
        if every:
            keep.update(s for s in ranked if s % every == 0)
        keep = (keep - due) | (pinned & set(ranked))
        keep |= protected_steps(self.storage, keep, self.references)
        return deletion_order(self.storage, [s for s in ranked if s not in keep], self.references)
