"""``nc.LoopState``: a loop resumed from a checkpoint sees the batches and draws the random numbers
of a loop that never stopped, bit for bit: torch's CPU generator, NumPy's and Python's global
streams, the loader's ``generator=``, its shuffle, its workers' streams (``np.random`` in
``__getitem__``), its samplers' ``set_epoch``, at any position (mid-epoch, the last batch of an
epoch, after an epoch's end), with a plain ``DataLoader`` and with torchdata's
``StatefulDataLoader``; stored without pickle, every counter an ``int`` again.

Each case runs the loop once without a stop (the reference), then once saving at a position and
once more from a fresh ``LoopState`` and a fresh loader restored from that checkpoint, with every
global stream reseeded in between (as a new process would find them), and compares what the loop
saw at every step. The SIGKILLed README example is in ``tests/api/test_docs.py``.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import pytest
import torch

import nebula_ckpt as nc

BATCH = 4


class Draws(torch.utils.data.Dataset):
    """Each item holds its index and one draw of every global stream of the process loading it."""

    def __init__(self, n: int = 14) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), float(np.random.normal()), random.random(), float(torch.rand(()))],
                            dtype=torch.float64)


Loader = Callable[[], Any]


def plain(num_workers: int = 0, *, generator: bool = False, drop_last: bool = False, n: int = 14) -> Loader:
    def make() -> Any:
        g = torch.Generator().manual_seed(5) if generator else None
        return torch.utils.data.DataLoader(Draws(n), batch_size=BATCH, shuffle=True, num_workers=num_workers,
                                           drop_last=drop_last, generator=g)
    return make


def distributed(rank: int) -> Loader:
    def make() -> Any:
        ds = Draws()
        sampler = torch.utils.data.DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=3)
        return torch.utils.data.DataLoader(ds, batch_size=2, sampler=sampler)
    return make


def stateful(num_workers: int) -> Loader:
    sdl = pytest.importorskip("torchdata.stateful_dataloader")

    def make() -> Any:
        return sdl.StatefulDataLoader(Draws(), batch_size=BATCH, shuffle=True, num_workers=num_workers)
    return make


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


Seen = list[tuple[int, int, int, list[float], float, float, float]]


def _loop(make: Loader, ck: nc.Checkpointer, *, epochs: int, stop: Optional[int] = None,
          restore: bool = False) -> Seen:
    """Run the loop; ``stop``: save at that step and return (a negative one: after epoch ``-stop - 1``
    ends, outside the inner loop); ``restore``: restore first."""
    seed_all(0)
    loop = nc.LoopState(make())
    state = {"loop": loop}
    if restore:
        seed_all(99)  # what a new process finds: other streams than at the save
        assert ck.load_latest(into=state) is not None
    seen: Seen = []
    for epoch in loop.epochs(epochs):
        for batch in loop:
            seen.append((epoch, loop.batch, loop.step, batch.flatten().tolist(), float(np.random.normal()),
                         random.random(), float(torch.rand(()))))
            if loop.step == stop:
                ck.save(loop.step, state)
                return seen
        if stop is not None and stop == -epoch - 1:
            ck.save(loop.step, state)
            return seen
    return seen


def resumed_equals_uninterrupted(make: Loader, tmp_path: Path, stops: list[int], epochs: int = 2) -> None:
    with nc.Checkpointer(str(tmp_path / "ref")) as ck:
        want = _loop(make, ck, epochs=epochs)
    orders = [[i for s in want if s[0] == e for i in s[3][0::4]] for e in range(epochs)]
    assert all(o != orders[0] for o in orders[1:]), orders  # each epoch reshuffled
    for stop in stops:
        root = str(tmp_path / f"stop{stop}")
        with nc.Checkpointer(root) as ck:
            first = _loop(make, ck, epochs=epochs, stop=stop)
        with nc.Checkpointer(root) as ck:
            rest = _loop(make, ck, epochs=epochs, restore=True)
        assert first + rest == want, f"stop {stop}: the resumed loop saw other batches or draws"


# 14 samples in batches of 4: 4 batches an epoch (the last one short), 3 with drop_last
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("generator", [False, True], ids=["global-rng", "generator"])
def test_a_plain_dataloader_resumes_bit_exact(tmp_path: Path, shm_dir: str, num_workers: int,
                                              generator: bool) -> None:
    """Mid-epoch, on an epoch's last batch and after an epoch's end; workers drawing from np.random,
    random and torch in ``__getitem__``; a loader with its own ``generator=`` or none (the shuffle
    and the workers' base seed then come from torch's global generator)."""
    resumed_equals_uninterrupted(plain(num_workers, generator=generator), tmp_path, [2, 4, -1, 6])


class Indices(torch.utils.data.Dataset):
    """Each item its index: a dataset that draws no random numbers."""

    def __len__(self) -> int:
        return 14

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)], dtype=torch.float64)


def test_a_loader_that_keeps_its_workers_resumes_bit_exact_in_every_epoch(tmp_path: Path, shm_dir: str) -> None:
    """``persistent_workers=True``: the run that saved made its workers (drawing their base seed)
    in the first epoch only; a resumed loop past it, mid-epoch or at an epoch's start, must shuffle
    as that run did (its workers made first, then the epoch's streams put back)."""
    def make() -> Any:
        return torch.utils.data.DataLoader(Indices(), batch_size=BATCH, shuffle=True, num_workers=2,
                                           persistent_workers=True)
    resumed_equals_uninterrupted(make, tmp_path, [6, -2], epochs=3)


def test_drop_last_and_a_third_epoch(tmp_path: Path, shm_dir: str) -> None:
    resumed_equals_uninterrupted(plain(drop_last=True), tmp_path, [3, 5, -2], epochs=3)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_distributed_sampler_is_told_the_epoch(tmp_path: Path, shm_dir: str, rank: int) -> None:
    """``DistributedSampler.set_epoch`` is called by the loop: each epoch its own shuffle (the
    reference loop's batches all differ), and a resume in epoch 1 is where it was."""
    resumed_equals_uninterrupted(distributed(rank), tmp_path, [2, 5, -1])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_stateful_dataloader_fast_forwards_bit_exact(tmp_path: Path, shm_dir: str, num_workers: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """torchdata's StatefulDataLoader is resumed by its own state (no batch loaded again: the
    dataset's ``__getitem__`` is counted), its workers' random streams included."""
    loads: list[int] = []
    original = Draws.__getitem__

    def counted(self: Draws, i: int) -> torch.Tensor:
        loads.append(i)
        return original(self, i)
    monkeypatch.setattr(Draws, "__getitem__", counted)
    make = stateful(num_workers)
    resumed_equals_uninterrupted(make, tmp_path, [2, 4, -1, 6])
    if num_workers == 0:  # loads in this process: the resumed loop loaded only what came after the save
        loads.clear()
        root = str(tmp_path / "count")
        with nc.Checkpointer(root) as ck:
            _loop(make, ck, epochs=2, stop=2)
        loads.clear()
        with nc.Checkpointer(root) as ck:
            _loop(make, ck, epochs=2, restore=True)
        assert len(loads) == 14 * 2 - 2 * BATCH


@pytest.mark.parametrize("saved, now", [(2, 0), (0, 2)])
def test_a_stateful_dataloader_resumed_with_other_workers_is_refused_naming_them(
        tmp_path: Path, shm_dir: str, saved: int, now: int) -> None:
    """torchdata keeps a loader's position per worker: resumed mid-epoch with another num_workers it
    failed at the first batch with its own assertion; the restore names both counts and the fix."""
    root = str(tmp_path / "ck")
    with nc.Checkpointer(root) as ck:
        _loop(stateful(saved), ck, epochs=2, stop=2)
    loop = nc.LoopState(stateful(now)())
    named = f"num_workers={saved}.*num_workers={now}"
    with nc.Checkpointer(root) as ck, pytest.raises(nc.ValidationError, match=named):
        ck.load_latest(into={"loop": loop})
    assert (loop.epoch, loop.batch, loop.step) == (0, 0, 0)  # the loop is as it was
    with nc.Checkpointer(root) as ck:  # at an epoch's end the workers may change
        _loop(stateful(saved), ck, epochs=2, stop=-1)
    with nc.Checkpointer(root) as ck:
        assert _loop(stateful(now), ck, epochs=2, restore=True)


def test_the_state_is_typed_leaves_without_pickle(tmp_path: Path, shm_dir: str) -> None:
    """Counters stay ints, the streams are tensors and NumPy arrays: no pickle in the manifest, and a
    Checkpointer that refuses pickle (the default) saves and restores it."""
    root = str(tmp_path / "ck")
    with nc.Checkpointer(root) as ck:
        _loop(plain(), ck, epochs=2, stop=5)
        step, tree = ck.read()
    assert step == 5
    loop = tree["loop"]
    for k in ("epoch", "batch", "step", "layout"):
        assert type(loop[k]) is int, (k, loop[k])
    assert (loop["epoch"], loop["batch"], loop["step"]) == (1, 1, 5) and loop["epoch_done"] is False
    streams = loop["now"]["streams"]
    assert streams["torch"].dtype == torch.uint8 and streams["python"]["state"].shape == (625,)
    assert isinstance(streams["numpy"]["key"], np.ndarray) and streams["numpy"]["key"].dtype == np.uint32
    manifest = next(Path(root).glob("step-5/manifest.json")).read_text()
    assert "pickle" not in manifest
    restored = nc.LoopState(plain()())
    with nc.Checkpointer(root, read_only=True) as ck:
        ck.load_latest(into={"loop": restored})
    assert (restored.epoch, restored.batch, restored.step) == (1, 1, 5)
    assert all(type(v) is int for v in (restored.epoch, restored.batch, restored.step))


def test_the_random_streams_come_back_at_load(tmp_path: Path, shm_dir: str) -> None:
    """Right after ``load_latest`` (before any batch), every global stream is where it was at the save."""
    with nc.Checkpointer(str(tmp_path / "ck")) as ck:
        seed_all(7)
        torch.rand(3), np.random.rand(3), random.random()
        ck.save(0, {"loop": nc.LoopState()})
        want = (torch.rand(4).tolist(), np.random.rand(4).tolist(), [random.random() for _ in range(4)],
                np.random.normal())
        seed_all(1)
        ck.load_latest(into={"loop": nc.LoopState()})
        got = (torch.rand(4).tolist(), np.random.rand(4).tolist(), [random.random() for _ in range(4)],
               np.random.normal())
    assert got == want


def test_gaussian_caches_of_numpy_and_python_come_back(tmp_path: Path, shm_dir: str) -> None:
    """``np.random.normal`` and ``random.gauss`` keep a second value between calls: it is part of the state."""
    with nc.Checkpointer(str(tmp_path / "ck")) as ck:
        seed_all(3)
        np.random.standard_normal(), random.gauss(0, 1)  # one value of each pair drawn: the other is cached
        ck.save(0, {"loop": nc.LoopState()})
        want = (np.random.standard_normal(), random.gauss(0, 1))
        seed_all(4)
        ck.load_latest(into={"loop": nc.LoopState()})
        assert (np.random.standard_normal(), random.gauss(0, 1)) == want


def test_a_loader_of_another_length_is_said(tmp_path: Path, shm_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    root = str(tmp_path / "ck")
    with nc.Checkpointer(root) as ck:
        _loop(plain(), ck, epochs=2, stop=2)
    loop = nc.LoopState(plain(n=30)())
    with nc.Checkpointer(root) as ck, caplog.at_level(logging.WARNING, logger="nebula_ckpt"):
        ck.load_latest(into={"loop": loop})
    assert any("8 batches per epoch, the checkpoint's had 4" in r.getMessage() for r in caplog.records), caplog.text
    assert next(iter(loop)).shape == (BATCH, 4)  # goes on, by batches


class DrawnStream(torch.utils.data.IterableDataset):
    """14 items in an order drawn from torch's global stream of the process iterating it (a worker's,
    split between the workers), each with one draw of every global stream; no state of its own."""

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        for j, i in enumerate(torch.randperm(14).tolist()):
            if j % nw == wid:
                yield torch.tensor([float(i), float(np.random.normal()), random.random(), float(torch.rand(()))],
                                   dtype=torch.float64)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_stateful_dataloader_over_an_iterable_dataset_resumes_bit_exact(tmp_path: Path, shm_dir: str,
                                                                         num_workers: int) -> None:
    """An ``IterableDataset`` without a ``state_dict`` is fast-forwarded by torchdata (its iterator made
    again, the items it had yielded dropped): the resumed epoch goes on after the last item seen (never
    from its first again), its order and every draw as in a loop that never stopped."""
    sdl = pytest.importorskip("torchdata.stateful_dataloader")

    def make() -> Any:
        return sdl.StatefulDataLoader(DrawnStream(), batch_size=BATCH, num_workers=num_workers)
    resumed_equals_uninterrupted(make, tmp_path, [2, 5, -1])


def _rolled_back(make: Loader, ck: nc.Checkpointer, at: int, back: int, mode: str) -> Seen:
    """The loop of :func:`_loop` saving every step, which at step ``at`` loads step ``back`` into its
    state (a rollback) and then goes on (``mode`` "continue") or leaves the epoch (``"break"``)."""
    seed_all(0)
    loop = nc.LoopState(make())
    state = {"loop": loop}
    seen: Seen = []
    for epoch in loop.epochs(2):
        for batch in loop:
            assert epoch == loop.epoch
            seen.append((epoch, loop.batch, loop.step, batch.flatten().tolist(), float(np.random.normal()),
                         random.random(), float(torch.rand(()))))
            ck.save(loop.step, state)
            if loop.step == at and len(seen) == at:
                ck.load(back, into=state)
                assert loop.step == back
                if mode == "break":
                    break
    return seen


def persistent() -> Any:
    return torch.utils.data.DataLoader(Indices(), batch_size=BATCH, shuffle=True, num_workers=2,
                                       persistent_workers=True)


@pytest.mark.parametrize("mode", ["continue", "break"])
@pytest.mark.parametrize("make", [plain(), plain(2), persistent, stateful(0), stateful(2)],
                         ids=["plain", "plain-workers", "persistent-workers", "stateful", "stateful-workers"])
def test_a_rollback_inside_the_loop_goes_on_from_the_loaded_step(tmp_path: Path, shm_dir: str, make: Loader,
                                                                 mode: str) -> None:
    """``ck.load(n, into=state)`` in the loop's body, then ``continue`` or ``break``: the loop goes on
    with step n's next batch and draws, in step n's epoch (back within the epoch, and from the
    second epoch into the first), as a loop resumed from step n in a new process does."""
    with nc.Checkpointer(str(tmp_path / "ref")) as ck:
        want = _loop(make, ck, epochs=2)
    for at, back in [(3, 1), (7, 2)]:
        with nc.Checkpointer(str(tmp_path / f"{mode}{at}"), keep_last=10, memory_tier=False) as ck:
            got = _rolled_back(make, ck, at, back, mode)
        assert got == want[:at] + want[back:], f"rolled back from step {at} to {back}: other batches or draws"


def test_iterating_without_a_loader_is_a_clear_error() -> None:
    with pytest.raises(nc.ValidationError, match=r"LoopState\(loader\)"):
        next(iter(nc.LoopState()))


def test_a_loop_that_breaks_out_goes_on_from_where_it_broke(shm_dir: str) -> None:
    """A ``break`` (a step budget) is a pause: the next ``for batch in loop`` goes on in the same epoch."""
    def epoch(stop_at: Optional[int]) -> list[list[float]]:
        seed_all(0)
        loop = nc.LoopState(plain()())
        got = []
        for batch in loop:
            got.append(batch[:, 0].tolist())
            if loop.batch == stop_at:
                break
        assert (loop.epoch, loop.batch) == (0, stop_at or 4)
        for batch in loop:
            got.append(batch[:, 0].tolist())
        return got
    assert epoch(2) == epoch(None)[:4]


@pytest.mark.gpu
def test_every_cuda_device_stream_comes_back(tmp_path: Path, shm_dir: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.cuda.init()
    with nc.Checkpointer(str(tmp_path / "ck")) as ck:
        torch.cuda.manual_seed_all(11)
        ck.save(0, {"loop": nc.LoopState()})
        want = [torch.rand(3, device=f"cuda:{i}").tolist() for i in range(torch.cuda.device_count())]
        torch.cuda.manual_seed_all(12)
        ck.load_latest(into={"loop": nc.LoopState()})
        got = [torch.rand(3, device=f"cuda:{i}").tolist() for i in range(torch.cuda.device_count())]
    assert got == want


@pytest.mark.parametrize("n", [None, 2.5, "3", -1, True], ids=["none", "float", "str", "negative", "bool"])
def test_epochs_of_anything_but_an_int_is_refused_at_the_call(n: Any) -> None:
    """``epochs(None)`` was a raw TypeError at the first ``next``; ``epochs(2.5)`` ran 3 epochs."""
    loop = nc.LoopState([1, 2])
    with pytest.raises(nc.ValidationError, match=r"LoopState.epochs\(n\): n must be an int >= 0.*loop.epochs\(10\)"):
        loop.epochs(n)  # at the call, not at the first epoch
    assert [e for e in loop.epochs(np.int64(2))] == [0, 1] and list(nc.LoopState([1]).epochs(0)) == []


def test_a_loader_that_is_not_iterable_is_refused_at_construction() -> None:
    """``LoopState(5)`` was accepted and failed at the first batch with a raw TypeError."""
    with pytest.raises(nc.ValidationError, match="LoopState: loader must be a data loader.*got int 5"):
        nc.LoopState(5)


@pytest.mark.parametrize("one_shot", [lambda: (x for x in range(3)), lambda: iter([0, 1, 2]),
                                      lambda: iter(torch.utils.data.DataLoader(list(range(3))))],
                         ids=["generator", "list-iterator", "dataloader-iterator"])
def test_a_one_shot_iterator_is_refused_naming_the_fix(one_shot: Callable[[], Any]) -> None:
    """A generator's second epoch was empty without a word (the docs say: any re-iterable)."""
    with pytest.raises(nc.ValidationError, match="one-shot iterator.*the DataLoader itself, a list of batches"):
        nc.LoopState(one_shot())
    loop = nc.LoopState([0, 1, 2])  # a re-iterable: every epoch has its batches
    assert [list(loop) for _ in loop.epochs(2)] == [[0, 1, 2], [0, 1, 2]]


@pytest.mark.parametrize("state,says", [(None, "state must be the dict LoopState.state_dict"),
                                        ([1], "state must be the dict LoopState.state_dict"),
                                        ({"layout": 1}, r"state lacks key\(s\) \['epoch'")],
                         ids=["none", "list", "missing-keys"])
def test_load_state_dict_of_no_loop_state_is_refused_changing_nothing(state: Any, says: str) -> None:
    """``load_state_dict(None)`` was a raw AttributeError."""
    loop = nc.LoopState([0, 1, 2])
    loop.step = 7
    with pytest.raises(nc.ValidationError, match=says):
        loop.load_state_dict(state)
    assert (loop.epoch, loop.batch, loop.step) == (0, 0, 7)
