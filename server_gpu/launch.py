"""Running the server: in the foreground (the CLI) or in a background thread (tests, benchmarks).

`BackgroundServer` binds its socket before uvicorn starts, so port 0 gives a free port with no race,
and `stop()` always shuts uvicorn and the engine down (use it as a context manager).
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn
from fastapi import FastAPI

from edgefinfer.errors import UserError


def bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _config(app: FastAPI, log_level: str) -> uvicorn.Config:
    # One process and one event loop: the engine thread is the only place a model runs.
    return uvicorn.Config(app, log_level=log_level, access_log=False, timeout_graceful_shutdown=5,
                          limit_concurrency=None, backlog=2048)


def serve_forever(app: FastAPI, host: str, port: int, log_level: str = "info") -> None:
    sock = bind(host, port)
    server = uvicorn.Server(_config(app, log_level))
    server.run(sockets=[sock])


class BackgroundServer:
    """uvicorn + the app in a daemon thread on 127.0.0.1 (a random free port by default)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self._sock = bind(host, port)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._server = uvicorn.Server(_config(app, log_level))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="edgefinfer-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
