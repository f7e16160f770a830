"""Reliability scenarios for the OpenAI-compatible server, shared by the tests (small sizes) and
bench/reliability.py (the issue's sizes): a schema-driven fuzz run, SIGTERM under load, SIGKILL and
restart. Each runs the real server (uvicorn on 127.0.0.1, `edgefinfer serve` for the signal scenarios)
and returns plain counts; the callers decide what must hold.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------ models
def tiny_gguf(path: Path) -> Path:
    """A tiny random llama GGUF (6 MB, 2 layers, 641 tokens) that llama.cpp loads in ~0.05 s."""
    from tests.test_gguf_import import tiny_model, train_vocab, write_gguf

    if not path.exists():
        vocab = train_vocab()
        write_gguf(path, tiny_model(len(vocab["tokens"])), vocab)
    return path


# ------------------------------------------------------------------------------------------ fuzzing
def fuzz_api(url: str, model_name: str, max_examples: int, seed: int = 0) -> dict:
    """schemathesis over the server's own /openapi.json: every operation, positive and negative cases.

    Half the generated bodies name the served model (a random `model` would stop nearly every case at
    the 404), so positive cases reach the engine. Checks: schemathesis's defaults (no 5xx, documented
    status codes, content types and response schemas, negative data rejected) except positive-data
    acceptance, which a JSON schema cannot make hold (the context window, the vocabulary), plus every
    error answer in OpenAI's shape with a message. Returns the case count, the 5xx count, statuses
    seen and one example per distinct failure."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, seed as hypothesis_seed, settings, strategies as st
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    schema = schemathesis.openapi.from_url(url + "/openapi.json")

    @schema.hook("flatmap_body")
    def served_model(context, body):
        if isinstance(body, dict) and isinstance(body.get("model"), str):
            return st.sampled_from([body, {**body, "model": model_name}])
        return st.just(body)

    statuses: collections.Counter = collections.Counter()
    failures: dict[str, str] = {}
    cases = 0

    def check(case) -> None:
        nonlocal cases
        cases += 1
        response = None
        try:
            response = case.call(base_url=url, timeout=60)
            statuses[response.status_code] += 1
            case.validate_response(response, excluded_checks=[positive_data_acceptance],
                                   additional_checks=[_openai_error_shape])
        except (Exception, BaseExceptionGroup) as e:  # failed checks (a group), or a hang or reset
            if response is None:
                statuses[type(e).__name__] += 1
            key = f"{case.operation.label}: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
            failures.setdefault(key, f"{str(e)[:600]}\nbody: {json.dumps(case.body, default=str)[:300]}")

    for operation in schema.get_all_operations():
        operation = operation.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @hypothesis_seed(seed)
            @settings(max_examples=max_examples, deadline=None, database=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case) -> None:
                check(case)

            try:
                run()
            except Unsatisfiable:  # no negative case exists for an operation without inputs (GET /health)
                pass
    server_5xx = sum(n for s, n in statuses.items() if isinstance(s, int) and s >= 500)
    return {"cases": cases, "server_5xx": server_5xx, "statuses": {str(k): v for k, v in sorted(statuses.items(),
                                                                                                 key=str)},
            "failures": failures}


def _openai_error_shape(ctx, response, case) -> bool | None:
    """Every 4xx/5xx body is OpenAI's error object with a message a client can show."""
    if response.status_code >= 400:
        error = response.json().get("error")
        assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, response.text[:200]
        assert isinstance(error["message"], str) and error["message"], response.text[:200]
    return None


# ------------------------------------------------------------------------------------------ load
LOAD_PROMPTS = [f"Fact {i}: the" for i in range(20)]


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def wait_kv_idle(url: str, timeout: float = 15.0) -> dict[str, float]:
    """/metrics once nothing runs or waits and no KV block is used (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        idle = (m["edgefinfer_num_requests_running"] == 0 and m["edgefinfer_num_requests_waiting"] == 0
                and m['edgefinfer_kv_blocks{state="used"}'] == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def load_with_disconnects(url: str, name: str, requests: int, concurrency: int, max_tokens: int = 3,
                          progress=None, exact: bool = True) -> dict:
    """`requests` greedy completions at `concurrency` through the official client: every 10th hangs up
    after its first chunk, half the rest stream, half do not. Each completed answer must equal the
    prompt's answer alone (asked first); "lost" counts requests that failed or answered differently.
    exact=False (a layout that is not batch-invariant): a completed answer must only end with
    finish_reason "length" and be non-empty text."""
    import openai

    sync = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    expected = {}
    for p in LOAD_PROMPTS:
        c = sync.completions.create(model=name, prompt=p, max_tokens=max_tokens, temperature=0).choices[0]
        expected[p] = (c.text, c.finish_reason)
    finished_before = sum(v for k, v in metrics(url).items() if k.startswith("edgefinfer_requests_total"))

    async def one(client, i: int) -> str:
        prompt = LOAD_PROMPTS[i % len(LOAD_PROMPTS)]
        args = dict(model=name, prompt=prompt, max_tokens=max_tokens, temperature=0)
        if i % 10 == 0:  # a client that hangs up after the first chunk
            stream = await client.completions.create(stream=True, **args)
            async for _ in stream:
                break
            await stream.close()
            return "dropped"
        if i % 2 == 0:
            text, finish = "", None
            async for chunk in await client.completions.create(stream=True, **args):
                for c in chunk.choices:
                    text += c.text
                    finish = c.finish_reason or finish
            return "stream" if ok((text, finish), prompt) else f"wrong: {prompt!r} -> {text!r} {finish}"
        r = await client.completions.create(**args)
        got = (r.choices[0].text, r.choices[0].finish_reason)
        return "full" if ok(got, prompt) else f"wrong: {prompt!r} -> {got}"

    def ok(got: tuple[str, str | None], prompt: str) -> bool:
        if exact:
            return got == expected[prompt]
        return bool(got[0]) and got[1] == expected[prompt][1]

    async def run() -> list:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120,
                                    http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=2 * concurrency)))
        gate, done = asyncio.Semaphore(concurrency), 0

        async def bounded(i: int):
            nonlocal done
            async with gate:
                try:
                    return await one(client, i)
                except Exception as e:
                    return f"error: {type(e).__name__}: {e}"
                finally:
                    done += 1
                    if progress is not None and done % 50 == 0:
                        progress(done, requests)

        results = await asyncio.gather(*[bounded(i) for i in range(requests)])
        await client.close()
        return results

    t0 = time.perf_counter()
    results = asyncio.run(run())
    seconds = time.perf_counter() - t0
    m = wait_kv_idle(url)
    finished = sum(v for k, v in m.items() if k.startswith("edgefinfer_requests_total")) - finished_before
    kinds = collections.Counter(r if r in ("full", "stream", "dropped") else "lost" for r in results)
    return {"requests": requests, "concurrency": concurrency, "max_tokens": max_tokens,
            "dropped": kinds["dropped"], "completed": kinds["full"] + kinds["stream"], "lost": kinds["lost"],
            "lost_examples": sorted({r for r in results if r not in ("full", "stream", "dropped")})[:3],
            "ended_once": int(finished), "kv_used_after": int(m['edgefinfer_kv_blocks{state="used"}']),
            "kv_free_after": int(m['edgefinfer_kv_blocks{state="free"}']), "kv_total": int(m["edgefinfer_kv_blocks_total"]),
            "seconds": round(seconds, 2)}


# ------------------------------------------------------------------------------------------ processes
# Ports for servers a test starts by number: below the kernel's ephemeral range (32768-60999 here), from
# which every port the OS picks comes (`bind(0)`, outgoing connections, the other xdist worker's
# servers, Ray's own), and above `ray start`'s worker ports (10002-19999). A port that `bind(0)` had
# just found free was taken by another process before the server bound it: a replicas cluster failed
# to bind, and another server on that port answered its /health.
SERVER_PORTS = range(20000, 32768)


def free_port() -> int:
    """A port in SERVER_PORTS that nothing listens on now."""
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.choice(SERVER_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {SERVER_PORTS.start}-{SERVER_PORTS.stop - 1}")


def start_serve(model: str, port: int, *args: str, log: Path) -> subprocess.Popen:
    """`edgefinfer serve MODEL` in a child process (its output goes to `log`)."""
    cmd = [sys.executable, "-m", "edgefinfer", "serve", model, "--port", str(port), "--threads", "1", *args]
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it answered /health")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the server did not become healthy")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


# ------------------------------------------------------------------------------------------ SIGTERM
_DRAINED = re.compile(r"drained: (\d+) request\(s\) in flight at the signal, (\d+) ended at the grace deadline "
                      r"\(finish_reason abort\), (\d+) response\(s\) unsent, (\d+) KV block\(s\) in use")


def sigterm_under_load(model: str, log: Path, streams: int = 32, max_tokens: int = 64, grace_s: float = 20.0,
                       serve_args: tuple[str, ...] = (), late_timeout_s: float = 60.0) -> dict:
    """Start `streams` streaming completions, SIGTERM the server once all of them have produced a token,
    then, once the server has logged that it drains, send a new request. Returns how every stream ended
    (finish_reason, or "lost": an error or a cut connection), how the new request was answered, the exit
    code, and the server's drain report.

    The new request races the drain's end (a drain with nothing left to wait for ends at once): it is
    answered 503 while the server drains, refused once it stopped listening; "late_request" says which,
    or names what else happened (a reset, or "hang": no answer within `late_timeout_s`)."""
    import openai

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_serve(model, port, "--max-num-seqs", str(streams), "--shutdown-grace-s", str(grace_s),
                       *serve_args, log=log)
    try:
        wait_healthy(url, proc)
        name = httpx.get(url + "/v1/models").json()["data"][0]["id"]

        async def scenario() -> tuple[list[str], tuple[str, httpx.Response | None], float]:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120,
                                        http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=streams)))
            started = asyncio.Semaphore(0)

            async def one(i: int) -> str:
                first = True
                try:
                    stream = await client.completions.create(model=name, prompt=f"Stream {i}:", max_tokens=max_tokens,
                                                             temperature=0, stream=True,
                                                             extra_body={"ignore_eos": True})
                    reason = None
                    async for chunk in stream:
                        if first:
                            started.release()
                            first = False
                        for c in chunk.choices:
                            reason = c.finish_reason or reason
                    return reason or "lost"
                except Exception as e:  # the stream broke: that is a lost request
                    if first:
                        started.release()
                    return f"lost: {type(e).__name__}"

            tasks = [asyncio.ensure_future(one(i)) for i in range(streams)]
            for _ in range(streams):
                await started.acquire()
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            # Not a fixed sleep: on a busy machine the signal may take longer to be handled than any sleep.
            await _wait_for_log(log, "shutting down: new requests get 503", proc)
            late = await _late_request(url, name, late_timeout_s)
            reasons = await asyncio.gather(*tasks)
            await client.close()
            return reasons, late, time.monotonic() - t0

        reasons, (late, refused), drain_s = asyncio.run(scenario())
        exit_code = proc.wait(timeout=grace_s + 120)
    finally:
        stop(proc)
    drained = _DRAINED.findall(log.read_text(errors="replace"))
    report = dict(zip(("in_flight", "ended", "unsent", "kv_used"), map(int, drained[-1]))) if drained else {}
    ends = collections.Counter(r if not r.startswith("lost") else "lost" for r in reasons)
    return {"exit_code": exit_code, "streams": streams, "grace_s": grace_s, "finish_reasons": dict(ends),
            "lost": ends.get("lost", 0), "lost_errors": sorted({r for r in reasons if r.startswith("lost")}),
            "late_request": late, "new_request_status": refused.status_code if refused is not None else None,
            "new_request_body": refused.json() if refused is not None else {},
            "seconds_to_last_stream": round(drain_s, 2), "drain_report": report}


async def _wait_for_log(log: Path, line: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while line not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server never logged {line!r}")
        await asyncio.sleep(0.02)


async def _late_request(url: str, name: str, timeout: float) -> tuple[str, httpx.Response | None]:
    """A completion sent during the shutdown: ("503", response), ("refused", None), or what else happened."""
    try:
        async with httpx.AsyncClient(timeout=timeout) as h:
            r = await h.post(url + "/v1/completions", json={"model": name, "prompt": "late", "max_tokens": 2})
    except httpx.ConnectError:
        return "refused", None
    except httpx.TimeoutException:
        return "hang", None
    except httpx.HTTPError as e:
        return f"reset: {type(e).__name__}", None
    return str(r.status_code), r


def kill9_restart(model: str, log: Path) -> dict:
    """SIGKILL a serving server mid-request, start it again on the same port: it must come back healthy
    and answer (the listening socket is bound with SO_REUSEADDR, so TIME_WAIT does not block it)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_serve(model, port, log=log)
    try:
        wait_healthy(url, proc)
        name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        with httpx.stream("POST", url + "/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 200,
                                                                 "ignore_eos": True, "stream": True}) as r:
            next(r.iter_lines())
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        killed_code = proc.returncode
        t0 = time.monotonic()
        proc = start_serve(model, port, log=log)
        wait_healthy(url, proc)
        restart_s = time.monotonic() - t0
        answer = httpx.post(url + "/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 4,
                                                           "ignore_eos": True}, timeout=60)
        metrics = httpx.get(url + "/metrics").text
    finally:
        stop(proc)
    used = re.search(r'^edgefinfer_kv_blocks\{state="used"\} (\S+)$', metrics, re.M)
    return {"killed_exit_code": killed_code, "restart_s": round(restart_s, 2), "status_after": answer.status_code,
            "completion_tokens_after": answer.json().get("usage", {}).get("completion_tokens"),
            "kv_used_after": float(used.group(1)) if used else None}
