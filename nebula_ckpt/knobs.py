"""The settings a user or operator of nebula_ckpt can choose, in one place.

A knob is kept here only when a user can act on it (thread counts, where the memory tier lives,
timeouts, retries, ...); the library's internal sizes and waits are named constants in the modules
that use them. Each knob has an environment variable, a getter (:func:`get`: an :func:`override` first, then
the environment, then the default), a line of documentation (:func:`describe`, :func:`table`),
and can be overridden in tests with :func:`override`. The library's own settings are read here
and nowhere else (``tests/api/test_architecture.py`` checks that no other module reads
``os.environ``, but for :mod:`nebula_ckpt.compat.nebula.environment`). Variables that belong to
other programs are not knobs: the Azure ML Nebula compatibility layer reads that product's
``NEBULA_PERSISTENT_*`` / ``NEBULA_MEMORY_BUFFER_SIZE`` settings in
:mod:`nebula_ckpt.compat.nebula.environment`, and ``LOCAL_WORLD_SIZE`` (set by torchrun) sizes the
default thread counts below (:func:`cores_per_rank`).

Example::

    from nebula_ckpt import knobs
    with knobs.override(copy_threads=1):
        ...
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

#: zstd's compression levels, from ``ZSTD_minCLevel()`` (the fastest) to
#: ``zstandard.MAX_COMPRESSION_LEVEL``; zstandard refuses a level above and silently clamps one below
ZSTD_LEVELS = (-(1 << 17), 22)
#: the most threads a thread-count knob takes: the native thread pools' own cap
#: (``clamp_threads`` of ``csrc/thread_pool.h``); more only makes the Python pools start thousands
MAX_THREADS = 256
#: the longest timeout a knob takes, in seconds (about 31 years: "never" in practice). Longer waits
#: fail with OverflowError (``threading.TIMEOUT_MAX``), and some waits are twice a knob
MAX_WAIT_S = min(1e9, threading.TIMEOUT_MAX / 4)


@dataclass(frozen=True)
class _Knob:
    env: str
    default: Any
    parse: Callable[[str], Any]
    doc: str
    #: the smallest value that makes sense (None: any); a value below it (or NaN) is an error naming the knob
    least: Any = None
    #: the largest value that makes sense (None: any); a value above it is an error naming the knob
    most: Any = None


def _bool(s: str) -> bool:
    return s.strip().lower() in {"1", "true", "yes", "on"}


def cores_per_rank() -> int:
    """This host's cores shared among the ranks on it (``LOCAL_WORLD_SIZE``, set by torchrun)."""
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    return (os.cpu_count() or 1) // max(1, ranks_here)


def _default_threads() -> int:
    """Cores shared by the ranks on this host, at most 8: ranks that each start a thread per core
    only make the copies fight for the cores."""
    return max(1, min(8, cores_per_rank()))


_KNOBS: dict[str, _Knob] = {
    "copy_threads": _Knob("NEBULA_COPY_THREADS", None, int,
                          "native threads that copy CPU tensors into staging buffers (default: cores / ranks on the "
                          "host, max 8)", least=1, most=MAX_THREADS),
    "io_threads": _Knob("NEBULA_IO_THREADS", None, int,
                        "parallel pwrite / checksum threads per file, and the threads that hash staged tensors "
                        "for incremental saves (default: cores / ranks on the host, max 8)", least=1, most=MAX_THREADS),
    "o_direct": _Knob("NEBULA_O_DIRECT", True, _bool,
                      "use O_DIRECT for local shard writes where the file system allows it"),
    "disable_native": _Knob("NEBULA_DISABLE_NATIVE", False, _bool,
                            "ignore the C++ extension and run the pure-PyTorch path (read once per process)"),
    "shm_dir": _Knob("NEBULA_SHM_DIR", "/dev/shm", str,
                     "where the memory tier lives (a tmpfs that survives a process crash)"),
    "huge_pages": _Knob("NEBULA_HUGE_PAGES", None, _bool,
                        "advise transparent huge pages for memory buffers (unset: only for a memory-tier "
                        "copy pulled from a partner at restore, 48 MB made in 2-4 ms instead of 10-20; "
                        "1: also staging and restore buffers, which on VMs that return freed memory to "
                        "the host cost 3-7x more in huge pages, so try it on bare metal; 0: nowhere, "
                        "where the kernel's compaction stalls for huge pages)"),
    "adopt_memory_tier": _Knob("NEBULA_ADOPT_MEMORY_TIER", True, _bool,
                               "a restore from the memory tier of a step also committed on a slower tier "
                               "hands the tier's pages to the process instead of copying them (the tier "
                               "gives that step up; see nebula_ckpt/tiers/memory/adopt.py)"),
    "shm_min_free_fraction": _Knob("NEBULA_SHM_MIN_FREE", 0.1, float,
                                   "memory tier is skipped when it would leave less free than this (a share of the "
                                   "tmpfs, 0 to 1)", least=0.0, most=1.0),
    "remote_part_bytes": _Knob("NEBULA_REMOTE_PART_BYTES", 32 << 20, int,
                               "part size of parallel uploads / downloads on remote tiers"),
    "remote_concurrency": _Knob("NEBULA_REMOTE_CONCURRENCY", 8, int,
                                "parts in flight at once per remote file"),
    "remote_retries": _Knob("NEBULA_REMOTE_RETRIES", 5, int,
                            "attempts per remote operation before the save fails"),
    "remote_timeout_s": _Knob("NEBULA_REMOTE_TIMEOUT_S", 30.0, float,
                              "deadline of one remote operation (one request, e.g. one upload part, "
                              "with all its retries) in seconds: an outage is reported within it; "
                              "also caps the clients' connect / read timeouts. Must allow one part "
                              "(NEBULA_REMOTE_PART_BYTES) to transfer on the slowest link", least=0.1, most=MAX_WAIT_S),
    "zstd_level": _Knob("NEBULA_ZSTD_LEVEL", 3, int, "zstd level when compression='zstd' (negative: faster, "
                        "0: zstd's default)", least=ZSTD_LEVELS[0], most=ZSTD_LEVELS[1]),
    "commit_timeout_s": _Knob("NEBULA_COMMIT_TIMEOUT_S", 600.0, float,
                              "multi-rank: how long a rank waits for the others in one round of the "
                              "checkpoint protocol (a rank that died fails the save sooner)", least=0.1,
                              most=MAX_WAIT_S),
    "exit_timeout_s": _Knob("NEBULA_EXIT_TIMEOUT_S", 300.0, float,
                            "how long interpreter exit waits for the pending saves of a Checkpointer "
                            "that was never closed (0: do not wait)", least=0.0, most=MAX_WAIT_S),
    "node_id": _Knob("NEBULA_NODE_ID", None, str,
                     "the node this process runs on, for memory-tier replicas (default: the host name); "
                     "ranks with one node id share a fate, so replicas go to other node ids. Tests "
                     "simulate nodes on one machine with it (each with its own NEBULA_SHM_DIR)"),
    "replica_timeout_s": _Knob("NEBULA_REPLICA_TIMEOUT_S", 600.0, float,
                               "multi-rank: how long a memory-tier replica transfer (one round of sends and "
                               "receives among the ranks) may take before the replicas of that save fail",
                               least=0.1, most=MAX_WAIT_S),
    "incremental_full_every": _Knob("NEBULA_INCREMENTAL_FULL_EVERY", 10, int,
                                    "incremental saves: every N-th save a tier writes is a full checkpoint "
                                    "(N >= 1; 1: every save full), so the steps a checkpoint refers to stay "
                                    "few and retention can drop old ones", least=1),
    "log_level": _Knob("NEBULA_LOG_LEVEL", None, str,
                       "level of the 'nebula_ckpt' logger if set (DEBUG, INFO, ...)"),
}

_overrides: dict[str, Any] = {}
_lock = threading.Lock()


def get(name: str) -> Any:
    """Return the current value of knob ``name`` (override > environment > default)."""
    knob = _KNOBS[name]
    with _lock:
        if name in _overrides:
            return _checked(name, knob, _overrides[name], "set by knobs.override")
    raw = os.environ.get(knob.env)
    if raw is not None and raw != "":
        try:
            value = knob.parse(raw)
        except ValueError as e:
            raise ValueError(f"environment variable {knob.env}={raw!r} is not valid: {e}") from None
        return _checked(name, knob, value, f"from the environment variable {knob.env}={raw!r}")
    if name in ("copy_threads", "io_threads") and knob.default is None:
        return _default_threads()
    return knob.default


#: values of knobs read at every save (:func:`get_once`), read from the environment once
_once: dict[str, Any] = {}


def get_once(name: str) -> Any:
    """The value of knob ``name`` as :func:`get` has it, with the environment read at the first call
    only: for a knob read at every save (the environment is not read again; :func:`override` is)."""
    if _overrides:  # read without the lock: override() replaces its items under it
        return get(name)
    try:
        return _once[name]
    except KeyError:
        value = _once[name] = get(name)
        return value


def chosen(name: str) -> bool:
    """Whether knob ``name`` was set (by the environment or :func:`override`), not left at its default."""
    with _lock:
        if name in _overrides:
            return True
    return bool(os.environ.get(_KNOBS[name].env))


def _checked(name: str, knob: _Knob, value: Any, where: str) -> Any:
    """``value`` of knob ``name`` (``where`` it came from), or a ValueError naming the knob, where it
    came from and its range when it is outside it (NaN included)."""
    if value is None:
        return value
    if (knob.least is not None and not value >= knob.least) or (knob.most is not None and not value <= knob.most):
        raise ValueError(f"knob {name} ({where}) is {value!r}: it must be {knob_range(name)}; {knob.doc}")
    return value


def knob_range(name: str) -> str:
    """The values knob ``name`` takes, in words: ``">= 1"``, ``"from -131072 to 22"``, ``"any"``."""
    knob = _KNOBS[name]
    if knob.least is not None and knob.most is not None:
        return f"from {_number(knob.least)} to {_number(knob.most)}"
    if knob.least is not None:
        return f">= {_number(knob.least)}"
    return f"<= {_number(knob.most)}" if knob.most is not None else "any"


def _number(value: float) -> str:
    """``1``, ``0.1``, ``1000000000`` (not ``1e+09``): a bound as a user types it."""
    return str(int(value)) if float(value).is_integer() else repr(value)


def check_all() -> None:
    """Read every knob that has a range (a ValueError naming the first one out of it): called when a
    Checkpointer is created, so that a bad setting fails there, before anything is written."""
    for name, knob in _KNOBS.items():
        if knob.least is not None or knob.most is not None:
            get(name)


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Temporarily set knobs (for tests and benchmarks).

    Args:
        **values: knob name -> value.
    """
    unknown = set(values) - set(_KNOBS)
    if unknown:
        raise KeyError(f"unknown knob(s) {sorted(unknown)}; known: {sorted(_KNOBS)}")
    with _lock:
        saved = dict(_overrides)
        _overrides.update(values)
    try:
        yield
    finally:
        with _lock:
            _overrides.clear()
            _overrides.update(saved)


class KnobTable(dict[str, tuple[str, Any, str]]):
    """``{name: (env var, current value, doc)}`` of every knob; printed, a readable table
    (:func:`table`), not one long dict on a line."""

    def __str__(self) -> str:
        return render_table(self)

    def __repr__(self) -> str:
        return render_table(self)


def describe() -> KnobTable:
    """Return ``{name: (env var, current value, doc)}`` for every knob (printed: :func:`table`)."""
    return KnobTable({n: (k.env, get(n), k.doc) for n, k in _KNOBS.items()})


def render_table(described: dict[str, tuple[str, Any, str]]) -> str:
    """``described`` (what :func:`describe` returns) as a table: knob, environment variable,
    current value, meaning."""
    rows = [("knob", "environment", "value", "meaning")]
    rows += [(n, env, repr(value), doc) for n, (env, value, doc) in described.items()]
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{a:<{w[0]}}  {b:<{w[1]}}  {c:<{w[2]}}  {d}" for a, b, c, d in rows)


def table() -> str:
    """Every knob as a readable table: name, environment variable, current value, meaning.

    ``python -c "from nebula_ckpt import knobs; print(knobs.table())"`` prints it (as does
    ``print(knobs.describe())``).
    """
    return render_table(describe())
