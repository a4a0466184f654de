"""``torch_nebula.Checkpoint``: one checkpoint of named parts, saved, committed (its parts as one
nebula_ckpt checkpoint) and loaded part by part."""

from __future__ import annotations

from typing import Any, Optional

import torch

from nebula_ckpt import SaveHandle
from nebula_ckpt.adapters import check_tag
from nebula_ckpt.compat.nebula.commit import commit_parts
from nebula_ckpt.compat.nebula.session import Parts, Session, current_session, reader_for, settle
from nebula_ckpt.errors import NotFoundError, ValidationError


def _check_num_of_files(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n == 0:
        raise ValidationError(f"torch_nebula.Checkpoint: num_of_files must be an int >= 1 (the checkpoint commits "
                              f"itself when that many parts are saved) or negative (-2, as DeepSpeed passes it: "
                              f"commit() says when it is complete), got {n!r}")
    return n


class Checkpoint:
    """One checkpoint of named parts (Nebula's ``torch_nebula.Checkpoint``).

    ``Checkpoint(tag, num_of_files)``: ``tag`` names it (its identity: ``get_checkpoint(tag=...)``
    finds it; default ``"step-<N>"``, N its step); ``num_of_files``: how many parts it holds. With
    ``n >= 1`` (default 1) it commits itself when its n-th part is saved, and ``commit()`` then
    returns True; ``commit()`` before that raises. With a negative value (DeepSpeed passes ``-2``)
    it commits when ``commit()`` is called. Objects made with the same tag before it commits are
    the same checkpoint (DeepSpeed creates one per part).

    The parts are held by reference and copied when the checkpoint commits, as one nebula_ckpt
    checkpoint ``{name: obj, ...}``: do not change them between ``save`` and the commit.
    Committed checkpoints (also those :func:`get_latest_checkpoint` / :func:`get_checkpoint`
    return) are read with :meth:`load`.

    Attributes:
        tag: the tag (``None`` until an untagged checkpoint commits).
        step: nebula_ckpt's step number (``None`` until it commits).
        num_of_files: as given.
    """

    def __init__(self, tag: Optional[str] = None, num_of_files: int = 1) -> None:
        s = current_session()
        check_tag(tag)
        n = _check_num_of_files(num_of_files)
        self._session = s
        #: the root it was found under (None: the one ``init`` named)
        self._root: Optional[str] = None
        self._cache: dict[str, Any] = {}
        self._cache_location: Any = None
        with s.lock:
            shared = s.pending.get(tag) if tag is not None else None
            if shared is not None and shared.num_of_files != n:
                raise ValidationError(f"torch_nebula.Checkpoint({tag!r}, {n}): checkpoint {tag!r} is already being "
                                      f"saved with num_of_files={shared.num_of_files} (parts {shared.names}); "
                                      "commit it first, or use the same num_of_files")
            self._p = shared or Parts(tag, n)

    @classmethod
    def _committed(cls, s: Session, root: Optional[str], tag: str, step: int) -> "Checkpoint":
        self = cls.__new__(cls)
        self._root = root
        self._session = s
        self._cache = {}
        self._cache_location = None
        self._p = Parts(tag, -1)
        self._p.step = step
        self._p.confirmed = True
        return self

    def __repr__(self) -> str:
        state = "committed" if self.committed else f"{len(self._p.names)} part(s) saved"
        return f"Checkpoint(tag={self.tag!r}, step={self.step}, {state})"

    @property
    def tag(self) -> Optional[str]:
        return self._p.tag

    @property
    def step(self) -> Optional[int]:
        return self._p.step

    @property
    def num_of_files(self) -> int:
        return self._p.num_of_files

    @property
    def committed(self) -> bool:
        """Whether it committed (its copy is taken; persisting may still run: :func:`flush_persistence`)."""
        return self._p.step is not None

    @property
    def handle(self) -> Optional[SaveHandle]:
        """The :class:`~nebula_ckpt.SaveHandle` of its commit in this process (``None`` otherwise)."""
        return self._p.handle

    def save(self, name: str, obj: Any) -> None:
        """Add part ``name`` (``obj``: a module, optimizer, state dict, tensor, plain values ...).

        Raises:
            ValidationError: an empty or repeated name, or a checkpoint already committed;
                the commit's own errors when this part completes ``num_of_files``.
        """
        s = self._session
        with s.lock:
            p = self._p
            where = f"checkpoint {p.tag!r}" if p.tag is not None else "this checkpoint"
            if p.step is not None:
                raise ValidationError(f"torch_nebula: {where} is committed (step {p.step}); parts cannot be added "
                                      "to it: create a new Checkpoint(tag) for the next one")
            if not isinstance(name, str) or not name:
                raise ValidationError(f"torch_nebula: a part's name must be a non-empty string, got {name!r}")
            if name in p.parts:
                raise ValidationError(f"torch_nebula: part {name!r} is already saved in {where} (parts {p.names})")
            p.parts[name] = obj
            p.names.append(name)
            if p.tag is not None:
                s.pending[p.tag] = p
            if 0 < p.num_of_files == len(p.names):
                try:
                    commit_parts(s, p)
                except BaseException:  # the part that completed it is taken back: nothing changed
                    del p.parts[name]
                    p.names.remove(name)
                    if not p.names and p.tag is not None and s.pending.get(p.tag) is p:
                        del s.pending[p.tag]
                    raise

    def commit(self) -> bool:
        """Commit the checkpoint: its parts are copied (``save_async``) and persisted in the background.

        Returns True. With ``num_of_files >= 1`` the n-th ``save`` committed it already; this
        confirms it (once).

        Raises:
            ValidationError: fewer parts than ``num_of_files`` (named), no part at all, or a
                second ``commit()``; the errors of :meth:`~nebula_ckpt.Checkpointer.save_async`
                (a part it cannot store, a failed earlier save), nothing committed then.
        """
        s = self._session
        with s.lock:
            p = self._p
            where = f"checkpoint {p.tag!r}" if p.tag is not None else "this checkpoint"
            if p.step is not None:
                if p.confirmed:
                    raise ValidationError(f"torch_nebula: {where} is already committed (step {p.step}); commit() "
                                          "is called once per checkpoint")
                p.confirmed = True
                return True
            if p.num_of_files > 0:
                raise ValidationError(f"torch_nebula: {where} has {len(p.names)} of its num_of_files="
                                      f"{p.num_of_files} parts ({p.names}); save the missing part(s) (it commits "
                                      "itself with the last one), or create it with num_of_files=-2 to commit "
                                      "whatever is saved")
            if not p.names:
                raise ValidationError(f"torch_nebula: {where} has no part to commit: save(name, obj) first")
            commit_parts(s, p)
            p.confirmed = True
            return True

    def load(self, name: str, map_location: Any = None) -> Any:
        """Part ``name`` of this committed checkpoint, as a fresh object.

        Modules and optimizers come back as their state dicts (``model.load_state_dict(...)``);
        tensors, NumPy values and plain values as saved. ``map_location`` as ``torch.load`` takes it.
        The checkpoint is read (and verified) once for all its parts: each other part is kept
        until it is loaded.

        Raises:
            ValidationError: the checkpoint is not committed yet.
            NotFoundError: no such part (the message lists the parts), or the checkpoint is gone.
            CorruptCheckpointError: every copy of it is damaged.
        """
        s = self._session
        p = self._p
        if p.step is None:
            raise ValidationError(f"torch_nebula: checkpoint {p.tag!r} is not committed; load() reads committed "
                                  "checkpoints")
        if name in self._cache and _same_location(self._cache_location, map_location):
            return self._cache.pop(name)
        settle(s)
        _, tree = reader_for(s, self._root)[1].read(p.step, map_location=map_location)
        if not isinstance(tree, dict) or name not in tree:
            names = sorted(tree) if isinstance(tree, dict) else []
            raise NotFoundError(f"torch_nebula: checkpoint {p.tag!r} (step {p.step}) has no part {name!r}; its parts: "
                                f"{names}")
        part = tree.pop(name)
        self._cache, self._cache_location = tree, map_location
        return part


def _same_location(a: Any, b: Any) -> bool:
    """Whether two ``map_location`` values are the same (callables and dicts: the same object)."""
    return a is b or (type(a) is type(b) and isinstance(a, (str, torch.device)) and a == b)


def committed_checkpoint(s: Session, root: Optional[str], tag: str, step: int) -> Checkpoint:
    """The :class:`Checkpoint` of committed ``step`` (tagged ``tag``), found under ``root`` (None:
    the root ``init`` named)."""
    return Checkpoint._committed(s, root, tag, step)
