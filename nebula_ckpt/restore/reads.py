"""Internal: the restore side of a :class:`~nebula_ckpt.checkpointer.Checkpointer`: ``list``,
``steps``, ``tags``, ``load_latest``, ``load``, ``read``.

:class:`CheckpointReads` is a base class of ``Checkpointer`` (the facade stays one class, as with
:class:`~nebula_ckpt.health.reports.HealthReports`); each method checks its arguments at the API
boundary and hands the work to the Checkpointer's :class:`~nebula_ckpt.restore.restorer.Restorer`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from nebula_ckpt.arguments import check_step_or_tag

if TYPE_CHECKING:
    from nebula_ckpt.restore.restorer import Restorer
    from nebula_ckpt.root import OpenRoot


class CheckpointReads:
    """Listing and restoring (a base class of :class:`~nebula_ckpt.checkpointer.Checkpointer`)."""

    if TYPE_CHECKING:  # what the Checkpointer provides
        _opened: OpenRoot
        _restores: Restorer

    @property
    def last_restore(self) -> Optional[dict[str, Any]]:
        """``{"step", "tier", "adopted_bytes", "copy_on_write_bytes", "health", "skipped", ...}`` of the
        last restore (``None`` before any): bytes handed over by the memory tier, bytes mapped copy-on-write
        (:mod:`nebula_ckpt.tiers.memory.adopt`), its health mark and the suspect steps skipped (:meth:`report`)."""
        return self._restores.last_restore

    def list(self, detailed: bool = False) -> Any:
        """Committed steps, ascending (the union over tiers).

        Args:
            detailed: return ``{tier name: [steps]}`` instead.

        See :meth:`tags` for the steps' tags.
        """
        per = self._restores.committed()
        return per if detailed else sorted({s for steps in per.values() for s in steps})

    def steps(self, *, check_shards: bool = True) -> dict[int, Optional[str]]:
        """Step -> tag (None: untagged) of every committed step whose manifest checks out on some
        tier (marker, manifest checksum, every field; ``check_shards``: and every shard file there
        with its recorded size). Reads each manifest; what :meth:`tags` is built on."""
        return self._restores.step_tags(check_shards)

    def tags(self) -> dict[str, int]:
        """Tag -> the newest step holding it, over the healthy committed checkpoints of every tier.

        Healthy here: the commit marker, the manifest and the shard sizes check out (full
        checksums are verified when a checkpoint is loaded). Untagged checkpoints are not listed.
        Each call reads the manifest of every committed step (no cache). In a multi-rank job each
        rank answers from the tiers it sees (its memory tier and the shared ones).

        Example::

            ckpt.save(1200, state, tag="epoch=3-step=1200.ckpt")
            ckpt.tags()    # {"epoch=3-step=1200.ckpt": 1200}
        """
        return self._restores.tags()

    def latest(self) -> Optional[tuple[int, Optional[str]]]:
        """``(step, tag)`` of the checkpoint :meth:`load_latest` tries first, without reading its
        tensors; None when there is none.

        The same order (the newest writer generation first, so that after a rollback the new
        run's steps win over the higher steps of the run it abandoned; then the newest step; then
        the fastest tier) and the same health marks (a step marked suspect is passed over); checked
        as :meth:`tags` checks (commit marker, manifest, shard sizes: the checksums are verified when
        it is loaded, and a restore that finds them wrong goes on to the next). ``tag`` is None for
        an untagged checkpoint. In a multi-rank job each rank answers from the tiers it sees.

        Example::

            step, tag = ckpt.latest() or (None, None)   # what a restart would resume from
        """
        return self._restores.latest()

    def load_latest(self, into: Any = None, *, map_location: Any = None, strict: bool = True,
                    on_damaged: str = "raise", must_exist: bool = False) -> Optional[int]:
        """Restore the newest healthy checkpoint into ``into`` in place; return its step.

        Every tier is searched, newest step first, fastest tier first; a candidate that fails
        verification is skipped (logged) and the next is tried.

        Args:
            into: the same tree shape as saved: objects get ``load_state_dict``, tensors are copied
                into, dict entries are replaced. ``None``: only find and verify.
            map_location: device for tensors that are created (not copied into).
            strict: require ``into`` and the checkpoint to have the same keys, both ways: a key
                the checkpoint holds that ``into`` lacks (a forgotten scheduler), a key of ``into``
                the checkpoint lacks, or an object / tensor in ``into`` where something else was
                saved raises :class:`ValidationError` naming every such key, with ``into``
                untouched. ``strict=False`` restores the keys both have and puts a key only the
                checkpoint has into its dict as the saved value.
            on_damaged: when committed checkpoints exist but none of them is restorable:
                ``"raise"`` (default) :class:`CorruptCheckpointError` naming every damaged copy,
                so a damaged root never silently restarts training from step 0; ``"warn"``: log
                it loudly and return ``None``.
            must_exist: raise :class:`NotFoundError`, not return ``None`` (else a missing root is named at WARNING).

        Returns:
            The step restored, or ``None`` when the root holds no committed checkpoint.

        Raises:
            ValidationError: a bad ``map_location`` or ``strict`` (before any tier is read), a mismatched ``into``.
            CorruptCheckpointError: committed checkpoints exist but all are damaged (see above).
            NotFoundError: ``must_exist`` and nothing to resume from.
        """
        got = self._restores.load(None, None, into, map_location, strict, on_damaged)
        return got if got is not None else self._opened.nothing_to_resume(must_exist)

    def load(self, step: Optional[int] = None, into: Any = None, *, map_location: Any = None, strict: bool = True,
             tag: Optional[str] = None) -> int:
        """Restore ``step``, or the newest step tagged ``tag`` (exactly one of them), into ``into``;
        return the step restored.

        The healthiest copy on the fastest tier is used; for a tag whose newest step is damaged
        on every tier, the next older step with the same tag (logged).

        Example::

            ckpt.load(tag="epoch=3-step=1200.ckpt", into={"model": model, "optim": opt})

        Raises:
            ValidationError: neither or both of ``step`` and ``tag``, or a malformed one.
            NotFoundError: nothing committed is that step / carries that tag.
            CorruptCheckpointError: it is, but every copy is damaged (the message names each).
        """
        check_step_or_tag("load", step, tag)
        got = self._restores.load(step, tag, into, map_location, strict)
        if got is None:
            raise self._restores.not_found(step, tag)
        return got

    def read(self, step: Optional[int] = None, *, map_location: Any = None,
             tag: Optional[str] = None) -> tuple[int, Any]:
        """Return ``(step, state)`` as a fresh tree (tensors owned, stateful objects as their state
        dicts, NumPy values as NumPy values): of ``step``, of the newest step tagged ``tag``, or
        (neither given) of the newest healthy step.

        Raises:
            ValidationError: both ``step`` and ``tag`` given, or a malformed one.
            NotFoundError: nothing healthy (of ``step`` / with ``tag``, if given).
        """
        if step is not None or tag is not None:
            check_step_or_tag("read", step, tag)
        return self._restores.read(step, tag, map_location)
