"""File write errors reach Python as OSError with the real errno and the path, on both hot paths."""

from __future__ import annotations

import errno
import os
from typing import Iterator

import pytest
import torch

from nebula_ckpt.native import get_ops
from tmpfs_mount import mounted_tmpfs

MiB = 1 << 20


@pytest.fixture
def tiny_fs(tmp_path) -> Iterator[str]:  # noqa: ANN001
    """A real 4 MiB tmpfs (needs root / CAP_SYS_ADMIN; skipped otherwise)."""
    with mounted_tmpfs(str(tmp_path / "tiny"), "4m") as d:
        yield d


@pytest.mark.parametrize("fsync", [True, False])
def test_full_disk_raises_enospc(ops_path: str, tiny_fs: str, fsync: bool) -> None:
    buf = torch.randint(0, 256, (6 * MiB,), dtype=torch.uint8)
    path = os.path.join(tiny_fs, "shard.bin")
    with pytest.raises(OSError) as ei:
        get_ops().write_file(path, buf, 0, buf.numel(), fsync)
    assert ei.value.errno == errno.ENOSPC, ei.value
    assert ei.value.filename == path
    assert path in str(ei.value)
    assert not os.path.exists(path)  # no torn file left holding the space
    # The file system still works for what fits.
    small = os.path.join(tiny_fs, "small.bin")
    get_ops().write_file(small, buf, 0, 64 * 1024, fsync)
    assert os.path.getsize(small) == 64 * 1024


def test_missing_directory_raises_enoent(ops_path: str, tmp_path) -> None:  # noqa: ANN001
    path = str(tmp_path / "no" / "such" / "x.bin")
    with pytest.raises(FileNotFoundError) as ei:
        get_ops().write_file(path, torch.zeros(10, dtype=torch.uint8), 0, 10, False)
    assert ei.value.errno == errno.ENOENT
    assert ei.value.filename == path


def test_directory_as_file_raises_eisdir(ops_path: str, tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(IsADirectoryError) as ei:
        get_ops().write_file(str(tmp_path), torch.zeros(10, dtype=torch.uint8), 0, 10, False)
    assert ei.value.errno == errno.EISDIR
    assert ei.value.filename == str(tmp_path)
