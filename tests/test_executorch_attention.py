"""The export-time source transformation, in eager torch (no lowering, seconds).

`swap_attention` + the custom-op caches run ExecuTorch's `llama::update_cache` / `custom_sdpa` CPU
kernels eagerly; they must reproduce our model with its own caches for any chunking, rollback and
the sliding-window / sink rules.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("executorch")

from edgefinfer.model.kv_cache import StaticCache  # noqa: E402
from edgefinfer.compile.et_attention import EtRingCache, EtStaticCache, ExportableLM, swap_attention  # noqa: E402
from edgefinfer.errors import UserError  # noqa: E402
from edgefinfer.runtime.kv.window import SlidingWindowCache  # noqa: E402
from tests.helpers import tiny_model  # noqa: E402

TOKENS = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(0))


def run_chunks(module: ExportableLM, chunks: list[int], tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    out, start = [], 0
    for n in chunks:
        out.append(module(tokens[:, start:start + n], torch.tensor([start])))
        start += n
    return torch.cat(out, 1)  # [1, sum(chunks), V]


@torch.no_grad()
def test_static_custom_ops_match_the_model():
    model = tiny_model()
    want = model(TOKENS, torch.arange(40)[None], StaticCache(model.config, 1, 64))
    got = run_chunks(ExportableLM(swap_attention(model), EtStaticCache(model.config, 64)), [16, 1, 1, 7, 1, 14])
    assert (got - want).abs().max() < 1e-4


@torch.no_grad()
def test_static_cache_applies_the_models_own_sliding_window():
    model = tiny_model(sliding_window=6)
    want = model(TOKENS, torch.arange(40)[None], StaticCache(model.config, 1, 64))
    cache = EtStaticCache(model.config, 64)
    assert cache.window == 6  # explicit-mask path
    got = run_chunks(ExportableLM(swap_attention(model), cache), [10, 1, 29])
    assert (got - want).abs().max() < 1e-4


@pytest.mark.parametrize("sinks", [0, 3])
@torch.no_grad()
def test_ring_custom_ops_match_the_window_cache(sinks):
    model = tiny_model()
    window, lookahead = 8, 6
    want = model(TOKENS, torch.arange(40)[None], SlidingWindowCache(model.config, 1, window, sinks, lookahead))
    cache = EtRingCache(model.config, window, sinks, lookahead)
    assert cache.max_chunk == lookahead + 1
    got = run_chunks(ExportableLM(swap_attention(model), cache), [7, 7, 1, 1, 5, 7, 1, 7, 4])
    assert (got - want).abs().max() < 1e-4


@torch.no_grad()
def test_ring_rollback_hides_rejected_tokens():
    model = tiny_model()
    cache = EtRingCache(model.config, 8, 2, 6)
    lm = ExportableLM(swap_attention(model), cache)
    run_chunks(lm, [7, 7, 6])  # 20 positions
    lm(torch.tensor([[1, 2, 3, 4]]), torch.tensor([20]))  # speculative, then all rejected
    got = lm(TOKENS[:, 20:23], torch.tensor([20]))
    fresh = ExportableLM(swap_attention(model), EtRingCache(model.config, 8, 2, 6))
    want = run_chunks(fresh, [7, 7, 6, 3])[:, 20:]
    assert (got - want).abs().max() < 1e-5


def test_swap_leaves_the_model_untouched():
    model = tiny_model()
    swapped = swap_attention(model)
    assert type(model.model.layers[0].self_attn).__name__ == "Attention"
    assert swapped.model.layers[0].self_attn.q_proj is model.model.layers[0].self_attn.q_proj


def test_ring_rejects_bad_sizes():
    cfg = tiny_model().config
    with pytest.raises(UserError, match="at least 1 token"):
        EtRingCache(cfg, 0)
    with pytest.raises(UserError, match="num_sinks"):
        EtRingCache(cfg, 4, num_sinks=-1)
