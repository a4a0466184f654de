"""The one atomic small-file write (storage.atomic.write_file_atomic) and the writers built on it:
LocalStorage.write_small, the file:// remote tier's write_small and the frameworks' pointer files."""

from __future__ import annotations

import os
import stat

import pytest

from nebula_ckpt.adapters import write_file_atomic
from nebula_ckpt.integrations.pointers import TMP_SUFFIX, write_local_pointer
from nebula_ckpt.storage.local import LocalStorage
from nebula_ckpt.storage.remote import FsspecStorage

LONG = "n" * 250  # a name near NAME_MAX: the temporary file's name must still fit


def _leftovers(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith("."))


def test_replace_create_only_and_no_leftovers(tmp_path) -> None:  # noqa: ANN001
    path = str(tmp_path / "sub" / "f.json")
    write_file_atomic(path, b"one")
    write_file_atomic(path, b"two")
    assert open(path, "rb").read() == b"two"
    with pytest.raises(FileExistsError):
        write_file_atomic(path, b"three", create_only=True)
    assert open(path, "rb").read() == b"two"  # a refused create changes nothing
    write_file_atomic(str(tmp_path / "sub" / "g"), b"new", create_only=True)
    with pytest.raises(TypeError):
        write_file_atomic(path, "not bytes")  # type: ignore[arg-type]
    assert open(path, "rb").read() == b"two"  # a failed write leaves the old file
    assert _leftovers(str(tmp_path / "sub")) == []  # and no temporary file


def test_modes(tmp_path) -> None:  # noqa: ANN001
    old = os.umask(0o027)
    try:
        write_file_atomic(str(tmp_path / "a"), b"x")
        write_file_atomic(str(tmp_path / "b"), b"x", mode=0o644, exact_mode=True)
        write_file_atomic(str(tmp_path / "c"), b"x", mode=0o600)
    finally:
        os.umask(old)
    modes = [stat.S_IMODE(os.stat(tmp_path / n).st_mode) for n in "abc"]
    assert modes == [0o640, 0o644, 0o600]


def test_long_names_in_every_writer(tmp_path) -> None:  # noqa: ANN001
    """Names of 250 bytes: the temporary name stays within NAME_MAX in every writer."""
    st = LocalStorage(str(tmp_path / "local"))
    st.write_small(f"d/{LONG}", b"local")
    assert st.read_small(f"d/{LONG}") == b"local"
    with pytest.raises(FileExistsError):
        st.write_small(f"d/{LONG}", b"again", create_only=True)
    remote = FsspecStorage(f"file://{tmp_path / 'remote'}")
    remote.write_small(f"d/{LONG}", b"remote", create_only=True)
    assert remote.read_small(f"d/{LONG}") == b"remote"
    with pytest.raises(FileExistsError):
        remote.write_small(f"d/{LONG}", b"again", create_only=True)
    remote.close()
    ptr = str(tmp_path / "ptr" / (LONG + ".ckpt"))
    write_local_pointer(ptr, b"pointer")
    assert open(ptr, "rb").read() == b"pointer"
    for folder in (tmp_path / "local" / "d", tmp_path / "remote" / "d", tmp_path / "ptr"):
        assert _leftovers(str(folder)) == []


def test_pointer_temporary_files_carry_the_suffix(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """A pointer being written is never taken for a pointer: its temporary name ends in TMP_SUFFIX."""
    seen: list[str] = []
    real = os.replace

    def spy(src: str, dst: str) -> None:
        seen.append(os.path.basename(src))
        real(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    write_local_pointer(str(tmp_path / "last.ckpt"), b"pointer")
    assert len(seen) == 1 and seen[0].endswith(TMP_SUFFIX) and seen[0].startswith(".last.ckpt.")
