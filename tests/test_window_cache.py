"""The sliding-window ring cache against transformers' Mistral sliding-window attention."""

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from edgefinfer.model.config import ModelConfig
from edgefinfer.errors import UserError
from edgefinfer.model.transformer import Transformer
from edgefinfer.runtime.kv.window import SlidingWindowCache
from tests.helpers import tiny_model

WINDOW = 8


def mistral_pair():
    torch.manual_seed(0)
    hf = MistralConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       sliding_window=WINDOW)
    hf._attn_implementation = "eager"
    ref = MistralForCausalLM(hf).eval()
    ours = Transformer(ModelConfig.from_hf(hf.to_dict()))
    ours.load_state_dict(ref.state_dict(), strict=False)
    return ref, ours.eval()


@pytest.mark.parametrize("chunks", [[1] * 32, [5, 1, 1, 13, 1, 11], [20, 12]])
def test_window_cache_equals_mistral_over_four_windows(chunks):
    ref, ours = mistral_pair()
    tokens = torch.randint(0, 101, (1, 4 * WINDOW), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(tokens).logits
        cache = SlidingWindowCache(ours.config, 1, window=WINDOW)
        got, start = [], 0
        for n in chunks:  # prefill chunks longer than the ring, then single decode steps
            got.append(ours(tokens[:, start:start + n], torch.arange(start, start + n), cache))
            start += n
    assert (torch.cat(got, 1) - want).abs().max() < 1e-5


def test_memory_is_constant_over_ten_windows():
    model = tiny_model()
    cache = SlidingWindowCache(model.config, 1, window=WINDOW, num_sinks=2)
    before = cache.nbytes()
    with torch.no_grad():
        for t in range(10 * WINDOW):
            model(torch.tensor([[t % 97]]), torch.tensor([t]), cache)
    assert cache.nbytes() == before
    # The sinks stay, and the ring holds exactly the last WINDOW positions.
    held = sorted(cache.pos[0, 0].tolist())
    assert held == [-1] + [0, 1] + list(range(10 * WINDOW - WINDOW, 10 * WINDOW))


def test_sinks_are_attended_and_the_middle_is_not():
    """With sinks, logits equal a full-attention model whose mask allows sinks + window, computed densely."""
    model = tiny_model()
    tokens = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(5))
    sinks = 3
    with torch.no_grad():
        cache = SlidingWindowCache(model.config, 1, window=WINDOW, num_sinks=sinks)
        got = torch.cat([model(tokens[:, t:t + 1], torch.tensor([t]), cache) for t in range(30)], 1)

        class DenseSinkMask:  # the "cache" of a full forward pass: keys are the tokens themselves
            window, num_sinks = WINDOW, sinks

            def update(self, layer, k, v, input_pos):
                return k, v, input_pos

        want = model(tokens, None, DenseSinkMask())
    assert (got - want).abs().max() < 1e-5
    assert (got[0, -1] - model(tokens)[0, -1]).abs().max() > 1e-3  # really differs from full attention


def test_rejected_speculative_tokens_do_not_leak():
    """Write 3 tokens that are then rolled back; later logits equal a run that never saw them."""
    model = tiny_model()
    tokens = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(6))
    junk = torch.randint(0, 97, (1, 3), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        clean = SlidingWindowCache(model.config, 1, window=WINDOW)
        spec = SlidingWindowCache(model.config, 1, window=WINDOW, lookahead=3)
        model(tokens[:, :16], torch.arange(16), clean)
        model(tokens[:, :16], torch.arange(16), spec)
        model(junk, torch.arange(16, 19), spec)  # drafted, then rejected: next write restarts at 16
        want = torch.cat([model(tokens[:, t:t + 1], torch.tensor([t]), clean) for t in range(16, 24)], 1)
        got = torch.cat([model(tokens[:, t:t + 1], torch.tensor([t]), spec) for t in range(16, 24)], 1)
    assert (got - want).abs().max() < 1e-5  # slot order differs (ring sizes differ): float summation order only


def test_bad_window():
    with pytest.raises(UserError, match="at least 1 token"):
        SlidingWindowCache(tiny_model().config, 1, window=0)


def test_window_cache_exports_with_torch_export():
    model = tiny_model()

    class Step(torch.nn.Module):
        def __init__(self, cache):
            super().__init__()
            self.model, self.cache = model, cache

        def forward(self, tokens, input_pos):
            return self.model(tokens, input_pos, self.cache)

    seq = torch.export.Dim.AUTO  # the ring's slot arithmetic adds guards a named Dim would have to spell out
    exported = torch.export.export(Step(SlidingWindowCache(model.config, 1, window=WINDOW, num_sinks=1)),
                                   (torch.zeros(1, 3, dtype=torch.long), torch.arange(3)[None]),
                                   dynamic_shapes=({1: seq}, {1: seq}), strict=False).module()
    eager = Step(SlidingWindowCache(model.config, 1, window=WINDOW, num_sinks=1))
    tokens = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        for start, n in [(0, 12), (12, 1), (13, 1), (14, 16)]:
            args = (tokens[:, start:start + n], torch.arange(start, start + n)[None])
            assert (exported(*args) - eager(*args)).abs().max() < 1e-5


# ---- the same window on llama.cpp (runtime/backends/llamacpp.py: cells removed, not masked) ------------
@pytest.fixture(scope="module")
def mistral_gguf(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    from edgefinfer.compile.gguf_export import export_gguf
    from tests.families import byte_tokenizer

    ref, ours = mistral_pair()
    path = tmp_path_factory.mktemp("window") / "mistral.gguf"
    export_gguf(ours, byte_tokenizer(101), path, "f32")
    return ref, ours, path


@pytest.mark.llamacpp
@pytest.mark.parametrize("chunks", [[1] * 32, [5, 1, 1, 13, 1, 11], [20, 12]])
def test_llamacpp_window_equals_mistral_over_four_windows(mistral_gguf, chunks):
    """llama.cpp runs Mistral's window over the whole context; `--kv window:N` gives the model's own."""
    from edgefinfer.runtime.backends.llamacpp import LlamaCppBackend

    ref, _, path = mistral_gguf
    tokens = torch.randint(0, 101, (1, 4 * WINDOW), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(tokens).logits[0].numpy()
    backend, start, got = LlamaCppBackend(path, threads=1, window=WINDOW), 0, []
    for n in chunks:
        got.append(backend.forward(tokens[0, start:start + n].tolist(), start))
        start += n
    import numpy as np

    assert np.abs(np.concatenate(got) - want).max() < 1e-4  # float32 summation order only


@pytest.mark.llamacpp
def test_llamacpp_window_with_sinks_equals_the_ring_cache(mistral_gguf):
    from edgefinfer.runtime.backends.llamacpp import LlamaCppBackend
    from edgefinfer.runtime.backends.torch_eager import TorchBackend
    from edgefinfer.runtime.engine import Engine

    _, ours, path = mistral_gguf
    llama = LlamaCppBackend(path, threads=1, window=WINDOW, num_sinks=2)
    ring = TorchBackend(ours, window=WINDOW, num_sinks=2)
    # Past the cells llama.cpp allocates (it sizes a context to 256 at least): positions keep growing.
    tokens = torch.randint(0, 101, (llama.ctx.n_ctx + 4 * WINDOW,), generator=torch.Generator().manual_seed(2)).tolist()
    import numpy as np

    got, want = llama.forward(tokens, 0), ring.forward(tokens, 0)
    assert np.abs(got - want).max() < 1e-4  # measured 2e-7
    # What a removed cell held cannot come back: a rollback behind the window's edge is refused, and
    # speculation (which rolls back rejected tokens) with it, in one line.
    with pytest.raises(UserError, match="no longer holds what position 10 attends to"):
        llama.rollback(10)
    with pytest.raises(UserError, match="can roll back at most 0 speculative tokens"):
        Engine.load(path, kv=f"window:{WINDOW}", speculative="lookup:2,3")


@pytest.mark.llamacpp
def test_a_window_llamacpp_would_ignore_is_refused_naming_the_fix(mistral_gguf):
    from edgefinfer.runtime.backends.llamacpp import LlamaCppBackend

    with pytest.raises(UserError, match=f"sliding window of {WINDOW} tokens, which llama.cpp does not apply.*"
                                        f"--kv window:{WINDOW}"):
        LlamaCppBackend(mistral_gguf[2], n_ctx=64)
    LlamaCppBackend(mistral_gguf[2], n_ctx=WINDOW)  # a context inside the window is the model's own
