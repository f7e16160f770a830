"""The OpenAI-compatible server on the shipped reference model (SmolLM2-135M Q4_1 GGUF, llama.cpp),
driven by the official `openai` client over real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("llama_cpp")

from edgefinfer.errors import UserError  # noqa: E402
from edgefinfer.server_gpu.api import ServerLimits, create_app  # noqa: E402
from edgefinfer.server_gpu.launch import BackgroundServer  # noqa: E402
from edgefinfer.server_gpu.loader import ServeOptions, build_engine  # noqa: E402
from edgefinfer.server_gpu.request import GenerationParams  # noqa: E402
from tests.server_harness import metrics as scrape, wait_kv_idle  # noqa: E402

pytestmark = [pytest.mark.reference, pytest.mark.llamacpp]

MODEL = "smollm2-135m"
PROMPTS = [f"Write one sentence about the number {i}:" for i in range(10)] + [
    "Once upon a time", "The capital of France is", "def fibonacci(n):", "List three colors:",
    "Q: What is 2+2?\nA:", "In 1492, Columbus"]


@pytest.fixture(scope="module")
def server():
    # --batch-invariant: these tests assert exact equality with the runtime and with requests alone.
    engine, name = build_engine(ServeOptions(MODEL, max_num_seqs=16, max_model_len=512, threads=1, batch_invariant=True))
    with BackgroundServer(create_app(engine, name)) as srv:
        srv.engine, srv.name = engine, name
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def metrics(server) -> dict[str, float]:
    return scrape(server.url)


def wait_idle(server, timeout: float = 15.0) -> dict[str, float]:
    return wait_kv_idle(server.url, timeout)


def test_greedy_output_equals_the_runtime(server, client):
    from edgefinfer.model import reference
    from edgefinfer.runtime.engine import Engine

    runtime = Engine.load(reference.gguf_path(MODEL))
    prompt, question = "The capital of France is", "Name three colors."
    expect = runtime.generate(prompt, max_tokens=16)
    got = client.completions.create(model=server.name, prompt=prompt, max_tokens=16, temperature=0)
    assert got.choices[0].text == expect.text
    assert got.usage.completion_tokens == len(expect.token_ids) + (expect.finish_reason == "stop")
    expect_chat = runtime.generate(question, max_tokens=16, chat=True)
    chat = client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": question}],
                                          max_tokens=16, temperature=0)
    assert chat.choices[0].message.content == expect_chat.text
    assert chat.choices[0].finish_reason == expect_chat.finish_reason


def test_sixteen_concurrent_greedy_requests_equal_each_alone(server, client):
    ask = dict(model=server.name, max_tokens=16, temperature=0, logprobs=0)
    alone = [client.completions.create(prompt=p, **ask).choices[0] for p in PROMPTS]

    async def together():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        rs = await asyncio.gather(*[aclient.completions.create(prompt=p, **ask) for p in PROMPTS])
        await aclient.close()
        return [r.choices[0] for r in rs]

    batched = asyncio.run(together())
    for a, b in zip(alone, batched):
        assert b.text == a.text
        assert b.logprobs.tokens == a.logprobs.tokens
        # One KV stream per sequence: not just the same argmax, the very same logits.
        assert b.logprobs.token_logprobs == a.logprobs.token_logprobs


def test_streaming_chat_and_parallel_choices(server, client):
    messages = [{"role": "user", "content": "Count from one to five."}]
    full = client.chat.completions.create(model=server.name, messages=messages, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model=server.name, messages=messages, max_tokens=20,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert full.usage.prompt_tokens > 0 and full.usage.completion_tokens > 0

    # n > 1 forks the prompt's KV: greedy choices must all equal the single greedy answer.
    one = client.completions.create(model=server.name, prompt=PROMPTS[11], max_tokens=12, temperature=0)
    three = client.completions.create(model=server.name, prompt=PROMPTS[11], max_tokens=12, temperature=0, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.text for c in three.choices} == {one.choices[0].text}
    sampled = dict(model=server.name, prompt=PROMPTS[11], max_tokens=12, temperature=1.0, n=2, seed=3)
    first, again = client.completions.create(**sampled), client.completions.create(**sampled)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seeded: reproducible
    streamed = list(client.completions.create(stream=True, **sampled))
    texts = {0: "", 1: ""}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [texts[0], texts[1]] == [c.text for c in first.choices]
    assert wait_idle(server)['edgefinfer_kv_blocks{state="used"}'] == 0


def test_logprobs_and_stop_strings(server, client):
    r = client.completions.create(model=server.name, prompt=PROMPTS[12], max_tokens=8, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and max(top.values()) == logprob and top[token] == logprob  # greedy = top-1
    assert "".join(lp.tokens) == r.choices[0].text

    text = client.completions.create(model=server.name, prompt=PROMPTS[11], max_tokens=24,
                                     temperature=0).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = client.completions.create(model=server.name, prompt=PROMPTS[11], max_tokens=24, temperature=0,
                                    stop=[stop, "never-there"])
    assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_bad_input_gets_openai_errors_and_the_server_keeps_serving(server, client):
    url = server.url + "/v1/completions"
    ok = {"model": server.name, "prompt": "Hi", "max_tokens": 2}
    cases = [
        (httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}), 400, None),
        (httpx.post(url, json={**ok, "max_tokens": "ten"}), 400, "max_tokens"),
        (httpx.post(url, json={**ok, "temperature": "hot"}), 400, "temperature"),
        (httpx.post(url, json={**ok, "prompt": 42}), 400, "prompt"),
        (httpx.post(url, json={**ok, "max_tokens": -1}), 400, "max_tokens"),
        (httpx.post(url, json={**ok, "max_tokens": 10**12}), 400, "max_tokens"),
        (httpx.post(url, json={**ok, "n": 0}), 400, "n"),
        (httpx.post(url, json={**ok, "top_p": 2.0}), 400, None),
        (httpx.post(url, json={**ok, "stop": ["a", "b", "c", "d", "e"]}), 400, "stop"),
        (httpx.post(url, json={**ok, "prompt": ""}), 400, "prompt"),
        (httpx.post(url, json={"prompt": "Hi"}), 400, "model"),
        (httpx.post(url, json={**ok, "model": "gpt-17"}), 404, "model"),
        (httpx.post(url, json={**ok, "prompt": "x" * (2 << 20)}), 413, None),
        (httpx.post(server.url + "/v1/chat/completions", json={"model": server.name, "messages": "hello"}), 400,
         "messages"),
        (httpx.post(server.url + "/v1/chat/completions", json={"model": server.name, "messages": []}), 400,
         "messages"),
        (httpx.get(server.url + "/v1/nothing"), 404, None),
        (httpx.get(url), 405, None),
    ]
    for response, status, param in cases:
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["type"] == "invalid_request_error"
        if param is not None:
            assert error["param"] == param, error
    assert cases[5][0].json()["error"]["code"] == "context_length_exceeded"
    assert cases[11][0].json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=server.name, prompt="Hi", max_tokens=0)
    assert client.completions.create(model=server.name, prompt="Hi", max_tokens=2).choices[0].text
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_models_metrics_and_openapi(server, client):
    assert [m.id for m in client.models.list().data] == [server.name]
    response = httpx.get(server.url + "/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    m = metrics(server)
    for name in ("edgefinfer_num_requests_waiting", "edgefinfer_num_requests_running",
                 'edgefinfer_kv_blocks{state="free"}', 'edgefinfer_kv_blocks{state="cached"}',
                 "edgefinfer_prefix_cache_hit_rate", "edgefinfer_prefix_cache_hits_total",
                 "edgefinfer_prefix_cache_queries_total", "edgefinfer_generation_tokens_per_second",
                 "edgefinfer_time_to_first_token_seconds_count", "edgefinfer_inter_token_latency_seconds_count"):
        assert name in m
    assert m["edgefinfer_time_to_first_token_seconds_count"] > 0
    # The counts behind the rate (this server, --batch-invariant, looks nothing up: both stay 0 then).
    queries, hits = m["edgefinfer_prefix_cache_queries_total"], m["edgefinfer_prefix_cache_hits_total"]
    assert 0 <= hits <= queries
    assert m["edgefinfer_prefix_cache_hit_rate"] == pytest.approx(hits / queries if queries else 0.0, abs=1e-3)
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(paths)


def test_client_disconnect_aborts_and_frees_blocks(server):
    before = metrics(server).get('edgefinfer_requests_total{finish_reason="abort"}', 0)
    body = {"model": server.name, "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0,
            "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as r:
        for _ in zip(range(3), r.iter_lines()):
            pass  # read a little, then hang up mid-stream
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
        httpx.post(server.url + "/v1/completions", json=body, timeout=1.0)
    m = wait_idle(server)
    assert m['edgefinfer_kv_blocks{state="used"}'] == 0 and m["edgefinfer_num_requests_running"] == 0
    assert m['edgefinfer_requests_total{finish_reason="abort"}'] == before + 2


def test_prefix_sharing_between_live_sequences_is_exact():
    # A shares 32 prompt tokens (two 16-token chunks) with B while both run: B copies them from A's
    # KV stream (seq_cp of the stream, then seq_rm) and must still answer exactly as alone.
    engine, _ = build_engine(ServeOptions(MODEL, max_num_seqs=4, max_model_len=256, threads=1, batch_invariant=True,
                                          prefill_chunk=16,
                                          max_num_batched_tokens=64))
    tok = engine.tokenizer
    prefix = tok.encode("The history of the printing press is long and full of surprises. " * 3)[:40]
    a, b = prefix + tok.encode(" First,"), prefix + tok.encode(" In short,")

    def run(prompts, params):
        outs = {i: [] for i in range(len(prompts))}
        done, started = threading.Semaphore(0), threading.Event()
        for i, (p, par) in enumerate(zip(prompts, params)):
            def sink(out, i=i):
                outs[i].extend(t for d in out.deltas for t in d.token_ids)
                started.set()
                if out.finished:
                    done.release()
            engine.submit(f"r{time.monotonic_ns()}-{i}", p, par, sink)
            # A's prompt is in the cache once A streams; B then arrives while A still runs (a fixed
            # sleep raced A's whole life on a fast idle machine: A was done and its blocks freed).
            assert i > 0 or started.wait(timeout=120)
        for _ in prompts:
            assert done.acquire(timeout=120)
        return outs

    engine.start()
    try:
        alone_b = run([b], [GenerationParams(max_tokens=12)])[0]
        hits_before = engine.manager.stats().prefix_hits
        both = run([a, b], [GenerationParams(max_tokens=96, ignore_eos=True), GenerationParams(max_tokens=12)])
        assert engine.manager.stats().prefix_hits - hits_before >= 32
        assert both[1] == alone_b
    finally:
        engine.stop()
        engine.executor.close()


def test_batch_invariant_chats_behind_one_system_prompt_run_together_and_exactly():
    # --batch-invariant reuses a lender's whole aligned chunks only: 32 of the 48 shared tokens here
    # (chunks of 32, blocks of 16). b and c both recompute tokens 32..48; c used to wait for b's copy
    # of them, which it could not use either, so each chat behind one system prompt waited for the one
    # before it (issue 32: TTFT p99 29.7 s for 16 chats). Now b and c start in the same step, and
    # every answer still equals its prompt's answer alone.
    from edgefinfer.server_gpu.request import Request

    engine, _ = build_engine(ServeOptions(MODEL, max_num_seqs=4, max_model_len=128, threads=1, batch_invariant=True,
                                          prefill_chunk=32, max_num_batched_tokens=96))
    tok, sched = engine.tokenizer, engine.scheduler
    system = tok.encode("You are a patient assistant who answers in one short sentence. " * 6)[:48]
    prompts = {k: system + tok.encode(q) for k, q in (("a", " Name a color."), ("b", " Name a fruit."),
                                                       ("c", " Name a tree."))}

    def serve(batch: dict[str, list[int]]) -> tuple[dict[str, list[int]], list[set[str]]]:
        out, running = {rid: [] for rid in batch}, []
        for rid, p in batch.items():
            sched.add(Request(f"{rid}-{time.monotonic_ns()}", p, GenerationParams(max_tokens=8, ignore_eos=True), None))
        while sched.has_work():
            plan = sched.schedule()
            running.append({s.request.request_id.split("-")[0] for s in sched.running})  # this step's
            for o in sched.update(plan, engine.executor.execute(plan))[0]:
                out[o.request_id.split("-")[0]] += [t for d in o.deltas for t in d.token_ids]
        return out, running

    try:
        together, running = serve(prompts)
        assert running[0] == {"a"}  # b and c wait for a's first chunk, which they take
        assert running[1] == {"a", "b", "c"}
        assert engine.manager.stats().prefix_hits == 2 * 32 and all(len(t) == 8 for t in together.values())
        assert together == {rid: serve({rid: p})[0][rid] for rid, p in prompts.items()}
    finally:
        engine.executor.close()


def test_swap_preemption_restores_sequences_exactly():
    # 8 blocks of 16 tokens hold two of these four sequences (3 blocks each): the scheduler must
    # preempt; swapped out and back (llama_state_seq_get/set_data), every answer stays exactly alone's.
    engine, _ = build_engine(ServeOptions(MODEL, max_num_seqs=4, max_model_len=128, threads=1, batch_invariant=True,
                                          kv_blocks=8,
                                          preemption="swap"))
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:4]]
    params = GenerationParams(max_tokens=30, ignore_eos=True)

    def run(batch):
        outs, done = {}, threading.Semaphore(0)
        for i in batch:
            def sink(out, i=i):
                outs.setdefault(i, []).extend(t for d in out.deltas for t in d.token_ids)
                if out.finished:
                    done.release()
            engine.submit(f"s{time.monotonic_ns()}-{i}", prompts[i], params, sink)
        for _ in batch:
            assert done.acquire(timeout=120)
        return outs

    engine.start()
    try:
        alone = {i: run([i])[i] for i in range(4)}
        assert ("preemptions_total", ()) not in engine.metrics.counters
        assert run(range(4)) == alone
        assert engine.metrics.counters[("preemptions_total", ())] > 0
        assert engine.executor.storage.num_swapped == 0
    finally:
        engine.stop()
        engine.executor.close()


def test_unified_kv_pool_shares_prefix_cells_and_frees_everything():
    # --kv-unified: one cell pool; a prefix hit shares cells (seq_cp of a range), n > 1 forks share the
    # prompt. Not batch-invariant, so only completion and clean-up are asserted here.
    engine, _ = build_engine(ServeOptions(MODEL, max_num_seqs=4, max_model_len=256, threads=1, kv_unified=True,
                                          kv_cells=1024, prefill_chunk=16, max_num_batched_tokens=64))
    tok = engine.tokenizer
    prefix = tok.encode("A long shared preamble about lighthouses and the sea. " * 3)[:40]
    done, finishes, streaming = threading.Semaphore(0), [], threading.Event()

    def sink(out):
        finishes.extend(d.finish_reason for d in out.deltas if d.finish_reason)
        streaming.set()
        if out.finished:
            done.release()

    engine.start()
    try:
        engine.submit("u0", prefix + tok.encode(" One"), GenerationParams(max_tokens=96, ignore_eos=True), sink)
        assert streaming.wait(timeout=120)  # u0's prompt is cached and u0 still runs when u1 arrives
        engine.submit("u1", prefix + tok.encode(" Two"), GenerationParams(max_tokens=8, n=2, ignore_eos=True), sink)
        assert done.acquire(timeout=120) and done.acquire(timeout=120)
        assert finishes == ["length"] * 3
        assert engine.manager.stats().prefix_hits >= 32
        deadline = time.monotonic() + 10
        while engine.snapshot()["kv_used"] and time.monotonic() < deadline:
            time.sleep(0.02)  # the storage follows the manager's frees on the engine's next pass
        # Every block is free; the finished prompts stay as retained prefixes, one llama seq id each.
        assert engine.snapshot()["kv_used"] == 0
        assert engine.executor.storage.num_used_slots == engine.manager.stats().num_retained >= 1
    finally:
        engine.stop()
        engine.executor.close()


def test_retained_prefixes_serve_later_requests_and_yield_their_cells():
    """A finished request's prompt outlives it in llama.cpp's unified pool (vLLM's prefix cache); when
    the manager needs those blocks it evicts them, and llama.cpp really has the room: a request that
    needs the whole pool runs (a wrong count would make llama_decode fail)."""
    engine, _ = build_engine(ServeOptions(MODEL, max_num_seqs=2, max_model_len=256, threads=1, kv_unified=True,
                                          kv_cells=256, prefill_chunk=64, max_num_batched_tokens=64))
    tok = engine.tokenizer
    system = tok.encode("You are a helpful assistant who answers briefly and politely. " * 8)[:48]
    assert len(system) == 48  # three whole blocks
    done, outs = threading.Semaphore(0), {}

    def ask(rid, prompt, max_tokens):
        def sink(out):
            outs.setdefault(rid, []).extend(d.finish_reason for d in out.deltas if d.finish_reason)
            if out.finished:
                done.release()
        engine.submit(rid, prompt, GenerationParams(max_tokens=max_tokens, ignore_eos=True), sink)
        assert done.acquire(timeout=120)
        return outs[rid]

    def settled():
        deadline = time.monotonic() + 10
        while engine.snapshot()["kv_used"] and time.monotonic() < deadline:
            time.sleep(0.02)
        return engine.manager.stats()

    engine.start()
    try:
        assert ask("a", system + tok.encode(" Name a color."), 8) == ["length"]
        s = settled()
        assert s.num_retained == 1 and s.num_cached >= 3 and s.num_used == 0
        assert ask("b", system + tok.encode(" Name a fruit."), 8) == ["length"]  # after "a" ended
        assert engine.manager.stats().prefix_hits - s.prefix_hits >= 48
        s = settled()  # both keep their computed tokens, to the token: the system prompt's blocks once
        assert s.num_retained == 2 and s.num_cached == 3 + 2
        assert ask("d", tok.encode(" A different opening, with nothing shared at all, about ships. " * 3), 8) == ["length"]
        assert settled().num_retained == 3
        old = engine.manager.retained()
        assert sum(map(len, old.values())) >= 6

        # 15 of the 16 blocks: the retained prefixes must yield, and llama.cpp must have their cells back.
        long_prompt = tok.encode(" ".join(f"word{i}" for i in range(400)))[:200]
        assert ask("c", long_prompt, 40) == ["length"]
        s = settled()
        now = engine.manager.retained()
        assert sum(len(t) for r, t in now.items() if r in old) <= 1  # cut or dropped to make room
        assert s.num_used == 0 and engine.executor.storage.num_used_slots == s.num_retained == len(now)
    finally:
        engine.stop()
        engine.executor.close()


def _ask_until_kept(engine, rid: str, prompt: list[int]) -> tuple[list[int], int]:
    """8 greedy tokens of `prompt` and the prompt tokens the prefix cache served, once the request's
    blocks are free again (its prompt retained, not running)."""
    done, tokens = threading.Semaphore(0), []

    def sink(out):
        tokens.extend(t for d in out.deltas for t in d.token_ids)
        if out.finished:
            done.release()
    before = engine.manager.stats().prefix_hits
    engine.submit(rid, prompt, GenerationParams(max_tokens=8, ignore_eos=True), sink)
    assert done.acquire(timeout=120)
    deadline = time.monotonic() + 10
    while engine.snapshot()["kv_used"] and time.monotonic() < deadline:  # the storage follows next pass
        time.sleep(0.02)
    return tokens, engine.manager.stats().prefix_hits - before


@pytest.mark.parametrize("unified", [True, False], ids=["unified", "per-slot"])
def test_a_repeated_prompt_computes_only_its_last_token(unified):
    """llama-server's slots reuse a finished prompt to the token; so do both layouts: the retained
    prefix holds the block after the hit blocks token by token, so a prompt asked again reuses all its
    tokens but the last (not only its whole 16-token blocks), and answers as it did (the first ask
    computed the prompt as one batch of under 48 tokens, which flash attention computes as it computes
    one token alone: bench/results/llamacpp_cells.json). Per-slot, the request takes over the stream that
    kept the prompt (no copy), and the prefix is gone from the retained ones."""
    engine, _ = build_engine(ServeOptions(MODEL, max_num_seqs=2, max_model_len=256, threads=1, kv_unified=unified))
    tok = engine.tokenizer
    prompt = tok.encode("The lighthouse keeper climbed the stairs every evening, counting each step. " * 4)[:41]
    assert len(prompt) == 41 and len(prompt) % 16  # two whole blocks and 9 tokens into the third
    engine.start()
    try:
        first, hits = _ask_until_kept(engine, "a", prompt)
        assert hits == 0
        assert engine.manager.stats().num_retained == 1
        again, hits = _ask_until_kept(engine, "b", prompt)
        assert hits == len(prompt) - 1  # was 32: the two whole blocks only
        assert again == first
        assert engine.executor.storage.num_used_slots == engine.manager.stats().num_retained == 1
    finally:
        engine.stop()
        engine.executor.close()


def test_per_slot_a_short_shared_header_is_copied_from_a_kept_prompt_which_stays():
    """Per-slot, a prompt that shares only a header with a kept prompt (under half of either) copies the
    header's cells from that prompt's stream instead of computing them again, and the kept prompt stays
    whole for its own chat; the reply is the one computed from scratch."""
    def started():
        engine, _ = build_engine(ServeOptions(MODEL, max_num_seqs=2, max_model_len=256, threads=1))
        engine.start()
        return engine

    engine = started()
    tok = engine.tokenizer
    header = tok.encode("You are a helpful assistant who answers briefly and politely. " * 4)[:32]
    a = header + tok.encode(" The lighthouse keeper climbed the stairs every evening, counting steps." * 3)[:40]
    b = header + tok.encode(" Ships sailed past the harbour walls at dawn, their sails full of wind." * 3)[:40]
    try:
        fresh, hits = _ask_until_kept(engine, "b0", b)
        assert hits == 0
    finally:
        engine.stop()
        engine.executor.close()
    engine = started()
    try:
        _ask_until_kept(engine, "a", a)
        (kept,) = engine.manager.retained()
        again, hits = _ask_until_kept(engine, "b", b)
        assert hits == 32  # the header's two blocks, under half of a's 72 kept tokens and of b's 72
        assert kept in engine.manager.retained() and len(engine.manager.retained()) == 2
        assert again == fresh
    finally:
        engine.stop()
        engine.executor.close()


def test_per_slot_steps_feed_sequences_in_slot_order():
    """llama.cpp runs per-slot sequences in one micro-batch only where their ids follow each other in
    the batch (`split_equal(sequential=true)`), so a step must reach it in slot order whatever order the
    scheduler planned it in; and the logits still go to the sequence that asked for them."""
    from edgefinfer.server_gpu.interface import SeqWork, StepPlan

    engine, _ = build_engine(ServeOptions(MODEL, max_num_seqs=4, max_model_len=64, threads=1))
    executor = engine.executor
    try:
        assert not executor.kv_unified  # the default layout
        storage = executor.storage
        for seq_id in (30, 10, 20):  # slots 0, 1, 2
            storage.slot(seq_id)
        ids = engine.tokenizer.encode("The lighthouse keeper climbed the stairs")
        work = [SeqWork(seq_id, tuple(ids[:n]), 0, 1, ()) for seq_id, n in ((20, 5), (10, 3), (30, 4))]
        (call,) = executor._calls(work)
        assert [storage.slot(w.seq_id) for w in call] == [0, 1, 2]
        logits = {k: v.copy() for k, v in executor.execute(StepPlan((), tuple(work))).logits.items()}
        for seq_id, n in ((20, 5), (10, 3), (30, 4)):  # each row is its own prompt's: as if run alone
            storage.release(seq_id)
            alone = executor.execute(StepPlan((), (SeqWork(seq_id, tuple(ids[:n]), 0, 1, ()),))).logits[seq_id]
            assert int(alone.argmax()) == int(logits[seq_id].argmax())
            storage.release(seq_id)
    finally:
        executor.close()


def test_a_new_sequence_fills_the_hole_between_live_streams_and_the_kept_prompt_moves_intact():
    """Per-slot, each run of consecutive live slots is its own micro-batch, so a new sequence takes the
    slot that joins its live neighbours even where a finished prompt is kept: the prompt moves to a free
    stream out of the way, and a request that takes it over later reads the same cells bit for bit."""
    from edgefinfer.runtime.kv.paged_manager import RetainedPrefix
    from edgefinfer.server_gpu.interface import SeqWork, StepPlan

    engine, _ = build_engine(ServeOptions(MODEL, max_num_seqs=5, max_model_len=64, threads=1))
    executor = engine.executor
    try:
        storage = executor.storage
        ids = engine.tokenizer.encode("The lighthouse keeper climbed the stairs at dusk")

        def last_logits(seq_id, start):  # the prompt's last token fed on top of its first `start` ones
            work = SeqWork(seq_id, tuple(ids[start:]), start, 1, ())
            return executor.execute(StepPlan((), (work,))).logits[seq_id].copy()

        fresh = {}
        for seq_id in (10, 11, 12):  # slots 0, 1, 2
            executor.execute(StepPlan((), (SeqWork(seq_id, tuple(ids[:-1]), 0, 0, ()),)))
            assert storage.slot(seq_id) == seq_id - 10
        fresh[11] = last_logits(11, len(ids) - 1)
        kept = RetainedPrefix(1)
        storage.retain(11, kept, len(ids) - 1)  # seq 11 finished; its prompt stays in slot 1
        assert storage.slot(13) == 1  # joins slots 0 and 2: one run, not 0-2 and 3
        assert storage.slot(kept) == 4 and storage.moves == 1  # the free stream farthest from 0-1-2
        assert storage.slot(14) == 3  # next to the run; slot 4 keeps the prompt
        storage.release(14)
        storage.adopt(kept, 15, len(ids) - 1)  # a request that starts with the kept prompt takes it over
        assert storage.slot(15) == 4
        assert np.array_equal(last_logits(15, len(ids) - 1), fresh[11])  # the moved cells, unchanged
        storage.release(12)
        assert storage.slot(16) == 2 and storage.moves == 1  # a free slot next to the run: no move
    finally:
        executor.close()


def test_draft_model_speculation_verifies_in_the_batch():
    # The model as its own draft (its own llama context, one slot per sequence): most drafts are accepted,
    # and rejected tails are rolled back on both sides.
    from edgefinfer.model import reference

    gguf = reference.gguf_path(MODEL)
    engine, _ = build_engine(ServeOptions(MODEL, max_num_seqs=2, max_model_len=256, threads=1,
                                          speculative=f"draft:{gguf},3", adaptive_speculation=False))
    done, tokens = threading.Semaphore(0), {0: [], 1: []}
    engine.start()
    try:
        for i, prompt in enumerate(PROMPTS[11:13]):
            def sink(out, i=i):
                tokens[i].extend(t for d in out.deltas for t in d.token_ids)
                if out.finished:
                    done.release()
            engine.submit(f"d{i}", engine.tokenizer.encode(prompt), GenerationParams(max_tokens=20, ignore_eos=True),
                          sink)
        assert done.acquire(timeout=120) and done.acquire(timeout=120)
        assert [len(t) for t in tokens.values()] == [20, 20]
        drafted = engine.metrics.counters[("spec_draft_tokens_total", ())]
        assert engine.metrics.counters[("spec_accepted_tokens_total", ())] > 0.5 * drafted > 0
    finally:
        engine.stop()
        engine.executor.close()


def tiny_engine():
    """A served engine on the tiny random torch model: for what the API does whatever the model."""
    from edgefinfer.server_gpu.engine import ServingEngine, ServingEngineConfig
    from edgefinfer.server_gpu.executor_torch import TorchExecutor
    from edgefinfer.server_gpu.scheduler import SchedulerConfig
    from tests.helpers import tiny_model, tiny_tokenizer

    return ServingEngine(TorchExecutor(tiny_model(), max_num_seqs=2, max_model_len=64, block_size=4),
                         tiny_tokenizer(), (), ServingEngineConfig(SchedulerConfig(
                             max_num_seqs=2, max_num_batched_tokens=16, prefill_chunk=8, max_model_len=64)))


def test_every_generation_request_closes_its_arrival_whatever_its_answer():
    # An open Arrival holds an idle engine's first step (up to ADMIT_WAIT_S): one left open by a
    # request that was answered would slow every burst after it. Submitted, streamed, refused by the
    # handler, by validation, by the body limit, by the API key: the count returns to zero.
    engine = tiny_engine()
    with BackgroundServer(create_app(engine, "tiny", api_key="k", limits=ServerLimits(max_body_bytes=4096))) as srv:
        key = {"authorization": "Bearer k"}
        ok = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}
        asks = [(ok, key, 200), ({**ok, "stream": True}, key, 200), ({**ok, "max_tokens": 0}, key, 400),
                ({**ok, "n": "x"}, key, 400), ({**ok, "prompt": "x" * 5000}, key, 413), (ok, {}, 401)]
        for body, headers, status in asks:
            r = httpx.post(srv.url + "/v1/completions", json=body, headers=headers)
            assert r.status_code == status, (body, r.text)
            deadline = time.monotonic() + 10
            while engine.arriving and time.monotonic() < deadline:  # the middleware closes after the answer
                time.sleep(0.01)
            assert engine.arriving == 0, (body, status)
        chat = httpx.post(srv.url + "/v1/chat/completions", json={"model": "tiny", "messages": []}, headers=key)
        assert chat.status_code == 400
        time.sleep(0.05)
        assert engine.arriving == 0


def test_api_key_is_required_when_set():
    engine = tiny_engine()
    with BackgroundServer(create_app(engine, "tiny", api_key="s3cret")) as srv:
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}
        denied = httpx.post(srv.url + "/v1/completions", json=body)
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        allowed = httpx.post(srv.url + "/v1/completions", json=body, headers={"authorization": "Bearer s3cret"})
        assert allowed.status_code == 200 and allowed.json()["usage"]["completion_tokens"] == 2
        assert httpx.get(srv.url + "/health").status_code == 200  # probes need no key
    assert json.loads(json.dumps(allowed.json()))["object"] == "text_completion"


@pytest.mark.parametrize("flags, named", [(["--kv-layout", "unified"], "--kv-layout unified"),
                                          (["--kv-dtype", "f32", "--flash-attn"], "--kv-dtype f32 and --flash-attn")])
def test_batch_invariant_refuses_settings_that_would_make_it_inexact(capsys, flags, named):
    from edgefinfer.app.entry_point import run_command
    from edgefinfer.app.serve_command import serve

    assert run_command(serve, [MODEL, "--batch-invariant", *flags]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: --batch-invariant computes exactly what `edgefinfer run` does (per-slot KV, f16 K/V without "
                   f"flash attention for this model); drop {named}, or drop --batch-invariant\n")


def test_defaults_are_llama_servers_and_the_exact_mode_is_a_flag():
    from edgefinfer.runtime.backends.llamacpp_binding import CellFormat
    from edgefinfer.server_gpu.loader import KVSettings, kv_settings

    quantized, float_weights = CellFormat("f16", False), CellFormat("f32", False)  # `edgefinfer run`'s cells
    for run in (quantized, float_weights):
        assert kv_settings(ServeOptions(MODEL), run) == KVSettings(unified=False, dtype="f16", flash_attn=True)
        assert kv_settings(ServeOptions(MODEL, kv_cells=4096), run) == KVSettings(True, "f16", True)  # sizes a pool
        assert kv_settings(ServeOptions(MODEL, kv_unified=True), run) == KVSettings(True, "f16", True)
        assert kv_settings(ServeOptions(MODEL, batch_invariant=True), run) == KVSettings(False, run.dtype,
                                                                                          run.flash_attn)
        assert kv_settings(ServeOptions(MODEL, sessions=("a.efs",)), run) == KVSettings(True, run.dtype, run.flash_attn)
        assert kv_settings(ServeOptions(MODEL, kv_unified=False, flash_attn=False), run) == KVSettings(False, "f16",
                                                                                                      False)
    with pytest.raises(UserError, match="need the unified pool with f32 K/V without flash attention .* drop --kv-dtype "
                                        "f16 and --flash-attn"):
        kv_settings(ServeOptions(MODEL, sessions=("a.efs",), kv_dtype="f16", flash_attn=True), float_weights)
