"""The health side of a :class:`~nebula_ckpt.checkpointer.Checkpointer`: ``report()``, and what ties
its monitor to the restores and to retention.

:class:`HealthReports` is a base class of ``Checkpointer`` (the facade stays one class; this part
lives with the rest of :mod:`nebula_ckpt.health`). It uses what the Checkpointer made: its root's
storage, its restorer, its tiers, its coordinator.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, Optional

from nebula_ckpt.format.commit import read_commit
from nebula_ckpt.format.health import SUSPECT
from nebula_ckpt.format.marker import Write
from nebula_ckpt.format.names import check_step
from nebula_ckpt.health.book import HealthBook, newest_healthy
from nebula_ckpt.health.monitor import HealthMonitor, as_signal
from nebula_ckpt.health.policy import HealthPolicy
from nebula_ckpt.save.budget import holds_write
from nebula_ckpt.storage.base import Storage

log = logging.getLogger("nebula_ckpt")

if TYPE_CHECKING:
    from nebula_ckpt.ranks.coordinator import Coordinator
    from nebula_ckpt.restore.restorer import Restorer
    from nebula_ckpt.root import OpenRoot
    from nebula_ckpt.tiers.runtime import TierRuntime


class HealthReports:
    """:meth:`report` and its wiring (a base class of :class:`~nebula_ckpt.checkpointer.Checkpointer`)."""

    #: turns reports into health marks (None: read only)
    _health: Optional[HealthMonitor] = None

    if TYPE_CHECKING:  # what the Checkpointer provides
        _opened: OpenRoot
        _restores: Restorer
        _saves: Any  # the SavePipeline (a layer above: typed loosely)
        _runtimes: list[TierRuntime]
        coordinator: Coordinator
        read_only: bool

        def _check_open(self, what: str) -> None: ...

        def _check_writable(self, what: str) -> None: ...

    def _open_health(self, policy: Optional[HealthPolicy]) -> None:
        """Read the root's health marks on restore; turn reports into marks (unless read only);
        let retention keep the newest healthy step: on the persistent tiers, and on the others
        (the memory tier) while no persistent tier holds it."""
        book = HealthBook(self._opened.root_storage)
        self._restores.health = book
        if self.read_only:
            return
        fence = self._opened.fence
        self._health = HealthMonitor(book, policy or HealthPolicy(), self.coordinator.rank, lambda: fence.generation)
        self._restores.monitor = self._saves.monitor = self._health
        persistent = [rt for rt in self._runtimes if rt.persistent]
        for rt in self._runtimes:
            if rt.persistent:
                rt.keep_also = functools.partial(self._keep_healthy, book, rt.storage)
            else:
                rt.keep_also = functools.partial(self._keep_unsaved, book, rt, persistent, None)
                rt.keep_also_in = functools.partial(self._keep_unsaved, book, rt, persistent)

    def _keep_healthy(self, book: HealthBook, storage: Storage, committed: list[int]) -> set[int]:
        """Retention (a tier's writer thread): of ``committed``, the newest healthy step and the steps
        the monitor holds until they could be confirmed (:meth:`HealthMonitor.held`), once this
        process reported (a job that never reports keeps exactly what ``keep_last`` says)."""
        monitor = self._health
        if monitor is None or not monitor.reported:
            return set()
        return newest_healthy(book, storage, committed) | monitor.held(committed)

    def _keep_unsaved(self, book: HealthBook, rt: TierRuntime, persistent: list[TierRuntime],
                      storage: Optional[Storage], committed: list[int]) -> set[int]:
        """Retention on a tier that does not survive a reboot (the memory tier; ``committed``: its
        steps, oldest first; a tier writer's thread, or its ``close``): what :meth:`_keep_healthy`
        keeps, while a newer step there is marked suspect (what a restart would skip for it: a
        run that keeps saving a diverged state), no persistent tier holds its write whole (their
        cadence skipped it, or its copy there does not restore: this tier holds its only whole
        copy; :func:`~nebula_ckpt.save.budget.holds_write`), and the tier has room for it beside its next
        save (:meth:`~nebula_ckpt.tiers.runtime.TierRuntime.affords`). ``storage``: where
        ``committed`` are (None: the tier; else copies of its steps there, a partner rank's replicas:
        every rank saves the same steps and judges the same reports)."""
        storage = rt.storage if storage is None else storage
        want = self._keep_healthy(book, storage, committed)
        if not want:
            return want
        writes = read_writes(storage, committed)
        view, monitor = book.view(), self._health
        assert monitor is not None  # _keep_healthy found it
        try:
            bad = [i for i, (s, w) in enumerate((s, writes.get(s)) for s in committed) if w is not None and (
                monitor.suspect(w[0], s, None if w[2] < 0 else w[2])
                or view.has_records(s) and view.mark(*w).state == SUSPECT)]
        except Exception as e:  # the records cannot be read: retention goes on as keep_last says
            log.debug("nebula_ckpt: tier %s: cannot read the health marks of its steps: %s", rt.name, e)
            return set()
        last_bad = bad[-1] if bad else -1
        kept = {s for s in want if s in writes and committed.index(s) < last_bad
                and not any(holds_write(p.storage, writes[s]) for p in persistent)}
        return rt.affords(kept, committed) if kept else kept

    def _saved(self, step: int, handle: Any) -> Any:
        """``save_async(step)`` returned ``handle``: the monitor follows the step; ``handle``."""
        if self._health is not None:
            self._health.saved(step, handle.progress.save)
        return handle

    def _close_health(self) -> None:
        if self._health is not None:
            self._health.close()

    def report(self, step: int, *, loss: Any, grad_norm: Any = None) -> None:
        """Report the training signal of ``step`` after the step (every step, or as often as you log).

        A checkpoint is marked *healthy* once the next ``healthy_after`` (2) reported steps had a
        finite loss, and *suspect* when the loss goes bad (non-finite, or refused by the policy's
        rule) within ``suspect_within`` (50) reported steps after a restore from it; the steps
        saved since are suspect with it, and so is a step saved after a bad loss and before a
        finite one. :meth:`~nebula_ckpt.checkpointer.Checkpointer.load_latest` restores the newest
        step not marked suspect and says in the log and in ``last_restore`` what it skipped and
        why (``docs/health.md``).

        Cheap on the training thread: a healthy mark is written in the background, a suspect one
        before this returns (it is what stops a restart loop): report the loss before anything that
        may raise on a bad one. Multi-rank jobs: call it on every rank with the loss that rank has
        (its own or the reduced one); no collective runs.

        Args:
            step: the step (non-negative int); several reports of one step count as one.
            loss: a real number or a one-element tensor (a CUDA tensor is read, which waits for the
                GPU: pass ``loss.item()`` where you have it already).
            grad_norm: optional, likewise. A finite loss with a non-finite ``grad_norm`` (a step an
                AMP loss scaler skipped) counts neither way.

        Raises:
            ValidationError: a bad argument (nothing is recorded).

        Example::

            loss = model(batch).loss
            ckpt.report(step, loss=loss.item())
            loss.backward()
        """
        self._check_open("report")
        self._check_writable("report")
        check_step(step)
        value, norm = as_signal(loss, "loss"), as_signal(grad_norm, "grad_norm", optional=True)
        assert self._health is not None and value is not None  # writable; a loss is never None here
        self._health.report(step, value, norm)


def read_writes(storage: Storage, steps: list[int]) -> dict[int, Write]:
    """The writes (generation, step, save) of committed ``steps`` on ``storage`` (unreadable ones left out)."""
    out = {}
    for s in steps:
        try:
            out[s] = read_commit(storage, s, f"{storage.display_url} step {s}").write
        except Exception:  # no write of anyone's: nothing to keep it for
            continue
    return out
