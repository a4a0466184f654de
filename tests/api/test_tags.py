"""Checkpoints addressed by tag, as frameworks do (issue #13): save(tag=), tags(), load / read by
tag, remove(step / tag) from every tier, the tag field of the manifest validated strictly."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt.cli import main
from nebula_ckpt.format import manifest as mf
from nebula_ckpt.format.names import MAX_TAG_CHARS
from test_hostile_manifest import rewrite


def _state(v: float) -> dict[str, object]:
    return {"w": torch.full((4, 4), float(v)), "step": int(v)}


def _manifest(root: str, step: int) -> dict:
    return json.load(open(os.path.join(root, f"step-{step}", "manifest.json")))


def test_tag_is_recorded_and_resolved_to_the_newest_step(root: str) -> None:
    with nc.Checkpointer(root, keep_last=10) as ck:
        ck.save(1, _state(1), tag="epoch=0-step=1.ckpt")
        ck.save(2, _state(2))                                 # untagged
        ck.save(3, _state(3), tag="last")
        ck.save_async(4, _state(4), tag="last").result()      # a tag may name several steps: newest wins
        assert ck.tags() == {"epoch=0-step=1.ckpt": 1, "last": 4}
        assert ck.list() == [1, 2, 3, 4]
        step, back = ck.read(tag="last")
        assert step == 4 and torch.equal(back["w"], torch.full((4, 4), 4.0))
        into = {"w": torch.zeros(4, 4), "step": 0}
        assert ck.load(tag="epoch=0-step=1.ckpt", into=into) == 1
        assert torch.equal(into["w"], torch.full((4, 4), 1.0)) and into["step"] == 1
        assert ck.load(2, into=into) == 2                     # by step, as before
    assert _manifest(root, 3)["tag"] == "last"
    assert "tag" not in _manifest(root, 2)                   # optional: untagged manifests unchanged
    # a new process finds the tags on the persistent tier
    with nc.Checkpointer(root, memory_tier=False) as ck:
        assert ck.tags() == {"epoch=0-step=1.ckpt": 1, "last": 4}


def test_unknown_tag_and_bad_arguments(root: str) -> None:
    with nc.Checkpointer(root) as ck:
        ck.save(1, _state(1), tag="a")
        with pytest.raises(nc.NotFoundError, match="tagged 'b'.*tags: \\['a'\\]"):
            ck.load(tag="b", into={})
        with pytest.raises(nc.NotFoundError, match="tagged 'b'"):
            ck.read(tag="b")
        with pytest.raises(nc.ValidationError, match="either step or tag"):
            ck.load(1, tag="a")
        with pytest.raises(nc.ValidationError, match="either step or tag"):
            ck.load()
        with pytest.raises(nc.ValidationError, match="either step or tag"):
            ck.read(1, tag="a")
        with pytest.raises(nc.ValidationError, match="either step or tag"):
            ck.remove()
        with pytest.raises(nc.ValidationError, match="step must be"):
            ck.load("1")  # type: ignore[arg-type]


@pytest.mark.parametrize("tag", [7, b"x", "", "has space", "quote'", "new\nline", "tab\t", "é", "x" * 257, None])
def test_bad_tags_rejected_before_writing(root: str, tag: object) -> None:
    with nc.Checkpointer(root) as ck:
        if tag is None:  # None means untagged: fine
            ck.save(1, _state(1), tag=None)
            assert ck.tags() == {}
            return
        with pytest.raises(nc.ValidationError, match="^tag ") as e:
            ck.save_async(1, _state(1), tag=tag)  # type: ignore[arg-type]
        assert "A-Z a-z 0-9" in str(e.value) or "must be a str" in str(e.value)
        with pytest.raises(nc.ValidationError, match="^tag "):
            ck.load(tag=tag)  # type: ignore[arg-type]
        assert ck.list() == []
    assert not os.path.exists(os.path.join(root, "step-1"))


def test_long_path_like_tag_is_fine(root: str) -> None:
    tag = "lightning_logs/version_0/checkpoints/epoch=3-step=1200,val_loss=0.12.ckpt"
    with nc.Checkpointer(root) as ck:
        ck.save(1200, _state(1), tag=tag)
        ck.save(1300, _state(2), tag="x" * MAX_TAG_CHARS)
        assert ck.tags() == {tag: 1200, "x" * 256: 1300}


@pytest.mark.parametrize("bad, what", [
    (7, "must be a str"), ("", "is not 1 to 256"), ("a b", "is not 1 to 256"), (None, "must be a str"),
    ("x" * 300, "is not 1 to 256"), (["a"], "must be a str")])
def test_hostile_tag_field_is_refused(root: str, bad: object, what: str) -> None:
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, _state(1), tag="good")
    rewrite(root, lambda m: m.update(tag=bad))
    with nc.Checkpointer(root, memory_tier=False) as ck:
        with pytest.raises(nc.CorruptCheckpointError, match=f"manifest.json: tag .*{what}"):
            ck.load_latest(into={})
        assert ck.tags() == {}                      # not a healthy checkpoint
    assert main(["verify", root]) == 1


def test_manifest_tag_field_round_trips() -> None:
    raw = mf.build_manifest(step=3, generation=1, shards=[{"file": "shard-g1-r0.safetensors", "bytes": 8}],
                            tensors={}, aliases={}, tree={"t": "none"}, stats={}, tag="t-1")
    man = mf.Manifest.parse(json.dumps(raw), "x", step=3)
    assert man.tag == "t-1" and man.to_json()["tag"] == "t-1" and "tag" not in man.extra
    del raw["tag"]
    man = mf.Manifest.parse(json.dumps(raw), "x", step=3)
    assert man.tag is None and "tag" not in man.to_json()


def test_damaged_newest_tagged_step_falls_back_to_an_older_one(root: str) -> None:
    with nc.Checkpointer(root, memory_tier=False, keep_last=5) as ck:
        ck.save(1, _state(1), tag="best")
        ck.save(2, _state(2), tag="best")
        ck.save(3, _state(3), tag="other")
    shard = next(f for f in os.listdir(os.path.join(root, "step-2")) if f.startswith("shard"))
    with open(os.path.join(root, "step-2", shard), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    with nc.Checkpointer(root, memory_tier=False) as ck:
        assert ck.read(tag="best")[0] == 1        # step 2's checksum fails: the older "best"
        with pytest.raises(nc.CorruptCheckpointError, match="checksum mismatch"):
            ck.load(2, into=_state(0))


def test_remove_deletes_from_every_tier_marker_first(root: str, shm_dir: str) -> None:
    removed_order: list[str] = []
    with nc.Checkpointer(root, tiers=[nc.MemoryTier(keep_last=10), nc.LocalTier(root, keep_last=10)]) as ck:
        for s in (1, 2, 3):
            ck.save(s, _state(s), tag="keep" if s == 2 else f"t{s}")
        assert [len(v) for v in ck.list(detailed=True).values()] == [3, 3]   # memory and disk
        st = ck._runtimes[1].storage
        real_remove = st.remove

        def spy(rel: str) -> None:
            removed_order.append(rel)
            real_remove(rel)

        st.remove = spy  # type: ignore[method-assign]
        assert ck.remove(1) == [1]
        assert removed_order[0] == "step-1/COMMIT"                      # the marker goes first
        assert ck.list(detailed=True) == {t.name: [2, 3] for t in ck.tiers}
        assert ck.remove(tag="t3") == [3]
        assert ck.list() == [2] and ck.tags() == {"keep": 2}
        assert not os.path.exists(os.path.join(root, "step-3"))
        with pytest.raises(nc.NotFoundError):
            ck.remove(3)
        with pytest.raises(nc.NotFoundError, match="tagged 'nope'"):
            ck.remove(tag="nope")
        assert ck.load_latest(into={"w": torch.zeros(4, 4), "step": 0}) == 2
        ck.save(4, _state(4))                                            # saving goes on as before
        assert ck.list() == [2, 4]


def test_remove_waits_for_a_save_of_that_step_in_flight(root: str) -> None:
    big = {f"t{i}": torch.randn(512, 512) for i in range(16)}          # 16 MiB: a write takes a while
    with nc.Checkpointer(root, keep_last=10) as ck:
        ck.save(1, _state(1))
        h = ck.save_async(2, big, tag="x")
        assert ck.remove(2) == [2]                 # never touches it half-written: waits, then removes
        assert h.result() and ck.list() == [1]
        h = ck.save_async(3, big, tag="y")
        assert ck.remove(tag="y") == [3]
        assert ck.list() == [1] and ck.tags() == {}
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-1"]


def test_remove_all_steps_of_a_tag_and_retention_goes_on(root: str) -> None:
    with nc.Checkpointer(root, keep_last=2, memory_tier=False) as ck:
        ck.save(1, _state(1), tag="last")
        ck.save(2, _state(2), tag="last")
        assert ck.remove(tag="last") == [1, 2]
        assert ck.list() == [] and ck.load_latest(into={}) is None
        for s in (3, 4, 5):
            ck.save(s, _state(s))
        assert ck.list() == [4, 5]


def test_stale_writer_cannot_remove_the_newer_runs_checkpoints(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "r")
    old = nc.Checkpointer(root, memory_tier=False, keep_last=10)
    old.save(1, _state(1))
    with nc.Checkpointer(root, memory_tier=False, keep_last=10) as new:
        new.save(2, _state(2))                     # a newer writer generation owns the root now
        with pytest.raises(nc.FencedError):
            old.remove(2)
        assert new.list() == [1, 2]
    old.close()


def test_remove_during_concurrent_retention_is_safe(root: str) -> None:
    """remove() on the training thread and retention on writer threads delete one at a time."""
    errors: list[BaseException] = []
    with nc.Checkpointer(root, keep_last=2) as ck:
        for s in range(6):
            ck.save(s, _state(s))

        def saver() -> None:
            try:
                for s in range(6, 30):
                    ck.save_async(s, _state(s))
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        t = threading.Thread(target=saver)
        t.start()
        for s in (4, 5):
            try:
                ck.remove(s)
            except nc.NotFoundError:
                pass  # retention got there first
        t.join()
        ck.wait()
        assert not errors
        assert 4 not in ck.list() and 5 not in ck.list() and ck.list()[-1] == 29


def test_cli_ls_and_inspect_show_tags(root: str, capsys: pytest.CaptureFixture[str]) -> None:
    with nc.Checkpointer(root, memory_tier=False, keep_last=5) as ck:
        ck.save(1, _state(1), tag="epoch=0.ckpt")
        ck.save(2, _state(2))
    assert main(["ls", root, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["tag"]) for r in rows] == [(1, "epoch=0.ckpt"), (2, None)]
    assert main(["ls", root]) == 0
    out = capsys.readouterr().out
    header, *lines = out.splitlines()
    assert header.split()[-3:] == ["tag", "state", "health"]
    by_step = {int(line.split()[1]): line.split() for line in lines}
    assert by_step[1][-3] == "epoch=0.ckpt" and by_step[2][-3] == "-"  # the tag column; untagged: -
    assert main(["inspect", root, "--step", "1"]) == 0
    assert "tag epoch=0.ckpt" in capsys.readouterr().out
    assert main(["inspect", root, "--step", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tag"] == "epoch=0.ckpt"


def test_one_liner_takes_a_tag(root: str) -> None:
    nc.save_async(root, 5, _state(5), tag="five").result()
    nc.close_all()
    with nc.Checkpointer(root) as ck:
        assert ck.tags() == {"five": 5}


def test_public_steps_closed_and_handle_wait(tmp_path) -> None:  # noqa: ANN001
    """What adapters use instead of private state: steps() with their tags, closed, and a
    handle's wait() that reports durability without marking a failure as seen."""
    root = str(tmp_path / "ck")
    ck = nc.Checkpointer(root, memory_tier=False, keep_last=5)
    h = ck.save_async(1, {"w": torch.ones(2)}, tag="one")
    assert h.wait(timeout=60) is True and h.done()
    assert len(h.result()) == 1
    ck.save(2, {"w": torch.ones(2)})
    assert ck.steps() == {1: "one", 2: None} and ck.steps(check_shards=False) == {1: "one", 2: None}
    assert not ck.closed
    ck.close()
    assert ck.closed
