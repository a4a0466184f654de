"""Start the tests' Python child processes warm: forked from a server that imported torch once.

Each Python process a test starts (a rank, a job to SIGKILL, the CLI) would spend ~5 s of CPU
importing torch and what a program's first optimizer imports (``torch._dynamo``); the suite starts
hundreds. :func:`popen` and :func:`run` take the arguments of ``subprocess.Popen`` /
``subprocess.run`` and give back what they give (``pid``, ``poll``, ``wait``, ``communicate``,
``kill``, ``send_signal``, ``returncode``, the pipes; a ``CompletedProcess``).

A plain Python command (``[sys.executable, (-u), SCRIPT | -c CODE | -m MODULE, *args]``, or a
console script of this interpreter such as ``nebula-ckpt``) runs in a child forked from one server
per test process. The server imported only third-party modules (``PRELOAD``), never nebula_ckpt
or a test module. The child is a real process of its own (its own pid; SIGKILL kills it for real);
it takes the command's environment, working folder, standard streams, ``sys.argv`` and
``sys.path`` as a fresh interpreter would, runs the command, and ends as the interpreter ends a
program: non-daemon threads joined, then the ``atexit`` functions, then the streams flushed.

Any other command runs through ``subprocess`` unchanged: another executable, other interpreter
flags, ``Popen`` keywords beyond these (``preexec_fn``, ``pass_fds``, ...), an environment that
differs from the server's in what the interpreter or torch's import reads (``PYTHON*`` but
``PYTHONPATH`` / ``PYTHONUNBUFFERED`` / ``PYTHONWARNINGS``, ``TORCH*``, ``LD_*``, ...; ``OMP_NUM_THREADS`` is applied in
the child), or ``NEBULA_COLD_PYTHON=1`` in it. Tests of what the interpreter itself does at exit
(its finalization, daemon threads then) call ``subprocess`` directly.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any, Optional, Sequence

PIPE, STDOUT, DEVNULL = subprocess.PIPE, subprocess.STDOUT, subprocess.DEVNULL
# torch._dynamo: what a program's first optimizer imports (~2 s of CPU, as much as torch itself)
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
           "numpy", "safetensors.torch", "fsspec", "zstandard", "psutil")
_MAX = 1 << 20


# ---------------------------------------------------------------------------------- the server

def _serve(path: str) -> None:
    """The server: import the third-party modules, then fork a child for each request."""
    import importlib
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    base_path = list(sys.path)
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    lsock.bind(path + ".new")
    lsock.listen(64)
    os.rename(path + ".new", path)  # the path appears once the server listens, not at bind()
    rfd, wfd = os.pipe()
    os.set_blocking(wfd, False)
    signal.set_wakeup_fd(wfd)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    waiting: dict[int, socket.socket] = {}
    import select
    parent = os.getppid()
    while True:
        ready, _, _ = select.select([lsock, rfd], [], [], 2.0)
        if os.getppid() != parent:  # the test process is gone (killed): so is its server
            os._exit(0)
        if rfd in ready:
            os.read(rfd, 4096)
            _reap(waiting)
        if lsock in ready:
            conn, _ = lsock.accept()
            try:
                _start(conn, lsock, (rfd, wfd), waiting, base_path)
            except OSError:  # the client went away: its child (if any) is reaped all the same
                conn.close()
            _reap(waiting)


def _start(conn: socket.socket, lsock: socket.socket, pipe: tuple[int, int], waiting: dict[int, socket.socket],
           base_path: list[str]) -> None:
    """Take one request from ``conn``: fork its child, answer with the child's pid."""
    data, fds, _, _ = socket.recv_fds(conn, _MAX, 3)
    try:
        if not data:  # the client went away before asking
            conn.close()
            return
        pid = os.fork()
        if pid == 0:
            lsock.close()
            for fd in pipe:
                os.close(fd)
            for c in waiting.values():
                c.close()
            conn.close()
            _child(json.loads(data), fds, base_path)  # never returns
    finally:
        for fd in fds:
            os.close(fd)
    waiting[pid] = conn
    conn.send(struct.pack("!q", pid))


def _reap(waiting: dict[int, socket.socket]) -> None:
    while waiting:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None:
            try:
                conn.send(struct.pack("!q", os.waitstatus_to_exitcode(status)))
            except OSError:
                pass
            conn.close()


def _child(req: dict[str, Any], fds: list[int], base_path: list[str]) -> None:
    """In the forked child: become the command's process, run it, end as the interpreter does."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        if hasattr(threading.main_thread(), "_set_native_id"):  # Python 3.11 keeps the server's at fork
            threading.main_thread()._set_native_id()  # type: ignore[attr-defined]
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in zip((0, 1, 2), fds, strict=True):
            os.dup2(fd, target)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        if req["new_session"]:
            os.setsid()
        os.environ.clear()
        os.environ.update(req["env"])
        threads = req["env"].get("OMP_NUM_THREADS") or req["env"].get("MKL_NUM_THREADS")
        if threads and threads.isdigit() and "torch" in sys.modules:  # read by torch's import: set it now
            sys.modules["torch"].set_num_threads(int(threads))
        os.chdir(req["cwd"])
        if req["umask"] is not None:
            os.umask(req["umask"])
        if req["unbuffered"] or req["env"].get("PYTHONUNBUFFERED"):
            _unbuffered()
        if req["env"].get("PYTHONWARNINGS"):  # the filters a fresh interpreter puts first at its start
            import warnings
            options = [o for o in req["env"]["PYTHONWARNINGS"].split(",") if o]
            sys.warnoptions[:] = options
            warnings._processoptions(options)  # type: ignore[attr-defined]
        extra = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        kind, what, args = req["kind"], req["what"], req["args"]
        first = os.path.dirname(os.path.realpath(what)) if kind == "script" else ("" if kind == "code" else os.getcwd())
        sys.path[:] = [first, *extra, *base_path]
        code = _run(kind, what, args)
    except SystemExit as e:  # raised before the command ran (its own exits are taken by _run)
        code = _exit_code(e)
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, exit code 1
        import traceback
        traceback.print_exc()
    code = _shutdown(code)
    if code == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


def _unbuffered() -> None:
    """What ``python -u`` makes of the standard streams: text written through to the file at once."""
    import io
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=old.encoding,  # type: ignore[type-var]
                                            errors=old.errors, write_through=True))


def _run(kind: str, what: str, args: list[str]) -> int:
    import runpy
    try:
        if kind == "script":
            sys.argv = [what, *args]
            runpy.run_path(what, run_name="__main__")
        elif kind == "module":
            sys.argv = [what, *args]
            runpy.run_module(what, run_name="__main__", alter_sys=True)
        else:
            import types
            main = types.ModuleType("__main__")
            main.__dict__["__builtins__"] = __builtins__
            sys.modules["__main__"] = main
            sys.argv = ["-c", *args]
            exec(compile(what, "<string>", "exec"), main.__dict__)  # noqa: S102 - the test's own -c code
    except SystemExit as e:
        return _exit_code(e)
    except KeyboardInterrupt:  # CPython ends such a program by SIGINT, after its shutdown
        import traceback
        traceback.print_exc()
        return -signal.SIGINT
    except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
        import traceback
        traceback.print_exc()
        return 1
    return 0


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _shutdown(code: int) -> int:
    """What ``Py_FinalizeEx`` does that a test can see: join non-daemon threads, run ``atexit``,
    flush the standard streams."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:  # noqa: BLE001
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is None or stream.closed:  # as CPython: a stream the program closed is left alone
            continue
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - CPython exits with 120 when flushing stdout fails
            code = code or 120
    return code


# ---------------------------------------------------------------------------------- the client

# what a fresh interpreter or torch's import reads from the environment: a command whose environment
# differs from the server's in one of these runs cold (OMP_NUM_THREADS is applied in the child)
_STARTUP = ("PYTHON", "TORCH", "LD_", "CUDA_", "KMP_", "GOMP_", "MKL_", "MALLOC_")
_STARTUP_SAME = ("PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONWARNINGS", "MKL_NUM_THREADS")
_server_env: dict[str, str] = {}
_server: Optional[subprocess.Popen[bytes]] = None
_server_path = ""
_server_pid = -1
_failed = False
_lock = threading.Lock()


def _socket_path() -> Optional[str]:
    """The server's socket, the server started first where this process has none running; None
    where it cannot start (said once; the children then start fresh)."""
    global _server, _server_path, _server_pid, _failed
    with _lock:
        if _server is not None and _server_pid == os.getpid() and _server.poll() is None:
            if os.path.exists(_server_path):
                return _server_path
            _server.kill()  # its socket is gone (removed by someone): a new server
            _server.wait()
        if _failed:
            return None
        # under /tmp: a socket's path must stay within 107 bytes, which a long $TMPDIR may exceed
        folder = tempfile.mkdtemp(prefix="warm-python-", dir="/tmp" if os.path.isdir("/tmp") else None)
        _server_path = os.path.join(folder, "sock")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        _server_env.clear()
        _server_env.update(_startup_vars(env))
        _server = subprocess.Popen([sys.executable, "-P", os.path.abspath(__file__), "serve", _server_path],
                                   env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   start_new_session=True)
        _server_pid = os.getpid()
        atexit.register(_stop, _server, folder, _server_pid)
        deadline = time.monotonic() + 120
        while not os.path.exists(_server_path):
            if _server.poll() is not None or time.monotonic() > deadline:
                _failed = True
                print(f"warm_python: the server did not start (exit {_server.poll()}): Python children "
                      "start fresh", file=sys.stderr)
                return None
            time.sleep(0.02)
        return _server_path


def _stop(server: subprocess.Popen[bytes], folder: str, owner: int) -> None:
    """At the exit of the test process that started ``server``: stop it, remove its folder. Not in a
    process forked from that one (a test's ``os.fork()`` whose child exits normally): the server and
    its socket are the parent's."""
    if os.getpid() != owner:
        return
    if server.poll() is None:
        server.kill()
        server.wait()
    import shutil
    shutil.rmtree(folder, ignore_errors=True)


def _startup_vars(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_STARTUP) and k not in _STARTUP_SAME}


def _umask() -> Optional[int]:
    """This process's umask, which a child started now inherits (read, not set: no window with 0)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return None


def _our_script(path: str) -> bool:
    """Whether ``path`` is a Python script of this interpreter (its ``#!`` line names it)."""
    try:
        with open(path, "rb") as f:
            first = f.readline(4096)
    except OSError:
        return False
    if not first.startswith(b"#!"):
        return False
    interpreter = first[2:].strip().decode(errors="replace")
    return os.path.realpath(os.path.dirname(interpreter)) == os.path.realpath(os.path.dirname(sys.executable)) \
        and os.path.basename(interpreter).startswith("python")


def _command(args: Sequence[Any]) -> Optional[tuple[str, str, list[str], bool]]:
    """``(kind, what, args, unbuffered)`` for a command the server can run, else None."""
    args = [os.fspath(a) for a in args]
    if args and args[0] != sys.executable and _our_script(args[0]):  # a console script: ``nebula-ckpt``
        return "script", args[0], args[1:], False
    if len(args) < 2 or args[0] != sys.executable:
        return None
    unbuffered = args[1] == "-u"
    args = [args[0], *args[1 + unbuffered:]]
    if len(args) < 2:
        return None
    if args[1] == "-c" and len(args) >= 3:
        return "code", args[2], args[3:], unbuffered
    if args[1] == "-m" and len(args) >= 3:
        return "module", args[2], args[3:], unbuffered
    if args[1].startswith("-"):
        return None
    return "script", args[1], args[2:], unbuffered


class WarmProcess:
    """A child started by the server, with the part of ``subprocess.Popen``'s interface tests use."""

    def __init__(self, path: str, args: Sequence[Any], kind: str, what: str, argv: list[str], unbuffered: bool,
                 env: dict[str, str], cwd: str, stdin: Any, stdout: Any, stderr: Any, text: bool,
                 new_session: bool) -> None:
        self.args = list(args)
        self.returncode: Optional[int] = None
        self._text = text
        mine: list[int] = []  # the parent's ends of pipes, and files opened here, closed after sending
        self.stdin: Optional[IO[Any]] = None
        self.stdout: Optional[IO[Any]] = None
        self.stderr: Optional[IO[Any]] = None
        in_fd = self._fd(stdin, 0, False, mine, "stdin")
        out_fd = self._fd(stdout, 1, True, mine, "stdout")
        err_fd = out_fd if stderr == STDOUT else self._fd(stderr, 2, True, mine, "stderr")
        req = {"kind": kind, "what": what, "args": argv, "env": env, "cwd": cwd, "new_session": new_session,
               "unbuffered": unbuffered, "umask": _umask()}
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._conn.connect(path)
            socket.send_fds(self._conn, [json.dumps(req).encode()], [in_fd, out_fd, err_fd])
            self.pid = struct.unpack("!q", self._conn.recv(8))[0]
        finally:
            for fd in mine:
                os.close(fd)

    def _fd(self, how: Any, default: int, out: bool, mine: list[int], name: str) -> int:
        if how is None:
            return default
        if how == DEVNULL:
            fd = os.open(os.devnull, os.O_WRONLY if out else os.O_RDONLY)
            mine.append(fd)
            return fd
        if how == PIPE:
            r, w = os.pipe()
            child, parent = (w, r) if out else (r, w)
            mine.append(child)
            mode = ("r" if out else "w") + ("" if self._text else "b")
            setattr(self, name, open(parent, mode, encoding="utf-8" if self._text else None))
            return child
        return int(how if isinstance(how, int) else how.fileno())

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self._conn.setblocking(False)
            try:
                self._got(self._conn.recv(8))
            except BlockingIOError:
                pass
            finally:
                if self.returncode is None:
                    self._conn.setblocking(True)
        return self.returncode

    def _got(self, data: bytes) -> None:
        # no word back: the server itself was killed; the child's status is not known
        self.returncode = struct.unpack("!q", data)[0] if len(data) == 8 else -signal.SIGKILL
        self._conn.close()

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                self._got(self._conn.recv(8))
            except socket.timeout:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
        assert self.returncode is not None
        return self.returncode

    def communicate(self, input: Any = None, timeout: Optional[float] = None) -> tuple[Any, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.stdin is not None:
            if input is not None:
                self.stdin.write(input)
            self.stdin.close()
        got: dict[str, Any] = {}

        def drain(name: str) -> None:
            stream = getattr(self, name)
            got[name] = stream.read()
            stream.close()

        readers = [threading.Thread(target=drain, args=(n,), daemon=True)
                   for n in ("stdout", "stderr") if getattr(self, n) is not None]
        for t in readers:
            t.start()
        for t in readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return got.get("stdout"), got.get("stderr")

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def __enter__(self) -> "WarmProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        for s in (self.stdout, self.stderr, self.stdin):
            if s is not None:
                s.close()
        self.wait()


def popen(args: Sequence[Any], *, env: Optional[dict[str, str]] = None, cwd: Any = None, stdin: Any = None,
          stdout: Any = None, stderr: Any = None, text: bool = False, universal_newlines: bool = False,
          start_new_session: bool = False, **kw: Any) -> Any:
    """``subprocess.Popen(args, ...)``, the child forked warm when the command is a plain Python one."""
    env = dict(os.environ if env is None else env)
    parsed = _command(args)
    if parsed is None or kw or env.get("NEBULA_COLD_PYTHON") == "1":
        return subprocess.Popen(args, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr,
                                text=text or universal_newlines, start_new_session=start_new_session, **kw)
    kind, what, argv, unbuffered = parsed
    path = _socket_path()
    if path is None or _startup_vars(env) != _server_env:  # no server, or its imports read other settings
        return subprocess.Popen(args, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr,
                                text=text or universal_newlines, start_new_session=start_new_session)
    return WarmProcess(path, args, kind, what, argv, unbuffered, env, os.fspath(cwd) if cwd else os.getcwd(), stdin,
                       stdout, stderr, text or universal_newlines, start_new_session)


def run(args: Sequence[Any], *, input: Any = None, capture_output: bool = False, timeout: Optional[float] = None,
        check: bool = False, **kw: Any) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run(args, ...)``, the child forked warm when the command is a plain Python one."""
    if capture_output:
        kw["stdout"] = kw["stderr"] = PIPE
    if input is not None:
        kw["stdin"] = PIPE
    with popen(args, **kw) as p:
        try:
            out, err = p.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            raise
        code = p.poll()
    assert code is not None
    if check and code:
        raise subprocess.CalledProcessError(code, args, out, err)
    return subprocess.CompletedProcess(args, code, out, err)


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    _serve(sys.argv[2])
