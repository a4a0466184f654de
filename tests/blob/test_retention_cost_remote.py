"""A save's retention on a blob tier reads no step it knows: the requests of one save do not grow
with the steps the tier keeps (Azurite, moto S3 and fsspec's memory://)."""

from __future__ import annotations

from typing import Any

import nebula_ckpt as nc
from counting import CountingReads, reads_per_save
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.storage.remote.registry import storage_class_for

from .conftest import Store


class CountingRemoteTier(nc.RemoteTier):
    """A remote tier whose storage counts (``storage``, once opened)."""

    storage: "Any | None" = None

    def make_storage(self) -> Storage:
        backend = storage_class_for(self.url)
        st: Any = type(f"Counting{backend.__name__}", (CountingReads, backend), {})(
            self.url, self.storage_options, compression=self.compression)
        st.reads = []
        self.storage = st
        return st


def test_a_saves_requests_on_a_blob_tier_do_not_grow_with_the_steps_kept(any_store: Store, shm_dir: str) -> None:
    url, opts = any_store.url("run"), any_store.storage_options
    tier = CountingRemoteTier(url, storage_options=opts, keep_every=2)
    with nc.Checkpointer(url, storage_options=opts, tiers=[tier], keep_last=2) as ck:
        reads = reads_per_save(ck, tier, range(1, 25))
        assert len(ck.list()) >= 12
    assert len(reads[24]) <= len(reads[8]), (reads[8], reads[24])
    for s in range(8, 25):  # nothing of a step it committed before
        assert not [r for r in reads[s] if r.startswith("step-") and not r.startswith(f"step-{s}/")], reads[s]
