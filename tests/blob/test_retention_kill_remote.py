"""Real SIGKILLs between the deletions of retention on a blob store (Azurite, moto S3): every
committed step stays restorable (see tests/crash/test_retention_kill.py for the local tiers)."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from crash.retention_kills import Zygote, kill_everywhere, zygote_process

from .conftest import Store


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    yield from zygote_process()

@pytest.mark.crash
@pytest.mark.blob
def test_sigkill_between_retention_deletions_on_a_blob_store(zygote: Zygote, tmp_path: Any, blob_store: Store) -> None:
    """A shorter chain than on the local tiers (a blob store is slower; the order is the same code):
    steps 0-2 (1 and 2 refer to 0), then step 3 after a restart keeping one. Azure takes the odd
    kill points, S3 the even ones: together every point is tried on a blob store."""
    kill_everywhere(zygote, str(tmp_path), "remote", blob_store.storage_options, blob_store.url("k"), steps=3,
                    every=2, first=1 if blob_store.kind == "azure" else 2)


