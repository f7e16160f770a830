"""Load: 500 requests at concurrency 32 on the reference model, 10% of the clients hanging up
mid-stream. Every completed request must be correct and complete, none lost, no 5xx, and the KV
pool must be entirely free afterwards (read from /metrics)."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("llama_cpp")

from edgefinfer.server_gpu.api import create_app  # noqa: E402
from edgefinfer.server_gpu.launch import BackgroundServer  # noqa: E402
from edgefinfer.server_gpu.loader import ServeOptions, build_engine  # noqa: E402
from tests.server_harness import load_with_disconnects  # noqa: E402

pytestmark = [pytest.mark.reference, pytest.mark.llamacpp]

NUM_REQUESTS, CONCURRENCY = 500, 32


def test_500_requests_at_concurrency_32_with_disconnects():
    # --batch-invariant: every answer must equal the prompt's answer alone. In the default unified
    # layout, 14 of 450 three-token greedy answers differed from alone's in one run.
    engine, name = build_engine(ServeOptions("smollm2-135m", max_num_seqs=CONCURRENCY, max_model_len=256,
                                             threads=1, batch_invariant=True))
    with BackgroundServer(create_app(engine, name)) as srv:
        r = load_with_disconnects(srv.url, name, NUM_REQUESTS, CONCURRENCY)
        assert r["lost"] == 0, r["lost_examples"]
        assert (r["completed"], r["dropped"]) == (450, 50)
        assert r["ended_once"] == NUM_REQUESTS  # every request ended exactly once (an abort counts)
        assert r["kv_used_after"] == 0 and r["kv_free_after"] == r["kv_total"]
        assert engine.executor.storage.num_used_slots == 0  # every llama sequence was removed too
        print(f"\n{NUM_REQUESTS} requests in {r['seconds']:.1f}s")


def test_unified_pool_under_load_frees_everything_but_its_retained_prefixes():
    # The unified layout (not batch-invariant: answers are checked for completion, not equality) in a
    # 1024-cell pool: disconnects free their blocks, every request ends once, the pool ends free.
    engine, name = build_engine(ServeOptions("smollm2-135m", max_num_seqs=16, max_model_len=256, threads=1,
                                             kv_unified=True, kv_cells=1024))
    with BackgroundServer(create_app(engine, name)) as srv:
        r = load_with_disconnects(srv.url, name, 120, 16, exact=False)
        assert r["lost"] == 0, r["lost_examples"]
        assert (r["completed"], r["dropped"], r["ended_once"]) == (108, 12, 120)
        assert r["kv_used_after"] == 0 and r["kv_free_after"] == r["kv_total"] == 64
        assert engine.executor.storage.num_used_slots == engine.manager.stats().num_retained
