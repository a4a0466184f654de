"""pytest plugin: run a framework's own checkpoint tests with nebula_ckpt swapped in, their files unedited.

Loaded by :mod:`tests.peers.run` as ``-p plugin`` (this folder on ``PYTHONPATH``), before pytest
imports any test module, so every name the tests import is already the swapped one.

``NEBULA_PEER_MODE=stock`` does nothing (the baseline run); ``NEBULA_PEER_MODE=nebula`` swaps,
for the suite named by ``NEBULA_PEER_SUITE``:

* ``lightning``: every ``Trainer`` built without a ``CheckpointIO`` of its own gets
  ``NebulaCheckpointIO`` on a fresh root (``NEBULA_PEER_ROOTS/lightning-<n>``, outside the test's
  folders: Lightning's tests list their folders and check that no file is left in their tree).
* ``huggingface``: ``transformers.Trainer`` is ``NebulaTrainer``, whose root is
  ``NEBULA_PEER_ROOTS/hf-<hash of output_dir>`` (a second trainer on the same ``output_dir``, as
  the resume tests make, finds the first one's checkpoints; nothing is added to ``output_dir``
  beyond the ``checkpoint-N/`` folders HF itself would write).
* ``dcp``: ``FileSystemWriter`` / ``FileSystemReader`` (in ``torch.distributed.checkpoint`` and its
  ``filesystem`` module; in the ranks' own processes too, through ``sitecustomize.py``) are
  :class:`PeerWriter` / :class:`PeerReader`: nebula_ckpt's DCP writer
  and reader on the same path. A stock writer overwrites the checkpoint at its path; ours never
  overwrites a committed step, so each save at a path is the next step and a read takes the
  newest. DCP's storage ``_extensions`` (compression, test transforms) are not applied: the
  format stores raw tensors (with CRC32C), which is what those tests then read back.
* ``deepspeed``: an engine's first ``save_checkpoint(save_dir)`` / ``load_checkpoint(save_dir)``
  ``enable``-s it on ``NEBULA_PEER_ROOTS/ds-<hash of save_dir>`` (every rank and every engine of a
  test agree on it). DeepSpeed's tests run their ranks in processes of their own, started by
  ``multiprocessing`` (a ``forkserver``): ``forkserver_preload.py`` beside this file makes the
  same swap in the server they are forked from.

Every swap is counted; the summary line ``nebula_ckpt peers: swapped ...`` says how many times each
happened, so a run where nothing was swapped is visible as such.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections import Counter
from typing import Any

import pytest

MODE = os.environ.get("NEBULA_PEER_MODE", "stock")
SUITE = os.environ.get("NEBULA_PEER_SUITE", "")
ROOTS = os.environ.get("NEBULA_PEER_ROOTS") or tempfile.mkdtemp(prefix="nebula-peer-roots-")
SWAPS: Counter[str] = Counter()


def _root(kind: str, key: str) -> str:
    return os.path.join(ROOTS, f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:16]}")


# -- Lightning ------------------------------------------------------------------------------------------
def _swap_lightning() -> None:
    import pytorch_lightning as pl
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO

    from nebula_ckpt.integrations.lightning import NebulaCheckpointIO

    original = pl.Trainer.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        plugins = kwargs.get("plugins")
        listed = list(plugins) if isinstance(plugins, (list, tuple)) else [] if plugins is None else [plugins]
        strategy = kwargs.get("strategy")
        own = getattr(strategy, "_checkpoint_io", None) is not None
        if not own and not any(isinstance(p, CheckpointIO) for p in listed):
            SWAPS["lightning Trainer"] += 1
            root = os.path.join(ROOTS, f"lightning-{SWAPS['lightning Trainer']}")
            kwargs["plugins"] = [*listed, NebulaCheckpointIO(root)]
        original(self, *args, **kwargs)

    pl.Trainer.__init__ = init  # type: ignore[method-assign]


# -- Hugging Face ---------------------------------------------------------------------------------------
def _swap_huggingface() -> None:
    import transformers
    import transformers.trainer

    from nebula_ckpt.integrations.huggingface import NebulaTrainer

    class PeerTrainer(NebulaTrainer):
        """``NebulaTrainer`` with its root outside ``output_dir``, the same for every trainer of one
        ``output_dir``."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            SWAPS["transformers Trainer"] += 1
            args_obj = kwargs.get("args") if "args" in kwargs else (args[1] if len(args) > 1 else None)
            out = getattr(args_obj, "output_dir", None) or "trainer_output"
            kwargs.setdefault("nebula_root", _root("hf", os.path.abspath(out)))
            super().__init__(*args, **kwargs)

    PeerTrainer.__name__ = PeerTrainer.__qualname__ = "Trainer"
    transformers.Trainer = PeerTrainer  # type: ignore[misc]
    transformers.trainer.Trainer = PeerTrainer  # type: ignore[misc]


# -- DCP ------------------------------------------------------------------------------------------------
def _swap_dcp() -> None:
    import torch.distributed.checkpoint as dcp

    if getattr(dcp, "_nebula_peer", False):
        return
    dcp._nebula_peer = True  # type: ignore[attr-defined]
    import torch.distributed.checkpoint.filesystem as fs

    from nebula_ckpt.dcp import NebulaStorageReader, NebulaStorageWriter
    from nebula_ckpt.format.commit import committed_steps
    from nebula_ckpt.storage.local import LocalStorage

    def newest(path: str) -> int:
        return max(committed_steps(LocalStorage(path)), default=-1) if os.path.isdir(path) else -1

    class PeerWriter(NebulaStorageWriter):
        """``FileSystemWriter(path, ...)`` as nebula_ckpt's writer: each save at ``path`` is its next step."""

        def __init__(self, path: Any, *args: Any, **kwargs: Any) -> None:
            SWAPS["dcp FileSystemWriter"] += 1
            path = os.fspath(path)
            super().__init__(path, step=newest(path) + 1)

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return fs.FileSystemWriter.validate_checkpoint_id(checkpoint_id)

        def reset(self, checkpoint_id: Any = None) -> None:
            if checkpoint_id is not None and os.fspath(checkpoint_id) != self.root:
                self.__init__(checkpoint_id)  # type: ignore[misc]
            else:
                super().reset(None)

    class PeerReader(NebulaStorageReader):
        """``FileSystemReader(path, ...)`` as nebula_ckpt's reader: the newest step at ``path``."""

        def __init__(self, path: Any, *args: Any, **kwargs: Any) -> None:
            SWAPS["dcp FileSystemReader"] += 1
            super().__init__(os.fspath(path))

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return fs.FileSystemReader.validate_checkpoint_id(checkpoint_id)

        def reset(self, checkpoint_id: Any = None) -> None:
            if checkpoint_id is not None and os.fspath(checkpoint_id) != self.root:
                self.__init__(checkpoint_id)  # type: ignore[misc]
            else:
                super().reset(None)

    for mod in (dcp, fs):
        mod.FileSystemWriter = PeerWriter  # type: ignore[misc, assignment]
        mod.FileSystemReader = PeerReader  # type: ignore[misc, assignment]


# -- DeepSpeed ------------------------------------------------------------------------------------------
def deepspeed_compat() -> None:
    """Both runs of the DeepSpeed suite (every process): its test helpers (``master``, older than the
    installed DeepSpeed) compare ``engine.sparse_tensor_module_names`` of the saved and the loaded
    engine; DeepSpeed 0.19.8 dropped sparse gradients and that attribute with them. The engine gets
    it as what 0.19.8 tracks: no sparse module (an empty set). ``NEBULA_PEER_DS_COMPAT=0`` leaves
    the engine as it is (then every test comparing engine states fails on stock too)."""
    if os.environ.get("NEBULA_PEER_DS_COMPAT", "1") == "0":
        return
    from deepspeed.runtime.engine import DeepSpeedEngine

    if not hasattr(DeepSpeedEngine, "sparse_tensor_module_names"):
        DeepSpeedEngine.sparse_tensor_module_names = frozenset()  # type: ignore[attr-defined]


def _swap_deepspeed() -> None:
    """Every engine saving to or loading from ``save_dir`` is ``enable``-d first, on the root of that
    ``save_dir`` (every rank, and every engine of a test, agree on it without talking). Applied in
    each process: DeepSpeed's tests run their ranks in processes of their own (``forkserver_preload``)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from nebula_ckpt.integrations.deepspeed import enable

    if getattr(DeepSpeedEngine, "_nebula_peer", False):
        return
    save, load = DeepSpeedEngine.save_checkpoint, DeepSpeedEngine.load_checkpoint

    def ensure(engine: Any, save_dir: Any) -> None:
        # a save_dir DeepSpeed refuses (None, "") still gets an engine: the refusal is DeepSpeed's,
        # made with nebula_ckpt in place
        key = os.path.abspath(os.fspath(save_dir)) if save_dir else f"<save_dir {save_dir!r}>"
        root = _root("ds", key)
        if getattr(engine, "_nebula_peer_root", None) == root:
            return
        old = getattr(engine, "_nebula_peer_ckpt", None)
        if old is not None:  # another save_dir: its own root, enabled on DeepSpeed's engine again
            old.close()
            engine.checkpoint_engine = engine._nebula_peer_stock
        else:
            engine._nebula_peer_stock = engine.checkpoint_engine
        SWAPS["deepspeed engine"] += 1
        engine._nebula_peer_ckpt = enable(engine, root)
        engine._nebula_peer_root = root

    def save_checkpoint(self: Any, save_dir: Any, *args: Any, **kwargs: Any) -> Any:
        ensure(self, save_dir)
        return save(self, save_dir, *args, **kwargs)

    def load_checkpoint(self: Any, load_dir: Any, *args: Any, **kwargs: Any) -> Any:
        ensure(self, load_dir)
        # enable() wraps the engine's own load_checkpoint (a load without a tag passes over suspect
        # steps): the first load of a fresh engine goes through that wrapper too; the wrapper's
        # call of the class's method comes back here and goes on to the stock load
        own = self.__dict__.get("load_checkpoint")
        if own is not None and not self.__dict__.get("_nebula_peer_in_load"):
            self._nebula_peer_in_load = True
            try:
                return own(load_dir, *args, **kwargs)
            finally:
                self._nebula_peer_in_load = False
        return load(self, load_dir, *args, **kwargs)

    DeepSpeedEngine.save_checkpoint = save_checkpoint  # type: ignore[method-assign]
    DeepSpeedEngine.load_checkpoint = load_checkpoint  # type: ignore[method-assign]
    DeepSpeedEngine._nebula_peer = True


_SWAPPERS = {"lightning": _swap_lightning, "huggingface": _swap_huggingface, "dcp": _swap_dcp,
             "deepspeed": _swap_deepspeed}


def swap() -> None:
    """Make this process's swap (``NEBULA_PEER_MODE`` / ``NEBULA_PEER_SUITE``)."""
    if MODE != "nebula":
        return
    if SUITE not in _SWAPPERS:
        raise pytest.UsageError(f"NEBULA_PEER_SUITE must be one of {sorted(_SWAPPERS)}, got {SUITE!r}")
    os.makedirs(ROOTS, exist_ok=True)
    _SWAPPERS[SUITE]()


def pytest_configure(config: pytest.Config) -> None:
    if SUITE == "deepspeed":
        deepspeed_compat()
    swap()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The manifest's verdicts: ``skip`` (fails on stock too) in both runs, ``xfail`` (a documented
    refusal of nebula_ckpt) in the nebula_ckpt run only, strict: one that passes is reported."""
    path = os.environ.get("NEBULA_PEER_MANIFEST")
    if not path:
        return
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)["suites"].get(SUITE, {})
    for item in items:
        for pattern, reason in spec.get("skip", {}).items():
            if pattern in item.nodeid:
                item.add_marker(pytest.mark.skip(reason=f"fails on stock too: {reason}"))
                break
        else:
            if MODE == "nebula":
                for pattern, reason in spec.get("xfail", {}).items():
                    if pattern in item.nodeid:
                        item.add_marker(pytest.mark.xfail(reason=f"documented: {reason}", strict=True))
                        break


def pytest_terminal_summary(terminalreporter: Any) -> None:
    done = ", ".join(f"{k} x{v}" for k, v in sorted(SWAPS.items())) or "nothing"
    if MODE == "nebula" and SUITE == "deepspeed" and os.path.isdir(ROOTS):
        # the ranks swap in processes of their own: count the roots they made
        roots = sum(1 for n in os.listdir(ROOTS) if n.startswith("ds-"))
        done += f" in this process; {roots} nebula_ckpt root(s) made by the ranks"
    terminalreporter.write_line(f"nebula_ckpt peers: mode {MODE}, suite {SUITE or '-'}, swapped {done}")
