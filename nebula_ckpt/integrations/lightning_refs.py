"""Which pointer files name a checkpoint: what :class:`~nebula_ckpt.integrations.lightning.NebulaCheckpointIO`
looks at before it removes one.

A pointer file may be a copy (Lightning copies ``epoch=N.ckpt`` to ``last.ckpt`` where
``save_last="link"`` cannot make a link; a user's ``cp``), or be overwritten by a save under
another tag (a run folder moved since the checkpoint it named was saved). A checkpoint is removed
only once no pointer file names it: looked for at the path it was written at, in the folder of
the file removed and in every folder the plugin saved to (pointer-sized files only).
"""

from __future__ import annotations

from typing import Any, Optional

from nebula_ckpt.adapters import canonical_root
from nebula_ckpt.errors import NebulaError
from nebula_ckpt.integrations.lightning_support import abs_path, folder_of, read_pointer, small_files
from nebula_ckpt.integrations.pointers import TMP_SUFFIX, candidate_roots


class PointerRefs:
    """The pointer files naming the checkpoints of one root, and the checkpoints waiting for the
    last of them to go.

    Attributes:
        folders: the folders the plugin wrote pointer files in (where copies are looked for).
        deferred: tag -> folders: checkpoints whose removal waits until no pointer file there names them.
    """

    def __init__(self, root: str) -> None:
        self.root = canonical_root(root)
        self.folders: set[str] = set()
        self.deferred: dict[str, set[str]] = {}

    def owns(self, ptr: dict[str, Any], path: str) -> bool:
        """Whether the pointer ``ptr`` read at ``path`` names this root (where it is now or was written)."""
        return any(canonical_root(r) == self.root for r in candidate_roots(ptr, path))

    def saved_at(self, path: str) -> None:
        """The plugin writes a pointer at ``path``."""
        self.folders.add(folder_of(path))

    def replacing(self, path: str, tag: str) -> Optional[dict[str, Any]]:
        """The pointer at ``path`` is about to name ``tag``: a checkpoint of this root it named under
        another tag (saved before the run folder moved) waits until no pointer file names it; its
        record is returned (the new pointer names it as ``prev_tag``, read when ``tag`` never committed)."""
        try:
            old = read_pointer(path)
        except (NebulaError, OSError):
            return None
        if old is None or old["tag"] == tag or not self.owns(old, path):
            return None
        self.deferred.setdefault(old["tag"], set()).update({folder_of(path), *self.folders})
        return old

    def folders_for(self, path: str, ptr: Optional[dict[str, Any]]) -> set[str]:
        """Where pointer files naming the checkpoint of ``ptr`` (read at ``path``) are looked for."""
        folders = {folder_of(path), *self.folders}
        written_at = (ptr or {}).get("path")
        if isinstance(written_at, str) and ("://" in written_at) == ("://" in path):
            folders.add(folder_of(written_at))  # where the original is (never another kind of store)
        return folders

    def referrers(self, tag: str, folders: set[str], skip: Optional[str] = None) -> list[str]:
        """Pointer files in ``folders`` (but ``skip``) naming the checkpoint tagged ``tag`` of this root
        (as their tag, or as the previous one they fall back to)."""
        skip_abs = abs_path(skip) if skip is not None else None
        out = []
        for folder in sorted(folders):
            for p in small_files(folder):
                if p == skip_abs or p.endswith(TMP_SUFFIX):  # a pointer being written (or left by a crash)
                    continue
                try:
                    ptr = read_pointer(p)
                except (NebulaError, OSError):
                    continue  # not a readable pointer: names nothing
                if ptr is not None and tag in (ptr["tag"], ptr.get("prev_tag")) and self.owns(ptr, p):
                    out.append(p)
        return out

    def unreferenced(self) -> list[str]:
        """The deferred tags no pointer file names any more (to remove now)."""
        return [tag for tag, folders in list(self.deferred.items()) if not self.referrers(tag, folders)]
