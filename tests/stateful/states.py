"""The tiny states the stateful test saves: every byte says which save (and rank) it belongs to.

Every element of tensor ``j`` of the state of save ``sid`` on ``rank`` is ``code(sid, rank, j)``;
the frozen tensor's elements are ``code(fid, rank, 15)`` (``fid``: the id of the frozen part,
which changes only now and then, so that saves are incremental); the non-tensor leaf ``meta``
holds both ids. :func:`decode` tells which save each part of a restored state came from.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

#: tensors of a state: name -> (index j in the code, number of elements)
TENSORS = {"model.weight": (0, 12), "model.bias": (1, 3), "extra": (2, 5)}
FROZEN = ("frozen", 15, 64)


def code(sid: int, rank: int, j: int) -> float:
    """The value of every element of tensor ``j`` of save ``sid`` on ``rank`` (exact in float32)."""
    return float((sid * 8 + rank) * 16 + j)


def uncode(value: float, rank: int, j: int) -> Optional[int]:
    """The save id whose tensor ``j`` of ``rank`` holds ``value`` (None: no save's)."""
    v = int(value)
    if v != value or (v - j) % 16 or ((v - j) // 16 - rank) % 8:
        return None
    return ((v - j) // 16 - rank) // 8


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(TENSORS["model.weight"][1]))
        self.bias = torch.nn.Parameter(torch.zeros(TENSORS["model.bias"][1]))


def make_state(sid: int, fid: int, rank: int, extra: int = TENSORS["extra"][1]) -> dict[str, Any]:
    """The state of save ``sid`` (frozen part ``fid``): a module, an optimizer whose state the
    restore creates (momentum buffers), a plain tensor (of ``extra`` elements: a large one makes
    the state weigh in a host-memory budget), a frozen tensor, and the ids as a leaf."""
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    with torch.no_grad():
        net.weight.fill_(code(sid, rank, 0))
        net.bias.fill_(code(sid, rank, 1))
    for i, p in enumerate((net.weight, net.bias)):
        opt.state[p]["momentum_buffer"] = torch.full_like(p, code(sid, rank, 8 + i))
    return {"model": net, "optim": opt, "extra": torch.full((extra,), code(sid, rank, 2)),
            "frozen": torch.full((FROZEN[2],), code(fid, rank, FROZEN[1])), "meta": {"sid": sid, "fid": fid}}


#: how the state of a save is made, by its save id (:func:`live_mode`): ``fresh`` objects, or the
#: live objects of the save before refilled as a training loop leaves them (``fill``: in place),
#: with a parameter's memory swapped under it (``data``: ``p.data = ...``, one optimizer buffer
#: replaced), or with a new parameter registered (``param``), so that saves reuse the plan of the
#: save before (the plan cache) and must see each change
LIVE_MODES = ("fresh", "fill", "fill", "data", "param")


def live_mode(sid: int) -> str:
    """How the state of save ``sid`` is made (:data:`LIVE_MODES`)."""
    return LIVE_MODES[sid % len(LIVE_MODES)]


def live_state(prev: Optional[dict[str, Any]], sid: int, fid: int, rank: int,
               extra: int = TENSORS["extra"][1]) -> dict[str, Any]:
    """The state of save ``sid`` as :func:`make_state` has it, made as :func:`live_mode` says from
    ``prev`` (the state of the save before, from this function; None: fresh): the same bytes
    either way, so a stale plan that copies an old memory or misses a change is a wrong byte."""
    mode = live_mode(sid)
    if mode == "fresh" or prev is None or prev["extra"].numel() != extra:
        return make_state(sid, fid, rank, extra)
    net, opt = prev["model"], prev["optim"]
    with torch.no_grad():
        if mode == "data":
            net.weight.data = torch.full_like(net.weight, code(sid, rank, 0))
        else:
            net.weight.fill_(code(sid, rank, 0))
        if mode == "param":
            net.bias = torch.nn.Parameter(torch.full_like(net.bias, code(sid, rank, 1)))
        else:
            net.bias.fill_(code(sid, rank, 1))
        for i, p in enumerate(opt.param_groups[0]["params"]):
            if mode == "data" and i == 1:
                opt.state[p]["momentum_buffer"] = torch.full_like(p, code(sid, rank, 8 + i))
            else:
                opt.state[p]["momentum_buffer"].fill_(code(sid, rank, 8 + i))
        prev["extra"].fill_(code(sid, rank, 2))
        prev["frozen"].fill_(code(fid, rank, FROZEN[1]))
    prev["meta"] = {"sid": sid, "fid": fid}
    return prev


def blank_state(rank: int, extra: int = TENSORS["extra"][1]) -> dict[str, Any]:
    """What a restarted job restores into (its optimizer has no state yet: the restore makes it)."""
    st = make_state(0, 0, rank, extra)
    st["optim"].state.clear()
    st["meta"] = {"sid": -1, "fid": -1}
    return st


def decode(state: dict[str, Any], rank: int) -> dict[str, Any]:
    """Which save each part of a restored (or read) state came from: ``{part: sid or "mixed"}``."""
    def one(t: Any, j: int) -> Any:
        vals = set(torch.as_tensor(t).reshape(-1).tolist())
        if len(vals) != 1:
            return "mixed"
        got = uncode(vals.pop(), rank, j)
        return "foreign" if got is None else got

    model = state["model"]
    msd = model.state_dict() if hasattr(model, "state_dict") else model
    osd = state["optim"].state_dict() if hasattr(state["optim"], "state_dict") else state["optim"]
    out = {"model.weight": one(msd["weight"], 0), "model.bias": one(msd["bias"], 1),
           "extra": one(state["extra"], 2), "frozen": one(state["frozen"], FROZEN[1])}
    for i in (0, 1):
        buf = osd.get("state", {}).get(i, {}).get("momentum_buffer")
        out[f"optim.{i}"] = "missing" if buf is None else one(buf, 8 + i)
    out["meta.sid"], out["meta.fid"] = state["meta"]["sid"], state["meta"]["fid"]
    return out


