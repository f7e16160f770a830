"""`edgefinfer serve --replicas N`: N copies of the serving engine as a Ray Serve deployment behind one
OpenAI-compatible endpoint.

Two deployments: `EngineReplica` (N replicas) each runs the whole single-process app of `api.create_app`
(its engine with its own threads, its routes, validation, errors, API key, streaming) in-process over
ASGI; `Ingress` (one replica, a FastAPI app under `serve.ingress`) tokenizes just enough of each request
for a routing key and streams the chosen replica's answer back byte for byte. Ray Serve does the rest:
placement, replica health checks and replacement, graceful draining; `PrefixAffinityRouter` is a Ray
Serve `RequestRouter` ranking replicas by `prefix_router.choose`.

Faults: a replica that dies before the client got a token is retried on another one (Ray replaces the
dead one; a chat stream's role-only opening chunk is held back until the first token, so it does not
count); one that dies mid-stream ends the stream with an OpenAI-shaped `error` event (a JSON answer
with a 502), so nothing hangs and no other replica's request is touched.

Imports ray at module level: only `serve --replicas` imports this module. No `from __future__ import
annotations`: FastAPI reads the ingress methods' annotations after Serve has wrapped them.
"""

import asyncio
import collections
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator

import ray
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from edgefinfer.server_gpu import prefix_router
from edgefinfer.server_gpu.metrics import CONTENT_TYPE, PREFIX
from edgefinfer.server_gpu.replica_spec import ReplicaSpec

log = logging.getLogger(__name__)

APP_NAME = "edgefinfer"
_GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
_RETRIES = 2  # replicas tried after the first for a request whose client got nothing yet


# ------------------------------------------------------------------------------------------ routing
class _PatientRouter(RequestRouter):
    # Ray probes a replica whose queue length it has not cached, and skips it when no answer comes
    # within 0.1 s (its default): on a loaded host a replica busy decoding misses that, and the request
    # goes to the next-ranked replica, a prefix miss or a skipped turn. One second, as Ray's backoff
    # would reach anyway.
    queue_len_response_deadline_s = 1.0


class PrefixAffinityRouter(_PatientRouter):
    """Ray Serve request router: a request's `routing_key` kwarg (`prefix_router.prefix_key`) picks its
    replica by consistent hashing with a load bound (queue lengths from Ray's own cache)."""

    def initialize_state(self, load_factor: float = prefix_router.DEFAULT_LOAD_FACTOR, batch: int = 0,
                         **kwargs) -> None:
        self._load_factor, self._batch = load_factor, batch

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        kwargs = pending_request.kwargs if pending_request is not None else {}
        loads = {rid: self.replica_queue_len_cache.get(r.replica_id) or 0 for rid, r in by_id.items()}
        order = prefix_router.choose(kwargs.get("routing_key"), list(by_id), loads, self._load_factor, self._batch)
        return [[by_id[rid]] for rid in order]


class RoundRobinRouter(_PatientRouter):
    """Ray Serve request router: each replica in turn (`prefix_router.round_robin`), the prompt ignored;
    the plain balancer that `--routing round-robin` compares prefix routing against."""

    def initialize_state(self, **kwargs) -> None:
        # A request's turn is fixed when it is first seen: Ray asks again for a request it could not
        # place at once, and that must not advance the cycle for the others.
        self._turns: collections.OrderedDict[str | None, int] = collections.OrderedDict()
        self._next = 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        request = pending_request.metadata.internal_request_id if pending_request is not None else None
        if request not in self._turns:
            self._turns[request], self._next = self._next, self._next + 1
            while len(self._turns) > 4096:  # requests long placed
                self._turns.popitem(last=False)
        return [[by_id[rid]] for rid in prefix_router.round_robin(self._turns[request], list(by_id))]


ROUTERS = {prefix_router.Routing.PREFIX: PrefixAffinityRouter, prefix_router.Routing.ROUND_ROBIN: RoundRobinRouter}


# ------------------------------------------------------------------------------------------ metrics board
@ray.remote(num_cpus=0)
class StatsBoard:
    """The replicas' latest counters, pushed by each replica every `STATS_PERIOD_S` (a plain Ray actor:
    a Serve handle cannot address one replica, and /metrics must show each)."""

    def __init__(self):
        self.stats: dict[str, dict] = {}

    def put(self, stats: dict) -> None:
        self.stats[stats["replica"]] = stats

    def live(self, max_age_s: float) -> list[dict]:
        """The replicas heard from in the last `max_age_s` (a dead one drops out), by id."""
        now = time.time()
        return [s for _, s in sorted(self.stats.items()) if now - s["time"] <= max_age_s]


STATS_PERIOD_S = 0.5


# ------------------------------------------------------------------------------------------ ASGI in-process
async def asgi_stream(app, method: str, path: str, query: str, headers: list[tuple[str, str]],
                      body: bytes) -> AsyncIterator[dict]:
    """Run one HTTP request through the ASGI `app` in this process; yields its `http.response.*`
    messages. Closing the generator early (the client went away) tells the app `http.disconnect`."""
    messages: asyncio.Queue[dict | None] = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query.encode(),
             "root_path": "", "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await messages.put(None)

    task = asyncio.create_task(run())
    try:
        while (message := await messages.get()) is not None:
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                break
    finally:
        gone.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 30.0)


# ------------------------------------------------------------------------------------------ deployments
class EngineReplica:
    """One serving engine and its single-process app; `http` runs a request through it."""

    def __init__(self, spec: ReplicaSpec, board):
        from edgefinfer.server_gpu.api import create_app
        from edgefinfer.server_gpu.loader import build_engine

        self.engine, self.name = build_engine(spec.opts)
        self.app = create_app(self.engine, self.name, api_key=spec.api_key, limits=spec.limits)
        self._lifespan = contextlib.AsyncExitStack()
        self._started: asyncio.Lock | None = None
        self._running = False
        self.requests = 0
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._closed = threading.Event()
        threading.Thread(target=self._report, args=(board,), name="edgefinfer-stats", daemon=True).start()

    async def _start(self) -> None:
        # The engine thread delivers onto the loop that runs the requests: Serve's user-code loop, which
        # exists only once a method runs, so the app's lifespan starts on the first call.
        self._started = self._started or asyncio.Lock()
        async with self._started:
            if not self._running:
                await self._lifespan.enter_async_context(self.app.router.lifespan_context(self.app))
                self._running = True

    async def http(self, method: str, path: str, query: str, headers: list[tuple[str, str]], body: bytes,
                   routing_key: str | None = None) -> AsyncIterator[dict]:
        await self._start()
        self.requests += path in _GENERATION_PATHS
        async for message in asgi_stream(self.app, method, path, query, headers, body):
            yield message

    def stats(self) -> dict:
        """This replica's load and prefix-cache counters (read without the engine's lock: plain ints)."""
        snap, kv = self.engine.snapshot(), self.engine.manager.stats()
        return {"replica": self.replica_id, "pid": os.getpid(), "time": time.time(), "requests": self.requests,
                "running": int(snap.get("running", 0)), "waiting": int(snap.get("waiting", 0)),
                "kv_usage": float(snap.get("kv_usage", 0.0)), "prefix_hits": int(kv.prefix_hits),
                "prefix_queries": int(kv.prefix_queries)}

    def _report(self, board) -> None:
        while not self._closed.wait(STATS_PERIOD_S):
            with contextlib.suppress(Exception):
                board.put.remote(self.stats())

    def __del__(self) -> None:
        # Serve calls this after draining (graceful_shutdown_timeout_s); free the model and its KV.
        self._closed.set()
        with contextlib.suppress(Exception):
            self.engine.close()


def _ingress_app(spec: ReplicaSpec) -> type:
    fastapi_app = FastAPI(title="edgefinfer", version="1", docs_url=None, redoc_url=None)

    class Ingress:
        def __init__(self, engines, board):
            from edgefinfer.server_gpu.loader import routing_tokenizer

            self.engines, self.board = engines, board
            self.tokenizer = routing_tokenizer(spec.opts.model)  # the replicas' split, without their weights

        def _routing_key(self, path: str, body: bytes) -> str | None:
            """The prefix key of a generation request's prompt; None for anything it cannot read (the
            replica answers that request's errors itself)."""
            if path not in _GENERATION_PATHS:
                return None
            with contextlib.suppress(Exception):
                req = json.loads(body)
                if path == "/v1/chat/completions":
                    msgs = [{"role": m["role"], "content": m.get("content") or ""} for m in req["messages"]]
                    ids = self.tokenizer.encode(self.tokenizer.apply_chat_template(msgs))
                else:
                    prompt = req["prompt"]
                    prompt = prompt[0] if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) \
                        else prompt
                    ids = self.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) \
                        else list(prompt)
                return prefix_router.prefix_key(ids, spec.opts.block_size, spec.prefix_blocks)
            return None

        @fastapi_app.get("/metrics")
        async def metrics(self) -> Response:
            return Response(render_cluster_metrics(await self.replica_stats()), media_type=CONTENT_TYPE)

        async def replica_stats(self) -> list[dict]:
            return await self.board.live.remote(4 * STATS_PERIOD_S + 1.0)

        @fastapi_app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
        async def forward(self, request: Request, path: str) -> Response:
            body = await request.body()
            args = (request.method, request.url.path, request.url.query, list(request.headers.items()), body)
            key = self._routing_key(request.url.path, body)
            for attempt in range(_RETRIES + 1):
                stream = self.engines.options(stream=True, method_name="http").remote(*args, routing_key=key)
                try:
                    start, first, complete = await _head(stream)
                except Exception as e:  # the replica died before the client got a byte: another one
                    log.warning("replica failed before answering (%s); attempt %d", type(e).__name__, attempt + 1)
                    if attempt == _RETRIES:
                        return JSONResponse(_error_body(503, "no replica could serve the request; retry"), 503)
                    continue
                headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.get("headers", [])}
                return StreamingResponse(_rest(stream, first, complete, headers), status_code=start["status"],
                                         headers=headers)
            raise AssertionError("unreachable")

    return serve.ingress(fastapi_app)(Ingress)


async def _head(stream) -> tuple[dict, bytes, bool]:
    """The response start, its first body bytes and whether that was the whole body. It waits for the
    first bytes that carry output: until they reach the client, a failed replica can still be retried.
    A stream's opening events that carry none (a chat stream's role chunk, sent before the request is
    even scheduled) are held back and go out with the first token."""
    start = await stream.__anext__()
    sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in start.get("headers", []))
    held = b""
    async for message in stream:
        body, more = message.get("body", b""), message.get("more_body", False)
        held += body
        if not more or (body and (not sse or carries_output(body))):
            return start, held, not more
    raise ConnectionError("the replica's answer ended before its body")


def carries_output(events: bytes) -> bool:
    """Whether SSE `events` hold anything a client acts on: text, a tool call, logprobs, a finish, an
    error, [DONE], or what this cannot read (passed on, to be safe); not a role-only opening chunk."""
    for line in events.split(b"\n"):
        if not line.startswith(b"data: "):
            continue
        try:
            event = json.loads(line[6:])
        except ValueError:
            return True  # [DONE], or what we cannot read
        if not isinstance(event, dict) or "error" in event or event.get("usage"):
            return True
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            if (choice.get("text") or choice.get("finish_reason") or choice.get("logprobs")
                    or any(v for k, v in delta.items() if k != "role")):
                return True
    return False


async def _rest(stream, first: bytes, complete: bool, headers: dict[str, str]) -> AsyncIterator[bytes]:
    yield first
    try:
        async for message in stream:
            if chunk := message.get("body", b""):
                yield chunk
            complete = not message.get("more_body", False)
        if complete:
            return
        reason: str = "its answer ended early"
    except Exception as e:  # the replica died mid-answer
        reason = type(e).__name__
    # End it cleanly, in the answer's own format: an SSE stream gets an OpenAI-shaped error event.
    log.warning("replica failed mid-answer: %s", reason)
    if headers.get("content-type", "").startswith("text/event-stream"):
        err = _error_body(502, "the replica serving this request failed; retry the request")
        yield b"data: " + json.dumps(err).encode() + b"\n\n"


def _error_body(status: int, message: str) -> dict:
    return {"error": {"message": message, "type": "server_error", "param": None, "code": str(status)}}


def render_cluster_metrics(stats: list[dict]) -> str:
    """Prometheus text: per-replica load and requests, the cluster's prefix-cache hit rate."""
    lines = [f"# HELP {PREFIX}_replicas Replicas answering.", f"# TYPE {PREFIX}_replicas gauge",
             f"{PREFIX}_replicas {len(stats)}"]
    for name, kind, help_, field in (
            ("replica_requests_total", "counter", "Generation requests a replica received.", "requests"),
            ("replica_requests_running", "gauge", "Sequences a replica decodes now.", "running"),
            ("replica_requests_waiting", "gauge", "Sequences waiting on a replica.", "waiting"),
            ("replica_kv_usage", "gauge", "Fraction of a replica's KV blocks in use.", "kv_usage"),
            ("replica_pid", "gauge", "A replica's process id (which process to look at, or to stop).", "pid"),
            ("replica_prefix_cache_hits_total", "counter", "Prompt tokens a replica served from its prefix cache.",
             "prefix_hits"),
            ("replica_prefix_cache_queries_total", "counter", "Prompt tokens a replica looked up in its prefix cache.",
             "prefix_queries")):
        lines += [f"# HELP {PREFIX}_{name} {help_}", f"# TYPE {PREFIX}_{name} {kind}"]
        lines += [f'{PREFIX}_{name}{{replica="{s["replica"]}"}} {s[field]}' for s in stats]
    queries = sum(s["prefix_queries"] for s in stats)
    rate = sum(s["prefix_hits"] for s in stats) / queries if queries else 0.0
    lines += [f"# HELP {PREFIX}_cluster_prefix_cache_hit_rate Prompt tokens served from a prefix cache / looked up, "
              "over all replicas.", f"# TYPE {PREFIX}_cluster_prefix_cache_hit_rate gauge",
              f"{PREFIX}_cluster_prefix_cache_hit_rate {rate!r}"]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ application
def replica_resources(threads: int, gpu_layers: int) -> dict:
    """What Ray reserves for one engine replica: its threads, and one whole GPU when layers are
    offloaded (Ray then sets CUDA_VISIBLE_DEVICES per replica: one replica per GPU)."""
    return {"num_cpus": threads, **({"num_gpus": 1} if gpu_layers > 0 else {})}


def router_kwargs(spec: ReplicaSpec) -> dict:
    """What the router's `initialize_state` gets: the prefix router, the replicas' batch size."""
    return {"batch": spec.opts.max_num_seqs} if spec.routing is prefix_router.Routing.PREFIX else {}


def build_application(spec: ReplicaSpec, n_replicas: int, threads: int, grace_s: float):
    """The Serve application: the ingress bound to N engine replicas routed by `spec.routing`."""
    engine = serve.deployment(
        EngineReplica, name="EngineReplica", num_replicas=n_replicas,
        ray_actor_options=replica_resources(threads, spec.opts.gpu_layers), max_ongoing_requests=max(spec.opts.max_num_seqs * 2, 8),
        graceful_shutdown_timeout_s=grace_s, graceful_shutdown_wait_loop_s=0.5, health_check_period_s=2.0,
        request_router_config=RequestRouterConfig(request_router_class=ROUTERS[spec.routing],
                                                  request_router_kwargs=router_kwargs(spec),
                                                  request_routing_stats_period_s=1.0))
    ingress = serve.deployment(_ingress_app(spec), name="Ingress", num_replicas=1,
                               ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)
    board = StatsBoard.remote()
    return ingress.bind(engine.bind(spec, board), board)
