"""Tests' view of a multi-rank checkpoint folder: the manifest with every rank's records merged in.

A version 3 checkpoint keeps each rank's tensor records in ``records-g<G>-r<R>.json`` beside its
shard; tests that look at every record at once read them through :func:`flat_manifest`, which
gives the JSON a version 2 manifest would hold (``tensors`` with ``r<R>/`` keys and ``shard``,
``aliases`` of replicated and tied keys), straight from the files (no library code).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def flat_manifest(step_folder: Path) -> dict[str, Any]:
    """The manifest of ``step_folder`` with the ranks' records merged into ``tensors`` / ``aliases``."""
    man = json.loads((step_folder / "manifest.json").read_text())
    if man["version"] < 3:
        return man
    tensors: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    own: list[dict[str, str]] = []
    for r, ref in enumerate(man["records"]):
        recs = json.loads((step_folder / ref["file"]).read_text())
        for k, v in recs["tensors"].items():
            tensors[f"r{r}/{k}"] = dict(v, shard=r) if r else v
        own.append(recs["aliases"])
    for r, mine in enumerate(own):
        for k, q in man["owners"].items():
            if q != r:
                aliases[f"r{r}/{k}"] = f"r{q}/{k}"
        for a, b in mine.items():
            aliases[f"r{r}/{a}"] = aliases.get(f"r{r}/{b}", f"r{r}/{b}")
    return dict(man, tensors=tensors, aliases=aliases)
