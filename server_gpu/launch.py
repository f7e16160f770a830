"""Running the server: in the foreground (the CLI) or in a background thread (tests, benchmarks).

`BackgroundServer` binds its socket before uvicorn starts, so port 0 gives a free port with no race,
and `stop()` always shuts uvicorn and the engine down (use it as a context manager).

In the foreground, SIGTERM (or Ctrl-C) drains the server first (`api.Shutdown`): new requests get 503
while the running ones have `grace_s` seconds to finish, then uvicorn shuts down and the process
exits 0. A second signal skips what is left of the grace period.

A request sent during the shutdown gets a 503 or, once the drain is over, a refused connection, never
a connection closed without an answer: the server stops listening first, then answers what it had
already accepted (`LINGER_S`), and only then closes its connections.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from types import FrameType

import uvicorn
from fastapi import FastAPI

from edgefinfer.errors import UserError

log = logging.getLogger(__name__)

LINGER_S = 0.5  # after the drain, with the listener closed: time for accepted requests to get their 503


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


def serve_forever(app: FastAPI, host: str, port: int, log_level: str = "info", grace_s: float = 20.0) -> None:
    sock = bind(host, port)
    server = _DrainingServer(_config(app, log_level), app, grace_s)
    server.run(sockets=[sock])


class _DrainingServer(uvicorn.Server):
    """uvicorn, whose first SIGTERM/SIGINT drains the app before uvicorn's own shutdown starts."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, grace_s: float):
        super().__init__(config)
        self.app, self.grace_s = app, grace_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining or self._loop is None or self.should_exit:
            self.force_exit = self._draining  # a second signal: no more waiting
            super().handle_exit(sig, frame)
            return
        # Not recorded as uvicorn's captured signal: uvicorn would re-raise it after a clean shutdown,
        # and the process would die of SIGTERM instead of exiting 0.
        self._draining = True
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain()))

    async def _drain(self) -> None:
        log.info("shutting down: new requests get 503; the running ones have %g s to finish", self.grace_s)
        r = await self.app.state.shutdown.drain(self.grace_s)
        log.info("drained: %d request(s) in flight at the signal, %d ended at the grace deadline "
                 "(finish_reason abort), %d response(s) unsent, %d KV block(s) in use",
                 r["in_flight"], r["ended"], r["unsent"], r["kv_used"])
        # uvicorn's shutdown closes the listener and every connection at once: one accepted a moment
        # before, whose request it had not read yet, would be closed unanswered. Stop accepting first
        # (new connections are refused), answer what was accepted (503), then let uvicorn close.
        for server in self.servers:
            server.close()
        await asyncio.sleep(LINGER_S)
        self.should_exit = True


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
