"""``flakyfs://``: a real local-disk fsspec filesystem under a scheme of its own, used as a remote
root, with a switch that makes every read of it fail as an unreachable blob store does.

Both the job (a subprocess that imports this module and calls :func:`register`) and the test
see the same files; only the test process flips :attr:`FlakyFileSystem.fault`.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import fsspec
from fsspec.implementations.local import LocalFileSystem

SCHEME = "flakyfs"


class FlakyFileSystem(LocalFileSystem):
    """Local files behind ``flakyfs://``; ``fault`` (when set) runs at the start of every read."""

    protocol = SCHEME
    #: called at the start of info / ls / cat_file / open (the fault stage): raise, or block
    fault: Optional[Callable[[], None]] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("auto_mkdir", True)
        super().__init__(*args, **kwargs)

    @staticmethod
    def _stage() -> None:
        if FlakyFileSystem.fault is not None:
            FlakyFileSystem.fault()

    def info(self, path: str, **kwargs: Any) -> Any:
        self._stage()
        return super().info(path, **kwargs)

    def ls(self, path: str, detail: bool = False, **kwargs: Any) -> Any:
        self._stage()
        return super().ls(path, detail=detail, **kwargs)

    def cat_file(self, path: str, start: Any = None, end: Any = None, **kwargs: Any) -> Any:
        self._stage()
        return super().cat_file(path, start=start, end=end, **kwargs)

    def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        self._stage()
        return super()._open(path, mode, *args, **kwargs)


def register() -> None:
    """Make ``flakyfs://`` known to fsspec in this process."""
    fsspec.register_implementation(SCHEME, FlakyFileSystem, clobber=True)


def raising(exc: BaseException) -> Callable[[], None]:
    """A fault that raises ``exc`` (an I/O error, a timeout) at every read: a new copy each time, as
    a store's client raises (one object raised again would chain every traceback it went through)."""
    def fault() -> None:
        raise type(exc)(*exc.args)
    return fault


def hanging(release: threading.Event) -> Callable[[], None]:
    """A fault that does not answer until ``release`` is set (a store that hangs)."""
    def fault() -> None:
        release.wait()
        raise TimeoutError("the store did not answer")
    return fault
