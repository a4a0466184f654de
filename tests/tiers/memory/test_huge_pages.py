"""The one ``huge_pages`` knob (``NEBULA_HUGE_PAGES``) says where transparent huge pages are
advised: unset, only for a memory-tier copy pulled from a partner at restore (a receive buffer);
``1``, also for staging buffers; ``0``, nowhere. Read from the kernel's own flags of each mapping
(``VmFlags: hg`` in ``/proc/self/smaps``: ``MADV_HUGEPAGE`` was given)."""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Optional

import pytest

from nebula_ckpt import knobs
from nebula_ckpt.save.slots import fresh_anonymous
from nebula_ckpt.tiers.memory import replica_pull

SIZE = 4 << 20

pytestmark = pytest.mark.skipif(not (hasattr(mmap, "MADV_HUGEPAGE") and os.path.exists("/proc/self/smaps")),
                                reason="transparent huge pages are a Linux feature")


def _advised(m: mmap.mmap) -> bool:
    """Whether the mapping ``m`` carries ``MADV_HUGEPAGE`` (its ``VmFlags`` hold ``hg``)."""
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    inside: Optional[bool] = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif head == "VmFlags:" and inside:
                return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping at {addr:#x} in /proc/self/smaps")


def _receive_buffer() -> bool:
    m = replica_pull._anonymous(SIZE)  # where a copy pulled from a partner lands
    try:
        return _advised(m)
    finally:
        m.close()


def _staging_buffer() -> bool:
    slot = fresh_anonymous(SIZE)
    try:
        return _advised(slot._mm)
    finally:
        slot.free()


@pytest.mark.parametrize("value,receive,staging", [(None, True, False), (True, True, True), (False, False, False)],
                         ids=["unset", "on", "off"])
def test_one_knob_says_where_huge_pages_are_advised(value: Optional[bool], receive: bool, staging: bool) -> None:
    with knobs.override(huge_pages=True):
        if not _receive_buffer():
            pytest.skip("this kernel takes no MADV_HUGEPAGE (no transparent huge pages)")
    with knobs.override(huge_pages=value):
        assert _receive_buffer() is receive
        assert _staging_buffer() is staging


def test_the_environment_variable_sets_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw, want in (("", None), ("1", True), ("0", False)):
        monkeypatch.setenv("NEBULA_HUGE_PAGES", raw)
        assert knobs.get("huge_pages") is want, raw
