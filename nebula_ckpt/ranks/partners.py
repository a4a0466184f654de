"""Which ranks hold a rank's memory-tier replicas: partners on other nodes.

A *node* is what fails as a whole: a host and its ``/dev/shm``. Its id is the host name, or
``NEBULA_NODE_ID`` (``knobs.node_id``) when set, so tests simulate several nodes on one machine.

:func:`choose_partners` is a pure function of every rank's node id (gathered over the
checkpoint's own process group, so every rank computes the same answer): nodes are ordered by
their lowest rank; rank ``r``, the ``i``-th rank of node ``n``, gets as its ``j``-th partner
(``j = 1..k``) the ``i``-th rank (modulo that node's size) of node ``n + j`` (modulo the number
of nodes). So a rank's ``k`` copies lie on ``k`` distinct nodes, none of them its own, and the
load spreads evenly when the nodes have the same number of ranks. Losing any ``k`` nodes leaves
at least one copy of every rank's step (its own, or one of its partners').
"""

from __future__ import annotations

import hashlib
import socket
from typing import Sequence

from nebula_ckpt import knobs
from nebula_ckpt.errors import ValidationError


def node_id() -> str:
    """This process's node: ``NEBULA_NODE_ID`` if set, else the host name."""
    return str(knobs.get("node_id") or socket.gethostname())


#: bytes a node id takes in the exchange of node ids (one fixed-size collective)
NODE_ID_BYTES = 256


def pack_node_id(node: str) -> bytes:
    """``node`` as :data:`NODE_ID_BYTES` bytes: its UTF-8, zero-padded (a longer id goes as its
    SHA-256, which tells nodes apart alike). An id read from the environment that is not valid
    UTF-8 holds its bytes as surrogates (Python's ``surrogateescape``): they travel as those bytes."""
    try:
        raw = node.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate no environment gives: its code points, hashed below
        raw = b"\0" + node.encode("utf-8", "surrogatepass")
    if len(raw) >= NODE_ID_BYTES or b"\0" in raw:
        raw = f"sha256:{hashlib.sha256(raw).hexdigest()}".encode()
    return raw.ljust(NODE_ID_BYTES, b"\0")


def unpack_node_id(data: bytes) -> str:
    """The node id :func:`pack_node_id` packed into ``data`` (bytes that are not UTF-8 as
    surrogates: two ids that differ in them stay two nodes)."""
    return data.rstrip(b"\0").decode("utf-8", errors="surrogateescape")


def node_order(nodes: Sequence[str]) -> list[str]:
    """The distinct node ids of ``nodes`` (one per rank), ordered by their lowest rank."""
    return list(dict.fromkeys(nodes))


def choose_partners(nodes: Sequence[str], k: int) -> list[list[int]]:
    """Partners of every rank: ``out[r]`` lists the ``k`` ranks that hold rank ``r``'s replicas.

    Args:
        nodes: the node id of each rank, by rank.
        k: copies per rank (``MemoryTier(replicas=k)``); 0 gives empty lists.

    Raises:
        ValidationError: ``k`` is negative, or the job has fewer than ``k + 1`` nodes (naming both
            numbers and the fix).
    """
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValidationError(f"MemoryTier(replicas=...) must be an int >= 0, got {k!r}")
    order = node_order(nodes)
    if k and len(order) < k + 1:
        raise ValidationError(
            f"MemoryTier(replicas={k}) needs at least {k + 1} nodes (each rank's {k} cop{'y' if k == 1 else 'ies'} "
            f"on {k} other node(s)), but the {len(nodes)} rank(s) of this job run on {len(order)} node(s) "
            f"({', '.join(order[:8])}); use replicas={max(0, len(order) - 1)} or fewer, or run on more nodes "
            "(NEBULA_NODE_ID names a rank's node when host names do not tell them apart)")
    members: dict[str, list[int]] = {n: [] for n in order}
    for r, n in enumerate(nodes):
        members[n].append(r)
    index = {n: i for i, n in enumerate(order)}
    out: list[list[int]] = []
    for r, n in enumerate(nodes):
        pos = members[n].index(r)
        mine = []
        for j in range(1, k + 1):
            other = members[order[(index[n] + j) % len(order)]]
            mine.append(other[pos % len(other)])
        out.append(mine)
    return out


def sources_of(partners: Sequence[Sequence[int]], rank: int) -> list[int]:
    """The ranks whose replicas ``rank`` holds (those that chose it as a partner), ascending."""
    return [r for r, ps in enumerate(partners) if rank in ps]
