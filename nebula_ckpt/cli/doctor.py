"""``nebula-ckpt doctor``: what this installation runs on, in one screen.

Whether the fast native path runs (the C++ extension) or the pure-PyTorch one, and why; CUDA;
the memory tier's tmpfs (``/dev/shm`` or ``NEBULA_SHM_DIR``), its size and free room, against a
state's size when one is given (``--size-gb``: the tier needs twice the state, its newest step
beside the next); a C++ compiler (to build the extension); the blob-storage backends installed.
Exit 0; 1 when something would keep checkpoints slow or off a tier (no native path, a tmpfs too
small for the state), each such line starting with ``!``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
from typing import Any, Optional

from nebula_ckpt import knobs
from nebula_ckpt._version import __version__
from nebula_ckpt.cli.common import human_bytes, out

__all__ = ["add_doctor_parser", "cmd_doctor", "version_text", "facts"]

#: fsspec backends of the blob tiers, by URL scheme, and the extra that installs each
BACKENDS = {"az": ("adlfs", "azure"), "s3": ("s3fs", "s3"), "gs": ("gcsfs", None)}
COMPILERS = ("c++", "g++", "clang++")


def version_text() -> str:
    """``nebula-ckpt --version``: the version, the path that runs (and why), torch."""
    import torch

    from nebula_ckpt.native import describe

    d = describe()
    why = f": {d['reason']}" if d.get("reason") else ""
    return (f"nebula-ckpt {__version__} ({d['path']} path{why}; torch {torch.__version__}, "
            f"Python {platform.python_version()})")


def _shm(size_bytes: Optional[int]) -> dict[str, Any]:
    shm_dir = str(knobs.get("shm_dir"))
    try:
        st = os.statvfs(shm_dir)
    except OSError as e:
        return {"dir": shm_dir, "error": str(e), "ok": False}
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    info: dict[str, Any] = {"dir": shm_dir, "bytes": total, "free_bytes": free, "ok": True}
    if size_bytes is not None:
        room = total - int(float(knobs.get("shm_min_free_fraction")) * total)
        info.update(state_bytes=size_bytes, needs_bytes=2 * size_bytes, ok=2 * size_bytes <= room)
    return info


def facts(size_bytes: Optional[int] = None) -> dict[str, Any]:
    """Everything ``doctor`` reports, as a dict (``--json``)."""
    import torch

    from nebula_ckpt.native import describe

    native = describe()
    cuda = torch.cuda.is_available()
    return {"version": __version__, "python": platform.python_version(), "torch": torch.__version__,
            "path": native.get("path"), "path_reason": native.get("reason"), "native": native,
            "cuda": {"available": cuda, "devices": torch.cuda.device_count() if cuda else 0,
                     "torch_cuda": torch.version.cuda},
            "shm": _shm(size_bytes),
            "compiler": next((shutil.which(c) for c in COMPILERS if shutil.which(c)), None),
            "backends": {scheme: importlib.util.find_spec(mod) is not None for scheme, (mod, _) in BACKENDS.items()},
            "zstd": importlib.util.find_spec("zstandard") is not None}


def _lines(f: dict[str, Any]) -> list[tuple[bool, str]]:
    """(fine, text) of each line of the report."""
    native = f["path"] == "native"
    path = ("native path (C++ extension)" if native else
            f"pure-PyTorch path: {f['path_reason'] or 'the C++ extension is not built'}; saves block longer "
            "(rebuild it: pip install --no-build-isolation -e . with a C++ compiler, or leave it if you chose "
            "NEBULA_NO_EXTENSION=1)")
    cuda = f["cuda"]
    lines = [(True, f"nebula_ckpt {f['version']}, torch {f['torch']}, Python {f['python']}"), (native, path),
             (True, f"CUDA: {cuda['devices']} device(s), torch built with CUDA {cuda['torch_cuda']}"
              if cuda["available"] else f"CUDA: not available (torch built with CUDA {cuda['torch_cuda']})")]
    shm = f["shm"]
    if "error" in shm:
        lines.append((False, f"memory tier: {shm['dir']}: {shm['error']} (NEBULA_SHM_DIR names another tmpfs)"))
    else:
        text = f"memory tier: {shm['dir']}, {human_bytes(shm['bytes'])} ({human_bytes(shm['free_bytes'])} free)"
        if "needs_bytes" in shm:
            verdict = "room for it" if shm["ok"] else ("too small: the memory tier will stand aside (docker run "
                                                      "--shm-size, a memory-backed emptyDir, or NEBULA_SHM_DIR)")
            text += (f"; a state of {human_bytes(shm['state_bytes'])} needs {human_bytes(shm['needs_bytes'])}: "
                     f"{verdict}")
        lines.append((shm["ok"], text))
    lines.append((True, f"C++ compiler: {f['compiler']}" if f["compiler"] else
                  "C++ compiler: none found (NEBULA_NO_EXTENSION=1 installs without the extension)"))
    have = [s for s, ok in f["backends"].items() if ok]
    missing = [f"{s}:// (pip install {BACKENDS[s][0]})" for s, ok in f["backends"].items() if not ok]
    lines.append((True, f"blob backends: {', '.join(f'{s}://' for s in have) or 'none'}"
                        + (f"; not installed: {', '.join(missing)}" if missing else "")
                        + f"; zstd compression: {'yes' if f['zstd'] else 'no (pip install zstandard)'}"))
    return lines


def cmd_doctor(args: argparse.Namespace) -> int:
    """Print the report (or ``--json``); exit 1 when a line says something keeps checkpoints slow or off a tier."""
    size = None if args.size_gb is None else int(args.size_gb * 1e9)
    f = facts(size)
    lines = _lines(f)
    if args.json:
        out(json.dumps(f, indent=2, default=str))
    else:
        for fine, text in lines:
            out(("  " if fine else "! ") + text)
    return 0 if all(fine for fine, _ in lines) else 1


def add_doctor_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """The ``doctor`` subcommand and its options."""
    sp = sub.add_parser("doctor", help="native or pure path and why, CUDA, the memory tier's room, compiler, backends")
    sp.add_argument("--size-gb", type=float, default=None,
                    help="the size of the state you save: is the memory tier's tmpfs large enough for it?")
    sp.add_argument("--json", action="store_true", help="machine-readable output")

