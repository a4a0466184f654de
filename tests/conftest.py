"""Shared fixtures: both hot paths (native / pure-PyTorch), small models, tier roots."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from typing import Callable, Iterator

import pytest
import torch

from nebula_ckpt import knobs
from nebula_ckpt.native import native_available
from tmpfs_mount import mounted_tmpfs

PATHS = ["native", "fallback"]


@pytest.fixture(params=PATHS)
def ops_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test once on the C++ extension and once on the pure-PyTorch path."""
    if request.param == "native" and not native_available():
        pytest.skip("C++ extension not built (pip install --no-build-isolation -e .)")
    with knobs.override(disable_native=request.param == "fallback"):
        yield request.param


@pytest.fixture
def shm_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private folder standing in for /dev/shm (under /dev/shm when it exists)."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        base = "/dev/shm"
    else:
        base = str(tmp_path_factory.mktemp("shm"))
    d = os.path.join(base, f"nebula-test-{uuid.uuid4().hex[:10]}")
    os.makedirs(d)
    with knobs.override(shm_dir=d):
        yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def small_tmpfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], str]]:
    """Mount real small tmpfs file systems: ``small_tmpfs("8m")`` mounts one on a fresh folder
    and returns its path; each is unmounted after the test (also when it fails). The test is
    skipped where mounting is not permitted (needs root / CAP_SYS_ADMIN)."""
    with contextlib.ExitStack() as stack:
        def mount(size: str) -> str:
            path = str(tmp_path_factory.mktemp("tmpfs"))
            return stack.enter_context(mounted_tmpfs(path, size))
        yield mount


@pytest.fixture
def root(tmp_path, shm_dir) -> str:  # noqa: ANN001
    """A checkpoint root on local disk, with the memory tier redirected to a private folder."""
    return str(tmp_path / "ckpt")


class TinyNet(torch.nn.Module):
    """Small model with a buffer (BatchNorm) and tied weights."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.lin = torch.nn.Linear(16, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.head = torch.nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(torch.relu(self.lin(self.emb(idx)))))


def make_training(seed: int = 0) -> tuple[TinyNet, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched


def train_step(model: TinyNet, opt: torch.optim.Optimizer, sched: object, step: int) -> float:
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, 32, (8,), generator=g)
    loss = torch.nn.functional.cross_entropy(model(idx), idx)
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()  # type: ignore[attr-defined]
    return float(loss)
