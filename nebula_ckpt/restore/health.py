"""What a restore makes of the health marks (:mod:`nebula_ckpt.health`): which step it skips, and
what it says about the step it restores.

A restore of the newest step (``load_latest``, ``read()``) skips every checkpoint marked
*suspect* and restores the newest one that is not: *healthy* or *unknown* alike, so that a job
whose newest step has not been confirmed yet (it crashed right after the save, the common case of
a hardware failure) loses no work; if that step is bad, the loss goes bad soon after the restore,
the step is marked suspect and the next restore skips it. A restore of a given step or tag
restores it whatever its mark (a warning says when it is suspect). In a multi-rank job rank 0
reads the marks and leaves the suspect steps out of the steps it offers to the ranks' agreement,
so every rank restores rank 0's choice; one exchange then tells every rank what rank 0 skipped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

from nebula_ckpt.errors import CorruptCheckpointError
from nebula_ckpt.format.health import SUSPECT
from nebula_ckpt.health.book import NO_MARK, HealthView, Mark

log = logging.getLogger("nebula_ckpt")


@dataclass
class HealthChoice:
    """The marks as one restore reads them, and the suspect checkpoints it skipped.

    Args:
        view: the marks (None: this rank does not read them; it follows rank 0's choice).
        skip_suspect: leave suspect checkpoints out (a restore of the newest step).
    """

    view: Optional[HealthView]
    skip_suspect: bool
    #: ``(generation, step)`` -> why, of every suspect checkpoint left out, in the order met
    skipped: dict[tuple[int, int], str] = field(default_factory=dict)

    def skips(self, generation: int, step: int) -> bool:
        """Whether the restore leaves the checkpoint ``(generation, step)`` out (remembered)."""
        if not self.skip_suspect or self.view is None:
            return False
        m = self.view.mark(generation, step)
        if m.state != SUSPECT:
            return False
        self.skipped.setdefault((generation, step), m.reason)
        return True

    def mark(self, generation: int, step: int) -> Mark:
        """The mark of the checkpoint restored (unknown where this rank reads none)."""
        return NO_MARK if self.view is None else self.view.mark(generation, step)

    def outcome(self, ck_key: Optional[tuple[int, int]]) -> dict[str, Any]:
        """What ``last_restore`` says: the restored step's mark and what was skipped (plain data,
        the same on every rank once exchanged)."""
        m = NO_MARK if ck_key is None else self.mark(*ck_key)
        return {"health": m.state, "health_reason": m.reason,
                "skipped": [{"step": s, "generation": g, "reason": why} for (g, s), why in self.skipped.items()]}


def say(outcome: dict[str, Any], step: Optional[int], root: str) -> None:
    """Log what the restore skipped and why (WARNING), and a restored step that is suspect."""
    skipped = outcome.get("skipped") or []
    if skipped:
        lines = "; ".join(f"step {x['step']} (writer generation {x['generation']}): {x['reason']}" for x in skipped)
        got = f"restoring step {step}" if step is not None else "restoring nothing"
        log.warning("nebula_ckpt: %s of %s; skipped %d step(s) marked suspect: %s%s", got, root, len(skipped), lines,
                    _same_failure_hint(skipped))
    if step is not None and outcome.get("health") == SUSPECT:
        log.warning("nebula_ckpt: restoring step %d of %s, which is marked suspect (%s); `nebula-ckpt mark --healthy "
                    "%d ROOT` clears the mark", step, root, outcome.get("health_reason"), step)


def _same_failure_hint(skipped: list[dict[str, Any]]) -> str:
    """When two skipped steps went bad at the same step, the cause is likely there, not in them."""
    at = [x["reason"].split(",")[0] for x in skipped if "after a restore from it" in x["reason"]]
    if len(at) >= 2 and len(set(at)) == 1:
        return (f". Restores from {len(at)} different steps went bad the same way ({at[0]}): the cause is likely "
                "the data or the code at that step, not a checkpoint; older steps will likely go bad too")
    return ""


def all_suspect_error(outcome: dict[str, Any], root: str) -> CorruptCheckpointError:
    """The error for a root whose every restorable step is marked suspect."""
    steps = [x["step"] for x in outcome.get("skipped") or []]
    return CorruptCheckpointError(
        f"no checkpoint of {root} is left to restore: every committed step that opens is marked suspect "
        f"(steps {steps[:20]}; the log says why). Restoring one again would repeat the failure: fix its cause, "
        "then clear a mark with `nebula-ckpt mark --healthy STEP ROOT`, or pass on_damaged='warn' to start afresh")
