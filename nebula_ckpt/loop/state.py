""":class:`LoopState`: what a training loop holds besides the model and the optimizer.

A loop resumed from a checkpoint draws the same random numbers and sees the same batches as one
that never stopped only when three things come back with the weights: every random stream of
the process (:mod:`nebula_ckpt.loop.streams`), the position in the data (epoch, batch) and the
data loader's own randomness (its shuffle, its workers' seeds; :mod:`nebula_ckpt.loop.data`).
:class:`LoopState` keeps all three; put it in the state handed to ``save_async`` and
``load_latest``, and let it hand out the epochs and the batches::

    loop = nc.LoopState(loader)
    state = {"model": model, "optim": opt, "loop": loop}
    ckpt.load_latest(into=state)                 # a fresh start when there is nothing
    for epoch in loop.epochs(10):
        for batch in loop:
            ...
            ckpt.save_async(loop.step, state)

Its ``state_dict()`` holds tensors, NumPy arrays and plain ints and floats only: it is stored
without pickle and every counter comes back as the ``int`` it was.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterator as OneShot
from typing import Any, Iterator, Mapping, Optional

import torch

from nebula_ckpt.errors import ValidationError
from nebula_ckpt.loop import data
from nebula_ckpt.loop.streams import capture, generator_state, restore

__all__ = ["LoopState"]

log = logging.getLogger("nebula_ckpt")

#: version of :meth:`LoopState.state_dict`'s layout
LAYOUT = 1


def _take(loader: Any, cuda: bool) -> dict[str, Any]:
    """The process's random streams and the loader's generators, now."""
    return {"streams": capture(cuda), "generators": [g.get_state() for g in data.generators(loader)]}


def _put(loader: Any, taken: Mapping[str, Any], where: str) -> None:
    """Set back what :func:`_take` took (the loader's generators by position)."""
    restore(taken["streams"], f"{where}['streams']")
    gens = data.generators(loader)
    saved = list(taken.get("generators") or [])
    if len(saved) != len(gens):
        log.warning("nebula_ckpt: %s: the checkpoint holds %d data-loader generator state(s), the loader has %d "
                    "generator(s): the first %d are restored (was the loader built the same way?)", where,
                    len(saved), len(gens), min(len(saved), len(gens)))
    for i, (g, s) in enumerate(zip(gens, saved, strict=False)):  # fewer: said above
        g.set_state(generator_state(s, f"{where}['generators'][{i}]"))


def _check_workers(saved: Any, now: Any) -> None:
    """A loader that keeps its own position (torchdata's ``StatefulDataLoader``) resumes mid-epoch
    only with the number of workers it was saved with (its state is per worker): else refused
    before anything of the loop changes, rather than torchdata's assertion at the first batch."""
    if isinstance(saved, int) and isinstance(now, int) and saved != now:
        raise ValidationError(f"LoopState: the checkpoint was taken in the middle of an epoch with a data loader of "
                              f"num_workers={saved}; this loader has num_workers={now}, and a StatefulDataLoader "
                              f"resumes its position only with the workers it saved: build it with "
                              f"num_workers={saved} for this resume (change it at an epoch's end)")


def _check_loader(loader: Any) -> None:
    """Refuse, at ``LoopState(loader)``, what cannot be iterated once per epoch: no iterable at all,
    or a one-shot iterator (a generator, ``iter(x)``): its second epoch, and a resumed run's replay
    of the consumed batches, would be empty without a word."""
    if loader is None:
        return
    kind = type(loader)
    if getattr(kind, "__iter__", None) is None and getattr(kind, "__getitem__", None) is None:
        raise ValidationError(f"LoopState: loader must be a data loader (a DataLoader, a StatefulDataLoader, a list "
                              f"of batches: anything iterated once per epoch) or None, got {kind.__name__} "
                              f"{loader!r}; pass LoopState(loader), or LoopState() to keep the random streams and "
                              "counters only")
    if isinstance(loader, OneShot):
        raise ValidationError(f"LoopState: loader is a one-shot iterator ({kind.__name__}): iterating it again (the "
                              "next epoch, a resumed run's replay of the batches it had consumed) gives nothing; pass "
                              "a re-iterable that makes a new iterator each epoch: the DataLoader itself, a list of "
                              "batches, or an object whose __iter__ returns a fresh iterator (not iter(loader), not a "
                              "generator)")


def _epoch_count(n: Any) -> int:
    """``n`` of :meth:`LoopState.epochs` as an int >= 0; anything else is refused."""
    try:
        count = operator.index(n) if not isinstance(n, bool) else None
    except TypeError:
        count = None
    if count is None or count < 0:
        raise ValidationError(f"LoopState.epochs(n): n must be an int >= 0 (the number of epochs of the whole "
                              f"training, a resumed run included), got {n!r}; e.g. loop.epochs(10)")
    return count


#: the keys :meth:`LoopState.load_state_dict` reads
_KEYS = ("layout", "epoch", "batch", "step", "epoch_done", "now")


def _check_state(state: Any) -> None:
    """Refuse what :meth:`LoopState.state_dict` never gives, before anything of the loop changes."""
    if not isinstance(state, Mapping):
        raise ValidationError(f"LoopState.load_state_dict(state): state must be the dict LoopState.state_dict() "
                              f"gave, got {type(state).__name__}; pass the saved state (or restore it with "
                              "load_latest(into={..., 'loop': loop}))")
    if state.get("layout") != LAYOUT:
        raise ValidationError(f"LoopState: unknown state layout {state.get('layout')!r} (this version reads "
                              f"{LAYOUT})")
    missing = [k for k in _KEYS if k not in state]
    if missing:
        raise ValidationError(f"LoopState.load_state_dict(state): state lacks key(s) {missing}; pass the dict "
                              "LoopState.state_dict() gave")


def _own(tree: Any) -> Any:
    """``tree`` with every tensor a copy of its own: a restored tensor may be a view into a buffer
    shared with others, and torch's ``Generator.set_state`` reads such a view from the wrong place
    (a loader's sampler state holds generator states)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _own(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_own(v) for v in tree)
    return tree


class LoopState:
    """Every random stream of the process and the loop's position in its data, in a checkpoint.

    Put it in the state (``{"model": model, "optim": opt, "loop": loop}``): ``save_async`` takes
    its :meth:`state_dict` with the rest, ``load_latest`` gives it back (:meth:`load_state_dict`).
    Iterate :meth:`epochs` and the object itself instead of ``range(epochs)`` and the loader: a
    resumed run then goes on with the batch after the last one the checkpoint had seen, drawing
    the same random numbers as a run that never stopped (torch's CPU generator, every CUDA
    device's, ``np.random``, ``random``, the loader's ``generator=`` and its workers' streams).

    Args:
        loader: the data loader (a ``DataLoader``, torchdata's ``StatefulDataLoader``, any
            re-iterable), or None to keep the random streams and the counters only.

    Attributes:
        epoch: the epoch in progress (0-based).
        batch: batches of this epoch handed to the loop so far.
        step: batches handed to the loop since the start of training (all epochs): a name for
            each checkpoint (``save_async(loop.step, state)``).

    Save at the end of the loop body, after the optimizer's step: what the rest of the body would
    have done after the save is done again by the resumed run. A plain ``DataLoader`` is resumed
    by loading the consumed batches of the epoch again (see :mod:`nebula_ckpt.loop.data`); a
    ``StatefulDataLoader`` fast-forwards itself.
    """

    def __init__(self, loader: Any = None) -> None:
        _check_loader(loader)
        self.loader = loader
        if data.has_own_state(loader):
            data.keep_worker_streams(loader)
        self.epoch = 0
        self.batch = 0
        self.step = 0
        self._epoch_done = False
        #: streams and generators just before this epoch's iterator was made (plain loaders)
        self._epoch_start: Optional[Mapping[str, Any]] = None
        #: a restored position not yet reached: (streams at the save, streams at the epoch's start)
        self._pending: Optional[Mapping[str, Any]] = None
        #: the loader's iterator of the epoch in progress
        self._live: Optional[Iterator[Any]] = None
        #: :meth:`load_state_dict` calls so far: a load inside the loop's body (a rollback) is seen by
        #: the suspended generators, which then go on from the restored position
        self._loads = 0

    # -- the loop ---------------------------------------------------------------------------------
    def epochs(self, n: int) -> Iterator[int]:
        """The epochs still to run, up to ``n`` (exclusive): from the restored one on.

        An epoch whose batches were all handed out is over; one the loop left early (a ``break``)
        is over too once the next one is asked for, unless a checkpoint was loaded into the loop
        meanwhile (a rollback): the loop then goes on from the loaded position.

        Raises:
            ValidationError: ``n`` is not an int >= 0 (at the call).
        """
        return self._epochs(_epoch_count(n))

    def _epochs(self, n: int) -> Iterator[int]:
        while True:
            if self._epoch_done:
                self._next_epoch()
            if self.epoch >= n:
                return
            loads = self._loads
            yield self.epoch
            if self._loads == loads:  # else a load in the body (a rollback) said where the loop is
                self._epoch_done = True

    def _next_epoch(self) -> None:
        self.epoch += 1
        self.batch = 0
        self._epoch_done = False
        self._epoch_start = None
        self._live = None

    def __iter__(self) -> Iterator[Any]:
        """The batches of the current epoch still to come (an epoch already over: the next one's).

        A checkpoint loaded into the loop while a batch is out (a rollback: ``ckpt.load(n,
        into=state)`` in the body, then ``continue``) is followed: the next batch is the one after
        the loaded position. A position in another epoch, or after its epoch's end, ends this
        ``for``; :meth:`epochs` then hands out the loaded epoch."""
        if self.loader is None:
            raise ValidationError("LoopState(): iterating it needs the data loader: LoopState(loader)")
        if self._epoch_done:
            self._next_epoch()
        epoch = self.epoch
        while True:
            if self._live is None:
                self._live = self._start()
            live, loads = self._live, self._loads
            for item in live:  # a ``break`` leaves it in ``_live``: the next ``for`` goes on with it
                self.batch += 1
                self.step += 1
                yield item
                if self._loads != loads:
                    break
            else:
                self._live = None
                self._epoch_done = True
                return
            if self._epoch_done or self.epoch != epoch:  # rolled back out of this epoch
                return

    def _start(self) -> Iterator[Any]:
        """The epoch's iterator, at the restored position when a restore is pending."""
        loader, pending, self._pending = self.loader, self._pending, None
        data.set_epoch(loader, self.epoch)
        if data.has_own_state(loader):
            return self._start_own(pending)
        if pending is not None:  # a rollback in this process goes on as a resumed process would
            data.drop_workers(loader)
        if pending is None or self.batch == 0:
            self._epoch_start = _take(loader, cuda=False)
            self._make_workers(self._epoch_start)
            return iter(loader)
        return self._replay(pending)

    def _start_own(self, pending: Optional[Mapping[str, Any]]) -> Iterator[Any]:
        """The iterator of a loader that keeps its own position (``load_state_dict`` gave it). One
        that fast-forwards (torchdata over an ``IterableDataset`` without a state of its own makes
        the epoch's iterator again and drops what it had yielded) draws as at the epoch's start."""
        loader = self.loader
        if pending is None or self.batch == 0:
            self._epoch_start = _take(loader, cuda=False)
            return iter(loader)
        if self.epoch > 0 and data.persistent_workers(loader) and data.fast_forwarded(loader):
            log.warning("nebula_ckpt: LoopState: the loader keeps its workers across epochs (persistent_workers=True) "
                        "and fast-forwards its IterableDataset: random numbers drawn inside the workers resume from "
                        "the start of epoch %d's workers, not from where they were", self.epoch)
        start = pending["epoch_start"]
        if start is not None:
            _put(loader, start, "LoopState (epoch start)")
            self._epoch_start = start
        it = iter(loader)  # at the position load_state_dict gave it
        _put(loader, pending["now"], "LoopState")  # making it drew (a base seed, a replay): as at the save
        return it

    def _make_workers(self, start: Any) -> None:
        """A loader that keeps its workers (``persistent_workers``) made them in the first epoch of
        the run that saved, drawing their base seed before the epoch's shuffle; a later epoch's
        ``iter()`` reuses them and draws none. A resumed process past the first epoch makes them now
        and puts the streams back to the epoch's ``start``, so the shuffle draws what it drew."""
        if self.epoch > 0 and data.persistent_workers(self.loader) and not data.has_workers(self.loader):
            iter(self.loader)
            _put(self.loader, start, "LoopState (epoch start)")

    def _replay(self, pending: Mapping[str, Any]) -> Iterator[Any]:
        start = pending["epoch_start"]
        if start is None:
            raise ValidationError("LoopState: the checkpoint is in the middle of an epoch but holds no state of its "
                                  "start (saved by a LoopState without a loader?): pass the same loader")
        if data.persistent_workers(self.loader) and self.epoch > 0:
            log.warning("nebula_ckpt: LoopState: the loader keeps its workers across epochs (persistent_workers=True): "
                        "random numbers drawn inside the workers resume from the start of epoch %d's workers, not from "
                        "where they were", self.epoch)
        _put(self.loader, start, "LoopState (epoch start)")
        self._make_workers(start)
        self._epoch_start = start
        it, done = data.replay(self.loader, self.batch, self.epoch)
        if done < self.batch:
            log.warning("nebula_ckpt: LoopState: epoch %d has %d batches now, the checkpoint was taken after batch %d: "
                        "the epoch is over", self.epoch, done, self.batch)
        _put(self.loader, pending["now"], "LoopState")
        return it

    # -- the checkpoint ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position and every random stream, now (typed leaves only: no pickle)."""
        loader = self.loader
        own = data.has_own_state(loader)
        return {"layout": LAYOUT, "epoch": self.epoch, "batch": self.batch, "step": self.step,
                "epoch_done": self._epoch_done, "now": _take(loader, cuda=True),
                "epoch_start": self._epoch_start,
                "loader": loader.state_dict() if own else None,
                "num_workers": getattr(loader, "num_workers", None) if own else None,
                "batches_per_epoch": data.length(loader) if loader is not None else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go back to the saved position: the random streams are set back now, the loader's position
        when the epoch's batches are next asked for (``for batch in loop``).

        Raises:
            ValidationError: ``state`` is no state of a LoopState (nothing of the loop changed).
        """
        _check_state(state)
        loader = self.loader
        saved_len, now_len = state.get("batches_per_epoch"), data.length(loader) if loader is not None else None
        if saved_len is not None and now_len is not None and saved_len != now_len:
            log.warning("nebula_ckpt: LoopState: the loader has %d batches per epoch, the checkpoint's had %d (another "
                        "batch size, dataset or drop_last?): the position is kept in batches", now_len, saved_len)
        # a loader with its own position takes it back mid-epoch (else the next iterator starts an epoch afresh)
        resume_loader = loader is not None and data.has_own_state(loader) and state.get("loader") is not None \
            and bool(int(state["batch"])) and not bool(state["epoch_done"])
        if resume_loader:
            _check_workers(state.get("num_workers"), getattr(loader, "num_workers", None))
        self.epoch, self.batch, self.step = int(state["epoch"]), int(state["batch"]), int(state["step"])
        self._epoch_done = bool(state["epoch_done"])
        self._epoch_start = state.get("epoch_start")
        self._live = None
        if resume_loader:
            loader.load_state_dict(_own(state["loader"]))
        _put(loader, state["now"], "LoopState")
        self._pending = {"now": state["now"], "epoch_start": self._epoch_start}
        self._loads += 1

    def __repr__(self) -> str:
        return f"LoopState(epoch={self.epoch}, batch={self.batch}, step={self.step})"
