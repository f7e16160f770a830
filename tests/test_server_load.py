"""Load: 500 requests at concurrency 32 on the reference model, 10% of the clients hanging up
mid-stream. Every completed request must be correct and complete, none lost, no 5xx, and the KV
pool must be entirely free afterwards (read from /metrics)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("llama_cpp")

from edgefinfer.server_gpu.api import create_app  # noqa: E402
from edgefinfer.server_gpu.launch import BackgroundServer  # noqa: E402
from edgefinfer.server_gpu.loader import ServeOptions, build_engine  # noqa: E402

pytestmark = [pytest.mark.reference, pytest.mark.llamacpp]

NUM_REQUESTS, CONCURRENCY, MAX_TOKENS = 500, 32, 3
PROMPTS = [f"Fact {i}: the" for i in range(20)]


def scrape(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


async def one(client, name: str, i: int, expected: dict[str, tuple[str, str]]) -> str:
    """Run request i; returns its kind once checked ("full", "stream" or "left")."""
    prompt = PROMPTS[i % len(PROMPTS)]
    args = dict(model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    if i % 10 == 0:  # a client that hangs up after the first chunk
        stream = await client.completions.create(stream=True, **args)
        async for _ in stream:
            break
        await stream.close()
        return "left"
    if i % 2 == 0:
        text, finish = "", None
        async for chunk in await client.completions.create(stream=True, **args):
            for c in chunk.choices:
                text += c.text
                finish = c.finish_reason or finish
        assert (text, finish) == expected[prompt], (prompt, text, finish)
        return "stream"
    r = await client.completions.create(**args)
    assert (r.choices[0].text, r.choices[0].finish_reason) == expected[prompt], (prompt, r.choices[0])
    assert r.usage.completion_tokens <= MAX_TOKENS
    return "full"


def test_500_requests_at_concurrency_32_with_disconnects():
    engine, name = build_engine(ServeOptions("smollm2-135m", max_num_seqs=CONCURRENCY, max_model_len=256,
                                             threads=1))
    with BackgroundServer(create_app(engine, name)) as srv:
        sync = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        expected = {}
        for p in PROMPTS:  # each prompt alone: the reference every loaded answer must equal
            c = sync.completions.create(model=name, prompt=p, max_tokens=MAX_TOKENS, temperature=0).choices[0]
            expected[p] = (c.text, c.finish_reason)

        async def load() -> list:
            client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120,
                                        http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=64)))
            gate = asyncio.Semaphore(CONCURRENCY)

            async def bounded(i: int):
                async with gate:
                    return await one(client, name, i, expected)

            results = await asyncio.gather(*[bounded(i) for i in range(NUM_REQUESTS)], return_exceptions=True)
            await client.close()
            return results

        t0 = time.perf_counter()
        results = asyncio.run(load())
        elapsed = time.perf_counter() - t0
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, f"{len(errors)} failed, first: {errors[0]!r}"
        kinds = {k: results.count(k) for k in ("full", "stream", "left")}
        assert kinds == {"full": 250, "stream": 200, "left": 50}

        deadline = time.monotonic() + 15
        while True:
            m = scrape(srv.url)
            idle = (m["edgefinfer_num_requests_running"] == 0 and m["edgefinfer_num_requests_waiting"] == 0
                    and m['edgefinfer_kv_blocks{state="used"}'] == 0 and engine.executor.storage.num_used_slots == 0)
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert m['edgefinfer_kv_blocks{state="used"}'] == 0
        assert m['edgefinfer_kv_blocks{state="free"}'] == m["edgefinfer_kv_blocks_total"]
        assert m["edgefinfer_num_requests_running"] == 0 and m["edgefinfer_num_requests_waiting"] == 0
        finished = sum(v for k, v in m.items() if k.startswith("edgefinfer_requests_total"))
        assert finished == NUM_REQUESTS + len(PROMPTS)  # every request ended exactly once, none lost
        assert engine.executor.storage.num_used_slots == 0  # every llama sequence was removed too
        print(f"\nsteps {m['edgefinfer_step_duration_seconds_count']:.0f} taking {m['edgefinfer_step_duration_seconds_sum']:.1f}s; "
              f"{NUM_REQUESTS} requests in {elapsed:.1f}s "
              f"({m['edgefinfer_generation_tokens_total']:.0f} tokens generated in all)")
