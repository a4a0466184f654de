"""A zstd frame spliced into a compressed object is decoded only to the size its frame table says.

The frame table (``[[raw_bytes, stored_bytes], ...]``, from the manifest) sets the buffer a read
allocates; the frames themselves come from the object, which anyone who can write the store can
replace. A frame whose header declares more raw bytes than the table gives it (a "zstd bomb": a few
KiB of zeros compressed from many MiB) is refused from its header, before a byte is decompressed,
as damage naming the object; a frame that declares no size, or hides more frames behind the first,
is cut off at the first byte past its slot. A restore then skips that step, naming its shard.
"""

from __future__ import annotations

import io
import logging
import struct
import uuid
from typing import Any

import fsspec
import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt.errors import CorruptCheckpointError
from nebula_ckpt.storage.remote import FsspecStorage
from nebula_ckpt.storage.remote.errors import CorruptRemoteDataError

zstd = pytest.importorskip("zstandard", reason="compression='zstd' needs the zstandard package")

MiB = 1 << 20
#: what the bomb decompresses to: far more than the 4 KiB (or 256 KiB) the frame table gives its frame
BOMB_RAW = 64 * MiB


def _bomb(declare_size: bool = True) -> bytes:
    """``BOMB_RAW`` zeros as one zstd frame (about 2 KiB), declaring its size in its header or not."""
    if declare_size:
        return zstd.ZstdCompressor(level=19).compress(bytes(BOMB_RAW))
    out = io.BytesIO()
    params = zstd.ZstdCompressionParameters.from_level(19, write_content_size=False)
    with zstd.ZstdCompressor(compression_params=params).stream_writer(out, closefd=False) as w:
        w.write(bytes(BOMB_RAW))
    return out.getvalue()


def _padded(frame: bytes, size: int) -> bytes:
    """``frame`` followed by a skippable zstd frame, ``size`` bytes in all (the object's stored size)."""
    pad = size - len(frame) - 8
    assert pad >= 0, (len(frame), size)
    return frame + struct.pack("<II", 0x184D2A50, pad) + bytes(pad)


def _no_decompressor(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a zstd decompressor was made for a frame its header already refuses")


def test_a_frame_declaring_more_than_its_slot_is_refused_before_decompressing(monkeypatch: pytest.MonkeyPatch
                                                                               ) -> None:
    st = FsspecStorage(f"memory://nebula-{uuid.uuid4().hex[:12]}", {}, compression="zstd")
    raw = 4096
    bomb = _bomb()
    st.write_small("bomb.bin", bomb)
    info = {"stored_bytes": len(bomb), "compression": "zstd", "raw_bytes": raw, "frames": [[raw, len(bomb)]]}
    with monkeypatch.context() as m:
        m.setattr(zstd, "ZstdDecompressor", _no_decompressor)
        with pytest.raises(CorruptRemoteDataError) as ei:
            st.read_buffer("bomb.bin", info, expected_bytes=raw)
    msg = str(ei.value)
    assert isinstance(ei.value, CorruptCheckpointError) and "bomb.bin" in msg, msg
    assert f"declares {BOMB_RAW} raw bytes, the frame table {raw}" in msg, msg
    # a bomb that declares no size is cut off at the end of its slot (never decoded whole)
    quiet = _bomb(declare_size=False)
    st.write_small("quiet.bin", quiet)
    info = {"stored_bytes": len(quiet), "compression": "zstd", "raw_bytes": raw, "frames": [[raw, len(quiet)]]}
    with pytest.raises(CorruptRemoteDataError, match="quiet.bin.*larger than the frame table says"):
        st.read_buffer("quiet.bin", info, expected_bytes=raw)
    # an honest frame still reads
    data = bytes(range(256)) * 16
    honest = st.write_buffer("honest.bin", memoryview(data))
    assert bytes(st.read_buffer("honest.bin", honest, expected_bytes=len(data))) == data


@pytest.mark.parametrize("declare_size", [True, False], ids=["declared", "undeclared"])
def test_a_bomb_spliced_into_a_shard_is_damage_naming_it_and_restore_falls_back(
        shm_dir: str, caplog: pytest.LogCaptureFixture, declare_size: bool) -> None:
    url = f"memory://nebula-{uuid.uuid4().hex[:12]}"
    gen = torch.Generator().manual_seed(0)
    with nc.Checkpointer(url, tiers=[nc.RemoteTier(url, compression="zstd")]) as ck:
        for s in (1, 2):  # random bytes: stored about as large as raw, room for the bomb
            ck.save(s, {"x": torch.randint(0, 256, (256 << 10,), dtype=torch.uint8, generator=gen)})
    fs = fsspec.filesystem("memory")
    shard = next(p for p in fs.ls(f"{url}/step-2", detail=False) if p.endswith(".safetensors"))
    fs.pipe_file(shard, _padded(_bomb(declare_size), fs.size(shard)))  # same stored size: the table holds
    caplog.set_level(logging.WARNING, logger="nebula_ckpt")
    x = torch.zeros(256 << 10, dtype=torch.uint8)
    with nc.Checkpointer(url, tiers=[nc.RemoteTier(url, compression="zstd")], read_only=True) as ck:
        assert ck.load_latest(into={"x": x}) == 1
    name = shard.rsplit("/", 1)[1]
    said = "declares 67108864 raw bytes" if declare_size else "larger than the frame table says"
    assert any(name in r.getMessage() and said in r.getMessage() for r in caplog.records), caplog.text
