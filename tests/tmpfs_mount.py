"""A real, small tmpfs mounted on a fresh folder for a test, so that a file system really fills up.

Mounting needs root (or ``CAP_SYS_ADMIN``); where it is not permitted the test is skipped with
the reason, never failed. The mount is always undone, a lazy unmount (``umount -l``) being the
fallback for one still busy (a process of the test still holding a file open).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from typing import Iterator

import pytest


def _umount(path: str) -> None:
    r = subprocess.run(["umount", path], capture_output=True, text=True, timeout=60)
    if r.returncode != 0 and os.path.ismount(path):
        subprocess.run(["umount", "-l", path], capture_output=True, text=True, timeout=60)


@contextlib.contextmanager
def mounted_tmpfs(path: str, size: str) -> Iterator[str]:
    """Mount a tmpfs of ``size`` (``"8m"``) on the folder ``path`` (created); unmount it after.

    Skips the calling test (``pytest.skip``) when mounting is not permitted.
    """
    os.makedirs(path, exist_ok=True)
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", path],
                           capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot mount a tmpfs to fill up ({e}): needs the mount tool and root/CAP_SYS_ADMIN")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill up (needs root/CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield path
    finally:
        _umount(path)


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still allocate on ``path``'s file system."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
