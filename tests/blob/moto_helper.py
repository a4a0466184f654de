"""The moto S3 helper process of :class:`.emulators.MotoEmulator` (``python moto_helper.py``).

moto keeps S3 in memory, so stopping the server must not end the process: this helper serves
moto's S3 app on 127.0.0.1 behind a werkzeug server it can stop (dropping every open client
connection, like a crashed server) and start again on the same port, obeying ``stop``,
``start PORT`` and ``quit`` on stdin. It enforces request signing with an IAM user it creates
and prints ``credentials KEY SECRET`` first, then ``Running on http://127.0.0.1:PORT``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from werkzeug.serving import WSGIRequestHandler

_HOST = "127.0.0.1"


def _create_signing_user() -> None:  # pragma: no cover - runs in the helper process
    """Create an allow-all IAM user and print its access key as ``credentials KEY SECRET``."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.iam.models import iam_backends

    iam = iam_backends[DEFAULT_ACCOUNT_ID]["aws"]
    iam.create_user(region_name="us-east-1", user_name="nebula-emulator")
    iam.put_user_policy("nebula-emulator", "allow-all", json.dumps({
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
    ak = iam.create_access_key("nebula-emulator")
    print(f"credentials {ak.access_key_id} {ak.secret_access_key}", flush=True)


def _connection_tracking_handler(conns: set[socket.socket],
                                 conns_lock: threading.Lock) -> "type[WSGIRequestHandler]":  # pragma: no cover
    """A quiet moto request handler class that keeps every open client connection in ``conns``."""
    from moto.moto_server.werkzeug_app import MotoRequestHandler

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

    return Handler


class _MotoHelperServer:  # pragma: no cover - runs in the helper process
    """moto's S3 app behind a threaded werkzeug server that can be stopped (dropping every open
    client connection) and started again on a given port, keeping moto's in-memory state."""

    def __init__(self) -> None:
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app

        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._handler = _connection_tracking_handler(self._conns, self._conns_lock)
        self._app = DomainDispatcherApplication(create_backend_app)
        self._state: dict[str, Any] = {}

    def serve(self, port: int) -> None:
        """Listen on ``port`` (0: the OS picks) and print the ``Running on`` line with the real port."""
        from werkzeug.serving import make_server

        srv = make_server(_HOST, port, self._app, threaded=True, request_handler=self._handler)
        t = threading.Thread(target=srv.serve_forever, daemon=True)
        t.start()
        self._state.update(server=srv, thread=t)
        print(f"Running on http://{_HOST}:{srv.server_address[1]}", flush=True)

    def stop(self) -> None:
        """Close the listening socket and shut down every open client connection."""
        srv = self._state.pop("server", None)
        if srv is not None:
            srv.shutdown()
            self._state.pop("thread").join()
            srv.server_close()
        with self._conns_lock:
            for c in list(self._conns):
                try:  # the handler thread then fails its read/write and closes it
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._conns.clear()
        print("stopped", flush=True)


def _serve_commands(server: _MotoHelperServer) -> None:  # pragma: no cover - runs in the helper process
    """Obey stdin commands (``stop``, ``start PORT``) until ``quit`` or end of input."""
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "stop":
            server.stop()
        elif cmd[0] == "start":
            server.serve(int(cmd[1]))
        elif cmd[0] == "quit":
            break


def _moto_helper_main() -> None:  # pragma: no cover - runs in the helper process
    """Serve moto S3 on 127.0.0.1; stdin commands: ``stop``, ``start PORT``, ``quit``."""
    import logging

    os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"  # enforce request signing (set before moto loads)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    _create_signing_user()
    server = _MotoHelperServer()
    server.serve(0)
    _serve_commands(server)
    server.stop()


if __name__ == "__main__":
    # run as a script, Python put this folder first on sys.path: drop it so that its module
    # names (conftest, util, servers, ...) can never shadow what moto and werkzeug import
    _here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != _here]
    _moto_helper_main()
