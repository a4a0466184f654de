"""A step saved again replaces the committed one only once the new save is committed.

The new save writes its files beside the committed ones under names of their own
(``shard-g<G>-r<R>-v<V>.safetensors``, ``manifest-v<V>.json``) and then replaces ``COMMIT`` by one
naming its manifest, in one atomic write (then the manifest gets its usual name back). A save
that fails on the way (a full disk, a blob store down) leaves the committed step whole and
restorable, bit for bit, and nothing of itself behind; the steps of an abandoned timeline that
referred to the old bytes stay until the new save commits.
Kills at each point of the protocol: ``tests/crash/test_resave_kill.py``.
"""

from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import nebula_ckpt as nc
from faults import FaultyStorage, FaultyTier
from nebula_ckpt.errors import CorruptCheckpointError
from nebula_ckpt.format.commit import Commit
from nebula_ckpt.storage.local import LocalStorage
from tmpfs_mount import mounted_tmpfs

MIB = 1 << 20


def _state(v: float, mib: int = 1) -> dict[str, torch.Tensor]:
    return {"w": torch.full((mib * MIB // 4,), float(v))}


def _files(root: str, step: int) -> set[str]:
    return set(os.listdir(os.path.join(root, f"step-{step}")))


def _restored(root: str, step: int, mib: int = 1, **kw: Any) -> torch.Tensor:
    with nc.Checkpointer(root, memory_tier=False, read_only=True, **kw) as ck:
        into = _state(-1.0, mib)
        assert ck.load(step, into) == step
        return into["w"]


def _fill(folder: str) -> str:
    """Fill the file system of ``folder`` up (a real ENOSPC for the next write); the filler's path."""
    path = os.path.join(folder, "filler")
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * MIB)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
        try:
            os.fsync(f.fileno())
        except OSError:
            pass
    return path


def test_a_resave_that_fills_the_disk_keeps_the_committed_step(tmp_path: Path, shm_dir: str) -> None:
    with mounted_tmpfs(str(tmp_path / "small"), "16m") as mnt:
        root = os.path.join(mnt, "root")
        ck = nc.Checkpointer(root, keep_last=1, memory_tier=False, incremental=False)
        ck.save(5, _state(5.0, 2))
        committed = _files(root, 5)
        filler = _fill(mnt)
        with pytest.raises(nc.PersistError) as ei:
            ck.save(5, {**_state(6.0, 2), "ema": torch.ones(MIB)})  # the state grew
        cause: BaseException | None = ei.value
        while cause is not None and not (isinstance(cause, OSError) and cause.errno == errno.ENOSPC):
            cause = cause.__cause__ or cause.__context__
        assert cause is not None, f"not an ENOSPC: {ei.value!r}"
        assert ck.list() == [5]
        assert _files(root, 5) == committed, "the failed save left files behind, or took the committed ones"
        os.unlink(filler)
        assert torch.equal(_restored(root, 5, 2), _state(5.0, 2)["w"])
        # with room again, the step is replaced: only the new write's files are left
        ck.save(5, _state(7.0, 2))
        ck.close()
        assert "manifest" not in json.loads(Path(root, "step-5", "COMMIT").read_text())  # its usual name again
        shard = json.loads(Path(root, "step-5", "manifest.json").read_text())["shards"][0]["file"]
        assert shard.startswith("shard-g1-r0-v") and _files(root, 5) == {"COMMIT", "manifest.json", shard}
        assert torch.equal(_restored(root, 5, 2), _state(7.0, 2)["w"])


def test_a_resave_during_a_blob_outage_keeps_the_committed_step(shm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from blob.servers import MotoServer, ServerUnavailable

    monkeypatch.setenv("NEBULA_REMOTE_TIMEOUT_S", "3")
    monkeypatch.setenv("NEBULA_REMOTE_RETRIES", "1")
    try:
        srv = MotoServer()
    except ServerUnavailable as e:
        pytest.skip(f"moto_server unavailable: {e}")
    try:
        loc = srv.new_container("resave")
        url, so = loc.url("run"), loc.storage_options
        ck = nc.Checkpointer(url, storage_options=so, memory_tier=False, keep_last=1)
        ck.save(5, _state(5.0))
        st = next(w for w in ck._saves.writers if w.tier.persistent).storage  # noqa: SLF001 - the blob tier's
        fired = threading.Event()
        upload = st.write_buffer

        def outage_as_the_upload_begins(rel: str, *a: Any, **kw: Any) -> Any:
            if rel.startswith("step-5/") and not fired.is_set():
                fired.set()
                srv.stop()
            return upload(rel, *a, **kw)

        st.write_buffer = outage_as_the_upload_begins
        with pytest.raises(nc.PersistError):
            ck.save(5, _state(6.0))
        assert fired.is_set()
        srv.start()  # the outage is over
        st.write_buffer = upload
        with nc.Checkpointer(url, storage_options=so, memory_tier=False, read_only=True) as fresh:
            assert fresh.list() == [5]
            into = _state(-1.0)
            assert fresh.load_latest(into=into) == 5
            assert torch.equal(into["w"], _state(5.0)["w"])
        ck.save(5, _state(7.0))  # and once the store is back, the step is replaced
        ck.close()
        with nc.Checkpointer(url, storage_options=so, memory_tier=False, read_only=True) as fresh:
            into = _state(-1.0)
            assert fresh.load_latest(into=into) == 5
            assert torch.equal(into["w"], _state(7.0)["w"])
    finally:
        srv.close()


class _AnyManifest(FaultyStorage):
    """:class:`FaultyStorage` whose stage ``manifest`` is a manifest of any name (``manifest-v<V>.json``)."""

    def write_small(self, rel: str, data: bytes, *, create_only: bool = False) -> None:
        name = rel.rsplit("/", 1)[-1]
        if name.startswith("manifest"):
            self._stage("manifest", rel)
        elif name == "COMMIT":
            self._stage("commit", rel)
        LocalStorage.write_small(self, rel, data, create_only=create_only)


class _Faulty(FaultyTier):
    def make_storage(self) -> LocalStorage:
        return _AnyManifest(self.path, self.fail_at, self.pause_at, self.gate, self.reached, self.fail_steps)


def test_the_steps_referring_to_a_resaved_step_stay_until_its_new_save_commits(root: str, shm_dir: str) -> None:
    """Steps 5 and 6 (6 incremental on 5); the job goes back to step 5 and saves it again. A failed
    save keeps both whole; a committed one drops 6 (its bytes were the old 5's) and the old files."""
    frozen = torch.randn(256 * 1024)

    def state(v: float) -> dict[str, torch.Tensor]:
        return {"frozen": frozen.clone(), "w": torch.full((1000,), v)}

    tier = _Faulty(root, fail_steps={5})
    ck = nc.Checkpointer(root, tiers=[tier], keep_last=5)
    ck.save(5, state(5.0))
    ck.save(6, state(6.0))
    assert json.loads(Path(root, "step-6", "manifest.json").read_text())["shards"][1]["step"] == 5  # refers to 5
    before = {5: _files(root, 5), 6: _files(root, 6)}
    for stage in ("shard", "manifest", "commit"):
        tier.fail_at = ck._saves.writers[0].storage.fail_at = stage  # noqa: SLF001 - the tier's storage
        with pytest.raises(nc.PersistError):
            ck.save(5, state(50.0))
        assert ck.list() == [5, 6], stage
        assert {5: _files(root, 5), 6: _files(root, 6)} == before, stage
    for s in (5, 6):
        with nc.Checkpointer(root, memory_tier=False, read_only=True) as fresh:
            _, got = fresh.read(s)
        assert torch.equal(got["w"], torch.full((1000,), float(s))) and torch.equal(got["frozen"], frozen)
    ck._saves.writers[0].storage.fail_at = None  # noqa: SLF001
    ck.save(5, state(50.0))
    ck.close()
    assert nc.Checkpointer(root, memory_tier=False, read_only=True).list() == [5]
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as fresh:
        _, got = fresh.read(5)
    assert torch.equal(got["w"], torch.full((1000,), 50.0))
    assert "shard-g1-r0.safetensors" not in _files(root, 5) and len(_files(root, 5)) == 3


def test_a_first_save_writes_the_marker_of_every_earlier_version(root: str, shm_dir: str) -> None:
    """A step saved once has today's files and a marker without ``manifest`` (what every earlier
    reader reads); a marker naming something other than a manifest file is refused."""
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(3, _state(3.0))
    assert _files(root, 3) == {"COMMIT", "manifest.json", "shard-g1-r0.safetensors"}
    marker = json.loads(Path(root, "step-3", "COMMIT").read_text())
    assert "manifest" not in marker
    for bad in ("../step-2/manifest.json", "ranks.json", "manifest-vXYZ.json", 7):
        with pytest.raises(CorruptCheckpointError, match="manifest"):
            Commit.parse(json.dumps({**marker, "manifest": bad}).encode(), "step 3")


def test_a_resave_drops_the_steps_that_refer_to_the_dropped_ones_too(root: str, shm_dir: str) -> None:
    """Steps 6 to 9 each changed a quarter of step 5 (so each refers to 5); step 10 changed the
    last quarter and refers to 6 to 9, not to 5. Saving step 5 again drops 6 to 9 (they refer to
    the old 5's bytes), and so step 10 too, which refers to their shards: no step stays listed
    that cannot be restored."""
    state = {**{k: torch.randn(64 * 1024) for k in "abcd"}, "w": torch.zeros(1000)}
    with nc.Checkpointer(root, memory_tier=False, keep_last=10) as ck:
        ck.save(5, state)
        for step, k in zip((6, 7, 8, 9, 10), "wabcd", strict=True):
            state = dict(state, **{k: state[k] + 1})
            ck.save(step, state)
        refs10 = {sh.get("step") for sh in json.loads(Path(root, "step-10", "manifest.json").read_text())["shards"]}
        assert 5 not in refs10 and refs10 & {6, 7, 8, 9}, refs10
        ck.save(5, {k: v - 1 for k, v in state.items()})
        assert ck.list() == [5]
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
        assert ck.list() == [5]
        _, got = ck.read(5)
    assert torch.equal(got["a"], state["a"] - 1)
