"""Internal: a ``close()`` re-entered from a signal handler is deferred until the interrupted call returns.

A signal handler runs on the main thread between two bytecodes of whatever that thread was doing.
A SIGTERM handler that calls ``ckpt.close()`` can therefore land inside ``save_async``, ``load``,
``remove``, ``wait``, ``stats``, ... of the very same Checkpointer: closing there would wait for
a lock the interrupted call holds (a deadlock: the locks are not re-entrant) or tear down the
threads and tiers that call is halfway through. So every public method records that the calling
thread is inside it (:func:`guard_methods`); a ``close()`` on a thread that is inside one is only
recorded (:meth:`Calls.defer`) and runs when the outermost call returns or raises (the handler's
``sys.exit()`` unwinding through it, typically). A ``close()`` from another thread is not deferred:
it waits like any close.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from typing import Any, Callable, Optional, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger("nebula_ckpt")


class Calls:
    """The threads inside a public method of one object (the outermost method's name), and the
    ``close()`` each of them deferred."""

    def __init__(self) -> None:
        self._inside: dict[int, str] = {}
        self._deferred: dict[int, Callable[[], None]] = {}

    def inside(self) -> Optional[str]:
        """The method the calling thread is inside (its outermost one), or None."""
        return self._inside.get(threading.get_ident())

    def defer(self, close: Callable[[], None]) -> Optional[str]:
        """If the calling thread is inside a method, keep ``close`` to run when it returns and
        return that method's name; else None (the caller closes now)."""
        me = threading.get_ident()
        name = self._inside.get(me)
        if name is not None:
            self._deferred[me] = close
        return name

    def call(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` as method ``name`` of the object; then a ``close()`` deferred meanwhile.

        When ``fn`` raised (the handler's ``sys.exit()`` or ``KeyboardInterrupt`` unwinding it,
        typically), that exception goes on as it is: a failure of the deferred close is logged."""
        me = threading.get_ident()
        outer = me not in self._inside
        raised: Optional[BaseException] = None
        try:
            if outer:  # inside the try: an interrupt after this line still clears it below
                self._inside[me] = name
            return fn(*args, **kwargs)
        except BaseException as e:
            raised = e
            raise
        finally:
            if outer:
                self._inside.pop(me, None)
                close = self._deferred.pop(me, None)
                if close is not None:
                    _close_deferred(close, name, raised)
            raised = None  # no cycle through the traceback


def _close_deferred(close: Callable[[], None], name: str, raised: Optional[BaseException]) -> None:
    """Run a deferred ``close``; if the interrupted call raised, a failure of the close is logged
    instead of taking the place of that exception."""
    if raised is None:
        close()
        return
    try:
        close()
    except Exception as e:
        log.error("nebula_ckpt: close() deferred behind %s(), which raised %s, failed: %s: %s", name,
                  type(raised).__name__, type(e).__name__, e)


def guard_methods(cls: type, calls_of: Callable[[Any], Calls], *, skip: tuple[str, ...] = ("close",)) -> None:
    """Wrap every public method of ``cls`` and of its base classes of this package (but ``skip``)
    so that it runs through ``calls_of(instance)``'s :meth:`Calls.call`."""
    for klass in [k for k in cls.__mro__ if k.__module__.split(".")[0] == __name__.split(".")[0]]:
        for name, fn in list(vars(klass).items()):
            if name.startswith("_") or name in skip or not inspect.isfunction(fn):
                continue
            setattr(klass, name, _guarded(name, fn, calls_of))


def _guarded(name: str, fn: F, calls_of: Callable[[Any], Calls]) -> F:
    @functools.wraps(fn)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return calls_of(self).call(name, fn, self, *args, **kwargs)
    return method  # type: ignore[return-value]
