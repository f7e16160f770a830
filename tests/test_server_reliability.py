"""The server as hostile clients and operators see it (issue 17): oversized bodies, a schema-driven fuzzer,
malformed values the fuzzer led to, SIGTERM under 32 streams, SIGKILL and restart. A tiny random GGUF
served by the real llama.cpp backend keeps it fast; bench/reliability.py runs the issue's sizes."""

from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("llama_cpp")
pytest.importorskip("schemathesis")

from edgefinfer.server_gpu.api import create_app  # noqa: E402
from edgefinfer.server_gpu.launch import BackgroundServer  # noqa: E402
from edgefinfer.server_gpu.loader import ServeOptions, build_engine  # noqa: E402
from tests.server_harness import fuzz_api, kill9_restart, sigterm_under_load, tiny_gguf  # noqa: E402

pytestmark = [pytest.mark.llamacpp]


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> str:
    return str(tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf"))


@pytest.fixture(scope="module")
def server(gguf):
    engine, name = build_engine(ServeOptions(gguf, max_num_seqs=16, max_model_len=64, threads=1))
    with BackgroundServer(create_app(engine, name)) as srv:
        srv.name = name
        yield srv


def post(server, body: dict | bytes, path: str = "/v1/completions") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"}, timeout=60)


def test_oversized_body_gets_a_413_the_client_can_read(server):
    big = json.dumps({"model": server.name, "prompt": "x" * (3 << 20)}).encode()
    expected = {"message": "the request body exceeds 1048576 bytes; send a smaller request",
                "type": "invalid_request_error", "param": None, "code": None}
    # Answering before the body was read used to reset the connection now and then (unread data at close).
    for _ in range(10):
        r = post(server, big)
        assert (r.status_code, r.json()["error"]) == (413, expected)
    chunked = httpx.post(server.url + "/v1/completions", content=iter([big[i:i + 65536] for i in range(0, len(big), 65536)]),
                         headers={"content-type": "application/json"})
    assert (chunked.status_code, chunked.json()["error"]) == (413, expected)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=server.name, prompt="x" * (3 << 20))
    assert e.value.status_code == 413 and e.value.body == expected
    assert client.completions.create(model=server.name, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_schemathesis_finds_no_5xx_and_the_server_stays_healthy(server):
    report = fuzz_api(server.url, server.name, max_examples=12)
    assert report["failures"] == {}
    assert report["server_5xx"] == 0 and report["cases"] >= 40
    assert {"200", "400", "404"} <= set(report["statuses"]), report["statuses"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_values_that_used_to_fail_inside_the_server_get_a_400_or_an_answer(server):
    ok = {"model": server.name, "prompt": "Hi", "max_tokens": 4, "ignore_eos": True}
    lone = b'{"model": "%s", "prompt": "a \\ud800 b", "max_tokens": 2}' % server.name.encode()
    r = post(server, lone)
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "prompt is not valid Unicode: '\\ud800' at character 2 is a lone surrogate; send UTF-8 text")
    chat = b'{"model": "%s", "messages": [{"role": "user", "content": "\\udc00"}]}' % server.name.encode()
    assert post(server, chat, "/v1/chat/completions").json()["error"]["param"] == "messages"
    r = post(server, {**ok, "seed": 2**70})  # torch's manual_seed overflowed: a 500
    assert r.status_code == 400 and r.json()["error"]["message"] == f"seed must be a 64-bit signed integer, got {2**70}"
    # Both used to fail the engine step (NaN probabilities), and with it every request in flight.
    greedy = post(server, {**ok, "temperature": 0}).json()["choices"][0]["text"]
    assert post(server, {**ok, "top_p": 1e-300}).json()["choices"][0]["text"] == greedy  # only the top token
    tiny_t = post(server, {**ok, "temperature": 1e-300})
    assert tiny_t.status_code == 200 and tiny_t.json()["usage"]["completion_tokens"] == 4


def test_top_p_that_underflows_keeps_the_most_likely_token():
    import torch

    from edgefinfer.decoding.sampling import logits_to_probs

    logits = torch.tensor([[0.5, 2.0, -1.0, 1.9]])
    assert logits_to_probs(logits, 1.0, None, 1e-300).tolist() == [[0.0, 1.0, 0.0, 0.0]]


# A grace the streams cannot outlast: the drain ends as soon as the last stream does, so a fast machine
# pays nothing for it. Grace 0: every stream still running at the signal ends with "abort" at once.
@pytest.mark.parametrize("grace_s, max_tokens, reason", [(600.0, 100, "length"), (0.0, 240, "abort")])
def test_sigterm_under_32_streams_drains_and_exits_0(gguf, tmp_path, grace_s, max_tokens, reason):
    log = tmp_path / "serve.log"
    r = sigterm_under_load(gguf, log, streams=32, max_tokens=max_tokens, grace_s=grace_s,
                           serve_args=("--max-model-len", "256"))
    tail = log.read_text(errors="replace")[-2000:]
    # What holds at any speed and any grace: the server exits 0, and every stream ends with a final
    # event (finished, or "abort" at the grace deadline), never a dropped connection.
    assert r["exit_code"] == 0, tail
    assert r["lost"] == 0, (r["lost_errors"], tail)
    assert sum(r["finish_reasons"].values()) == 32 and set(r["finish_reasons"]) <= {"length", "abort"}, r
    report = r["drain_report"]
    assert (report["unsent"], report["kv_used"]) == (0, 0) and 0 < report["in_flight"] <= 32, (report, tail)
    # A request sent while the server drains gets a 503; sent once the drain is over (a drain with
    # nothing left to wait for ends at once), its connection is refused. Never a hang or a reset.
    assert r["late_request"] in ("503", "refused"), r
    if r["late_request"] == "503":
        assert r["new_request_body"]["error"]["code"] == "server_shutting_down"
    aborted = r["finish_reasons"].get("abort", 0)
    if reason == "length":
        assert r["finish_reasons"] == {"length": 32} and report["ended"] == 0, r
    else:  # 240 tokens cannot all be out before the signal is handled: the deadline ends them
        assert report["ended"] >= aborted >= 1, r


def test_sigkill_then_restart_on_the_same_port_serves_again(gguf, tmp_path):
    r = kill9_restart(gguf, tmp_path / "serve.log")
    assert r["killed_exit_code"] == -9
    assert (r["status_after"], r["completion_tokens_after"], r["kv_used_after"]) == (200, 4, 0.0)
