"""The incremental-checkpoint benchmark runs end to end at its ``--quick`` size (its figures are for
the report; what is checked here is what cannot be noise: bytes, bit-exact restores)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft", reason="peft is not installed (pip install peft)")

from benchmarks import incremental  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_run_writes_the_adapter_not_the_base(tmp_path: Path, shm_dir: str) -> None:
    out = tmp_path / "out"
    # one save per training step, one throughput round; one compute thread (on 2 shared cores a second
    # one spins in OpenMP barriers): the bytes and restores checked below are the same
    threads = torch.get_num_threads()
    try:
        assert incremental.main(["--quick", "--interval", "1", "--steps", "1", "--threads", "1",
                                 "--target", str(tmp_path), "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    doc = json.loads((out / "results.json").read_text())
    state, changed = doc["workload"]["state_bytes"], doc["trainable"]["changed_bytes_per_step"]
    assert changed < state / 10
    disk = doc["setups"]["disk"]["systems"]
    assert set(disk) == set(incremental.SYSTEMS)
    for name, r in disk.items():
        assert r["status"] == "ok", (name, r.get("reason"))
        assert r["restore_bit_exact"], name
        assert len(r["saves"]) == 3
    inc, full = disk["nebula_incremental"], disk["nebula_full"]
    assert inc["first"]["bytes"] >= state and full["first"]["bytes"] >= state   # the base: whole
    assert full["later_bytes"]["min"] >= state                                   # incremental=False
    assert inc["later_bytes"]["max"] <= changed + 64 * 1024                      # what changed, + metadata
    assert disk["torch_save"]["later_bytes"]["min"] >= state
    assert disk["torch_save_adapters"]["later_bytes"]["max"] < state / 10
    remote = doc["setups"]["remote"]
    if not remote.get("unavailable"):   # Azurite installed (scripts/install_blob_servers.sh)
        r = remote["systems"]
        assert r["nebula_incremental"]["status"] == "ok" and r["nebula_full"]["status"] == "ok"
        assert r["nebula_incremental"]["restore_bit_exact"] and r["nebula_full"]["restore_bit_exact"]
        assert r["nebula_incremental"]["later_bytes"]["max"] <= changed + 64 * 1024
        assert r["nebula_full"]["later_bytes"]["min"] >= state
        assert r["torch_save"]["status"] == "unavailable"
    memory = doc["setups"]["memory"]
    if not memory.get("unavailable"):   # a writable /dev/shm: bytes a step holds in the tmpfs
        m = memory["systems"]
        assert m["nebula_incremental"]["restore_bit_exact"] and m["nebula_full"]["restore_bit_exact"]
        assert m["nebula_incremental"]["first"]["bytes"] >= state
        assert m["nebula_incremental"]["later_bytes"]["max"] <= changed + 64 * 1024
        assert m["nebula_full"]["later_bytes"]["min"] >= state
        assert m["torch_save"]["status"] == "unavailable"
    text = (out / "results.md").read_text()
    assert "| nebula_incremental |" in text and "python -m benchmarks.incremental --quick" in text
    assert "writes <= 2% of a full save's bytes" in text
