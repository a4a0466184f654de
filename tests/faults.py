"""A local tier that fails (or pauses) at a named stage of the commit protocol.

Used beside the real crash tests, never instead of them.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import nebula_ckpt as nc
from nebula_ckpt.storage.local import LocalStorage

STAGES = ("shard", "manifest", "commit")


class FaultyStorage(LocalStorage):
    def __init__(self, root: str, fail_at: Optional[str], pause_at: Optional[str],
                 gate: Optional[threading.Event], reached: Optional[threading.Event],
                 fail_steps: Optional[set[int]]) -> None:
        super().__init__(root)
        self.fail_at, self.pause_at, self.gate, self.reached = fail_at, pause_at, gate, reached
        self.fail_steps = fail_steps

    def _stage(self, stage: str, rel: str) -> None:
        step = int(rel.split("/")[0].split("-")[1]) if rel.startswith("step-") else None
        if self.pause_at == stage and self.gate is not None:
            assert self.reached is not None
            self.reached.set()
            self.gate.wait(30)
        if self.fail_at == stage and (self.fail_steps is None or step in self.fail_steps):
            raise OSError(f"injected failure at stage '{stage}' writing {rel}")

    def write_buffer(self, rel: str, data: Any) -> dict[str, Any]:
        self._stage("shard", rel)
        return super().write_buffer(rel, data)

    def write_parts(self, rel: str, parts: list[memoryview]) -> dict[str, Any]:  # incremental shards
        self._stage("shard", rel)
        return super().write_parts(rel, parts)

    def write_small(self, rel: str, data: bytes, *, create_only: bool = False) -> None:
        if rel.endswith("manifest.json"):
            self._stage("manifest", rel)
        elif rel.endswith("COMMIT"):
            self._stage("commit", rel)
        super().write_small(rel, data, create_only=create_only)


class FaultyTier(nc.LocalTier):
    """LocalTier whose storage fails at ``fail_at`` (for ``fail_steps``) or pauses at ``pause_at``."""

    def __init__(self, path: str, *, fail_at: Optional[str] = None, pause_at: Optional[str] = None,
                 fail_steps: Optional[set[int]] = None, **kw: Any) -> None:
        super().__init__(path, **kw)
        self.fail_at, self.pause_at, self.fail_steps = fail_at, pause_at, fail_steps
        self.gate = threading.Event()
        self.reached = threading.Event()

    def make_storage(self) -> LocalStorage:
        return FaultyStorage(self.path, self.fail_at, self.pause_at, self.gate, self.reached, self.fail_steps)


def renumber_step(folder: str, step: int, new_step: int) -> None:
    """Copy committed ``step`` of the tier folder ``folder`` as a committed ``new_step`` of the same
    writer generation (manifest and marker rewritten, shard bytes as they are): a higher step of
    the same writer, as a stale writer leaves on its memory tier."""
    import json
    import os
    import shutil

    from nebula_ckpt.format.commit import Commit
    from nebula_ckpt.format.names import COMMIT, MANIFEST, step_dir
    from nebula_ckpt.native import get_ops

    src, dst = os.path.join(folder, step_dir(step)), os.path.join(folder, step_dir(new_step))
    shutil.copytree(src, dst)
    with open(os.path.join(dst, MANIFEST)) as f:
        man = json.load(f)
    man["step"] = new_step
    mbytes = json.dumps(man).encode()
    with open(os.path.join(dst, MANIFEST), "wb") as f:
        f.write(mbytes)
    with open(os.path.join(dst, COMMIT), "wb") as f:
        f.write(Commit(new_step, man["generation"], len(mbytes), get_ops().crc32c_bytes(mbytes)).to_bytes())
