"""`edgefinfer serve --replicas` (issue 32 items 1-3): the real CLI on a real local Ray instance on 127.0.0.1,
2 replicas of 1 thread each on the tiny GGUF, against the single-process server for the same text; prefix
routing read back from the per-replica metrics; a replica killed under load; the bad-input lines.
Ray starts once for the module (tens of seconds on 2 cores)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llama_cpp")
pytest.importorskip("ray.serve")
psutil = pytest.importorskip("psutil")

from edgefinfer.server_gpu import prefix_router  # noqa: E402
from edgefinfer.server_gpu.api import create_app  # noqa: E402
from edgefinfer.server_gpu.launch import BackgroundServer  # noqa: E402
from edgefinfer.server_gpu.loader import ServeOptions, build_engine  # noqa: E402
from tests.server_harness import ROOT, free_port, tiny_gguf, wait_healthy  # noqa: E402

pytestmark = [pytest.mark.llamacpp]

SERVE = [sys.executable, "-m", "edgefinfer.app.serve_command"]
FLAGS = ["--max-num-seqs", "4", "--max-model-len", "512", "--batch-invariant", "--log-level", "warning"]
# 94 tokens on the tiny vocabulary, over the 4 blocks of 16 that the routing key hashes: shared text only.
SHARED = "You are a careful assistant. " + " ".join(["answer every question with the facts you know"] * 3)
KEY = {"authorization": "Bearer k"}  # the cluster runs with --api-key k; the single server ignores it
PROMPTS = ["hello world", "the quick brown fox", "once upon a time there was"]


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> str:
    return str(tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf"))


def _start_cluster(gguf: str, log, *extra: str) -> tuple[str, subprocess.Popen]:
    """`edgefinfer serve GGUF --replicas 2 --threads 1 ...` in its own process (its own local Ray)."""
    port = free_port()
    with open(log, "w") as out:  # a file, not a pipe: nobody reads Ray's chatter while the tests run
        proc = subprocess.Popen([*SERVE, gguf, "--replicas", "2", "--threads", "1", "--port", str(port), "--api-key", "k",
                                 *FLAGS, *extra],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=150)  # one replica answers /health: the other may still be loading
        deadline = time.monotonic() + 120
        while _metric(url, "replicas") < 2:
            if time.monotonic() > deadline:
                raise RuntimeError("the second replica did not come up")
            time.sleep(0.5)
        time.sleep(2.0)  # and Ray's routers hear of it
    except RuntimeError:
        _stop_cluster(proc)
        pytest.fail(f"serve --replicas did not come up: {log.read_text()[-2000:]}")
    return url, proc


def _stop_cluster(proc: subprocess.Popen) -> None:
    """SIGTERM (Serve drains, Ray shuts down); should that not end it, kill it and every process it
    started, so that no Ray process outlives the tests."""
    family: list[psutil.Process] = []
    with contextlib.suppress(psutil.NoSuchProcess):
        family = psutil.Process(proc.pid).children(recursive=True)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)
    for p in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


@pytest.fixture(scope="module")
def cluster(gguf, tmp_path_factory):
    url, proc = _start_cluster(gguf, tmp_path_factory.mktemp("replicas") / "serve.log")
    try:
        yield url, proc
    finally:  # test_sigterm_drains_every_replica may have stopped it already
        _stop_cluster(proc)


@pytest.fixture(scope="module")
def single(gguf):
    engine, name = build_engine(ServeOptions(gguf, max_num_seqs=4, max_model_len=512, threads=1, batch_invariant=True))
    with BackgroundServer(create_app(engine, name)) as srv:
        srv.name = name
        yield srv


def _complete(url: str, prompt: str, max_tokens: int = 12, stream: bool = False) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    return httpx.post(url + "/v1/completions", json=body, headers=KEY, timeout=60)


def _streamed_text(resp: httpx.Response) -> str:
    events = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
    return "".join(e["choices"][0]["text"] for e in events)


def _replica_counts(url: str) -> dict[str, int]:  # what each replica last reported
    text = httpx.get(url + "/metrics", timeout=30).text
    return {m[1]: int(m[2]) for m in re.finditer(r'edgefinfer_replica_requests_total\{replica="([^"]+)"\} (\d+)', text)}


def _metric(url: str, name: str) -> float:
    return float(re.search(rf"^edgefinfer_{name} (\S+)$", httpx.get(url + "/metrics", timeout=30).text, re.M)[1])


# ------------------------------------------------------------------------------------------ item 1
def test_same_greedy_text_as_one_process(cluster, single):
    url, _ = cluster
    for prompt in PROMPTS:
        ref = _complete(single.url, prompt).json()["choices"][0]["text"]
        assert _complete(url, prompt).json()["choices"][0]["text"] == ref
        streamed = _complete(url, prompt, stream=True)
        assert streamed.headers["content-type"].startswith("text/event-stream")
        assert streamed.text.rstrip().endswith("data: [DONE]")
        assert _streamed_text(streamed) == ref


def test_errors_and_routes_are_the_single_servers(cluster, single):
    url, _ = cluster
    for path, body in (("/v1/completions", {"model": "tiny", "prompt": "", "max_tokens": 4}),
                       ("/v1/completions", {"model": "nope", "prompt": "hi"}),
                       ("/v1/chat/completions", {"model": "tiny", "messages": []})):
        ours, ref = (httpx.post(u + path, json=body, headers=KEY, timeout=60) for u in (url, single.url))
        assert (ours.status_code, ours.json()) == (ref.status_code, ref.json())
    assert httpx.get(url + "/v1/models", headers=KEY, timeout=30).json()["data"][0]["id"] == "tiny"
    no_key = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi"}, timeout=60)
    assert (no_key.status_code, no_key.json()["error"]["code"]) == (401, "invalid_api_key")
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    assert _metric(url, "replicas") == 2


def test_replicas_run_at_normal_priority(cluster):
    _, proc = cluster  # Ray's workers default to nice 15, which yields a replica's cores to anything else
    assert [p.nice() for p in _engine_replicas(proc)] == [0, 0]


# ------------------------------------------------------------------------------------------ item 2
def test_shared_prefix_lands_on_one_replica(cluster):
    url, _ = cluster
    time.sleep(1.2)  # two report periods: earlier tests' requests are counted before we start
    before = _replica_counts(url)
    for tail in ("first question", "second question", "a third one", "and the fourth", "fifth", "sixth"):
        assert _complete(url, f"{SHARED} {tail}", max_tokens=4).status_code == 200
    deadline = time.monotonic() + 15  # replicas report every 0.5 s
    while sum((after := _replica_counts(url)).values()) < sum(before.values()) + 6 and time.monotonic() < deadline:
        time.sleep(0.5)
    gained = sorted(after[r] - before.get(r, 0) for r in after)
    assert gained == [0, 6], (before, after)  # one after another: no load spills them
    assert 0 <= _metric(url, "cluster_prefix_cache_hit_rate") <= 1  # per-slot KV (--batch-invariant) keeps no prompt


def test_cluster_hit_rate_pools_the_replicas_counters():
    from edgefinfer.server_gpu.replicas import render_cluster_metrics

    stats = [{"replica": r, "pid": 7, "requests": n, "running": 0, "waiting": 0, "kv_usage": 0.0, "prefix_hits": h,
              "prefix_queries": q} for r, n, h, q in (("a", 3, 90, 100), ("b", 1, 0, 300))]
    text = render_cluster_metrics(stats)
    assert "edgefinfer_cluster_prefix_cache_hit_rate 0.225\n" in text  # (90 + 0) / (100 + 300), not the mean
    assert 'edgefinfer_replica_requests_total{replica="b"} 1\n' in text
    assert 'edgefinfer_replica_pid{replica="a"} 7\n' in text


def test_routing_policy_is_consistent_and_load_bounded():
    ids = list(range(100))
    key = prefix_router.prefix_key(ids, 16)
    assert key == prefix_router.prefix_key(ids[:64] + [7] * 30, 16)  # only the leading 4 blocks count
    assert prefix_router.prefix_key(ids[:15], 16) is None
    replicas = ["a", "b", "c"]
    home = prefix_router.choose(key, replicas, {})[0]
    assert prefix_router.choose(key, list(reversed(replicas)), {})[0] == home
    # The home replica over the bound: the key's next replica takes it; with no key, the least loaded.
    loads = {home: 10}
    assert prefix_router.choose(key, replicas, loads)[0] != home
    assert prefix_router.choose(None, replicas, {"a": 3, "b": 1, "c": 2})[0] == "b"
    # Under its batch size (--max-num-seqs) the home replica keeps the key, whatever the others' loads.
    assert prefix_router.choose(key, replicas, loads, batch=16)[0] == home
    assert prefix_router.choose(key, replicas, {home: 16}, batch=16)[0] != home
    # A replica leaving moves only its own keys.
    keys = [prefix_router.prefix_key([i] * 16, 16) for i in range(200)]
    homes = {k: prefix_router.choose(k, replicas, {})[0] for k in keys}
    moved = [k for k in keys if homes[k] != "c" and prefix_router.choose(k, ["a", "b"], {})[0] != homes[k]]
    assert moved == []


def test_round_robin_takes_each_replica_in_turn():
    firsts = [prefix_router.round_robin(turn, ["b", "c", "a"])[0] for turn in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    assert prefix_router.round_robin(4, ["b", "a"]) == ["a", "b"]  # the rest follow, for Ray to fall back on
    assert prefix_router.round_robin(3, []) == []


# ------------------------------------------------------------------------------------------ item 3
def _engine_replicas(proc: subprocess.Popen) -> list[psutil.Process]:
    kids = psutil.Process(proc.pid).children(recursive=True)
    return [p for p in kids if "EngineReplica" in " ".join(p.cmdline())]


def _event_text(event: str) -> str:
    choice = (json.loads(event[6:]).get("choices") or [{}])[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def _stream_outcome(client: httpx.AsyncClient, url: str, prompt: str, chat: bool = False,
                          max_tokens: int = 230) -> str:
    """How one streamed request ended: done ([DONE]), error (an error event after some text), error
    before any token (what a retry should have spared it), 5xx, or what else went wrong."""
    path, body = ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}) if chat else \
        ("/v1/completions", {"prompt": prompt})
    body |= {"model": "tiny", "max_tokens": max_tokens, "temperature": 0, "stream": True}  # tiny: 256 ctx
    async with client.stream("POST", url + path, json=body, headers=KEY) as resp:
        if resp.status_code != 200:
            return "5xx" if resp.status_code >= 500 else f"status {resp.status_code}: {(await resp.aread())[:200]!r}"
        events = [line async for line in resp.aiter_lines() if line.startswith("data: ")]
    if any('"error"' in e for e in events):
        return "error" if any(_event_text(e) for e in events if e.startswith("data: {") and '"error"' not in e) \
            else "error before any token"
    return "done" if events and events[-1] == "data: [DONE]" else f"truncated: {events[-2:]}"


def _wait_replaced(url: str, proc: subprocess.Popen, timeout: float = 90) -> None:
    """Until Ray has replaced a killed replica: two report to /metrics and two processes run."""
    deadline = time.monotonic() + timeout
    while _metric(url, "replicas") < 2 or len(_engine_replicas(proc)) < 2:
        assert time.monotonic() < deadline, "the killed replica was not replaced"
        time.sleep(2)


def test_replica_dying_before_a_token_is_retried_elsewhere(cluster, single):
    """A frozen replica (SIGSTOP) holds its requests without a byte sent; killed, it loses none of
    them: each is served by the other replica, with the single server's text."""
    url, proc = cluster
    prompts = [f"{word} {SHARED}" for word in ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf",
                                                "hotel")]  # distinct leading blocks: keys on both replicas
    refs = [_complete(single.url, p).json()["choices"][0]["text"] for p in prompts]
    for p in prompts[:2]:  # fresh queue lengths in Ray's router, so it sends to the frozen one unprobed
        _complete(url, p)
    victim = _engine_replicas(proc)[0]
    victim.suspend()

    async def load() -> tuple[int, list[httpx.Response]]:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"model": "tiny", "max_tokens": 12, "temperature": 0}
            tasks = [asyncio.create_task(client.post(url + "/v1/completions", json=body | {"prompt": p}, headers=KEY))
                     for p in prompts]
            await asyncio.sleep(3)  # the other replica answers its share in well under a second
            stuck = sum(not t.done() for t in tasks)
            victim.kill()
            return stuck, await asyncio.gather(*tasks)

    try:
        stuck, answers = asyncio.run(asyncio.wait_for(load(), 150))  # nothing hangs
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            victim.kill()
    assert stuck > 0  # some requests were held by the frozen replica
    assert [a.status_code for a in answers] == [200] * len(prompts)
    assert [a.json()["choices"][0]["text"] for a in answers] == refs
    _wait_replaced(url, proc)


def test_killed_replica_ends_its_requests_cleanly_and_is_replaced(cluster):
    """A replica SIGKILLed under 12 streams (4 decode on each replica, the rest wait): a stream that had text
    ends with an error event; one that had none (waiting; a chat stream's role chunk does not count) is
    retried on the other replica and completes."""
    url, proc = cluster
    victims = _engine_replicas(proc)
    assert len(victims) == 2

    async def load() -> list[str]:
        async with httpx.AsyncClient(timeout=90) as client:
            tasks = [asyncio.create_task(_stream_outcome(client, url, f"{i} {p}", chat=i % 2 == 1,
                                                         max_tokens=200 if i % 2 else 230))
                     for i in range(4) for p in PROMPTS]
            await asyncio.sleep(0.5)
            victims[0].kill()
            return await asyncio.gather(*tasks)

    outcomes = asyncio.run(asyncio.wait_for(load(), 120))  # nothing hangs
    print(collections.Counter(outcomes))
    assert set(outcomes) <= {"done", "error", "5xx"}, outcomes
    assert "done" in outcomes  # the other replica's requests finished
    _wait_replaced(url, proc)
    assert all(_complete(url, p).status_code == 200 for p in PROMPTS)


def test_role_chunk_carries_no_output_and_every_later_event_does(single):
    """What the ingress holds back before a chat stream's first token: the single server's own events."""
    from edgefinfer.server_gpu.replicas import carries_output

    body = {"model": single.name, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    text = httpx.post(single.url + "/v1/chat/completions", json=body, timeout=60).text
    events = [e.encode() + b"\n\n" for e in text.split("\n\n") if e.startswith("data: ")]
    assert b'"role":"assistant"' in events[0] and not carries_output(events[0])
    assert all(carries_output(e) for e in events[1:]) and events[-1] == b"data: [DONE]\n\n"
    completion = httpx.post(single.url + "/v1/completions", timeout=60,
                            json={"model": single.name, "prompt": "hello", "max_tokens": 3, "stream": True}).text
    assert carries_output(completion.split("\n\n")[0].encode())  # a completion stream opens with text


# ------------------------------------------------------------------------------------------ bad input
def _bad(*args: str, prelude: str = "") -> subprocess.CompletedProcess:
    code = f"import sys; {prelude}from edgefinfer.app.serve_command import main; sys.exit(main())"
    return subprocess.run([sys.executable, "-c", code, "no-such-model.gguf", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env={**os.environ, "CI": ""})


@pytest.mark.parametrize("args,prelude,says", [
    (("--replicas", "0"), "", "give 1 or more replicas"),
    (("--replicas", "2", "--address", "ray://127.0.0.1:9"), "", "no Ray cluster answers at ray://127.0.0.1:9"),
    (("--replicas", "2"), "sys.modules['ray'] = None; ", "pip install 'edgefinfer[replicas]'"),
    (("--routing", "round-robin"), "", "--routing round-robin routes between replicas: add --replicas N"),
    (("--replicas", "2", "--routing", "random"), "", "'random' is not one of 'prefix', 'round-robin'"),
])
def test_bad_input_one_line_exit_2_before_the_model(args, prelude, says):
    # The model does not exist: each error must come before the server looks for it.
    r = _bad(*args, prelude=prelude)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in r.stderr, r.stderr


def test_a_replica_takes_one_whole_gpu_when_layers_are_offloaded():
    from edgefinfer.errors import UserError
    from edgefinfer.server_gpu.replica_launch import check_gpus
    from edgefinfer.server_gpu.replicas import replica_resources

    assert replica_resources(4, 999) == {"num_cpus": 4, "num_gpus": 1}  # Ray gives each its own CUDA device
    assert replica_resources(1, 0) == {"num_cpus": 1}
    check_gpus(2, 999, 2.0)
    check_gpus(8, 0, 0.0)  # CPU replicas need no GPU
    with pytest.raises(UserError, match="each replica takes one GPU and the Ray cluster has 1 GPU"):
        check_gpus(2, 999, 1.0)


def test_single_process_serve_never_imports_ray(gguf):
    code = ("import sys\n"
            "from edgefinfer.app import serve_command\n"
            "from edgefinfer.server_gpu.api import create_app\n"
            "from edgefinfer.server_gpu.loader import ServeOptions, build_engine\n"
            f"engine, name = build_engine(ServeOptions({gguf!r}, max_num_seqs=2, max_model_len=64, threads=1))\n"
            "create_app(engine, name)\n"
            "assert 'ray' not in sys.modules, 'ray imported'\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_sigterm_drains_every_replica(cluster):
    """Last: it stops the module's cluster. Streams under way on both replicas finish; the process exits 0."""
    url, proc = cluster

    async def load() -> tuple[int, list[str]]:
        async with httpx.AsyncClient(timeout=90) as client:
            tasks = [asyncio.create_task(_stream_outcome(client, url, f"{i} {p}")) for i in range(2) for p in PROMPTS]
            await asyncio.sleep(0.3)
            running = sum(not t.done() for t in tasks)
            proc.send_signal(signal.SIGTERM)
            return running, await asyncio.gather(*tasks)

    running, outcomes = asyncio.run(asyncio.wait_for(load(), 120))
    assert running > 0  # the signal came while streams ran
    assert outcomes == ["done"] * len(outcomes), outcomes
    assert proc.wait(90) == 0


def test_round_robin_spreads_a_shared_prefix(cluster, gguf, tmp_path):
    """Once the module's cluster is stopped (one Ray at a time): `--routing round-robin` sends six
    requests sharing a prefix to the two replicas in turn, where prefix routing put all six on one."""
    _stop_cluster(cluster[1])
    url, proc = _start_cluster(gguf, tmp_path / "serve.log", "--routing", "round-robin")
    try:
        for tail in ("first question", "second question", "a third one", "and the fourth", "fifth", "sixth"):
            assert _complete(url, f"{SHARED} {tail}", max_tokens=4).status_code == 200
        deadline = time.monotonic() + 15
        while sum((counts := _replica_counts(url)).values()) < 6 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert sorted(counts.values()) == [3, 3], counts
    finally:
        _stop_cluster(proc)


def test_more_gpu_replicas_than_gpus_exit_2_without_waiting_on_ray(gguf):
    """Last, once no other Ray runs: a real local Ray counts the GPUs, and 64 GPU replicas (more GPUs
    than any host has) end in one error line and exit 2, not in a deployment that waits forever."""
    r = subprocess.run([*SERVE, gguf, "--replicas", "64", "--gpu-layers", "1", "--threads", "1"], cwd=ROOT,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(  # Ray's own start-up warning may precede it
        "error: --replicas 64 --gpu-layers 1: each replica takes one GPU and the Ray cluster has"), r.stderr
    assert "Traceback" not in r.stderr
