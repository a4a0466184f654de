"""A persistent root's own records: the run record and the writer generation records.

Beside its steps a persistent root holds (names in :mod:`nebula_ckpt.format.names`)::

    _nebula/run.json          {"run_id": "<hex>", "host": "<name>", "time": <seconds>}
    _nebula/writers/g-<G>.json {"host": "<name>", "pid": <int>, "time": <seconds>}

The run record is created once (create-only) by the first run that opens the root: its run id
ties the memory tiers to this incarnation of the root. A writer generation record is created
(create-only) by the writer that takes generation ``G`` (:mod:`nebula_ckpt.ranks.fencing`). Both
are built here and parsed here, as input: a record that is not what this module writes fails with
an error naming the file and the fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from nebula_ckpt.errors import CorruptCheckpointError
from nebula_ckpt.format.checks import as_int, as_str, bad, load_object

#: the largest run record or writer generation record a reader reads (one is some 100 bytes): a
#: larger file (a crafted or sparse one) is refused unread, like a garbled one
MAX_ROOT_RECORD_BYTES = 1 << 16
#: what to do about a run record that is not one
RUN_FIX = "remove it if no job is running on this root (the next run records a new run id)"


def encode_run_record(run_id: str, host: str, time: float) -> bytes:
    """The bytes of the run record naming ``run_id`` (created by ``host`` at ``time``)."""
    return json.dumps({"run_id": run_id, "host": host, "time": time}).encode()


def parse_run_record(raw: bytes, where: str) -> str:
    """The run id the run record ``raw`` names.

    Args:
        raw: the bytes of ``_nebula/run.json``.
        where: names the file in errors (the root and the record's path).

    Raises:
        CorruptCheckpointError: not a run record (not JSON, no string ``run_id``), naming ``where``.
    """
    d = load_object(bytes(raw), where, "the run record", RUN_FIX)
    run = d.get("run_id")
    if type(run) is not str:
        raise bad(where, "holds no run id (a string run_id)", RUN_FIX)
    return run


def read_run_id_or_none(raw: bytes, where: str) -> str | None:
    """:func:`parse_run_record`, or None where the record is not one (a reader that treats an
    unreadable record as no record: it never writes on the strength of it)."""
    try:
        return parse_run_record(raw, where)
    except CorruptCheckpointError:
        return None


@dataclass(frozen=True)
class WriterRecord:
    """A writer generation record: the process that took the generation, and when."""

    host: str
    pid: int
    time: float


def encode_writer_record(record: WriterRecord) -> bytes:
    """The bytes of a writer generation record."""
    return json.dumps({"host": record.host, "pid": record.pid, "time": record.time}).encode()


def parse_writer_record(raw: bytes, where: str) -> WriterRecord:
    """The writer generation record ``raw`` (``host``, ``pid``, ``time``).

    Raises:
        CorruptCheckpointError: not a writer record, naming ``where`` and the field.
    """
    fix = "a writer generation record is written only by nebula_ckpt; remove it if no job writes to this root"
    d = load_object(bytes(raw), where, "a writer generation record", fix)
    host = as_str(d.get("host"), where, "host")
    pid = as_int(d.get("pid"), where, "pid", hi=2**31)
    t = d.get("time")
    if type(t) not in (int, float):
        raise bad(where, f"time must be a number, got {type(t).__name__}", fix)
    assert isinstance(t, (int, float))
    if not -2**53 <= t <= 2**53:  # also false for NaN: 10**400 or Infinity is no time (float() of it raises)
        raise bad(where, "time must be a finite number in [-2**53, 2**53] (seconds since the epoch)", fix)
    return WriterRecord(host, pid, float(t))
