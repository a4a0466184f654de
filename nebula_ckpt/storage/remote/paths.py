"""Object paths of a remote tier: relative paths checked, objects named in messages, listings
normalised the same way on every backend."""

from __future__ import annotations

from typing import Any


def object_path(root: str, rel: str, url: str) -> str:
    """The filesystem path of ``rel`` under the tier root ``root`` (``url``: for the error).

    Raises:
        ValueError: ``rel`` has an empty, ``.`` or ``..`` component.
    """
    rel = (rel or "").strip("/")
    if rel and any(comp in ("", ".", "..") for comp in rel.split("/")):
        raise ValueError(f"remote tier {url}: invalid relative path {rel!r}")
    if not rel:
        return root
    return f"{root}/{rel}" if root else rel


def where(url: str, rel: str) -> str:
    """``<display url>/<rel>`` (the tier alone for ``""``): how messages name an object."""
    rel = (rel or "").strip("/")
    return f"{url}/{rel}" if rel else url


def child_names(entries: list[Any], path: str) -> list[str]:
    """Sorted names (no prefix, no trailing slash) of the entries an ``ls`` of ``path`` returned,
    the folder itself left out; pseudo-directories (common prefixes) by name too."""
    me = path.strip("/")
    names: set[str] = set()
    for e in entries:
        name = (e["name"] if isinstance(e, dict) else str(e)).rstrip("/")
        if name.strip("/") == me:
            continue  # the directory (or file) itself
        base = name.rsplit("/", 1)[-1]
        if base:
            names.add(base)
    return sorted(names)


def objects_under(found: list[str], path: str) -> list[str]:
    """The objects of ``found`` at or under ``path`` (``step-1`` never matches ``step-10``)."""
    me = path.strip("/")
    return [f for f in found if f.strip("/") == me or f.strip("/").startswith(me + "/")]
