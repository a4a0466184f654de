"""Hostile pointer files and the roots they name: a read never writes, odd files never hang a read,
names built from tags and paths stay within NAME_MAX.

A pointer file names a root; whoever can write the pointer can name any folder. Every read path
(Lightning's ``load_checkpoint`` and plugin, ``nebula-ckpt ls / verify / inspect``, Hugging Face's
``get_last_checkpoint`` / ``export_pretrained`` / ``to_hf_checkpoint``, DeepSpeed's
``materialize``, ``torch_nebula``'s ``persist_path=`` getters) must leave the file tree exactly as
it was: no root folder, no ``_nebula/run.json``, no memory-tier folder or lock file.
"""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import threading
from typing import Any, Callable

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt import cli

pl = pytest.importorskip("pytorch_lightning", reason="PyTorch Lightning is not installed")

from nebula_ckpt.integrations.lightning import (  # noqa: E402
    POINTER_FORMAT,
    NebulaCheckpointIO,
    load_checkpoint,
    read_pointer,
)

Tree = dict[str, tuple[str, int, int]]


def _tree(*folders: str) -> Tree:
    """Every entry under ``folders``: kind, size and modification time (a file written shows)."""
    out: Tree = {}
    for top in folders:
        for dirpath, dirs, files in os.walk(top):
            for n in dirs + files:
                p = os.path.join(dirpath, n)
                st = os.lstat(p)
                out[p] = (stat.filemode(st.st_mode)[0], st.st_size if not stat.S_ISDIR(st.st_mode) else 0,
                          st.st_mtime_ns if stat.S_ISREG(st.st_mode) else 0)
    return out


def _crafted(tmp_path: Any, victim: str) -> str:
    """A Lightning pointer file naming the root ``victim``."""
    p = str(tmp_path / "ckpts" / "epoch=1.ckpt")
    os.makedirs(os.path.dirname(p), exist_ok=True)
    with open(p, "w") as f:
        json.dump({"format": POINTER_FORMAT, "root": victim, "step": 0, "tag": "epoch=1.ckpt"}, f)
    return p


#: what a read through a pointer to nothing committed says: the root it names is gone, or holds no
#: committed checkpoint of it
NOTHING = "no committed checkpoint|no longer exists"


def _lightning_function(tmp_path: Any, victim: str, ptr: str) -> None:
    with pytest.raises(FileNotFoundError, match=NOTHING):
        load_checkpoint(ptr)


def _lightning_plugin_other_root(tmp_path: Any, victim: str, ptr: str) -> None:
    io = NebulaCheckpointIO(str(tmp_path / "mine"))  # a root of its own, never saved to
    try:
        with pytest.raises(FileNotFoundError, match=NOTHING):
            io.load_checkpoint(ptr)
    finally:
        io.teardown()


def _lightning_plugin_own_root(tmp_path: Any, victim: str, ptr: str) -> None:
    io = NebulaCheckpointIO(victim)  # e.g. trainer.validate(ckpt_path=...) before any save
    try:
        with pytest.raises(FileNotFoundError, match=NOTHING):
            io.load_checkpoint(ptr)
    finally:
        io.teardown()


def _cli(tmp_path: Any, victim: str, ptr: str) -> None:
    for argv in (["ls", ptr], ["ls", victim], ["ls", "--quick", victim], ["verify", victim], ["verify", ptr],
                 ["inspect", victim, "--step", "0"], ["export", victim, "--step", "0", "--to",
                                                     str(tmp_path / "out.safetensors")]):
        assert cli.main(argv) == 1, argv  # nothing there


def _huggingface(tmp_path: Any, victim: str, ptr: str) -> None:
    hf = pytest.importorskip("nebula_ckpt.integrations.huggingface", reason="transformers is not installed")
    out_dir = os.path.dirname(victim)  # <output_dir>/nebula is the victim root
    assert hf.get_last_checkpoint(out_dir, root=victim) is None
    with pytest.raises(nc.NotFoundError):
        hf.export_pretrained(victim, str(tmp_path / "export"))
    with pytest.raises(nc.NotFoundError):
        hf.to_hf_checkpoint(victim, str(tmp_path / "hf"))


def _compat(tmp_path: Any, victim: str, ptr: str) -> None:
    import nebula_ckpt.compat.torch_nebula as tn

    tn.init(persistent_storage_path=str(tmp_path / "own"))  # creates its own root: not under test
    try:
        before = _tree(str(tmp_path))
        assert tn.get_latest_checkpoint(persist_path=victim) is None
        assert tn.list_checkpoints(persist_path=victim) == []
        with pytest.raises(nc.NotFoundError):
            tn.get_checkpoint("epoch=1.ckpt", persist_path=victim)
        assert tn.get_latest_checkpoint_path(persist_path=victim) is None
        assert _tree(str(tmp_path)) == before
    finally:
        tn.shutdown()


READERS: dict[str, Callable[[Any, str, str], None]] = {
    "lightning_load_checkpoint": _lightning_function,
    "lightning_plugin_other_root": _lightning_plugin_other_root,
    "lightning_plugin_own_root": _lightning_plugin_own_root,
    "cli": _cli,
    "huggingface": _huggingface,
    "torch_nebula_persist_path": _compat,
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim_exists", [False, True], ids=["missing_root", "empty_root"])
@pytest.mark.parametrize("reader", sorted(READERS))
def test_reading_through_a_pointer_creates_nothing(tmp_path, shm_dir: str, reader: str,  # noqa: ANN001
                                                   victim_exists: bool) -> None:
    """A pointer (or a root argument) naming a root that does not exist, or an empty folder: every
    read path fails cleanly and the file tree, /dev/shm included, is exactly what it was."""
    victim = str(tmp_path / "victim" / "nebula")
    if victim_exists:
        os.makedirs(victim)
    elif reader == "torch_nebula_persist_path":
        pytest.skip("torch_nebula refuses a persist_path that does not exist before opening it")
    ptr = _crafted(tmp_path, victim)
    before = _tree(str(tmp_path), shm_dir)
    READERS[reader](tmp_path, victim, ptr)
    after = _tree(str(tmp_path), shm_dir)
    if reader == "torch_nebula_persist_path":  # its own init root, checked inside around the reads
        after = {p: v for p, v in after.items() if not p.startswith(str(tmp_path / "own"))
                 and not p.startswith(shm_dir)}
        before = {p: v for p, v in before.items() if not p.startswith(shm_dir)}
    created = sorted(set(after) - set(before))
    changed = sorted(p for p in before if p in after and before[p] != after[p])
    assert not created and not changed and set(before) <= set(after), (created, changed)


@pytest.mark.timeout(120)
def test_reading_a_real_checkpoint_writes_nothing(tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    """Loading a real pointer (while its writer still holds the memory tier, and after it closed)
    claims, locks and writes nothing in the root or /dev/shm."""
    root = str(tmp_path / "root")
    io = NebulaCheckpointIO(root)
    path = str(tmp_path / "ckpts" / "last.ckpt")
    state = {"epoch": 1, "global_step": 3, "state_dict": {"w": torch.arange(4.0)}}
    io.save_checkpoint(state, path)
    io.wait()
    try:
        before = _tree(str(tmp_path), shm_dir)
        got = load_checkpoint(path)  # a second reader while the writer is live
        assert torch.equal(got["state_dict"]["w"], state["state_dict"]["w"])
        assert cli.main(["ls", root]) == 0
        assert _tree(str(tmp_path), shm_dir) == before
    finally:
        io.teardown()
    before = _tree(str(tmp_path), shm_dir)
    assert torch.equal(load_checkpoint(path)["state_dict"]["w"], state["state_dict"]["w"])
    assert _tree(str(tmp_path), shm_dir) == before


@pytest.mark.timeout(120)
def test_huggingface_last_checkpoint_never_names_a_path_outside_output_dir(tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    """A tag read back from the root becomes ``<output_dir>/<tag>``, which ``train`` opens: a tag
    climbing out of the output dir (valid as a tag: ``.`` and ``/`` are tag characters) is never
    returned, the newest checkpoint inside it is."""
    hf = pytest.importorskip("nebula_ckpt.integrations.huggingface", reason="transformers is not installed")
    out_dir = str(tmp_path / "out")
    root = os.path.join(out_dir, "nebula")
    with nc.Checkpointer(root, keep_last=10) as ck:
        ck.save(3, {"model": {"w": torch.ones(2)}}, tag="checkpoint-3")
        for i, tag in enumerate(("./checkpoint-7", "/abs/checkpoint-8", "../../elsewhere/checkpoint-9")):
            ck.save(7 + i, {"model": {"w": torch.ones(2)}}, tag=tag)
    assert hf.get_last_checkpoint(out_dir) == os.path.join(out_dir, "checkpoint-3")


def test_read_only_checkpointer_refuses_to_write(tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    root = str(tmp_path / "nothing")
    with nc.Checkpointer(root, read_only=True) as ck:
        assert ck.list() == [] and ck.tags() == {} and ck.load_latest() is None
        for call in (lambda: ck.save_async(0, {"a": 1}), lambda: ck.remove(step=0),
                     lambda: ck.prepare({"a": torch.ones(2)})):
            with pytest.raises(nc.NebulaError, match="read-only"):
                call()
    assert not os.path.exists(root) and os.listdir(shm_dir) == []


def _in_thread(fn: Callable[[], Any], seconds: float = 20) -> BaseException:
    """Run ``fn`` (expected to raise) in a thread; its exception, or a failure if it blocks."""
    box: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"blocked for {seconds} s (reading a FIFO?)")
    assert box, "did not raise"
    return box[0]


@pytest.mark.timeout(60)
def test_fifo_and_symlink_loop_at_a_checkpoint_path(tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    """A FIFO planted at a checkpoint path is refused at once (never opened for a blocking read);
    a symlink loop raises naming the path; neither creates anything."""
    fifo = str(tmp_path / "last.ckpt")
    os.mkfifo(fifo)
    loop = str(tmp_path / "loop.ckpt")
    os.symlink(os.path.basename(loop), loop)
    before = _tree(str(tmp_path), shm_dir)
    e = _in_thread(lambda: load_checkpoint(fifo))
    assert isinstance(e, nc.ValidationError) and "not a regular file" in str(e) and fifo in str(e), e
    e = _in_thread(lambda: read_pointer(fifo))
    assert isinstance(e, nc.ValidationError), e
    e = _in_thread(lambda: load_checkpoint(loop))
    assert isinstance(e, OSError) and loop in str(e), e
    io = NebulaCheckpointIO(str(tmp_path / "root"))
    e = _in_thread(lambda: io.load_checkpoint(fifo))
    assert isinstance(e, nc.ValidationError), e
    io.teardown()
    assert _tree(str(tmp_path), shm_dir) == before


@pytest.mark.timeout(120)
def test_longest_file_name_multibyte_pointer(tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    """A checkpoint path whose file name is 255 bytes of multi-byte UTF-8 (Lightning names files
    from metrics): the pointer is written (its temporary name stays within NAME_MAX), read back,
    loaded and removed; the tag stays a valid tag."""
    name = "é" * 124 + "xy.ckpt"  # 248 + 7 bytes
    assert len(name.encode()) == 255
    path = str(tmp_path / "ckpts" / name)
    io = NebulaCheckpointIO(str(tmp_path / "root"))
    try:
        io.save_checkpoint({"epoch": 0, "state_dict": {"w": torch.ones(3)}}, path)
        io.wait()
        assert os.listdir(tmp_path / "ckpts") == [name]
        assert torch.equal(io.load_checkpoint(path)["state_dict"]["w"], torch.ones(3))
        io.remove_checkpoint(path)
        assert io.checkpointer.tags() == {} and os.listdir(tmp_path / "ckpts") == []
    finally:
        io.teardown()


@pytest.mark.timeout(120)
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_deepspeed_hostile_pointers_and_long_tags(tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    """In a DeepSpeed worker process: materialize() of a save_dir whose pointers name a root that
    does not exist creates nothing; a FIFO at a DeepSpeed path is refused at once; a valid tag
    too long for a folder name is refused by create() before anything is written, and by
    restore_pointers() instead of failing with ENAMETOOLONG."""
    from integrations.test_deepspeed import _run

    out = tmp_path / "hostile.json"
    _run(["hostile", 0, tmp_path / "root", tmp_path / "ds", out], shm_dir)
    r = json.loads(out.read_text())
    assert r["materialize"].startswith("NotFoundError") and r["created"] == [], r
    assert r["fifo"].startswith("ValidationError") and "not a regular file" in r["fifo"], r
    assert r["long_tag_create"].startswith("ValidationError") and "255" in r["long_tag_create"], r
    assert r["long_tag_written"] == [], r
    assert r["long_tag_restore"].startswith("ValidationError"), r


def test_json_nested_past_the_parser_at_a_checkpoint_path_is_no_pointer(tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    """A small file at a checkpoint path holding JSON nested deeper than the parser's stack is not
    a pointer (as any other JSON that is not one): None, never a RecursionError."""
    path = str(tmp_path / "deep.ckpt")
    with open(path, "w") as f:
        f.write('{"a": ' + "[" * 30_000 + "]" * 30_000 + "}")
    assert read_pointer(path) is None
    from nebula_ckpt.integrations.pointers import parse_pointer

    with open(path, "rb") as f:
        assert parse_pointer(f.read(), path, POINTER_FORMAT, {}) is None
