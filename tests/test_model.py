"""Our decoder against transformers' implementations, and the KV cache against full forward passes."""

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

from edgefinfer.model.kv_cache import StaticCache
from edgefinfer.model.config import ModelConfig
from edgefinfer.errors import UserError
from edgefinfer.model.transformer import Transformer
from tests.helpers import tiny_model

TINY = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}

CASES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "llama3-rope-tied": (LlamaConfig, LlamaForCausalLM, {"rope_scaling": LLAMA3_ROPE, "tie_word_embeddings": True}),
    "llama-bias": (LlamaConfig, LlamaForCausalLM, {"attention_bias": True}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    # A window shorter than the sequence, so the window really cuts attention.
    "mistral-window": (MistralConfig, MistralForCausalLM, {"sliding_window": 7}),
}


def reference_pair(case: str, seed: int = 0):
    hf_cls, model_cls, extra = CASES[case]
    torch.manual_seed(seed)
    hf_config = hf_cls(**TINY, **extra)
    hf_config._attn_implementation = "eager"
    ref = model_cls(hf_config).eval()
    with torch.no_grad():  # HF initialises biases to zero; randomise them so they are really tested
        for name, p in ref.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    ours = Transformer(ModelConfig.from_hf(hf_config.to_dict()))
    missing, unexpected = ours.load_state_dict(ref.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return ref, ours.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers(case):
    ref, ours = reference_pair(case)
    tokens = torch.randint(0, TINY["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(tokens).logits
        got = ours(tokens)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-4


def test_config_flags_follow_the_architecture():
    assert ModelConfig.from_hf(Qwen2Config(**TINY).to_dict()).qkv_bias
    assert ModelConfig.from_hf(Qwen2Config(**TINY).to_dict()).sliding_window is None  # use_sliding_window=False
    assert ModelConfig.from_hf(MistralConfig(**TINY, sliding_window=7).to_dict()).sliding_window == 7
    assert not ModelConfig.from_hf(LlamaConfig(**TINY).to_dict()).o_bias


@pytest.mark.parametrize("case", ["llama", "mistral-window"])
def test_incremental_decoding_equals_full_forward(case):
    _, model = reference_pair(case)
    tokens = torch.randint(0, TINY["vocab_size"], (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(tokens)
        cache = StaticCache(model.config, batch_size=1, max_seq_len=32)
        pieces = [model(tokens[:, :11], torch.arange(11), cache)]  # prefill
        for t in range(11, 30):  # then one token at a time
            pieces.append(model(tokens[:, t:t + 1], torch.tensor([t]), cache))
    step = torch.cat(pieces, dim=1)
    assert (step - full).abs().max().item() < 1e-5


def test_batched_rows_with_different_positions_use_their_own_cache_rows():
    model = tiny_model()
    a = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(3))
    b = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        cache = StaticCache(model.config, batch_size=2, max_seq_len=16)
        # Row 0 has consumed 10 tokens, row 1 only 6: feed each its next token in one batch.
        model(a[:, :10], torch.arange(10), StaticCache(model.config, 1, 16))  # warm nothing shared
        model(torch.cat([a[:, :10], b[:, :10]]), torch.arange(10), cache)
        pos = torch.tensor([[10], [6]])
        nxt = torch.cat([a[:, 10:11], b[:, 6:7]])
        got = model(nxt, pos, cache)[:, -1]
        want_a = model(a[:, :11])[:, -1]
        want_b = model(b[:, :7])[:, -1]
    assert (got[0] - want_a[0]).abs().max() < 1e-5
    # Row 1's slots 7..9 hold stale keys from the longer prefill: causality must hide them.
    assert (got[1] - want_b[0]).abs().max() < 1e-5


def test_unsupported_architecture_is_a_user_error():
    with pytest.raises(UserError, match="unsupported architecture 'GPT2LMHeadModel'"):
        ModelConfig.from_hf({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **TINY})


def test_heads_that_break_gqa_groups_are_refused():
    with pytest.raises(UserError, match="not a multiple of num_key_value_heads"):
        ModelConfig(**{**TINY, "num_key_value_heads": 3})


def test_parameter_count_matches_the_module():
    for case in CASES:
        _, model = reference_pair(case)
        counted = sum(p.numel() for p in model.parameters())  # tied weights are one Parameter
        assert model.config.num_parameters() == counted, case


def test_model_exports_with_torch_export():
    model = tiny_model()
    cache = StaticCache(model.config, 1, 32, trim=False)

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model, self.cache = model, cache

        def forward(self, tokens, input_pos):
            return self.model(tokens, input_pos, self.cache)

    seq = torch.export.Dim("seq", min=1, max=31)
    ep = torch.export.export(Step(), (torch.zeros(1, 4, dtype=torch.long), torch.arange(4)[None]),
                             dynamic_shapes=({1: seq}, {1: seq}), strict=False)
    tokens = torch.randint(0, 97, (1, 5))
    with torch.no_grad():
        want = model(tokens)
        cache.reset()
        got = ep.module()(tokens, torch.arange(5)[None])
    assert (got - want).abs().max() < 1e-5
