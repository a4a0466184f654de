"""Where every rank's state comes from at restore, when memory-tier replicas exist: the plan.

Pure functions of what every rank reported (its *view*, gathered by
:mod:`~nebula_ckpt.tiers.memory.replica_recover`), so every rank computes the same plan:

* ``own``: ``(generation, step, save)`` committed in the rank's own memory tier;
* ``held``: source rank -> ``(generation, step, save)`` of the replicas the rank holds of it;
* ``shared``: the ``(generation, step, save)`` the shared tiers (disk, blob) hold for the whole job;
* ``can_pull``: whether the rank has a memory tier to receive a pulled copy into.

Copies are matched by the *write* they hold, ``(generation, step, save)``
(:attr:`~nebula_ckpt.format.commit.Commit.write`), never by the step number alone: a step saved
twice is two writes, and every rank restores the same one (a rank whose own copy is the second
write and a rank that can get only the first restore the first, or an older step every rank has).

A rank can get a step when its own memory tier holds it, some other live rank holds a replica of
it (and it can receive one), or a shared tier holds it. The target is the newest step every rank
can get; ranks whose own copy is gone or damaged pull it from the holders in turn (one holder
per attempt, the next holder when a copy fails its checksums); a rank none of whose holders delivers falls
back to the shared tier, and when that lacks the step too, the step is excluded and the next
newest one is planned.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Sequence

Order = tuple[int, int, int]


def _orders(xs: Iterable[Any]) -> set[Order]:
    return {(int(g), int(s), int(w)) for g, s, w in xs}


def shared_orders(views: Sequence[dict[str, Any]]) -> set[Order]:
    """Steps every rank sees on the shared tiers."""
    sets = [_orders(v.get("shared", [])) for v in views]
    return set.intersection(*sets) if sets else set()


def holders(views: Sequence[dict[str, Any]], rank: int, target: Order) -> list[int]:
    """Ranks other than ``rank`` holding a replica of ``rank``'s ``target``, ascending."""
    return [h for h, v in enumerate(views) if h != rank and target in _orders(v.get("held", {}).get(rank, []))]


def gettable(views: Sequence[dict[str, Any]], rank: int) -> set[Order]:
    """Every step ``rank`` can get: own memory tier, a replica elsewhere, a shared tier."""
    out = _orders(views[rank].get("own", [])) | shared_orders(views)
    if views[rank].get("can_pull"):
        for h, v in enumerate(views):
            if h != rank:
                out |= _orders(v.get("held", {}).get(rank, []))
    return out


def choose_target(views: Sequence[dict[str, Any]], step: Optional[int] = None,
                  among: Optional[Sequence[int]] = None, excluded: Iterable[Order] = ()) -> Optional[Order]:
    """The newest write ``(generation, step, save)`` every rank can get (of ``step`` / ``among``
    when given)."""
    sets = [gettable(views, r) for r in range(len(views))]
    common = set.intersection(*sets) if sets else set()
    common -= set(excluded)
    common = {o for o in common if (step is None or o[1] == step) and (among is None or o[1] in among)}
    return max(common, default=None)


def assignments(views: Sequence[dict[str, Any]], target: Order, attempts: Mapping[int, int]) -> dict[int, int]:
    """Requester -> holder for the next pull: ``attempts[r]`` is how many of ``r``'s holders it
    tried already (0: its first holder, 1: the next, ...); a rank that cannot receive a copy (no
    memory tier) or has tried every holder gets none."""
    out = {}
    for r, attempt in attempts.items():
        hs = holders(views, r, target) if views[r].get("can_pull") else []
        if attempt < len(hs):
            out[r] = hs[attempt]
    return out
