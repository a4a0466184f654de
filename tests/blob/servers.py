"""Loopback blob servers for the tests: Azurite (Azure Blob) and moto (S3).

Both listen on 127.0.0.1 only, on a free port chosen by the OS (port 0; the real port is parsed
from the server's log line). Each server object can be stopped and started again on the SAME
port with the SAME data, so a test can take the endpoint away in the middle of an upload:

* Azurite runs as its own node process with a temporary ``--location``; ``stop()`` sends TERM
  (Azurite saves its metadata on a clean exit), waits up to 10 s, then KILLs; ``start()``
  relaunches it on the same port and folder.
* moto has no on-disk persistence, so it runs inside a small helper process (this file, run as
  a script) that keeps the in-memory S3 state; ``stop()`` closes the listening socket *and*
  every open client connection (clients see refused / reset connections, like a crashed
  server) and ``start()`` listens again on the same port. The helper enforces request signing
  (``INITIAL_NO_AUTH_ACTION_COUNT=0``) with an IAM user it creates, so a wrong secret is
  rejected with 403 the way real S3 does (plain moto accepts any credentials).

Connection info is plain data (:class:`BlobLocation`: str / dict / int) so that it can be
passed to a subprocess (``json.dumps(loc.plain())``).

Install the servers with ``scripts/install_blob_servers.sh``.
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[2]
INSTALL_SCRIPT = "scripts/install_blob_servers.sh"
AZURITE_BIN = REPO / ".node" / "node_modules" / ".bin" / "azurite-blob"

#: Azurite's well-known development account (public, documented by Microsoft).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/"
               "KBHBeksoGMGw==")

_START_TIMEOUT_S = 30.0
_STOP_WAIT_S = 10.0


class ServerUnavailable(RuntimeError):
    """The server binary / package is not installed (tests skip with this message)."""


@dataclass(frozen=True)
class BlobLocation:
    """Where a test may write: plain data, usable from another process.

    Attributes:
        kind: ``"azure"`` or ``"s3"``.
        url_prefix: ``az://<container>`` or ``s3://<bucket>``.
        storage_options: fsspec storage options (credentials + endpoint).
        endpoint: ``http://127.0.0.1:PORT`` of the server.
    """

    kind: str
    url_prefix: str
    storage_options: dict[str, Any]
    endpoint: str

    def url(self, *parts: str) -> str:
        """``url_prefix`` joined with ``parts``."""
        return "/".join([self.url_prefix.rstrip("/"), *[p.strip("/") for p in parts if p]])

    def plain(self) -> dict[str, Any]:
        """JSON-serialisable dict (for a subprocess)."""
        return asdict(self)

    @classmethod
    def from_plain(cls, d: dict[str, Any]) -> "BlobLocation":
        """Inverse of :meth:`plain`."""
        return cls(**d)


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


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
    raise RuntimeError(f"server on {host}:{port} did not answer within {timeout:.0f}s: {last}")


def _terminate(proc: subprocess.Popen, wait_s: float = _STOP_WAIT_S) -> None:
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


class BlobServer:
    """Base class: a loopback blob server with stop/start on the same port and data."""

    kind = ""

    def __init__(self) -> None:
        self.host = "127.0.0.1"
        self.port = 0
        self.tmp = Path(tempfile.mkdtemp(prefix=f"nebula-{self.kind}-"))
        self.log_path = self.tmp / "server.log"
        self._lock = threading.Lock()
        self._default: Optional[BlobLocation] = None

    # --- public API -------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://{self.host}:{self.port}"

    @property
    def url_prefix(self) -> str:
        """URL prefix of the session's default container / bucket."""
        assert self._default is not None
        return self._default.url_prefix

    @property
    def storage_options(self) -> dict[str, Any]:
        """fsspec storage options for this server."""
        return self._storage_options()

    def location(self, container: str) -> BlobLocation:
        """Plain connection info for ``container`` (not created)."""
        scheme = "az" if self.kind == "azure" else "s3"
        return BlobLocation(self.kind, f"{scheme}://{container}", self._storage_options(),
                            self.endpoint)

    def new_container(self, prefix: str = "t") -> BlobLocation:
        """Create a fresh, uniquely named container / bucket and return its location."""
        name = f"{prefix}{uuid.uuid4().hex[:20]}"
        self._create_container(name)
        return self.location(name)

    def log_tail(self, n: int = 3000) -> str:
        """Last characters of the server log (for failure messages)."""
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def start(self) -> None:
        """Start (or restart on the same port and data)."""
        raise NotImplementedError

    def stop(self) -> None:
        """Stop serving: new connections are refused, open ones are dropped."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop for good and remove the data folder."""
        raise NotImplementedError

    def freeze(self) -> None:
        """SIGSTOP the server process: connections are still accepted (by the kernel) but no
        request is ever answered -- a hung endpoint, unlike :meth:`stop`'s refused one."""
        os.kill(self._pid(), signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT after :meth:`freeze` (harmless when not frozen or not running)."""
        try:
            os.kill(self._pid(), signal.SIGCONT)
        except (ProcessLookupError, RuntimeError):
            pass

    def _pid(self) -> int:
        proc = getattr(self, "proc", None)
        if proc is None or proc.poll() is not None:
            raise RuntimeError(f"{self.kind} server is not running")
        return proc.pid

    # --- helpers ----------------------------------------------------------------------
    def _fs(self) -> Any:
        """Admin filesystem (created once: an S3 session costs about a second)."""
        fs = getattr(self, "_admin_fs", None)
        if fs is None:
            import fsspec
            proto = "az" if self.kind == "azure" else "s3"
            fs = fsspec.filesystem(proto, skip_instance_cache=True, **self._storage_options())
            self._admin_fs = fs
        return fs

    def _create_container(self, name: str) -> None:
        fs = self._fs()
        fs.mkdir(name)
        # adlfs's mkdir only warns on failure: check the container is really there
        if self.kind == "azure":
            from fsspec.asyn import sync
            sync(fs.loop, fs.service_client.get_container_client(name).get_container_properties)

    def _storage_options(self) -> dict[str, Any]:
        raise NotImplementedError


class AzuriteServer(BlobServer):
    """Azurite blob service (node process) on 127.0.0.1."""

    kind = "azure"

    def __init__(self) -> None:
        if not AZURITE_BIN.exists():
            raise ServerUnavailable(
                f"Azurite not installed ({AZURITE_BIN} missing): run "
                f"{INSTALL_SCRIPT} (needs npm / Node >= 18)")
        if shutil.which("node") is None:
            raise ServerUnavailable(f"node not found on PATH (needed by Azurite); see {INSTALL_SCRIPT}")
        try:
            import adlfs  # noqa: F401
            import azure.storage.blob  # noqa: F401
        except ImportError as e:
            raise ServerUnavailable(f"adlfs / azure-storage-blob missing ({e}): run {INSTALL_SCRIPT}")
        super().__init__()
        self.data_dir = self.tmp / "data"
        self.data_dir.mkdir()
        self.proc: Optional[subprocess.Popen] = None
        self.start()
        self._default = self.new_container("session")

    def _storage_options(self) -> dict[str, Any]:
        return {"connection_string": (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
            f"BlobEndpoint=http://{self.host}:{self.port}/{AZURITE_ACCOUNT};")}

    def start(self) -> None:
        with self._lock:
            if self.proc is not None and self.proc.poll() is None:
                return
            log = open(self.log_path, "ab")
            start_at = log.tell()
            cmd = [str(AZURITE_BIN), "--blobHost", self.host, "--blobPort", str(self.port),
                   "--location", str(self.data_dir), "--silent", "--loose",
                   "--skipApiVersionCheck", "--disableTelemetry"]
            # a plain command: the pid we hold is node's own (the .bin entry is a node script)
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=self.tmp,
                                         start_new_session=True)
            log.close()
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
        with self._lock:
            if self.proc is not None:
                _terminate(self.proc)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


class MotoServer(BlobServer):
    """moto S3 in a helper process that keeps its state across stop()/start()."""

    kind = "s3"

    def __init__(self) -> None:
        try:
            import moto  # noqa: F401
            import s3fs  # noqa: F401
            import werkzeug  # noqa: F401
            import flask  # noqa: F401
        except ImportError as e:
            raise ServerUnavailable(f"moto[server] / s3fs missing ({e}): run {INSTALL_SCRIPT}")
        super().__init__()
        self._lines: "queue.Queue[str]" = queue.Queue()
        self.key = ""
        self.secret = ""
        log = open(self.log_path, "ab")
        # the helper's stdout carries the control protocol; its stderr goes to the log file
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--moto-helper"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=self.tmp,
            env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"}, text=True, bufsize=1,
            start_new_session=True)
        log.close()
        threading.Thread(target=self._read_stdout, daemon=True, name="moto-helper-out").start()
        creds = self._expect("credentials ")
        _, self.key, self.secret = creds.split()
        self.port = int(self._expect("Running on ").rsplit(":", 1)[1])
        _wait_http(self.host, self.port, "/", _START_TIMEOUT_S)
        self._running = True
        self._default = self.new_container("session")

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
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
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._expect(reply)

    def _storage_options(self) -> dict[str, Any]:
        return {"key": self.key, "secret": self.secret,
                "client_kwargs": {"endpoint_url": self.endpoint}}

    def start(self) -> None:
        with self._lock:
            if self._running:
                return
            self._command(f"start {self.port}", "Running on ")
            self._running = True

    def stop(self) -> None:
        with self._lock:
            if not self._running:
                return
            self._command("stop", "stopped")
            self._running = False

    def close(self) -> None:
        with self._lock:
            try:
                if self.proc.poll() is None and self.proc.stdin is not None:
                    self.proc.stdin.close()
            except OSError:
                pass
            _terminate(self.proc)
        shutil.rmtree(self.tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------
# moto helper process (python servers.py --moto-helper)
# ------------------------------------------------------------------------------------------


def _moto_helper_main() -> None:  # pragma: no cover - runs in the helper process
    """Serve moto S3 on 127.0.0.1; stdin commands: ``stop``, ``start PORT``, ``quit``."""
    import logging

    os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"  # enforce request signing
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.iam.models import iam_backends
    from moto.moto_server.werkzeug_app import (DomainDispatcherApplication, MotoRequestHandler,
                                               create_backend_app)
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    iam = iam_backends[DEFAULT_ACCOUNT_ID]["aws"]
    iam.create_user(region_name="us-east-1", user_name="nebula-test")
    iam.put_user_policy("nebula-test", "allow-all", json.dumps({
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
    ak = iam.create_access_key("nebula-test")
    print(f"credentials {ak.access_key_id} {ak.secret_access_key}", flush=True)

    conns: set[socket.socket] = set()
    conns_lock = threading.Lock()

    class Handler(MotoRequestHandler):
        def setup(self) -> None:
            super().setup()
            with conns_lock:
                conns.add(self.connection)

        def finish(self) -> None:
            with conns_lock:
                conns.discard(self.connection)
            try:
                super().finish()
            except OSError:
                pass

        def log_message(self, *args: Any) -> None:  # quiet
            pass

    app = DomainDispatcherApplication(create_backend_app)
    state: dict[str, Any] = {}

    def serve(port: int) -> None:
        srv = make_server("127.0.0.1", port, app, threaded=True, request_handler=Handler)
        t = threading.Thread(target=srv.serve_forever, daemon=True)
        t.start()
        state.update(server=srv, thread=t)
        print(f"Running on http://127.0.0.1:{srv.server_address[1]}", flush=True)

    def stop() -> None:
        srv = state.pop("server", None)
        if srv is not None:
            srv.shutdown()
            state.pop("thread").join()
            srv.server_close()
        with conns_lock:
            for c in list(conns):
                try:  # the handler thread then fails its read/write and closes it
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            conns.clear()
        print("stopped", flush=True)

    serve(0)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "stop":
            stop()
        elif cmd[0] == "start":
            serve(int(cmd[1]))
        elif cmd[0] == "quit":
            break
    stop()


if __name__ == "__main__" and "--moto-helper" in sys.argv:
    _moto_helper_main()
