"""``torch_nebula``'s persistence and histories: ``flush_persistence`` and one entry per commit of
this process (what Nebula wrote to ``checkpointHistories.csv``)."""

from __future__ import annotations

import csv
from typing import Any, Optional

from nebula_ckpt.compat.nebula.session import current_session

#: the fields of one entry of :func:`checkpoint_histories` (and the columns of
#: :func:`write_checkpoint_histories`), in order
HISTORY_FIELDS = ("tag", "step", "parts", "size_bytes", "start_time", "blocking_seconds", "duration_seconds",
                  "throughput_bytes_per_second", "tiers", "tiers_dropped", "status")


def flush_persistence(tag: Optional[str] = None) -> bool:
    """Wait until every commit so far is durable on every tier that took it (``tag`` is accepted and
    ignored: everything is flushed). Returns True.

    Raises:
        PersistError: a save failed (the first failure not yet seen).
    """
    s = current_session()
    s.ck.wait()
    for t in list(s.watchers):
        t.join()
    return True


def checkpoint_histories() -> list[dict[str, Any]]:
    """One entry per commit of this process, oldest first (what Nebula wrote to ``checkpointHistories.csv``).

    Fields (:data:`HISTORY_FIELDS`): ``tag``, ``step``, ``parts`` (names), ``size_bytes`` (of the
    tensors), ``start_time`` (``time.time()`` of the commit), ``blocking_seconds`` (the commit
    call), ``duration_seconds`` (commit until durable on every tier that took it),
    ``throughput_bytes_per_second`` (size / duration), ``tiers`` (written), ``tiers_dropped``
    (skipped while busy with an older save), ``status`` (``pending``, ``ok``, ``failed: ...``,
    ``skipped: ...``). Entries still ``pending`` have no duration yet.
    """
    s = current_session()
    with s.lock:
        return [dict(e, parts=list(e["parts"]), tiers=list(e["tiers"]), tiers_dropped=list(e["tiers_dropped"]))
                for e in s.histories]


def write_checkpoint_histories(path: str) -> str:
    """Write :func:`checkpoint_histories` as CSV (Nebula's ``checkpointHistories.csv``) to ``path``; return it.

    Lists are joined with ``;``.
    """
    rows = checkpoint_histories()
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=HISTORY_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: ";".join(r[k]) if isinstance(r[k], list) else r[k] for k in HISTORY_FIELDS})
    return path
