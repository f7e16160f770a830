"""The continuous-batching engine on the torch executor (tiny random model, no HTTP): every feature
must return exactly what eager decoding (`edgefinfer.decoding.eager.generate_ids`) returns alone."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from edgefinfer.decoding.eager import generate_ids
from edgefinfer.decoding.sampling import SamplingParams
from edgefinfer.server_gpu.batched_speculation import SpeculationConfig, StepCostModel
from edgefinfer.server_gpu import engine as engine_module
from edgefinfer.server_gpu.engine import ServingEngine, ServingEngineConfig
from edgefinfer.server_gpu.executor_torch import TorchExecutor
from edgefinfer.server_gpu.metrics import Histogram, Metrics
from edgefinfer.server_gpu.request import GenerationParams, Request, RequestOutput, Status
from edgefinfer.server_gpu.scheduler import SchedulerConfig
from edgefinfer.runtime.speculative.proposers import PromptLookupProposer
from tests.helpers import tiny_model, tiny_tokenizer

BS = 4


@contextmanager
def running(engine: ServingEngine):
    """The engine's step loop, stopped however the test ends."""
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=1)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def make_engine(model, tokenizer, num_blocks=None, max_num_seqs=8, chunk=8, budget=24, speculation=None,
                prefix_caching=True) -> ServingEngine:
    executor = TorchExecutor(model, max_num_seqs=max_num_seqs, max_model_len=128, block_size=BS,
                             num_blocks=num_blocks)
    config = ServingEngineConfig(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                                 prefill_chunk=chunk, max_model_len=128), prefix_caching)
    return ServingEngine(executor, tokenizer, (), config, speculation)


def run(engine: ServingEngine, prompts: list[list[int]], params: GenerationParams, timeout: float = 60.0,
        on_output=None) -> list[dict[int, list[int]]]:
    """Submit every prompt at once; per request, the token ids of each choice."""
    results: list[dict[int, list[int]]] = [{} for _ in prompts]
    errors: list[str] = []
    done = threading.Semaphore(0)

    def sink_for(i: int):
        def sink(out: RequestOutput) -> None:  # runs in the engine thread: record, never raise
            if out.error:
                errors.append(out.error)
            for d in out.deltas:
                results[i].setdefault(d.index, []).extend(d.token_ids)
            if on_output is not None:
                on_output(i, out)
            if out.finished:
                done.release()
        return sink

    for i, p in enumerate(prompts):
        engine.submit(f"req-{id(results)}-{i}", p, params, sink_for(i))
    for _ in prompts:
        assert done.acquire(timeout=timeout), "a request never finished"
    assert not errors, errors
    return results


def eager(model, prompt: list[int], n: int) -> list[int]:
    return list(generate_ids(model, prompt, n))


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (n,), generator=g).tolist() for n in lengths]


def wait_idle(engine: ServingEngine, timeout: float = 10.0) -> dict:
    """The engine's published state once nothing runs (the snapshot trails the last step)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snap = engine.snapshot()
        if snap["running"] == 0 and snap["waiting"] == 0 and snap["kv_used"] == 0:
            return snap
        time.sleep(0.01)
    return engine.snapshot()


def test_concurrent_chunked_prefill_equals_eager(model, tokenizer):
    # Prompts longer than the chunk (8) and the step budget (24) are split over several steps while
    # others decode; every sequence must still produce eager decoding's tokens.
    engine = make_engine(model, tokenizer)
    with running(engine):
        prompts = prompts_of([3, 11, 30, 17, 1, 25])
        out = run(engine, prompts, GenerationParams(max_tokens=12))
        for p, r in zip(prompts, out):
            assert r[0] == eager(model, p, 12)
        assert wait_idle(engine)["kv_used"] == 0


def test_manager_holds_exactly_the_fed_tokens(model, tokenizer):
    # A 17-token prompt with 8-token chunks ends in a 1-token chunk, which must not pass for a decode
    # step (that would plan the last prompt token twice and corrupt the prefix-cache hashes).
    engine = make_engine(model, tokenizer)  # not started: the test drives its scheduler step by step
    sched, executor = engine.scheduler, engine.executor
    prompt = prompts_of([17])[0]
    sched.add(Request("r", prompt, GenerationParams(max_tokens=4), lambda out: None))
    seq = sched.waiting[0]
    while sched.has_work():
        plan = sched.schedule()
        sched.update(plan, executor.execute(plan))
        if seq.status is Status.RUNNING:
            planned = list(sched.manager.token_ids(seq.seq_id))
            assert planned == seq.tokens[:len(planned)] and len(seq.tokens) - len(planned) in (0, 1)
    assert seq.tokens[17:] == eager(model, prompt, 4)


def test_preemption_by_recompute_keeps_outputs_exact(model, tokenizer):
    # 14 blocks of 4 tokens hold two of these sequences, not four: the scheduler must preempt
    # (free and later recompute) and still return eager decoding's tokens.
    engine = make_engine(model, tokenizer, num_blocks=14, prefix_caching=False)
    with running(engine):
        prompts = prompts_of([9, 10, 11, 12], seed=3)
        out = run(engine, prompts, GenerationParams(max_tokens=16))
        for p, r in zip(prompts, out):
            assert r[0] == eager(model, p, 16)
        assert engine.metrics.counters[("preemptions_total", ())] > 0
        assert wait_idle(engine)["kv_used"] == 0


def test_prefix_cache_hit_and_parallel_sampling_fork(model, tokenizer):
    engine = make_engine(model, tokenizer)
    with running(engine):
        prefix = prompts_of([16], seed=5)[0]
        a, b = prefix + [1, 2, 3], prefix + [4, 5]
        run(engine, [a], GenerationParams(max_tokens=4))
        (rb,) = run(engine, [b], GenerationParams(max_tokens=8))  # reuses a's 4 cached full blocks
        assert rb[0] == eager(model, b, 8)
        assert engine.manager.stats().prefix_hits >= 16
        # n = 3 greedy: the two forked choices share the prompt's blocks and must equal choice 0.
        (rn,) = run(engine, [a], GenerationParams(max_tokens=10, n=3))
        assert sorted(rn) == [0, 1, 2]
        assert rn[0] == rn[1] == rn[2] == eager(model, a, 10)
        # Seeded sampling: reproducible per choice, and the choices are different streams.
        sampled = GenerationParams(max_tokens=10, n=3, sampling=SamplingParams(temperature=1.0, seed=7))
        (s1,) = run(engine, [a], sampled)
        (s2,) = run(engine, [a], sampled)
        assert s1 == s2 and len({tuple(v) for v in s1.values()}) > 1
        assert wait_idle(engine)["kv_used"] == 0


def test_requests_arriving_together_compute_a_shared_prefix_once(model, tokenizer):
    # Four prompts with one 24-token prefix (6 blocks), submitted at once: the first computes the prefix
    # (three 8-token chunks), the others wait for it and reuse it; answers stay eager's.
    engine = make_engine(model, tokenizer)
    prefix = prompts_of([24], seed=9)[0]
    prompts = [prefix + [10 + i, 20 + i] for i in range(4)]
    with running(engine):
        results = run(engine, prompts, GenerationParams(max_tokens=4))
    assert [r[0] for r in results] == [eager(model, p, 4) for p in prompts]
    computed = engine.metrics.counters[("prompt_tokens_total", ())]
    assert computed == 24 + 4 * 2 and engine.manager.stats().prefix_hits == 3 * 24


def step_by_hand(engine: ServingEngine, prompts: dict[str, list[int]], max_tokens: int,
                 check) -> dict[str, list[int]]:
    """Add `prompts` in order and run the scheduler step by step in this thread; `check(step, scheduler)`
    runs after each step. Returns each request's tokens."""
    sched, out = engine.scheduler, {rid: [] for rid in prompts}
    for rid, p in prompts.items():
        sched.add(Request(rid, p, GenerationParams(max_tokens=max_tokens), None))
    step = 0
    while sched.has_work():
        plan = sched.schedule()
        outputs, _ = sched.update(plan, engine.executor.execute(plan))
        for o in outputs:
            assert o.error is None, o.error
            out[o.request_id] += [t for d in o.deltas for t in d.token_ids]
        step += 1
        check(step, sched)
    return out


def running_ids(sched) -> set[str]:
    return {s.request.request_id for s in sched.running}


def test_a_request_waiting_for_a_shared_prefix_lets_unrelated_ones_pass(model, tokenizer):
    # b waits for the 32 tokens a is computing (it will take them), but c, behind b and sharing nothing,
    # is not held behind it: it starts in the first step (strict FCFS kept it waiting for a's prompt).
    engine = make_engine(model, tokenizer)
    prefix, c = prompts_of([32, 6], seed=3)
    prompts = {"a": prefix + [1, 2], "b": prefix + [3, 4], "c": c}
    seen = []

    def check(step, sched):
        seen.append(running_ids(sched))
        if step == 1:
            assert seen[0] == {"a", "c"} and [s.request.request_id for s in sched.waiting] == ["b"]

    out = step_by_hand(engine, prompts, 3, check)
    assert out == {rid: eager(model, p, 3) for rid, p in prompts.items()}
    assert engine.manager.stats().prefix_hits >= 32  # b still took a's prefix


def test_a_prompt_after_a_prefix_hit_runs_in_one_chunk_unless_batch_invariant(model, tokenizer):
    # b finds a's first 12 tokens cached (three 4-token blocks) and has 5 more: one chunk of 5 from
    # position 12, not 4 up to the chunk boundary at 16 and 1 a step later (each step a forward over
    # every running sequence: bench/server.py's shared-system lost a step per request that way).
    # Batch-invariant chunks stay aligned (and a hit on a finished lender is cut back to none).
    a = prompts_of([13], seed=5)[0]
    b = a[:12] + [7, 7, 7, 7, 7]
    for invariant, expected in ((False, [(12, 5)]), (True, [(0, 8), (8, 8), (16, 1)])):
        engine = make_engine(model, tokenizer)
        sched = engine.scheduler
        sched.batch_invariant = invariant
        step_by_hand(engine, {"a": a}, 2, lambda step, sched: None)
        sched.add(Request("b", b, GenerationParams(max_tokens=2), None))
        chunks = []
        while sched.has_work():
            plan = sched.schedule()
            chunks += [(w.start_pos, len(w.token_ids)) for w in plan.work if w.start_pos < len(b)]  # prompt
            outputs, _ = sched.update(plan, engine.executor.execute(plan))
            assert all(o.error is None for o in outputs)
        assert chunks == expected, invariant


def test_speculative_prompt_lookup_is_lossless(model, tokenizer):
    spec = SpeculationConfig(lambda seq_id: PromptLookupProposer(max_ngram=3), k_max=4, adaptive=False)
    engine = make_engine(model, tokenizer, speculation=spec)
    with running(engine):
        # Repetitive prompts give the lookup something to propose.
        prompts = [[5, 6, 7, 8] * 5, [9, 10, 11] * 6, prompts_of([12], seed=9)[0]]
        out = run(engine, prompts, GenerationParams(max_tokens=20))
        for p, r in zip(prompts, out):
            assert r[0] == eager(model, p, 20)
        drafted = engine.metrics.counters[("spec_draft_tokens_total", ())]
        accepted = engine.metrics.counters[("spec_accepted_tokens_total", ())]
        assert drafted > 0 and accepted > 0
        assert wait_idle(engine)["kv_used"] == 0


def first_steps(engine: ServingEngine) -> tuple[list[set[str]], threading.Event, list[float]]:
    """Record, for each step the engine runs, which requests it computes; the event is set after the first."""
    steps: list[set[str]] = []
    stamps: list[float] = []
    first = threading.Event()
    execute = engine.executor.execute

    def traced(plan):
        stamps.append(time.monotonic())
        ids = {w.seq_id for w in plan.work}
        steps.append({s.request.request_id for s in engine.scheduler.running if s.seq_id in ids})
        result = execute(plan)
        first.set()
        return result

    engine.executor.execute = traced
    return steps, first, stamps


def test_an_idle_engine_admits_requests_still_arriving_in_its_first_step(model, tokenizer, monkeypatch):
    # Two requests arrive together; the first is submitted while the second is still being read
    # (its Arrival open): the engine waits for it and computes both in its first step. Without
    # an open Arrival the engine starts at once and the second joins a step later.
    monkeypatch.setattr(engine_module, "ADMIT_WAIT_S", 30.0)  # no deadline in this test: only the Arrival counts
    a, b = prompts_of([6, 7], seed=11)
    params = GenerationParams(max_tokens=3)
    for arriving in (True, False):
        engine = make_engine(model, tokenizer)
        steps, first, _ = first_steps(engine)
        done = threading.Semaphore(0)
        sink = lambda out: out.finished and done.release()  # noqa: E731
        with running(engine):
            later = engine.arrival() if arriving else None
            engine.submit("a", a, params, sink)
            if arriving:
                assert not first.wait(0.2)  # held: b is on its way
                engine.submit("b", b, params, sink)
                later.close()
            else:
                assert first.wait(30)
                engine.submit("b", b, params, sink)
            assert done.acquire(timeout=30) and done.acquire(timeout=30)
        assert steps[0] == ({"a", "b"} if arriving else {"a"}), arriving
        assert engine.arriving == 0


def test_an_arrival_never_submitted_holds_the_first_step_no_longer_than_the_deadline(model, tokenizer, monkeypatch):
    monkeypatch.setattr(engine_module, "ADMIT_WAIT_S", 0.3)
    engine = make_engine(model, tokenizer)
    steps, first, stamps = first_steps(engine)
    with running(engine):
        stuck = engine.arrival()  # a request still uploading, or one whose handler will refuse it
        t0 = time.monotonic()
        engine.submit("a", prompts_of([5])[0], GenerationParams(max_tokens=2), lambda out: None)
        assert first.wait(30)
        assert stamps[0] - t0 >= 0.3 and steps[0] == {"a"}
        stuck.close()
        stuck.close()  # idempotent: a refusal closes it, and the HTTP middleware again at the end
    assert engine.arriving == 0


def test_abort_frees_blocks_at_once(model, tokenizer):
    engine = make_engine(model, tokenizer)
    with running(engine):
        first = threading.Event()
        results: list[RequestOutput] = []

        def sink(out: RequestOutput) -> None:
            results.append(out)
            first.set()

        engine.submit("long", prompts_of([20])[0], GenerationParams(max_tokens=100), sink)
        assert first.wait(30)
        engine.abort("long")
        snap = wait_idle(engine)
        assert snap["kv_used"] == 0 and snap["running"] == 0
        assert not results[-1].finished  # it was cut short, never completed
        assert engine.metrics.counters[("requests_total", (("finish_reason", "abort"),))] == 1


def test_stop_string_and_length_finish(model, tokenizer):
    engine = make_engine(model, tokenizer)
    with running(engine):
        prompt = prompts_of([6], seed=11)[0]
        ids = eager(model, prompt, 12)
        full = tokenizer.decode(ids)
        stop = full[len(full) // 2:len(full) // 2 + 2]
        deltas: list = []
        run(engine, [prompt], GenerationParams(max_tokens=12, stop=(stop,)),
            on_output=lambda i, out: deltas.extend(out.deltas))
        text = "".join(d.text for d in deltas)
        assert deltas[-1].finish_reason == "stop"
        assert text == full[:full.index(stop)]
        deltas.clear()
        run(engine, [prompt], GenerationParams(max_tokens=5), on_output=lambda i, out: deltas.extend(out.deltas))
        assert deltas[-1].finish_reason == "length" and sum(len(d.token_ids) for d in deltas) == 5


def test_step_cost_model_turns_speculation_off_under_load():
    cost = StepCostModel(decay=1.0)
    for n in (1, 2, 4, 8, 16, 32, 64):
        cost.observe(n, 0.010 + 0.002 * n)  # a = 10 ms, b = 2 ms per token
    a, b = cost.fit()
    assert a == pytest.approx(0.010) and b == pytest.approx(0.002)
    one, full = cost.cost(1).verify_per_token, cost.cost(32).verify_per_token
    assert one == pytest.approx(0.002 / 0.012) and full == pytest.approx(0.064 / 0.074)
    from edgefinfer.runtime.speculative.adaptive import AdaptiveK

    # 50% acceptance pays for one sequence, not for 32.
    assert AdaptiveK(k_max=4, cost=cost.cost(1), prior_acceptance=0.5).initial().k > 0
    assert AdaptiveK(k_max=4, cost=cost.cost(32), prior_acceptance=0.5).initial().k == 0


def test_prometheus_exposition():
    hist = Histogram((0.1, 1.0))
    for x in (0.05, 0.5, 5.0):
        hist.observe(x)
    assert hist.lines("h") == ['h_bucket{le="0.1"} 1', 'h_bucket{le="1"} 2', 'h_bucket{le="+Inf"} 3',
                               "h_sum 5.55", "h_count 3"]
    m = Metrics(lambda: {"waiting": 2, "kv_used": 3, "kv_free": 5, "kv_total": 8})
    m.inc("requests_total", finish_reason="stop")
    m.record_step(0.02, 4, [0.3], [0.01, 0.02], prompt_tokens=7)
    m.record_step(0.01, 1, [], [0.01])
    text = m.render()
    assert "edgefinfer_generation_tokens_total 5\n" in text and "edgefinfer_prompt_tokens_total 7\n" in text
    assert "edgefinfer_num_requests_waiting 2\n" in text
    assert 'edgefinfer_kv_blocks{state="used"} 3\n' in text
    assert 'edgefinfer_requests_total{finish_reason="stop"} 1\n' in text
    assert 'edgefinfer_time_to_first_token_seconds_bucket{le="0.5"} 1\n' in text
    assert "edgefinfer_inter_token_latency_seconds_count 3\n" in text
    assert "# TYPE edgefinfer_inter_token_latency_seconds histogram\n" in text


def test_logprobs_match_log_softmax(model, tokenizer):
    engine = make_engine(model, tokenizer)
    with running(engine):
        prompt = prompts_of([5], seed=13)[0]
        got: list = []
        run(engine, [prompt], GenerationParams(max_tokens=1, logprobs=3),
            on_output=lambda i, out: got.extend(lp for d in out.deltas for lp in d.logprobs or []))
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt]))[0, -1].double(), -1)
        (lp,) = got
        assert lp.token_id == int(ref.argmax()) and lp.logprob == pytest.approx(float(ref.max()), abs=1e-5)
        assert [t for t, _ in lp.top] == ref.topk(3).indices.tolist()
        assert np.allclose([v for _, v in lp.top], ref.topk(3).values.numpy(), atol=1e-5)


def test_logit_bias_bans_tokens_and_logprobs_stay_raw(model, tokenizer):
    # Ban the greedy pick at every step: the reply is the eager greedy reply of the model whose logits
    # carry the bias. With logprobs on, the reported logprob of a picked token is its raw one (the bias
    # is applied to a copy); without, the bias goes into the step's own logits, the same tokens result.
    prompt = prompts_of([6], seed=21)[0]
    first = eager(model, prompt, 1)[0]
    bias = ((first, -100.0),)
    engine = make_engine(model, tokenizer)
    with running(engine):
        plain = run(engine, [prompt], GenerationParams(max_tokens=4, logit_bias=bias))[0][0]
        got: list = []
        with_lp = run(engine, [prompt], GenerationParams(max_tokens=4, logit_bias=bias, logprobs=0),
                      on_output=lambda i, out: got.extend(lp for d in out.deltas for lp in d.logprobs or []))[0][0]
    ids, ref_lp = list(prompt), []
    with torch.no_grad():
        for _ in range(4):
            logits = model(torch.tensor([ids]))[0, -1].double()
            logits_biased = logits.clone()
            logits_biased[first] -= 100.0
            tok = int(logits_biased.argmax())
            ref_lp.append(float(torch.log_softmax(logits, -1)[tok]))
            ids.append(tok)
    assert plain == with_lp == ids[len(prompt):] and first not in plain
    assert [lp.token_id for lp in got] == plain
    assert np.allclose([lp.logprob for lp in got], ref_lp, atol=1e-5)


# ------------------------------------------------------------------------------- sliding window
WINDOW = 10  # tokens; with blocks of 4, a window overlaps at most 4 blocks


@pytest.mark.parametrize("lookup", [False, True], ids=["plain", "prompt-lookup"])
def test_sliding_window_model_keeps_kv_flat_and_equals_the_ring_cache(tokenizer, lookup):
    # A Mistral-style model (sliding_window 10) served by the torch executor: the manager drops the
    # blocks behind the window, so past it every sequence holds a flat number of blocks; the tokens
    # equal what `edgefinfer run --kv window:10` gives (the runtime's ring cache, runtime/kv/window.py).
    from edgefinfer.runtime.backends.torch_eager import TorchBackend
    from edgefinfer.runtime.decode import generate_tokens

    model = tiny_model(seed=4, sliding_window=WINDOW)
    k = 3
    spec = (SpeculationConfig(lambda seq_id: PromptLookupProposer(max_ngram=2), k_max=k, adaptive=False)
            if lookup else None)
    engine = make_engine(model, tokenizer, speculation=spec)  # not started: stepped by the test
    sched, executor = engine.scheduler, engine.executor
    prompts = [[5, 6, 7, 8] * 3, prompts_of([23], seed=2)[0]]  # one short, one longer than the window
    for i, p in enumerate(prompts):
        sched.add(Request(f"w{i}", p, GenerationParams(max_tokens=60, ignore_eos=True), lambda out: None))
    seqs = list(sched.waiting)
    prompt_len = {s.seq_id: len(p) for s, p in zip(seqs, prompts)}
    held: dict[int, list[int]] = {s.seq_id: [] for s in seqs}
    accepted = 0
    while sched.has_work():
        plan = sched.schedule()
        for w in plan.work:
            if w.start_pos >= prompt_len[w.seq_id] + WINDOW:  # decoding, past the window
                held[w.seq_id].append(engine.manager.num_held_blocks(w.seq_id))
        accepted += sched.update(plan, executor.execute(plan))[1].accepted
    # The window of the first new token plus up to k drafts: at most ceil((WINDOW + k) / 4) + 1 blocks.
    bound = -(-(WINDOW + (k if lookup else 0)) // BS) + 1
    for s in seqs:
        assert len(held[s.seq_id]) > (10 if lookup else 40) and max(held[s.seq_id]) <= bound, held[s.seq_id]
    assert engine.manager.stats().num_used == 0
    for s, p in zip(seqs, prompts):
        ring = TorchBackend(model, window=WINDOW)  # what `--kv window:N` opens for a checkpoint
        assert s.tokens[len(p):] == list(generate_tokens(ring, p, 60)), f"prompt of {len(p)} tokens"
        assert s.tokens[len(p):] == eager(model, p, 60)  # the full cache under the model's own mask
    assert (accepted > 0) == lookup
