"""Incremental checkpoints on blob tiers: Azurite, moto (S3) and fsspec's memory://.

A chain of saves whose large tensor never changes uploads it once; every step restores bit for
bit on a "fresh machine" (the remote tier alone, read through ranged reads of the referenced
shard), and retention keeps the step that holds the frozen bytes.
"""

from __future__ import annotations

from typing import Any

import torch

import nebula_ckpt as nc
from nebula_ckpt import knobs

from .conftest import Store


def test_incremental_chain_round_trips_on_a_blob_tier(any_store: Store, shm_dir: str, tmp_path: Any) -> None:
    url, opts = any_store.url("run"), any_store.storage_options
    frozen = torch.randn(256, 1024, generator=torch.Generator().manual_seed(5))  # 1 MiB
    train = torch.zeros(1024)
    want: dict[int, torch.Tensor] = {}
    with knobs.override(incremental_full_every=3), \
            nc.Checkpointer(url, storage_options=opts, keep_last=2) as ck:
        remote = next(t.name for t in ck.tiers if t.kind == "remote")
        for step in range(5):
            train += 1
            h = ck.save(step, {"frozen": frozen, "train": train, "step": step})
            want[step] = train.clone()
            up = h.metrics.written_bytes[remote]
            assert (up == h.metrics.bytes) if step % 3 == 0 else (up < 16 << 10), (step, up)
            if step == 2:  # keep_last=2, and step 0 holds the frozen bytes steps 1 and 2 refer to
                assert sorted(ck.list()) == [0, 1, 2]
        assert sorted(ck.list()) == [3, 4]  # step 3 is full: nothing refers to 0..2 any more
    fresh_shm = tmp_path / "fresh-shm"
    fresh_shm.mkdir()
    with knobs.override(shm_dir=str(fresh_shm)), \
            nc.Checkpointer(url, storage_options=opts, tiers=[nc.RemoteTier(url, storage_options=opts)],
                            read_only=True) as r:
        for step in (3, 4):
            got, state = r.read(step)
            assert got == step and torch.equal(state["frozen"], frozen) and torch.equal(state["train"], want[step])


def test_a_removed_base_goes_when_a_later_process_removes_its_referrers(any_store: Store, shm_dir: str) -> None:
    """``remove()`` of a step later steps refer to is recorded on the blob tier (``step-N/REMOVED``):
    a later Checkpointer that removes those steps deletes it too, and nothing restores it."""
    url, opts = any_store.url("run"), any_store.storage_options
    frozen = torch.randn(256, 256, generator=torch.Generator().manual_seed(5))

    def state(i: int) -> dict[str, Any]:
        return {"frozen": frozen, "w": torch.full((64,), float(i))}

    with nc.Checkpointer(url, storage_options=opts, keep_last=10, memory_tier=False) as ck:
        for i in (1, 2, 3):
            ck.save(i, state(i))  # 2 and 3 refer to step 1's frozen bytes
        assert ck.remove(1) == [1] and ck.list() == [1, 2, 3]
    storage = nc.RemoteTier(url, storage_options=opts).make_storage()
    try:
        assert storage.exists("step-1/REMOVED")
        with nc.Checkpointer(url, storage_options=opts, keep_last=10, memory_tier=False) as ck:
            assert ck.remove(2) == [2] and ck.remove(3) == [3]
            assert ck.list() == [] and ck.load_latest(into=state(0)) is None
        assert [n for n in storage.list("") if n.startswith("step-")] == []
    finally:
        storage.close()


def test_the_first_save_after_a_restore_never_waits_for_a_store_that_is_down(blob_store: Store, shm_dir: str) -> None:
    """A restarted job restores, then the blob store goes down (stopped, or hung: SIGSTOP): its first
    ``save_async`` returns without touching the store (the restored step is taken up as the next
    save's base by the tier's writer thread, not by the training thread) and the failure comes back
    through the handle (every tier's: a process takes its writer generation on the root before it
    writes anywhere); once the store is back the next save reaches it, whole, and is the one a fresh
    process restores."""
    server = blob_store.server
    assert server is not None
    url, opts = blob_store.url("run"), blob_store.storage_options

    def state(v: float) -> dict[str, Any]:
        return {"w": torch.full((4096,), v)}

    # the store answers slowly on a busy machine: a short deadline only while it is down
    with knobs.override(remote_timeout_s=30.0, remote_retries=4):
        with nc.Checkpointer(url, storage_options=opts) as ck:
            ck.save(0, state(0.0))
            ck.save(1, state(1.0))
        for down, up in ((server.stop, server.start), (server.freeze, server.thaw)):
            ck = nc.Checkpointer(url, storage_options=opts, on_persist_error="log")
            into = state(-1.0)
            assert ck.load_latest(into=into) == 1 and torch.equal(into["w"], state(1.0)["w"])
            remote = next(t.name for t in ck.tiers if t.kind == "remote")
            down()
            try:
                with knobs.override(remote_timeout_s=2.0, remote_retries=2):
                    h = ck.save_async(2, state(2.0))  # never raises for the store: the outage is the handle's
                    h.wait(60)
            finally:
                up()
            assert h.done() and remote in h.metrics.failed, h.metrics.to_dict()
            assert isinstance(h.error(), nc.PersistError)
            with knobs.override(remote_timeout_s=30.0, remote_retries=4):  # the store is back
                h3 = ck.save(3, state(3.0))
                assert remote in h3.tiers_written
                ck.close()
                with nc.Checkpointer(url, storage_options=opts, tiers=[nc.RemoteTier(url, storage_options=opts)],
                                     read_only=True) as r:
                    assert 3 in r.list()
                    got, st = r.read(3)
                    assert got == 3 and torch.equal(st["w"], state(3.0)["w"])
                with nc.Checkpointer(url, storage_options=opts) as ck:  # the next round starts from step 1 again
                    ck.remove(3)
