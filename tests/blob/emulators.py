"""Blob-store emulators on 127.0.0.1: Azurite (Azure Blob) and moto (S3).

The blob tests build their servers on these (:mod:`.servers` adds what only the tests need),
and the remote benchmark (``python -m benchmarks.remote --emulators``) borrows them, so there is
one way to launch either. They belong to the tests: the suite must run from a checkout without
the benchmark harness, and neither folder is installed with the package.

Install them with ``scripts/install_blob_servers.sh`` (Azurite 3.35.0 from npm into
``<repo>/.node``, the last version that runs on Node 20; ``moto[server]``, ``adlfs``, ``s3fs``
from PyPI).

Both listen on 127.0.0.1 only, on a port the OS picks (port 0; the real port is parsed from
the server's first log line). ``stop()`` takes the endpoint away and ``start()`` brings it back
on the SAME port with the SAME data:

* Azurite runs as its own node process (the pid we hold is node's own) with a temporary
  ``--location``; ``--skipApiVersionCheck`` because the SDK speaks a newer API version than
  Azurite, ``--disableTelemetry`` so that it never reaches an outside host. ``stop()`` sends
  TERM (Azurite saves its metadata on a clean exit), waits up to 10 s, then KILLs.
* moto has no on-disk persistence, so it runs inside a small helper process
  (:mod:`.moto_helper`, run as a script) that keeps the in-memory S3 state; ``stop()`` closes the listening socket *and*
  every open client connection (clients see refused / reset connections, like a crashed
  server) and ``start()`` listens again on the same port. The helper enforces request signing
  (``INITIAL_NO_AUTH_ACTION_COUNT=0``) with an IAM user it creates, so a wrong secret is
  rejected with 403 as real S3 does (plain moto accepts any credentials). No region is set:
  creating a bucket with an explicit ``us-east-1`` fails.

Example::

    with AzuriteEmulator() as az:                       # started; closed (data removed) on exit
        url = az.create_container("bench")              # "az://bench1f3a..."
        nc.Checkpointer(f"{url}/run-1", storage_options=az.storage_options)
"""

from __future__ import annotations

import http.client
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    pass

__all__ = ["AzuriteEmulator", "Emulator", "EmulatorUnavailable", "MotoEmulator", "INSTALL_SCRIPT"]

#: how to install both emulators (named in every "unavailable" message)
INSTALL_SCRIPT = "scripts/install_blob_servers.sh"
#: where the install script puts Azurite when the package runs from a repository checkout
_REPO_AZURITE = Path(__file__).resolve().parents[2] / ".node" / "node_modules" / ".bin" / "azurite-blob"

#: Azurite's well-known development account (public, documented by Microsoft).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/"
               "KBHBeksoGMGw==")

_HOST = "127.0.0.1"
_START_TIMEOUT_S = 30.0
_STOP_WAIT_S = 10.0


class EmulatorUnavailable(RuntimeError):
    """The emulator or its client library is not installed (the message says how to install)."""


def _wait_http(host: str, port: int, path: str, timeout: float) -> None:
    """Wait until an HTTP request gets any answer (any status)."""
    deadline = time.monotonic() + timeout
    last: Optional[BaseException] = None
    while time.monotonic() < deadline:
        try:
            c = http.client.HTTPConnection(host, port, timeout=2)
            c.request("GET", path)
            c.getresponse().read()
            c.close()
            return
        except OSError as e:
            last = e
            time.sleep(0.05)
    raise RuntimeError(f"emulator on {host}:{port} did not answer within {timeout:.0f}s: {last}")


def _terminate(proc: "subprocess.Popen[Any]", wait_s: float = _STOP_WAIT_S) -> None:
    """TERM the process by its pid, wait up to ``wait_s``, then KILL."""
    if proc.poll() is not None:
        return
    try:
        os.kill(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(5)


class Emulator:
    """One blob-store emulator process on 127.0.0.1 (base class; use a subclass).

    The constructor only checks that the emulator is installed and makes its temporary
    folder; :meth:`start` (or ``with``) launches it. All methods are thread-safe.

    Attributes:
        kind: ``"azure"`` or ``"s3"``.
        scheme: the URL scheme of its containers (``"az"`` / ``"s3"``).
        host, port: where it listens (``port`` is 0 until the first start).
        tmp: its private temporary folder (log, data); removed by :meth:`close`.

    Raises:
        EmulatorUnavailable: not installed (the message names :data:`INSTALL_SCRIPT`).
    """

    kind = ""
    scheme = ""

    def __init__(self) -> None:
        self.host = _HOST
        self.port = 0
        self.tmp = Path(tempfile.mkdtemp(prefix=f"nebula-{self.kind}-"))
        self.log_path = self.tmp / "server.log"
        self._lock = threading.Lock()
        self._admin_fs: Any = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.endpoint!r})"

    def __enter__(self) -> "Emulator":
        self.start()
        return self

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.close()

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://{self.host}:{self.port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """fsspec storage options (credentials + endpoint) for this emulator; plain data."""
        raise NotImplementedError

    @property
    def pid(self) -> Optional[int]:
        """The emulator's process id, ``None`` when it is not running."""
        proc = getattr(self, "proc", None)
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self) -> None:
        """Start, or restart after :meth:`stop` on the same port with the same data."""
        raise NotImplementedError

    def stop(self) -> None:
        """Stop serving: new connections are refused, open ones are dropped."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop for good and remove the temporary folder. Idempotent."""
        raise NotImplementedError

    def create_container(self, prefix: str = "c") -> str:
        """Create a fresh, uniquely named container / bucket; return its URL (``az://NAME``).

        Raises:
            Exception: the emulator's error when it refused (e.g. not started).
        """
        name = f"{prefix}{uuid.uuid4().hex[:20]}"
        fs = self._fs()
        fs.mkdir(name)
        # adlfs's mkdir only warns on failure: check the container is really there
        if self.kind == "azure":
            from fsspec.asyn import sync
            sync(fs.loop, fs.service_client.get_container_client(name).get_container_properties)
        return f"{self.scheme}://{name}"

    def log_tail(self, n: int = 3000) -> str:
        """The last ``n`` characters of the emulator's log (for failure messages)."""
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def _fs(self) -> Any:
        """Admin filesystem, created once (an S3 session costs about a second)."""
        if self._admin_fs is None:
            import fsspec
            self._admin_fs = fsspec.filesystem(self.scheme, skip_instance_cache=True,
                                               **self.storage_options)
        return self._admin_fs


class AzuriteEmulator(Emulator):
    """Azurite's blob service (a node process) on 127.0.0.1.

    Args:
        azurite_bin: the ``azurite-blob`` executable; default: the one the install script puts
            into ``<repo>/.node``, else ``azurite-blob`` on ``PATH``.
    """

    kind = "azure"
    scheme = "az"

    def __init__(self, azurite_bin: Optional[str] = None) -> None:
        found = azurite_bin or (str(_REPO_AZURITE) if _REPO_AZURITE.exists() else shutil.which("azurite-blob"))
        if not found or not Path(found).exists():
            raise EmulatorUnavailable(f"Azurite not installed ({found or _REPO_AZURITE} missing): run "
                                      f"{INSTALL_SCRIPT} (needs npm / Node >= 18)")
        if shutil.which("node") is None:
            raise EmulatorUnavailable(f"node not found on PATH (needed by Azurite); see {INSTALL_SCRIPT}")
        try:
            import adlfs  # noqa: F401
            import azure.storage.blob  # noqa: F401
        except ImportError as e:
            raise EmulatorUnavailable(f"adlfs / azure-storage-blob missing ({e}): run {INSTALL_SCRIPT}") from e
        super().__init__()
        self.bin = found
        self.data_dir = self.tmp / "data"
        self.data_dir.mkdir()
        self.proc: Optional["subprocess.Popen[bytes]"] = None

    @property
    def storage_options(self) -> dict[str, Any]:
        """``{"connection_string": ...}`` with the public development account key."""
        return {"connection_string": (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
            f"BlobEndpoint=http://{self.host}:{self.port}/{AZURITE_ACCOUNT};")}

    def start(self) -> None:
        """Start Azurite (port 0 the first time, then the same port); wait until it answers.

        Raises:
            RuntimeError: it exited or printed no port within 30 s (the message has its log).
        """
        with self._lock:
            if self.proc is not None and self.proc.poll() is None:
                return
            with open(self.log_path, "ab") as log:
                start_at = log.tell()
                cmd = [self.bin, "--blobHost", self.host, "--blobPort", str(self.port),
                       "--location", str(self.data_dir), "--silent", "--loose",
                       "--skipApiVersionCheck", "--disableTelemetry"]
                # a plain command: the pid we hold is node's own (the .bin entry is a node script)
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, cwd=self.tmp,
                                             start_new_session=True)
            deadline = time.monotonic() + _START_TIMEOUT_S
            pat = re.compile(r"successfully listens on http://[\d.]+:(\d+)")
            while True:
                with open(self.log_path, "rb") as f:
                    f.seek(start_at)
                    m = pat.search(f.read().decode(errors="replace"))
                if m:
                    self.port = int(m.group(1))
                    break
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    _terminate(self.proc)
                    raise RuntimeError(f"Azurite did not start (rc={self.proc.returncode}):\n"
                                       f"{self.log_tail()}")
                time.sleep(0.05)
            _wait_http(self.host, self.port, f"/{AZURITE_ACCOUNT}?comp=list", _START_TIMEOUT_S)

    def stop(self) -> None:
        """TERM node (Azurite saves its metadata), KILL after 10 s."""
        with self._lock:
            if self.proc is not None:
                _terminate(self.proc)

    def close(self) -> None:
        """Stop and remove the data folder."""
        self.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


class MotoEmulator(Emulator):
    """moto S3 in a helper process that keeps its state across :meth:`stop` / :meth:`start`."""

    kind = "s3"
    scheme = "s3"

    def __init__(self) -> None:
        try:
            import flask  # noqa: F401
            import moto  # noqa: F401
            import s3fs  # noqa: F401
            import werkzeug  # noqa: F401
        except ImportError as e:
            raise EmulatorUnavailable(f"moto[server] / s3fs missing ({e}): run {INSTALL_SCRIPT}") from e
        super().__init__()
        self._lines: "queue.Queue[str]" = queue.Queue()
        self.key = ""
        self.secret = ""
        self.proc: Optional["subprocess.Popen[str]"] = None
        self._running = False

    @property
    def storage_options(self) -> dict[str, Any]:
        """``key`` / ``secret`` of the helper's IAM user and ``client_kwargs.endpoint_url``."""
        return {"key": self.key, "secret": self.secret,
                "client_kwargs": {"endpoint_url": self.endpoint}}

    def start(self) -> None:
        """Launch the helper (first call) or make it listen again on the same port.

        Raises:
            RuntimeError: the helper did not answer within 30 s (the message has its log).
        """
        with self._lock:
            if self._running:
                return
            if self.proc is None:
                self._launch()
            else:
                self._command(f"start {self.port}", "Running on ")
            self._running = True

    def _launch(self) -> None:
        with open(self.log_path, "ab") as log:
            # the helper's stdout carries the control protocol; its stderr goes to the log file.
            # Run by path, not with -m: the helper needs moto only, not torch and nebula_ckpt.
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve().with_name("moto_helper.py"))],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=self.tmp,
                env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"}, text=True, bufsize=1,
                start_new_session=True)
        threading.Thread(target=self._read_stdout, daemon=True, name="moto-helper-out").start()
        _, self.key, self.secret = self._expect("credentials ").split()
        self.port = int(self._expect("Running on ").rsplit(":", 1)[1])
        _wait_http(self.host, self.port, "/", _START_TIMEOUT_S)

    def stop(self) -> None:
        """Close the listening socket and every open connection (the S3 state is kept)."""
        with self._lock:
            if not self._running:
                return
            self._command("stop", "stopped")
            self._running = False

    def close(self) -> None:
        """End the helper process and remove the temporary folder."""
        with self._lock:
            if self.proc is not None:
                try:
                    if self.proc.poll() is None and self.proc.stdin is not None:
                        self.proc.stdin.close()
                except OSError:
                    pass
                _terminate(self.proc)
            self._running = False
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _read_stdout(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())
        self._lines.put("<eof>")

    def _expect(self, prefix: str) -> str:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            try:
                line = self._lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                line = "<timeout>"
            if line.startswith(prefix):
                return line
            if line in ("<eof>", "<timeout>"):
                raise RuntimeError(f"moto helper: expected {prefix!r}, got {line}:\n{self.log_tail()}")

    def _command(self, cmd: str, reply: str) -> str:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._expect(reply)
