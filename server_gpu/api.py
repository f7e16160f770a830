"""The OpenAI-compatible HTTP API (FastAPI): completions, chat, models, health, metrics.

Every request is tokenized and validated here, in the event loop, then handed to the engine thread.
Outputs come back per step; streaming answers them as server-sent events in OpenAI's chunk format.
A client that goes away is noticed by a task that waits for `http.disconnect`, whatever the stream
is doing (even while the request still waits in the queue), and its request is aborted at once,
which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from edgefinfer.errors import UserError
from edgefinfer.decoding.sampling import SamplingParams
from edgefinfer.server_gpu import openai_format as fmt
from edgefinfer.server_gpu.engine import ServingEngine
from edgefinfer.server_gpu.metrics import CONTENT_TYPE
from edgefinfer.server_gpu.protocol import (APIError, ChatCompletionRequest, ChatCompletionResponse,
                                            CompletionRequest, CompletionResponse, ErrorResponse, ModelList,
                                            error_body)
from edgefinfer.server_gpu.request import GenerationParams, RequestOutput
from edgefinfer.decoding.structured import Constraint
from edgefinfer.decoding import tool_calls

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 1 << 20
    max_n: int = 16
    max_stop: int = 4
    max_logprobs: int = 20
    max_prompt_tokens: int | None = None  # default: the model length minus one


# With "stream": true the 200 answer is server-sent events, not one JSON body; the schema is one event's.
_STREAMED = {200: {"content": {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a chunk object as JSON, then [DONE]"}}}}}}}


# ------------------------------------------------------------------------------------------- app
def create_app(engine: ServingEngine, model_name: str, api_key: str | None = None,
               limits: ServerLimits = ServerLimits(), close_engine: bool = True) -> FastAPI:
    """The ASGI app. Its lifespan starts the engine thread on the server's event loop, and at shutdown
    stops it and (with `close_engine`) frees the model and its KV memory. `app.state.shutdown` drains
    it gracefully (see `Shutdown`). The routes declare the API (paths, models, auth); their work is in
    `_complete` and `_chat`."""
    served = _Served.of(engine, model_name, limits)
    app = _app_shell(engine, close_engine, served.limits)
    auth = _bearer_auth(api_key)

    @app.get("/health")
    async def health() -> dict:
        if not engine.alive:
            raise APIError(503, "the engine thread is not running", type="server_error")
        return {"status": "ok"}

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList, dependencies=[Depends(auth)])
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": served.created,
                                            "owned_by": "edgefinfer", "max_model_len": served.max_len,
                                            "meta": engine.executor.describe()}]}

    @app.post("/v1/completions", response_model=CompletionResponse, dependencies=[Depends(auth)],
              responses=_STREAMED)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _complete(served, body, request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, dependencies=[Depends(auth)],
              responses=_STREAMED)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await _chat(served, body, request)

    return app


@dataclass(frozen=True)
class _Served:
    """What every route of one app reads, fixed when the app is created: the engine, the model's name,
    length and vocabulary, and the limits a request is held to."""

    engine: ServingEngine
    model_name: str
    created: int
    max_len: int
    vocab: int
    max_prompt: int
    limits: ServerLimits

    @classmethod
    def of(cls, engine: ServingEngine, model_name: str, limits: ServerLimits) -> "_Served":
        max_len, vocab = engine.executor.max_model_len, engine.executor.vocab_size
        max_prompt = min(limits.max_prompt_tokens or max_len - 1, max_len - 1)
        # A request's n choices run together, so n can never exceed the sequences the engine runs at once.
        limits = dataclasses.replace(limits, max_n=min(limits.max_n, engine.scheduler.config.max_num_seqs))
        return cls(engine, model_name, int(time.time()), max_len, vocab, max_prompt, limits)

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")


def _app_shell(engine: ServingEngine, close_engine: bool, limits: ServerLimits) -> FastAPI:
    """The FastAPI app without routes: the engine's lifespan, the graceful shutdown, the body limit and
    the error handlers (every error in OpenAI's JSON shape)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start(asyncio.get_running_loop())
        yield
        if close_engine:
            engine.close()
        else:
            engine.stop()

    app = FastAPI(title="edgefinfer", version="1", lifespan=lifespan,
                  description="OpenAI-compatible server: continuous batching over llama.cpp or torch.",
                  responses={400: {"model": ErrorResponse}, 401: {"model": ErrorResponse},
                             404: {"model": ErrorResponse}, 413: {"model": ErrorResponse}})
    app.state.shutdown = Shutdown(engine)
    # Starlette runs the last added middleware first: the body is read before a 503 goes out (see BodyLimit).
    app.add_middleware(ShutdownGate, shutdown=app.state.shutdown)
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)
    app.add_middleware(Arrivals, engine=engine)
    _install_error_handlers(app)
    return app


def _bearer_auth(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    """The routes' dependency that refuses a request without `Authorization: Bearer <api_key>` (401);
    with no key, every request passes."""
    expected = f"Bearer {api_key}".encode() if api_key is not None else None

    async def auth(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if expected is not None and not hmac.compare_digest(given, expected):  # constant time
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    return auth


async def _complete(served: _Served, body: CompletionRequest, request: Request) -> Response:
    """/v1/completions: validate, tokenize, submit, answer (a JSON body or a stream)."""
    engine, limits = served.engine, served.limits
    served.check_model(body.model)
    if body.echo or body.suffix or (body.best_of not in (None, 1, body.n)):
        raise APIError(400, "echo, suffix and best_of are not supported by this server", param="echo")
    prompts = _completion_prompts(engine, body.prompt, served.max_prompt)
    params = _params(body, max(len(p) for p in prompts), served.max_len, served.vocab, limits, body.max_tokens,
                     body.logprobs, "logprobs")
    params = await _with_grammar(engine, params, _constraint(body))
    rid = f"cmpl-{uuid.uuid4().hex}"
    builder = fmt.CompletionBuilder(engine.tokenizer, rid, served.model_name, created=int(time.time()), n=body.n,
                                    logprobs=body.logprobs is not None)
    return await _respond(request, engine, rid, prompts, params, builder, body.stream,
                          bool(body.stream_options and body.stream_options.include_usage))


async def _chat(served: _Served, body: ChatCompletionRequest, request: Request) -> Response:
    """/v1/chat/completions: validate, render the messages (and tools) through the chat template,
    submit, answer; a reply that may call a tool follows the tool-call grammar."""
    engine, limits = served.engine, served.limits
    served.check_model(body.model)
    if not body.messages:
        raise APIError(400, "messages must hold at least one message", param="messages")
    tools, constraint = _chat_tools(body)
    calling = bool(tools)
    ids = _chat_prompt(engine, body, tools, served.max_prompt)
    top = body.top_logprobs
    if top is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = _params(body, len(ids), served.max_len, served.vocab, limits, max_tokens,
                     (top or 0) if body.logprobs else None, "top_logprobs")
    params = await _with_grammar(engine, params, constraint, "tools" if calling else "response_format")
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    builder = fmt.ChatBuilder(engine.tokenizer, rid, served.model_name, created=int(time.time()), n=body.n,
                              logprobs=body.logprobs, tools=calling)
    return await _respond(request, engine, rid, [ids], params, builder, body.stream,
                          bool(body.stream_options and body.stream_options.include_usage))


# ------------------------------------------------------------------------------------------- chat
def _chat_tools(body: ChatCompletionRequest) -> tuple[list, Constraint | None]:
    """(the tools the reply may call, none with tool_choice "none"; the constraint the reply follows:
    the tool-call grammar when it may call one, else the request's response_format, if any)."""
    try:
        tools = tool_calls.parse_tools(body.tools or [])
    except UserError as e:
        raise APIError(400, str(e), param="tools") from None
    try:
        choice = tool_calls.parse_tool_choice(body.tool_choice, tools)
    except UserError as e:
        raise APIError(400, str(e), param="tool_choice") from None
    constraint = _constraint(body)
    if choice == "none":
        return [], constraint
    if constraint is not None:
        raise APIError(400, "tools and a response_format or structured_outputs constraint exclude each "
                            "other; send one of them (or tool_choice \"none\")", param="response_format")
    return tools, tool_calls.tool_call_constraint(tools, choice, body.parallel_tool_calls)


def _chat_prompt(engine: ServingEngine, body: ChatCompletionRequest, tools: list, max_prompt: int) -> list[int]:
    """The prompt ids: the messages (and the tools they may call) through the model's chat template."""
    messages = [{"role": m.role, "content": _check_text(m.text(), "messages"),
                 "tool_calls": [c.model_dump() for c in m.tool_calls] if m.tool_calls else None}
                for m in body.messages]
    try:
        text = engine.tokenizer.apply_chat_template(tool_calls.render_messages(messages, tools))
    except UserError as e:
        raise APIError(400, str(e), param="messages") from None
    ids = engine.tokenizer.encode(text)
    _check_prompt(ids, max_prompt, "messages")
    return ids


# ------------------------------------------------------------------------------------------- validation
def _completion_prompts(engine: ServingEngine, prompt: object, max_prompt: int) -> list[list[int]]:
    if isinstance(prompt, str):
        prompts = [engine.tokenizer.encode(_check_text(prompt, "prompt"), add_special_tokens=True)]
    elif prompt and all(isinstance(p, str) for p in prompt):
        prompts = [engine.tokenizer.encode(_check_text(p, "prompt"), add_special_tokens=True) for p in prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    elif prompt and all(isinstance(p, list) for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise APIError(400, "prompt must be a non-empty string, list of strings, or list(s) of token ids",
                       param="prompt")
    if len(prompts) > 64:
        raise APIError(400, f"at most 64 prompts per request, got {len(prompts)}", param="prompt")
    vocab = engine.executor.vocab_size
    for ids in prompts:
        _check_prompt(ids, max_prompt, "prompt")
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
    return prompts


def _check_prompt(ids: list[int], max_prompt: int, param: str) -> None:
    if not ids:
        raise APIError(400, "the prompt is empty after tokenization; give at least one token", param=param)
    if len(ids) > max_prompt:
        raise APIError(400, f"the prompt has {len(ids)} tokens; this server accepts at most {max_prompt}",
                       param=param, code="context_length_exceeded")


def _params(body, prompt_len: int, max_len: int, vocab: int, limits: ServerLimits, max_tokens: int | None,
            logprobs: int | None, logprobs_param: str) -> GenerationParams:
    room = max_len - prompt_len
    if max_tokens is None:
        max_tokens = room
    if max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if max_tokens > room:
        raise APIError(400, f"this model's context is {max_len} tokens, but {prompt_len + max_tokens} were "
                            f"requested ({prompt_len} in the prompt, {max_tokens} in the completion); "
                            f"lower max_tokens or shorten the prompt", param="max_tokens",
                       code="context_length_exceeded")
    if not 1 <= body.n <= limits.max_n:
        raise APIError(400, f"n must be in [1, {limits.max_n}], got {body.n}", param="n")
    if logprobs is not None and not 0 <= logprobs <= limits.max_logprobs:
        raise APIError(400, f"{logprobs_param} must be in [0, {limits.max_logprobs}], got {logprobs}",
                       param=logprobs_param)
    if body.presence_penalty or body.frequency_penalty:
        raise APIError(400, "presence_penalty and frequency_penalty are not supported", param="presence_penalty")
    bias = _logit_bias(body.logit_bias or {}, vocab)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > limits.max_stop or any(not s for s in stop):
        raise APIError(400, f"stop takes up to {limits.max_stop} non-empty strings", param="stop")
    temperature = 1.0 if body.temperature is None else body.temperature
    if not 0.0 <= temperature <= 2.0:
        raise APIError(400, f"temperature must be in [0, 2], got {temperature}", param="temperature")
    if 0.0 < temperature < _MIN_TEMPERATURE:
        temperature = _MIN_TEMPERATURE
    if body.seed is not None and not -(2**63) <= body.seed < 2**63:
        raise APIError(400, f"seed must be a 64-bit signed integer, got {body.seed}", param="seed")
    top_p = None if body.top_p is None or body.top_p == 1.0 else body.top_p
    try:
        sampling = SamplingParams(temperature=temperature, top_k=body.top_k, top_p=top_p, seed=body.seed)
    except UserError as e:
        raise APIError(400, str(e)) from None
    return GenerationParams(max_tokens=max_tokens, sampling=sampling, n=body.n, stop=tuple(stop), logprobs=logprobs,
                            ignore_eos=body.ignore_eos, logit_bias=bias)


def _constraint(body) -> Constraint | None:
    """The request's output constraint: OpenAI's `response_format`, or the `structured_outputs` extension."""
    so = body.structured_outputs
    given = [k for k, v in (("json", so.json_ if so else None), ("regex", so.regex if so else None),
                            ("grammar", so.grammar if so else None)) if v is not None]
    try:
        from_format = Constraint.from_response_format(body.response_format)
        if len(given) + (from_format is not None) > 1:
            raise UserError("give one constraint: response_format, or one of structured_outputs' json, regex, grammar")
        if from_format is not None or not given:
            return from_format
        if given == ["json"]:
            return Constraint.json_schema(so.json_)
        return Constraint.regex(so.regex) if given == ["regex"] else Constraint.grammar(so.grammar)
    except UserError as e:
        raise APIError(400, str(e), param="structured_outputs" if given else "response_format") from None


async def _with_grammar(engine: ServingEngine, params: GenerationParams, constraint: Constraint | None,
                        param: str = "response_format") -> GenerationParams:
    """Compile the constraint off the event loop (the first one builds the tokenizer's trie, ~0.5 s);
    one that does not compile is a 400 with the grammar engine's reason, before any token."""
    if constraint is None:
        return params
    try:
        grammar = await asyncio.to_thread(engine.grammars.compile, constraint)
    except UserError as e:
        raise APIError(400, str(e), param=param) from None
    return dataclasses.replace(params, grammar=grammar)


# Dividing float32 logits by a smaller temperature overflows them to inf (1e-300 is 0 in float32), and
# the softmax then gives NaN; vLLM raises such temperatures to 1e-2 for the same reason.
_MIN_TEMPERATURE = 1e-2


def _check_text(text: str, param: str) -> str:
    """JSON may carry lone UTF-16 surrogates ("\\ud800"), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param} is not valid Unicode: {e.object[e.start:e.end]!r} at character {e.start} "
                            f"is a lone surrogate; send UTF-8 text", param=param) from None
    return text


def _logit_bias(bias: dict[str, float], vocab: int) -> tuple[tuple[int, float], ...]:
    out = []
    for key, value in bias.items():
        if not key.isdigit() or int(key) >= vocab or not -100.0 <= value <= 100.0:
            raise APIError(400, f"logit_bias maps token ids in [0, {vocab}) to values in [-100, 100]; "
                                f"got {key!r}: {value}", param="logit_bias")
        out.append((int(key), float(value)))
    return tuple(out)


# ------------------------------------------------------------------------------------------- responses
class Submission:
    """Requests for one HTTP call (one per prompt) and the queue their outputs arrive on."""

    def __init__(self, engine: ServingEngine, request_id: str, prompts: list[list[int]], params: GenerationParams):
        self.engine = engine
        self.queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        self.pending = {f"{request_id}-{i}": i for i in range(len(prompts))}
        for rid, i in self.pending.items():
            engine.submit(rid, prompts[i], params, lambda out, i=i: self.queue.put_nowait((i, out)))

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self.pending:
            i, out = await self.queue.get()
            if out.finished:
                self.pending.pop(out.request_id, None)
            yield i, out

    def abort(self) -> None:
        for rid in self.pending:
            self.engine.abort(rid)
        self.pending.clear()


async def _respond(request: Request, engine: ServingEngine, rid: str, prompts: list[list[int]],
                   params: GenerationParams, builder: fmt.Builder, stream: bool, include_usage: bool) -> Response:
    sub = Submission(engine, rid, prompts, params)
    arrival = getattr(request.state, "arrival", None)
    if arrival is not None:
        arrival.close()  # submitted: an idle engine need not wait for this one any more
    if stream:
        return SSEResponse(_sse(sub, builder, include_usage), on_disconnect=sub.abort)

    async def collect() -> dict:
        async for i, out in sub.outputs():
            if out.error:
                raise APIError(500, out.error, type="server_error")
            builder.add(i, out)
        return builder.final()

    try:
        body = await _unless_disconnected(request.receive, collect())
    finally:
        sub.abort()  # no-op once everything finished; frees the KV of a client that left
    return JSONResponse(body) if body is not None else Response(status_code=499)


async def _sse(sub: Submission, builder: fmt.Builder, include_usage: bool) -> AsyncIterator[bytes]:
    try:
        for chunk in builder.start_chunks():
            yield _event(chunk)
        async for i, out in sub.outputs():
            if out.error:
                yield _event(error_body(out.error, "server_error"))
                break
            for chunk in builder.chunks(i, out):
                yield _event(chunk)
        if include_usage:
            yield _event(builder.usage_chunk())
        yield b"data: [DONE]\n\n"
    finally:
        sub.abort()


def _event(obj: dict) -> bytes:
    return b"data: " + _JSON.encode(obj).encode() + b"\n\n"


# One encoder for every event: json.dumps with any non-default argument builds a new one per call
# (a chunk's encoding 8.7 -> 6.3 us, warm).
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


async def _unless_disconnected(receive: Receive, work: Awaitable[dict]) -> dict | None:
    """Run `work`, or give up (None) as soon as the client disconnects."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        pending = [t for t in (task, watcher) if not t.done()]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)  # let the work's cleanup run now
    return None if task.cancelled() else task.result()


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class SSEResponse(StreamingResponse):
    """Server-sent events that also watch for the client leaving, whatever the ASGI version (Starlette
    only notices a gone client on its next write otherwise, which may be long for a queued request)."""

    def __init__(self, events: AsyncIterator[bytes], on_disconnect: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        self.events, self.on_disconnect = events, on_disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        if await _unless_disconnected(receive, _as_dict(stream())) is None:
            self.on_disconnect()
            await self.events.aclose()


async def _as_dict(work: Awaitable[None]) -> dict:
    try:
        await work
    except OSError:  # the socket broke under a write: the watcher will report the disconnect
        await asyncio.Event().wait()
    return {}


# ------------------------------------------------------------------------------------------- shutdown
class Shutdown:
    """Graceful shutdown: once `drain` starts, new requests get 503; the ones in flight may finish for
    `grace_s` seconds, then the engine ends what still runs (finish_reason "abort") and `drain` returns
    when every response has been sent, so that uvicorn's own shutdown finds nothing left to cut.

    Every stream ends with its final event, whatever the grace and however slow the machine: the
    engine's "abort" endings take one step to arrive, and a request that slips in after them (it was
    being validated at the deadline) is ended at once (`ServingEngine.end_all`). Only a client that
    stops reading can hold the exit, for at most `flush_s`."""

    def __init__(self, engine: ServingEngine, flush_s: float = 30.0):
        self.engine = engine
        self.flush_s = flush_s
        self.closed = False
        self.in_flight = 0  # HTTP requests inside the app (a stream counts until its last byte)

    async def drain(self, grace_s: float, poll_s: float = 0.02) -> dict[str, int]:
        self.closed = True
        loop = asyncio.get_running_loop()
        at_signal, deadline = self.in_flight, loop.time() + grace_s
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(poll_s)
        ended = self.in_flight
        self.engine.end_all()  # also when nothing runs: a request still being validated ends at once
        # What is left now are last chunks on their way out, and KV releases the engine does next step.
        deadline = loop.time() + self.flush_s
        while (self.in_flight or self.engine.snapshot()["kv_used"]) and loop.time() < deadline:
            await asyncio.sleep(poll_s)
        return {"in_flight": at_signal, "ended": ended, "unsent": self.in_flight,
                "kv_used": int(self.engine.snapshot()["kv_used"])}


class ShutdownGate:
    """Counts the requests in flight; once the server is shutting down, answers new ones with 503
    (all but /metrics, which monitoring keeps reading while the server drains)."""

    def __init__(self, app: ASGIApp, shutdown: Shutdown):
        self.app, self.shutdown = app, shutdown

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.shutdown.closed and scope["path"] != "/metrics":
            await _send_error(send, 503, "the server is shutting down; send the request again to another "
                                         "server, or to this one once it has restarted",
                              type="server_error", code="server_shutting_down")
            return
        self.shutdown.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.shutdown.in_flight -= 1


# ------------------------------------------------------------------------------------------- middleware
class Arrivals:
    """Opens an engine `Arrival` for each generation request as it comes in (before its body is read),
    so that an idle engine admits a burst together (`edgefinfer.server_gpu.engine`); `_respond` closes
    it once the request is submitted, and this middleware when the request ends without that."""

    PATHS = ("/v1/completions", "/v1/chat/completions")

    def __init__(self, app: ASGIApp, engine: ServingEngine):
        self.app, self.engine = app, engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.PATHS:
            await self.app(scope, receive, send)
            return
        arrival = scope.setdefault("state", {})["arrival"] = self.engine.arrival()
        try:
            await self.app(scope, receive, send)
        finally:
            arrival.close()


class BodyLimit:
    """Refuse bodies over `max_bytes` with 413 before anything parses them (Content-Length or streamed).

    An oversized body is still read (and dropped) up to `drain_bytes` before the 413 goes out: closing a
    socket whose peer is still sending makes the kernel answer with a reset, and the client then sees a
    dropped connection instead of the 413 (nginx's "lingering close" for the same reason). Beyond
    `drain_bytes` the server stops paying for the upload and answers at once.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, drain_bytes: int = 64 << 20):
        self.app, self.max_bytes, self.drain_bytes = app, max_bytes, max(drain_bytes, max_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        declared_size = int(declared) if declared is not None and declared.isdigit() else 0
        if declared_size > self.drain_bytes:
            await _send_error(send, 413, self._message())
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            more = message.get("more_body", False)
            if max(size, declared_size) <= self.max_bytes:
                chunks.append(body)
            elif size > self.drain_bytes:
                break
        if max(size, declared_size) > self.max_bytes:
            await _send_error(send, 413, self._message())
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _message(self) -> str:
        return f"the request body exceeds {self.max_bytes} bytes; send a smaller request"


async def _send_error(send: Send, status: int, message: str, type: str = "invalid_request_error",
                      code: str | None = None) -> None:
    body = json.dumps(error_body(message, type, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}"
            return JSONResponse(error_body(message), status_code=400)
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = loc[0] if loc else None  # the top-level field; the message keeps the full path
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body("internal server error", "server_error"), status_code=500)
