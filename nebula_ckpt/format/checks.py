"""Field checks of everything read from storage: the one way a reader says what is malformed.

Every record of the format (the commit marker, the manifest and its records, storage info) is
parsed with these: each check names the file and the field, and refuses bools and floats where
an integer belongs, so a reader never acts on a number a hostile writer chose freely.
"""

from __future__ import annotations

import json
from typing import Any

from nebula_ckpt.errors import CorruptCheckpointError

#: Bounds that keep hostile numbers cheap: no file of ours is anywhere near 2**62 bytes.
MAX_BYTES = 1 << 62
MAX_NDIM = 64
#: the largest int64: a tensor dimension, a step, and what torch's sizes and element counts must fit
MAX_INT64 = 2**63 - 1
#: largest step: it must fit a signed 64-bit integer (file names, manifests, other readers)
MAX_STEP = MAX_INT64


def bad(where: str, what: str, fix: str = "") -> CorruptCheckpointError:
    """The error for a malformed field: ``"<where>: <what>; <fix>"``."""
    return CorruptCheckpointError(f"{where}: {what}" + (f"; {fix}" if fix else ""))


def short(v: Any) -> str:
    """``repr(v)`` cut to 60 characters (a huge int is shown by its bit length)."""
    text = repr(v) if not isinstance(v, int) or abs(v) < 10**30 else f"<{v.bit_length()}-bit int>"
    return text if len(text) <= 60 else text[:57] + "..."


def as_int(v: Any, where: str, name: str, lo: int = 0, hi: int = MAX_BYTES) -> int:
    """``v`` as an int in ``[lo, hi]`` (bools and floats refused)."""
    if type(v) is not int:
        raise bad(where, f"{name} must be an integer, got {type(v).__name__} {short(v)}")
    if not lo <= v <= hi:
        raise bad(where, f"{name} = {short(v)} is out of range [{lo}, {hi}]")
    return v


def as_step(v: Any, where: str, name: str = "step") -> int:
    """``v`` as a step number: an int in ``[0, MAX_STEP]``, exactly what a save accepts (every
    parser of a step field uses this, so no step a save wrote is refused when read back)."""
    return as_int(v, where, name, hi=MAX_STEP)


def as_str(v: Any, where: str, name: str) -> str:
    """``v`` as a str."""
    if type(v) is not str:
        raise bad(where, f"{name} must be a string, got {type(v).__name__} {short(v)}")
    return v


def as_obj(v: Any, where: str, name: str) -> dict[str, Any]:
    """``v`` as a JSON object (a dict)."""
    if type(v) is not dict:
        raise bad(where, f"{name} must be a JSON object, got {type(v).__name__}")
    return v


def load_object(raw: "bytes | str", where: str, name: str, fix: str = "") -> dict[str, Any]:
    """The JSON object the bytes ``raw`` of a format file hold; what is not valid JSON (too deep,
    not UTF-8) or not an object is refused naming ``where`` (and ``fix``)."""
    try:
        d = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise bad(where, f"is not valid JSON ({type(e).__name__}: {e})", fix) from None
    if type(d) is not dict:
        raise bad(where, f"{name} must be a JSON object, got {type(d).__name__}", fix)
    return d


def as_list(v: Any, where: str, name: str) -> list[Any]:
    """``v`` as a JSON list."""
    if type(v) is not list:
        raise bad(where, f"{name} must be a JSON list, got {type(v).__name__}")
    return v


def only_fields(d: dict[str, Any], allowed: tuple[str, ...], where: str, what: str) -> None:
    """Refuse fields of ``d`` outside ``allowed`` (a newer format's record)."""
    extra = sorted(set(d) - set(allowed))
    if extra:
        raise bad(where, f"{what} has unknown field(s) {extra[:5]} (allowed: {list(allowed)})",
                  "a newer format needs a newer manifest version")


_HEX = frozenset("0123456789abcdef")


def as_hashes(raw: Any, stored: Any, where: str) -> dict[str, str]:
    """A ``sha256`` map: each key one of ``stored`` (the stored tensor keys), each value 64
    lowercase hex digits."""
    out: dict[str, str] = {}
    for k, v in as_obj(raw, where, "sha256").items():
        if k not in stored:
            raise bad(where, f"sha256[{short(k)}]: no such stored tensor")
        v = as_str(v, where, f"sha256[{short(k)}]")
        if len(v) != 64 or not set(v) <= _HEX:
            raise bad(where, f"sha256[{short(k)}] = {short(v)} is not 64 lowercase hex digits")
        out[k] = v
    return out
