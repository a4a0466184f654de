"""``nebula-ckpt inspect``'s default answer: one row per top-level key of the saved state.

A small training run's checkpoint holds hundreds of values (an optimizer's per-parameter steps,
the 625 words of Python's random state, a scheduler's fields): the full listing (``--full``)
gives each its own line. The summary says what a reader asks first: which keys, what each is
(the saved object's class, or the value's type), how many tensors and how many bytes, how many
other values, and the totals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping, Optional

from nebula_ckpt.cli.common import human_bytes

__all__ = ["Row", "rows", "render"]

#: how many top-level keys the summary shows (the rest are counted in one line)
MAX_ROWS = 40


@dataclass
class Row:
    """What one top-level key of the state holds."""

    key: str
    kind: str
    tensors: int = 0
    nbytes: int = 0
    values: int = 0
    value: Optional[str] = None
    #: stored tensors counted, with their bytes (a tied key names one already counted)
    seen: dict[Hashable, int] = field(default_factory=dict)


def _kind(node: Mapping[str, Any]) -> str:
    t = node["t"]
    if t == "stateful":
        return str(node.get("cls") or "object")
    if t in ("dict", "odict", "list", "tuple"):
        return f"{t}[{len(node['v'])}]"
    return t


def _leaf(node: Mapping[str, Any]) -> Optional[str]:
    """A scalar's value as the summary shows it; None for anything else."""
    t = node["t"]
    if t in ("int", "bool", "str"):
        text = repr(node["v"])
        return text if len(text) <= 40 else text[:37] + "..."
    if t == "float":
        return repr(float.fromhex(node["v"]))
    if t == "none":
        return "None"
    return None


#: ``record(tensor key)``: the stored tensor's identity (tied keys share it) and its bytes
Record = Callable[[str], tuple[Hashable, int]]


def _count(node: Mapping[str, Any], row: Row, record: Record) -> None:
    t = node["t"]
    if t in ("dict", "odict"):
        for _k, v in node["v"]:
            _count(v, row, record)
    elif t in ("list", "tuple"):
        for v in node["v"]:
            _count(v, row, record)
    elif t == "stateful":
        _count(node["state"], row, record)
    elif t == "tensor" or t == "ndarray":
        ident, nbytes = record(node["k"] if t == "tensor" else node["v"]["k"])
        row.tensors += 1
        if ident not in row.seen:
            row.seen[ident] = nbytes
            row.nbytes += nbytes
    else:
        row.values += 1


def rows(tree: Mapping[str, Any], record: Record) -> list[Row]:
    """One :class:`Row` per top-level key of ``tree`` (the whole tree as one row when it is not a
    dict)."""
    top = tree["state"] if tree["t"] == "stateful" else tree
    if top["t"] not in ("dict", "odict"):
        items = [("<state>", tree)]
    else:
        items = [(str(k["v"]), v) for k, v in top["v"]]
    out = []
    for key, node in items:
        row = Row(key, _kind(node), value=_leaf(node))
        _count(node, row, record)
        out.append(row)
    return out


def render(all_rows: list[Row]) -> list[str]:
    """The summary's lines: a header, a row per key (the first :data:`MAX_ROWS`), the totals."""
    cells = [("key", "kind", "tensors", "bytes", "other values")]
    for r in all_rows[:MAX_ROWS]:
        other = f"= {r.value}" if r.value is not None else str(r.values)
        cells.append((r.key, r.kind, str(r.tensors), human_bytes(r.nbytes) if r.tensors else "-", other))
    if len(all_rows) > MAX_ROWS:
        cells.append((f"... {len(all_rows) - MAX_ROWS} more keys", "", "", "", ""))
    seen: dict[Hashable, int] = {}
    for r in all_rows:
        seen.update(r.seen)
    total_bytes = sum(seen.values())
    cells.append(("total", "", str(sum(r.tensors for r in all_rows)), human_bytes(total_bytes),
                  str(sum(r.values for r in all_rows))))
    w = [min(max(len(c[i]) for c in cells), 60) for i in range(5)]
    return [f"{a:<{w[0]}}  {b:<{w[1]}}  {c:>{w[2]}}  {d:>{w[3]}}  {e}" for a, b, c, d, e in cells]
