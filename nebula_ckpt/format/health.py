"""Health records: what the training signal said about a committed checkpoint, one small file each.

A persistent root holds, beside its steps, ``_nebula/health/step-<S>/`` with one record per mark
of a checkpoint of step ``S``::

    g<G>-t<T>-<who>.json     G: the writer generation of the checkpoint marked
                             T: the time it was marked (ns since the epoch), which orders marks
                             who: ``r<R>`` (rank R's reports) or ``user`` (``nebula-ckpt mark``)

and in it::

    {"format": "nebula_ckpt.health", "version": 1, "step": S, "generation": G, "time_ns": T,
     "state": "healthy" | "suspect", "by": "report" | "user", "rank": R | null, "reason": "...",
     "save": N}

``save`` (optional) is the save number of the write marked (its ``COMMIT``'s ``save``): a step saved
again by the same writer (a run that went back in process) is another write, and a mark that
names the write it replaced does not apply to it. A record without ``save`` applies to every
write of ``(G, S)``.

Records are only ever created (create-only, one request on a blob store, tmp + fsync + link on a
file system), never changed: a crash leaves a record whole or absent, and a temporary file is
not a record by its name. A checkpoint is keyed by ``(generation, step)``: a step saved again by
a newer writer is another checkpoint, and the marks of the older one never apply to it.

:func:`parse_record` reads a record as hostile input: the name and the content must agree, every
field is checked, the reason is cut to :data:`MAX_REASON` printable characters, a record longer
than :data:`MAX_RECORD_BYTES` is never read; a record of a newer format version is ignored. What
a crafted record can do is mark a step, nothing more.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

from nebula_ckpt.errors import CorruptCheckpointError
from nebula_ckpt.format.checks import as_int, as_obj, as_step, as_str, bad, only_fields
from nebula_ckpt.format.names import step_dir

#: the folder of a root's health records
HEALTH_DIR = "_nebula/health"
HEALTH_FORMAT = "nebula_ckpt.health"
#: the newest health record version this nebula_ckpt reads and writes
HEALTH_VERSION = 1
#: a record is far smaller; a larger file is never read
MAX_RECORD_BYTES = 4096
#: characters of a reason kept (the rest is cut)
MAX_REASON = 400
HEALTHY, SUSPECT = "healthy", "suspect"
STATES = (HEALTHY, SUSPECT)
#: who marked: a Checkpointer's reports, or a person (``nebula-ckpt mark``)
BY_REPORT, BY_USER = "report", "user"
_FIELDS = ("format", "version", "step", "generation", "time_ns", "state", "by", "rank", "reason", "save")
_NAME_RE = re.compile(r"g(0|[1-9][0-9]{0,17})-t(0|[1-9][0-9]{0,20})-(user|r(?:0|[1-9][0-9]{0,8}))\.json")
_MAX_TIME_NS = 10**21


def health_folder(step: int) -> str:
    """The folder (in the root) of the records of ``step``."""
    return f"{HEALTH_DIR}/{step_dir(step)}"


@dataclass(frozen=True)
class RecordName:
    """What a record's file name says: the checkpoint's generation, the time, who wrote it."""

    generation: int
    time_ns: int
    rank: Optional[int]  # None: a user's mark

    @staticmethod
    def parse(name: str) -> Optional["RecordName"]:
        """The fields of a record's file name; None for any other name (a temporary file, a stranger)."""
        m = _NAME_RE.fullmatch(name)
        if m is None:
            return None
        who = m.group(3)
        return RecordName(int(m.group(1)), int(m.group(2)), None if who == "user" else int(who[1:]))


@dataclass(frozen=True)
class HealthRecord:
    """One mark of the checkpoint ``(generation, step)``.

    Attributes:
        step, generation: the checkpoint marked.
        time_ns: when, or just after the newest earlier record of the checkpoint (orders the
            marks of one checkpoint in the order they were written: the newest decides, see
            :func:`nebula_ckpt.health.book.fold`).
        state: ``"healthy"`` or ``"suspect"``.
        by: ``"report"`` (a Checkpointer, from the training signal) or ``"user"``.
        rank: the rank whose reports decided (None for a user's mark).
        reason: why, in words (shown by ``nebula-ckpt ls`` and the restore's warning).
        save: the save number of the write marked (None: every write of the checkpoint).
    """

    step: int
    generation: int
    time_ns: int
    state: str
    by: str
    rank: Optional[int]
    reason: str
    save: Optional[int] = None

    def applies_to(self, save: Optional[int]) -> bool:
        """Whether this mark is of the write ``save`` (None: not known, every mark applies)."""
        return self.save is None or save is None or self.save == save

    @property
    def name(self) -> str:
        """The record's file name (in :func:`health_folder` of its step)."""
        who = "user" if self.rank is None else f"r{self.rank}"
        return f"g{self.generation}-t{self.time_ns}-{who}.json"

    @property
    def path(self) -> str:
        """The record's path in the root."""
        return f"{health_folder(self.step)}/{self.name}"

    def to_bytes(self) -> bytes:
        """Serialise (the reason cut to :data:`MAX_REASON` printable characters)."""
        d = {"format": HEALTH_FORMAT, "version": HEALTH_VERSION, "step": self.step, "generation": self.generation,
             "time_ns": self.time_ns, "state": self.state, "by": self.by, "rank": self.rank,
             "reason": clean_reason(self.reason)}
        if self.save is not None:
            d["save"] = self.save
        return json.dumps(d).encode()


def clean_reason(text: str) -> str:
    """``text`` with every non-printable character (terminal escapes, newlines) replaced by ``?``,
    cut to :data:`MAX_REASON` characters: a reason is shown on terminals and in logs."""
    text = "".join(ch if ch.isprintable() else "?" for ch in text[:MAX_REASON + 1])
    return text if len(text) <= MAX_REASON else text[:MAX_REASON - 3] + "..."


def parse_record(data: bytes, name: str, step: int) -> Optional[HealthRecord]:
    """The record in ``data`` (file ``name`` of the folder of ``step``); None when it is of a newer
    format version (ignored: a newer nebula_ckpt wrote it).

    Raises:
        CorruptCheckpointError: the name is not a record's, the content is not a record, or the two
            disagree (a torn or crafted file), naming the file and the field.
    """
    where = f"{health_folder(step)}/{name[:80]}"
    named = RecordName.parse(name)
    if named is None:
        raise bad(where, "is not named like a health record")
    if len(data) > MAX_RECORD_BYTES:
        raise bad(where, f"is {len(data)} bytes; a health record is at most {MAX_RECORD_BYTES}")
    try:
        d = as_obj(json.loads(data), where, "a health record")
    except CorruptCheckpointError:
        raise
    except Exception as e:  # ValueError, RecursionError, UnicodeDecodeError: torn or not JSON
        raise bad(where, f"is not a health record ({type(e).__name__})") from None
    if d.get("format") != HEALTH_FORMAT:
        raise bad(where, f"format must be {HEALTH_FORMAT!r}")
    if as_int(d.get("version"), where, "version", lo=1, hi=2**31) > HEALTH_VERSION:
        return None
    only_fields(d, _FIELDS, where, "a health record")
    rec = _fields(d, where)
    if (rec.step, rec.generation, rec.time_ns, rec.rank) != (step, named.generation, named.time_ns, named.rank):
        raise bad(where, "its content names another checkpoint, time or writer than its file name")
    return rec


def _fields(d: dict[str, Any], where: str) -> HealthRecord:
    state, by = as_str(d.get("state"), where, "state"), as_str(d.get("by"), where, "by")
    if state not in STATES:
        raise bad(where, f"state must be one of {list(STATES)}")
    if by not in (BY_REPORT, BY_USER):
        raise bad(where, f"by must be {BY_REPORT!r} or {BY_USER!r}")
    rank = None if d.get("rank") is None else as_int(d.get("rank"), where, "rank", hi=10**9)
    if (rank is None) != (by == BY_USER):
        raise bad(where, "a user's mark has no rank, a report's has one")
    return HealthRecord(step=as_step(d.get("step"), where), generation=as_int(d.get("generation"), where, "generation"),
                        time_ns=as_int(d.get("time_ns"), where, "time_ns", hi=_MAX_TIME_NS), state=state, by=by,
                        rank=rank, reason=clean_reason(as_str(d.get("reason"), where, "reason")),
                        save=None if d.get("save") is None else as_int(d.get("save"), where, "save", hi=2**62))
