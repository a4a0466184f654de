"""Every tunable of nebula_ckpt, in one place.

Each knob has an environment variable, a getter (:func:`get`: an :func:`override` first, then
the environment, then the default), a line of documentation (:func:`describe`, :func:`table`),
and can be overridden in tests with :func:`override`. The library's own tunables are read here
and nowhere else (``tests/test_architecture.py`` checks that no other module reads
``os.environ``). Variables that belong to other programs are not knobs: the Azure ML Nebula
compatibility layer (:mod:`nebula_ckpt.compat.torch_nebula`) honours that product's
``NEBULA_PERSISTENT_*`` / ``NEBULA_MEMORY_BUFFER_SIZE`` settings, and ``LOCAL_WORLD_SIZE``
(set by torchrun) sizes the default thread counts below.

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


@dataclass(frozen=True)
class _Knob:
    env: str
    default: Any
    parse: Callable[[str], Any]
    doc: str
    #: the smallest value that makes sense (None: any); a value below it is an error naming the knob
    least: Any = None


def _bool(s: str) -> bool:
    return s.strip().lower() in {"1", "true", "yes", "on"}


def _default_threads() -> int:
    """Cores shared by the ranks on this host (``LOCAL_WORLD_SIZE``, set by torchrun), at most 8:
    ranks that each start a thread per core only make the copies fight for the cores."""
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    return max(1, min(8, (os.cpu_count() or 1) // max(1, ranks_here)))


def _default_fault_threads() -> int:
    """The cores of this rank the copy threads leave idle, at most 8."""
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    return max(0, min(8, (os.cpu_count() or 1) // max(1, ranks_here) - int(get("copy_threads"))))


_KNOBS: dict[str, _Knob] = {
    "copy_threads": _Knob("NEBULA_COPY_THREADS", None, int,
                          "native threads that copy CPU tensors into staging buffers (default: cores / ranks on the "
                          "host, max 8)"),
    "io_threads": _Knob("NEBULA_IO_THREADS", None, int,
                        "parallel pwrite / checksum threads per file (default: cores / ranks on the host, max 8)"),
    "fault_ahead_threads": _Knob("NEBULA_FAULT_AHEAD_THREADS", None, int,
                                 "threads that fault in a fresh staging buffer's pages from its end while "
                                 "the first save's copy fills it from the start (default: the cores of "
                                 "this rank the copy threads leave idle, max 8; 0: the copy faults them)"),
    "write_chunk_bytes": _Knob("NEBULA_WRITE_CHUNK_BYTES", 16 << 20, int,
                               "bytes per pwrite call on local tiers"),
    "o_direct": _Knob("NEBULA_O_DIRECT", True, _bool,
                      "use O_DIRECT for local shard writes where the file system allows it"),
    "disable_native": _Knob("NEBULA_DISABLE_NATIVE", False, _bool,
                            "ignore the C++ extension and run the pure-PyTorch path"),
    "shm_dir": _Knob("NEBULA_SHM_DIR", "/dev/shm", str,
                     "where the memory tier lives (a tmpfs that survives a process crash)"),
    "slot_ahead_bytes": _Knob("NEBULA_SLOT_AHEAD_BYTES", 32 << 20, int,
                              "states at least this large never create a memory-tier slot file on the "
                              "training thread: a save with no slot file ready stages in an anonymous "
                              "buffer while the next slot file is made in the background"),
    "slot_ahead_wait_s": _Knob("NEBULA_SLOT_AHEAD_WAIT_S", 60.0, float,
                               "longest a staging buffer made in the background waits for the copy of "
                               "the save that asked for it to finish (so that it does not take that "
                               "copy's cores and memory bandwidth) before it is made anyway"),
    "huge_pages": _Knob("NEBULA_HUGE_PAGES", False, _bool,
                        "advise transparent huge pages for staging and restore buffers (off: on VMs "
                        "that return freed memory to the host, such as the one the README's "
                        "benchmarks ran on, a fresh huge page costs 3-7x more than 512 small ones; "
                        "try it on bare metal)"),
    "adopt_memory_tier": _Knob("NEBULA_ADOPT_MEMORY_TIER", True, _bool,
                               "a restore from the memory tier of a step also committed on a slower tier "
                               "hands the tier's pages to the process instead of copying them (the tier "
                               "gives that step up; see nebula_ckpt/restore/adopt.py)"),
    "shm_min_free_fraction": _Knob("NEBULA_SHM_MIN_FREE", 0.1, float,
                                   "memory tier is skipped when it would leave less free than this"),
    "remote_part_bytes": _Knob("NEBULA_REMOTE_PART_BYTES", 32 << 20, int,
                               "part size of parallel uploads / downloads on remote tiers"),
    "remote_concurrency": _Knob("NEBULA_REMOTE_CONCURRENCY", 8, int,
                                "parts in flight at once per remote file"),
    "remote_retries": _Knob("NEBULA_REMOTE_RETRIES", 5, int,
                            "attempts per remote operation before the save fails"),
    "remote_backoff_s": _Knob("NEBULA_REMOTE_BACKOFF_S", 0.2, float,
                              "first retry delay on a remote tier (doubles, capped, with jitter)"),
    "remote_backoff_max_s": _Knob("NEBULA_REMOTE_BACKOFF_MAX_S", 5.0, float,
                                  "largest retry delay on a remote tier"),
    "remote_timeout_s": _Knob("NEBULA_REMOTE_TIMEOUT_S", 30.0, float,
                              "deadline of one remote operation (one request, e.g. one upload part, "
                              "with all its retries) in seconds: an outage is reported within it; "
                              "also caps the clients' connect / read timeouts. Must allow one part "
                              "(NEBULA_REMOTE_PART_BYTES) to transfer on the slowest link"),
    "zstd_level": _Knob("NEBULA_ZSTD_LEVEL", 3, int, "zstd level when compression='zstd'"),
    "confirm_timeout_s": _Knob("NEBULA_CONFIRM_TIMEOUT_S", 5.0, float,
                               "how long a tier waits for the training thread to confirm a snapshot "
                               "(next optimizer.step / save_async / wait) before checking it itself"),
    "commit_timeout_s": _Knob("NEBULA_COMMIT_TIMEOUT_S", 600.0, float,
                              "multi-rank: how long a rank waits for the others in one round of the "
                              "checkpoint protocol (a rank that died fails the save sooner)"),
    "small_replica_bytes": _Knob("NEBULA_SMALL_REPLICA_BYTES", 64 << 10, int,
                                 "multi-rank: replicated tensors smaller than this are all written by "
                                 "rank 0 (larger ones are spread over the ranks)"),
    "replica_owner_ranks": _Knob("NEBULA_REPLICA_OWNER_RANKS", 64, int,
                                 "multi-rank: replicated tensors are written by ranks 0..N-1 only (0: by "
                                 "every rank); a restoring rank then reads at most N+1 records files, and "
                                 "each of those ranks writes about 1/N of the replicated bytes"),
    "exit_timeout_s": _Knob("NEBULA_EXIT_TIMEOUT_S", 300.0, float,
                            "how long interpreter exit waits for the pending saves of a Checkpointer "
                            "that was never closed"),
    "gc_root_timeout_s": _Knob("NEBULA_GC_ROOT_TIMEOUT_S", 60.0, float,
                               "how long `nebula-ckpt gc` waits for a memory tier's root (a mount, a blob "
                               "store) to answer; a root that does not answer in time is unknown, and its "
                               "memory tier is kept"),
    "node_id": _Knob("NEBULA_NODE_ID", None, str,
                     "the node this process runs on, for memory-tier replicas (default: the host name); "
                     "ranks with one node id share a fate, so replicas go to other node ids. Tests "
                     "simulate nodes on one machine with it (each with its own NEBULA_SHM_DIR)"),
    "replica_pull_chunk_bytes": _Knob("NEBULA_REPLICA_PULL_CHUNK_BYTES", 8 << 20, int,
                                      "multi-rank: bytes per transfer of a memory-tier copy pulled from a "
                                      "partner at restore (the puller allocates the next chunk and checks "
                                      "the tensors landed while one arrives)"),
    "replica_keep_after_s": _Knob("NEBULA_REPLICA_KEEP_AFTER_S", 1.0, float,
                                  "multi-rank: after a restore that pulled memory-tier copies from partners, "
                                  "how long the replicas' thread waits (unless a save or close() comes first) "
                                  "before pulling them again into the memory tiers, so that the copies do not "
                                  "compete with the first training steps for the cores"),
    "replica_pull_huge_pages": _Knob("NEBULA_REPLICA_PULL_HUGE_PAGES", True, _bool,
                                     "multi-rank: receive a memory-tier copy pulled from a partner at restore "
                                     "into transparent huge pages where the kernel gives them (48 MB made in "
                                     "2-4 ms instead of 10-20; off where the kernel's compaction stalls for "
                                     "huge pages cost more than that)"),
    "replica_timeout_s": _Knob("NEBULA_REPLICA_TIMEOUT_S", 600.0, float,
                               "multi-rank: how long a memory-tier replica transfer (one round of sends and "
                               "receives among the ranks) may take before the replicas of that save fail"),
    "replica_nice": _Knob("NEBULA_REPLICA_NICE", 10, int,
                          "multi-rank: the threads that move and check memory-tier replicas during "
                          "training run this much nicer than the process (Linux, 0-19; 0: same priority), "
                          "so that on a machine without idle cores replication yields to training"),
    "small_unguarded_bytes": _Knob("NEBULA_SMALL_UNGUARDED_BYTES", 1 << 20, int,
                                   "unguarded CPU tensors (no module or optimizer hook can make their next "
                                   "change wait for the copy) up to this many bytes in all are copied on the "
                                   "training thread, so the rest of an asynchronous save still overlaps; "
                                   "more, or any on a GPU, make the save synchronous"),
    "incremental_full_every": _Knob("NEBULA_INCREMENTAL_FULL_EVERY", 10, int,
                                    "incremental saves: every N-th save a tier writes is a full checkpoint "
                                    "(N >= 1; 1: every save full), so the steps a checkpoint refers to stay "
                                    "few and retention can drop old ones", least=1),
    "hash_threads": _Knob("NEBULA_HASH_THREADS", None, int,
                          "incremental saves: threads that take the SHA-256 of staged tensors off the "
                          "training thread (default: io_threads)"),
    "hash_nice": _Knob("NEBULA_HASH_NICE", 10, int,
                       "incremental saves: the hash threads run this much nicer than the process "
                       "(Linux, 0-19; 0: same priority), so that on a machine without idle cores "
                       "hashing yields to training instead of taking its cores"),
    "restore_chunk_bytes": _Knob("NEBULA_RESTORE_CHUNK_BYTES", 64 << 20, int,
                                 "restore: most bytes checksummed or copied between two drops of the mapped "
                                 "source pages (what a restore keeps resident beyond the owned bytes)"),
    "log_level": _Knob("NEBULA_LOG_LEVEL", None, str,
                       "level of the 'nebula_ckpt' logger if set (DEBUG, INFO, ...)"),
    "progress_delay_s": _Knob("NEBULA_PROGRESS_DELAY_S", 2.0, float,
                              "seconds a `nebula-ckpt` command works before it draws a progress bar "
                              "(only on a terminal, never with --json)"),
    "persistent_storage_path": _Knob("NEBULA_PERSISTENT_STORAGE_PATH", None, str,
                                     "torch_nebula compat: the root when init() is given no "
                                     "persistent_storage_path (as Azure ML Nebula read it)"),
    "persistent_time_interval": _Knob("NEBULA_PERSISTENT_TIME_INTERVAL", None, str,
                                      "torch_nebula compat: seconds between persisted checkpoints when "
                                      "init() is given no persistent_time_interval"),
    "memory_buffer_size": _Knob("NEBULA_MEMORY_BUFFER_SIZE", None, str,
                                "torch_nebula compat: Azure ML Nebula's streaming buffer size; ignored "
                                "(init() warns): nebula_ckpt stages whole checkpoints, capped by "
                                "host_memory_budget"),
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
    if name in ("copy_threads", "io_threads", "hash_threads") and knob.default is None:
        return _default_threads()
    if name == "fault_ahead_threads" and knob.default is None:
        return _default_fault_threads()
    return knob.default


def chosen(name: str) -> bool:
    """Whether knob ``name`` was set (by the environment or :func:`override`), not left at its default."""
    with _lock:
        if name in _overrides:
            return True
    return bool(os.environ.get(_KNOBS[name].env))


def _checked(name: str, knob: _Knob, value: Any, where: str) -> Any:
    """``value`` of knob ``name`` (``where`` it came from), or a ValueError when it is below the
    knob's least value."""
    if knob.least is not None and value is not None and value < knob.least:
        raise ValueError(f"knob {name} ({where}) is {value!r}: it must be >= {knob.least}; {knob.doc}")
    return value


def check_all() -> None:
    """Read every knob that has a least value (a ValueError naming the first one out of range)."""
    for name, knob in _KNOBS.items():
        if knob.least is not None:
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
