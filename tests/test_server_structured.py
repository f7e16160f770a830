"""Structured output and tool calling on the server, through the official `openai` client: the same
greedy tokens as the device Engine for the same constraint, `tool_calls` in SmolLM2's own format,
streamed and whole, a round trip with a tool result, and 400s for constraints that do not compile.
The scheduler side (tiny model, no HTTP): each choice its own matcher, lossless with speculation,
freed when its sequence ends or is cancelled."""

from __future__ import annotations

import gc
import json
import re
import sys
import threading
import weakref
from pathlib import Path

import pytest

from edgefinfer.server_gpu.request import GenerationParams
from edgefinfer.decoding.structured import Constraint, Grammar
from tests.helpers import TEST_THREADS, tiny_model, tiny_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from structured_tasks import is_valid, tasks  # noqa: E402

MODEL = "smollm2-135m"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"},
                                          "unit": {"enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
]
QUESTION = [{"role": "user", "content": "What is the weather in Paris in celsius?"}]


@pytest.fixture(scope="module")
def server():
    pytest.importorskip("llama_cpp")
    pytest.importorskip("fastapi")
    from edgefinfer.server_gpu.api import create_app
    from edgefinfer.server_gpu.launch import BackgroundServer
    from edgefinfer.server_gpu.loader import ServeOptions, build_engine

    engine, name = build_engine(ServeOptions(MODEL, max_num_seqs=4, max_model_len=1024, threads=TEST_THREADS, batch_invariant=True))
    with BackgroundServer(create_app(engine, name)) as srv:
        srv.engine, srv.name = engine, name
        yield srv


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _format(task: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": task["name"], "schema": task["schema"]}}


@pytest.mark.reference
@pytest.mark.llamacpp
def test_json_schema_gives_the_device_engines_tokens(server, client):
    from edgefinfer.model import reference
    from edgefinfer.runtime.engine import Engine

    runtime = Engine.load(reference.gguf_path(MODEL), threads=TEST_THREADS)
    for task in (tasks()[5], tasks()[31]):
        expect = runtime.generate(task["prompt"], max_tokens=160, chat=True, response_format=_format(task))
        got = client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": task["prompt"]}],
                                             max_tokens=160, temperature=0, response_format=_format(task))
        assert got.choices[0].message.content == expect.text
        assert got.usage.completion_tokens == len(expect.token_ids)
        assert got.choices[0].finish_reason == "stop" and is_valid(expect.text, task["schema"])


@pytest.mark.reference
@pytest.mark.llamacpp
def test_parallel_choices_and_regex_on_completions(server, client):
    task = tasks()[2]
    got = client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": task["prompt"]}],
                                         max_tokens=160, temperature=0.8, seed=3, n=2, response_format=_format(task))
    assert len(got.choices) == 2
    for choice in got.choices:
        assert choice.finish_reason == "stop" and is_valid(choice.message.content, task["schema"])
    pattern = r"\+1-[0-9]{3}-[0-9]{4}"
    done = client.completions.create(model=server.name, prompt="Phone:", max_tokens=20, temperature=0,
                                     extra_body={"structured_outputs": {"regex": pattern}})
    assert re.fullmatch(pattern, done.choices[0].text) and done.choices[0].finish_reason == "stop"
    endless = client.completions.create(model=server.name, prompt="Letters:", max_tokens=6, temperature=0,
                                        extra_body={"structured_outputs": {"regex": "[a-z]{500}"}})
    assert endless.choices[0].finish_reason == "length" and endless.usage.completion_tokens == 6


def _check_weather_call(call) -> dict:
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    return args


@pytest.mark.reference
@pytest.mark.llamacpp
def test_tool_calls_whole_streamed_named_and_round_trip(server, client):
    whole = client.chat.completions.create(model=server.name, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                           max_tokens=80, temperature=0)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    args = _check_weather_call(choice.message.tool_calls[0])
    assert args["city"] == "Paris"

    stream = client.chat.completions.create(model=server.name, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                            max_tokens=80, temperature=0, stream=True)
    chunks = [c for c in stream if c.choices]
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks)  # the call text is never streamed as content
    assert [(c.function.name, c.function.arguments) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]

    named = client.chat.completions.create(model=server.name, messages=QUESTION, tools=TOOLS, max_tokens=80,
                                           temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [c.function.name for c in named.choices[0].message.tool_calls] == ["get_time"]

    call = choice.message.tool_calls[0]
    follow_up = QUESTION + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                            {"role": "tool", "tool_call_id": call.id,
                             "content": json.dumps({"temperature": 18, "sky": "cloudy"})}]
    answer = client.chat.completions.create(model=server.name, messages=follow_up, tools=TOOLS, tool_choice="none",
                                            max_tokens=40, temperature=0)
    assert answer.choices[0].message.tool_calls is None
    assert "18" in answer.choices[0].message.content  # the model read the tool's result


@pytest.mark.reference
@pytest.mark.llamacpp
def test_bad_constraints_and_tools_are_400s_before_any_token(server, client):
    import openai

    bad = [
        dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
        dict(response_format={"type": "yaml"}),
        dict(extra_body={"structured_outputs": {"regex": "(open"}}),
        dict(extra_body={"structured_outputs": {"grammar": "start: nowhere\n"}}),
        dict(extra_body={"structured_outputs": {"regex": "a", "grammar": "start: \"a\"\n"}}),
        dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]),
        dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "missing"}}),
        dict(tools=TOOLS, response_format={"type": "json_object"}),
        dict(tool_choice="required"),
    ]
    before = server.engine.metrics.counters.get(("generation_tokens_total", ()), 0)
    for kw in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=server.name, messages=QUESTION, max_tokens=5, **kw)
        message = e.value.body["message"]
        assert message and "\n" not in message, kw
        assert e.value.body["param"] in ("response_format", "structured_outputs", "tools", "tool_choice"), kw
    assert server.engine.metrics.counters.get(("generation_tokens_total", ()), 0) == before


# ---- the scheduler: one matcher per choice, lossless with speculation, freed at the end -----------------
def _tiny_engine(speculation=None):
    from edgefinfer.server_gpu.engine import ServingEngine, ServingEngineConfig
    from edgefinfer.server_gpu.executor_torch import TorchExecutor
    from edgefinfer.server_gpu.scheduler import SchedulerConfig

    tokenizer = tiny_tokenizer()
    model = tiny_model(vocab_size=tokenizer.vocab_size, seed=1)
    executor = TorchExecutor(model, max_num_seqs=4, max_model_len=128, block_size=4)
    config = ServingEngineConfig(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, prefill_chunk=8,
                                                 max_model_len=128))
    return model, ServingEngine(executor, tokenizer, (), config, speculation)


def _submit_all(engine, prompts, params, ids) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {i: [] for i in ids}
    done = threading.Semaphore(0)
    for rid, prompt in zip(ids, prompts):
        def sink(o, rid=rid):
            out[rid].extend(t for d in o.deltas for t in d.token_ids)
            if o.finished:
                done.release()
        engine.submit(rid, prompt, params, sink)
    for _ in ids:
        assert done.acquire(timeout=60)
    return out


@pytest.mark.parametrize("speculate", [False, True])
def test_scheduler_output_equals_the_runtime_loop_under_a_grammar(speculate):
    from edgefinfer.runtime.backends.torch_eager import TorchBackend
    from edgefinfer.runtime.decode import generate_tokens
    from edgefinfer.runtime.speculative.proposers import PromptLookupProposer
    from edgefinfer.server_gpu.batched_speculation import SpeculationConfig

    spec = SpeculationConfig(lambda seq_id: PromptLookupProposer(max_ngram=2), k_max=4, adaptive=False)
    model, engine = _tiny_engine(spec if speculate else None)
    regex = r"[a-z ]{8,30}[.]"
    grammar = engine.grammars.compile(Constraint.regex(regex))
    tok = engine.tokenizer
    prompts = [tok.encode("the cat sat on the mat, the cat sat on the mat"), tok.encode("hello there"),
               tok.encode("a b c a b c a b c")]
    engine.start()
    try:
        got = _submit_all(engine, prompts, GenerationParams(max_tokens=40, grammar=grammar), ["a", "b", "c"])
    finally:
        engine.stop()
    backend = TorchBackend(model, max_seq_len=128)
    for rid, prompt in zip("abc", prompts):
        expect = list(generate_tokens(backend, prompt, 40, matcher=grammar.matcher()))
        assert got[rid] == expect
        assert re.fullmatch(regex, tok.decode(expect)), tok.decode(expect)
    if speculate:
        assert engine.metrics.counters[("spec_draft_tokens_total", ())] > 0


def test_matchers_are_freed_when_a_sequence_finishes_or_is_cancelled(monkeypatch):
    _, engine = _tiny_engine()
    made: list[weakref.ref] = []
    original = Grammar.matcher

    def tracked(self):
        m = original(self)
        made.append(weakref.ref(m))
        return m

    monkeypatch.setattr(Grammar, "matcher", tracked)
    endless = engine.grammars.compile(Constraint.regex("[a-z]{500}"))
    short = engine.grammars.compile(Constraint.regex("[a-z]{3}"))
    first = threading.Event()
    engine.start()
    try:
        engine.submit("long", [5, 6, 7], GenerationParams(max_tokens=100, grammar=endless), lambda o: first.set())
        assert first.wait(30)
        engine.abort("long")
        _submit_all(engine, [[8, 9]], GenerationParams(max_tokens=10, grammar=short, n=2), ["done"])
    finally:
        engine.stop()
    gc.collect()
    assert len(made) == 3 and all(ref() is None for ref in made)
