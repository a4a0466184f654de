"""Where a training loop is in its data, and how to get back there.

Two kinds of loader are resumed:

* a loader with ``state_dict()`` / ``load_state_dict()`` of its own (torchdata's
  ``StatefulDataLoader``, or your own): its state is saved, and it fast-forwards itself (no batch
  of the epoch is loaded again). ``StatefulDataLoader`` keeps what each worker's dataset returns
  from ``state_dict()``; a map-style dataset without one is given a pair that holds the worker's
  random streams (:func:`keep_worker_streams`), so draws in ``__getitem__`` resume where they were.
  An ``IterableDataset`` without one is fast-forwarded by torchdata: each worker, seeded as it was,
  makes its iterator again and drops the items it had yielded, so its position and its draws
  come back (the cost: those items are made a second time);
* any other re-iterable loader (a plain ``torch.utils.data.DataLoader``): the epoch's iterator is
  made again from the random streams as they were when the epoch started, and the batches the
  loop had consumed are drawn from it again and dropped (**replayed**). The shuffle, the workers'
  base seed and each worker's own random streams then advance exactly as they did, whatever the
  dataset draws in ``__getitem__``; the cost is loading those batches a second time.

Samplers with ``set_epoch`` (``DistributedSampler``) are told the epoch before its iterator is made.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Iterator, Mapping, Optional

import torch

from nebula_ckpt.loop.streams import capture, restore

__all__ = ["generators", "has_own_state", "set_epoch", "length", "replay", "persistent_workers",
           "keep_worker_streams", "drop_workers", "fast_forwarded"]

log = logging.getLogger("nebula_ckpt")


def has_own_state(loader: Any) -> bool:
    """Whether ``loader`` saves and restores its own position (torchdata's ``StatefulDataLoader``)."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def _samplers(loader: Any) -> list[Any]:
    """The loader's sampler, its batch sampler and the sampler inside that (those it has), once each."""
    out: list[Any] = []
    batch_sampler = getattr(loader, "batch_sampler", None)
    for s in (getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None)):
        if s is not None and all(s is not o for o in out):
            out.append(s)
    return out


def generators(loader: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects the loader's iteration draws from (the loader's ``generator=``
    and its samplers'), once each, in a fixed order."""
    out: list[torch.Generator] = []
    for owner in (loader, *_samplers(loader)):
        g = getattr(owner, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not o for o in out):
            out.append(g)
    return out


def set_epoch(loader: Any, epoch: int) -> None:
    """Tell every sampler of ``loader`` that has ``set_epoch`` (``DistributedSampler``) the epoch."""
    for s in _samplers(loader):
        if callable(getattr(s, "set_epoch", None)):
            s.set_epoch(epoch)


def length(loader: Any) -> Optional[int]:
    """Batches per epoch, or None when the loader has no length (an iterable dataset)."""
    try:
        return len(loader)
    except TypeError:
        return None


def persistent_workers(loader: Any) -> bool:
    """Whether the loader keeps its worker processes from one epoch to the next."""
    return bool(getattr(loader, "persistent_workers", False)) and int(getattr(loader, "num_workers", 0) or 0) > 0


def has_workers(loader: Any) -> bool:
    """Whether a ``persistent_workers`` loader made its worker iterator already (torch keeps it in
    the loader; the next ``iter()`` reuses it and draws no base seed)."""
    return getattr(loader, "_iterator", None) is not None


def drop_workers(loader: Any) -> None:
    """Let the workers a ``persistent_workers`` loader made in this process go (torch shuts them
    down with the iterator that holds them), for a rollback: the next ``iter()`` makes them again
    as a resumed process does, drawing their base seed and seeding their streams afresh."""
    if persistent_workers(loader) and has_workers(loader):
        loader._iterator = None


def fast_forwarded(loader: Any) -> bool:
    """Whether torchdata resumes ``loader`` by making each worker's iterator again and dropping the
    items it had yielded: an ``IterableDataset`` without a state of its own, in worker processes."""
    dataset = getattr(loader, "dataset", None)
    return isinstance(dataset, torch.utils.data.IterableDataset) and int(getattr(loader, "num_workers", 0) or 0) > 0 \
        and not has_own_state(dataset)


def replay(loader: Iterable[Any], batches: int, epoch: int) -> tuple[Iterator[Any], int]:
    """A new iterator over ``loader`` with its first ``batches`` batches drawn and dropped.

    Returns the iterator and the number of batches dropped (fewer than ``batches`` when the epoch
    is shorter now: the caller says so)."""
    it = iter(loader)
    if batches:
        log.info("nebula_ckpt: resuming epoch %d after batch %d: loading and dropping its first %d batches so the "
                 "shuffle and the workers' random streams are where they were", epoch, batches, batches)
    done = 0
    for _ in range(batches):
        try:
            next(it)
        except StopIteration:
            break
        done += 1
    return it, done


class _WorkerStreamsState:
    """A dataset's ``state_dict()``: the random streams of the process it runs in (a worker's)."""

    def __call__(self) -> dict[str, Any]:
        return {"nebula_worker_streams": capture(cuda=False)}


class _WorkerStreamsLoad:
    """A dataset's ``load_state_dict()``: sets back what :class:`_WorkerStreamsState` took."""

    def __call__(self, state: Mapping[str, Any]) -> None:
        restore(state["nebula_worker_streams"], "a data-loader worker's random streams")


def keep_worker_streams(loader: Any) -> bool:
    """Give the map-style dataset of a self-resuming loader with worker processes a
    ``state_dict()`` / ``load_state_dict()`` pair holding the worker's random streams, unless it has
    its own; return whether it has one now. ``StatefulDataLoader`` calls them in each worker after
    each batch and at a resume (the streams of a worker otherwise restart from its seed).

    An ``IterableDataset`` is left as it is: to torchdata such a pair means "this dataset resumes
    its own position", and it would then start the epoch's items again from the first; without
    it, torchdata fast-forwards each worker, which brings back its position and its streams."""
    dataset = getattr(loader, "dataset", None)
    if dataset is None or int(getattr(loader, "num_workers", 0) or 0) == 0:
        return False
    if callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None)):
        return True
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return False
    try:  # on the instance: picklable callables, for workers started with "spawn" as well
        dataset.state_dict = _WorkerStreamsState()
        dataset.load_state_dict = _WorkerStreamsLoad()
    except AttributeError:  # __slots__ or a read-only attribute
        log.warning("nebula_ckpt: LoopState: the dataset (%s) takes no state_dict attribute: random numbers drawn in "
                    "the loader's workers restart from the workers' seeds at a resume", type(dataset).__name__)
        return False
    return True
