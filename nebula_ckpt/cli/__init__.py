"""The ``nebula-ckpt`` command line: ls, verify, inspect, export, mark, gc, persist-memory, doctor, bench.

Multi-rank checkpoints (format v2) are understood everywhere: ls and verify show the job's
world size and check every rank's shard, inspect shows global shapes and which rank stores
what, export gathers one full, unsharded file (keys without the ``r<R>/`` rank prefix).

Exit codes: 0 success; 1 damage found (verify) or nothing to act on (a ROOT that is a file, too); 2
bad usage (a ROOT that is a malformed URL, too); 3 could not be read: the store did not answer (an
outage, a timeout) or this process was refused the files, so nothing is called damaged and no
older step is read in place of one that could not be read (run it again once the store answers).
ls, verify, inspect, export, mark, gc, persist-memory and doctor take ``--json`` for scripts (stdout
holds one JSON value on every exit: ``{"error": ..., "exit": N}`` when the command fails) and
``--storage-options JSON`` for a remote root (no error shows its value: it may hold credentials);
bench has options of its own: ``nebula-ckpt bench --help``.
``ls`` verifies every checksum like ``verify`` (``ls --quick`` checks sizes only) and shows
each checkpoint's tag and what it adds: the bytes its own folder holds, and for an incremental
checkpoint the bytes it refers to in earlier steps' folders and which steps those are, and its
health from the training signal (healthy / suspect / unknown; ``mark --healthy STEP`` or
``--suspect STEP`` sets it by hand). verify,
inspect and export follow the references (damage there is named with the step that holds it).
inspect and export read ``--step N``, ``--tag NAME`` or (neither, or
``--step latest``) the newest healthy step. ``export --key model`` writes only what the state
held under ``model``, named by the module's own ``state_dict()`` keys (what Hugging Face's
``from_pretrained`` loads), with the saved Hugging Face config as ``config.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from typing import Any, Callable, Optional, Sequence, TextIO, cast

from nebula_ckpt.cli.bench import cmd_bench
from nebula_ckpt.cli.choose import add_choice_arguments, step_number
from nebula_ckpt.cli.common import (
    EXIT_UNREADABLE,
    HIDDEN,
    CliParser,
    NotChecked,
    StdoutClosed,
    UsageError,
    add_storage_options,
    check_root_url,
    close_opened,
    flush_out,
    out,
    secret_values,
)
from nebula_ckpt.cli.doctor import add_doctor_parser, cmd_doctor, version_text
from nebula_ckpt.cli.export import add_export_parser, cmd_export
from nebula_ckpt.cli.gc import add_gc_parser, cmd_gc
from nebula_ckpt.cli.listing import cmd_inspect, cmd_ls
from nebula_ckpt.cli.mark import add_mark_parser, cmd_mark
from nebula_ckpt.cli.persist_memory import add_persist_memory_parser, cmd_persist_memory
from nebula_ckpt.cli.verify import cmd_verify
from nebula_ckpt.errors import NebulaError, PickleNotAllowedError
from nebula_ckpt.restore.unreadable import outage, refused_here

__all__ = ["main", "build_parser"]

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "ls": cmd_ls, "verify": cmd_verify, "inspect": cmd_inspect, "export": cmd_export, "gc": cmd_gc,
    "persist-memory": cmd_persist_memory, "mark": cmd_mark, "doctor": cmd_doctor}


def _common(sp: argparse.ArgumentParser) -> None:
    """The arguments of every command that reads a root."""
    sp.add_argument("root", help="checkpoint root: a path or fsspec URL")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    add_storage_options(sp)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``nebula-ckpt`` (``bench`` is listed; its arguments are the harness's own)."""
    p = CliParser(prog="nebula-ckpt", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    p.add_argument("--version", action="store_true",
                   help="the version, whether the native (C++) or the pure-PyTorch path runs and why, torch")
    # CliParser's too (add_subparsers makes its parsers of the parent's class); typed as argparse's
    sub = cast("argparse._SubParsersAction[argparse.ArgumentParser]", p.add_subparsers(dest="cmd"))
    sp = sub.add_parser("ls", help="steps per tier, sizes, verified/DAMAGED (checksums), health "
                                   "(healthy/suspect/unknown)")
    _common(sp)
    sp.add_argument("--quick", action="store_true",
                    help="check sizes only, not checksums (rows say 'committed (not verified)')")
    sp = sub.add_parser("verify", help="full checksum check; exit 1 on damage, 3 when a step could not be read "
                                       "(an outage)")
    _common(sp)
    sp.add_argument("--step", type=step_number, default=None, metavar="N",
                    help="only this step (default: every committed step)")
    sp = sub.add_parser("inspect", help="what a step holds: a row per top-level key (--full: every tensor and value)")
    _common(sp)
    add_choice_arguments(sp)
    sp.add_argument("--full", action="store_true",
                    help="list every tensor (dtype, shape, bytes, checksum) and every non-tensor value")
    add_export_parser(sub, _common)
    add_mark_parser(sub, _common)
    add_gc_parser(sub)
    add_persist_memory_parser(sub, _common)
    add_doctor_parser(sub)
    sub.add_parser("bench", help="benchmark against torch.save (and peers, from a checkout); see bench --help",
                   add_help=False)
    return p


def _run(args: argparse.Namespace) -> int:
    """Run one parsed command; errors become one line on stderr and exit code 1 (2 for a ROOT that
    is a malformed URL; 3 for what could not be read though it may be whole: an outage)."""
    try:
        check_root_url(getattr(args, "root", None))  # before the root is parsed, logged or shown
        return COMMANDS[args.cmd](args)
    except StdoutClosed:
        raise  # not the command's error: main stops quietly
    except UsageError as e:
        sys.stderr.write(f"nebula-ckpt {args.cmd}: error: {e}\n")
        return 2
    except PickleNotAllowedError as e:  # the library's hint names its argument; here it is a flag
        sys.stderr.write(f"nebula-ckpt: {str(e).replace('allow_pickle=True', '--allow-pickle')}\n")
        return 1
    except NotChecked as e:
        sys.stderr.write(f"nebula-ckpt: {e}\n")
        return EXIT_UNREADABLE
    except (NebulaError, OSError) as e:  # a store that did not answer (the root cannot be listed): not 1
        sys.stderr.write(f"nebula-ckpt: {e}\n")
        return EXIT_UNREADABLE if outage(e) and refused_here(e, "") is None else 1
    except Exception as e:  # damaged input must never end in a traceback; -v shows it
        if args.verbose:
            raise
        sys.stderr.write(f"nebula-ckpt: {type(e).__name__}: {e} (run with -v for the traceback)\n")
        return 1
    finally:
        close_opened()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``nebula-ckpt``: parse ``argv`` (default ``sys.argv[1:]``), run, return the
    exit code. When the reader of the output goes away (``nebula-ckpt ls ROOT | head``) the command
    stops quietly with exit 1, as Python's documentation advises for a closed pipe."""
    try:
        code = _main(argv)
        flush_out()  # a reader gone away is found here, not in the interpreter's last flush
        return code
    except StdoutClosed:
        _drop_output()
        return 1


def _drop_output() -> None:
    """Send what stdout still buffers to ``os.devnull``: the interpreter's last flush then fails no
    more (Python's documentation on SIGPIPE)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # no file behind it (a test's capture): nothing to flush
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


class _Watched:
    """A stream that passes every write on, remembering whether one came and the last error line:
    a write that starts with ``nebula-ckpt`` (``nebula-ckpt: ...``, argparse's ``nebula-ckpt ls:
    error: ...``; a command writes its error in one write, log records start otherwise)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.wrote = False
        self.error = ""

    def write(self, text: str) -> int:
        self.wrote = self.wrote or bool(text)
        if text.startswith("nebula-ckpt"):
            self.error = text
        return self.stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


#: what a command's error line starts with, left out of the JSON error
_ERROR_PREFIX = re.compile(r"^(?:nebula-ckpt(?: [\w-]+)?: (?:error: )?)+")


def _json_answered(argv: list[str]) -> int:
    """:func:`_parsed_and_run` for a ``--json`` command line: stdout holds one JSON value on every
    exit, ``{"error": ..., "exit": N}`` (the error stderr shows) where the command failed without
    printing its own (``verify``'s ``[]``, ``ls``'s rows of damaged steps are its own)."""
    out_w, err_w = _Watched(sys.stdout), _Watched(sys.stderr)
    sys.stdout, sys.stderr = out_w, err_w
    code: Optional[int] = None  # None: interrupted (a Ctrl-C, -v's traceback): no answer
    try:
        code = _parsed_and_run(argv)
    except SystemExit as e:  # argparse's usage error (2), or --help (0)
        code = e.code if isinstance(e.code, int) else None
        raise
    finally:
        sys.stdout, sys.stderr = out_w.stream, err_w.stream
        if code and not out_w.wrote:
            said = _ERROR_PREFIX.sub("", err_w.error.strip()) or f"the command failed with exit code {code}"
            out(json.dumps({"error": said, "exit": code}))
    return code


def _main(argv: Optional[Sequence[str]]) -> int:
    """:func:`main`, but for a reader of stdout gone away."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        if secret_values(argv):  # the harness's own parser would echo it
            sys.stderr.write(f"nebula-ckpt bench: error: bench takes no --storage-options ({HIDDEN})\n")
            return 2
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        try:
            return cmd_bench(argv[1:])
        except NebulaError as e:
            sys.stderr.write(f"{e}\n")
            return 1
    return _json_answered(argv) if "--json" in argv else _parsed_and_run(argv)


def _parsed_and_run(argv: list[str]) -> int:
    """Parse ``argv`` (not bench's) and run the command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        out(version_text())
        return 0
    if args.cmd is None:
        parser.error("a command is required (ls, verify, inspect, export, gc, persist-memory, doctor, bench)")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    return _run(args)
