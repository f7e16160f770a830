"""The runtime Engine on the torch backend: same tokens as the core generator, speculative decoding
exact for every cache kind, cancellation, bad input."""

import threading

import pytest

from edgefinfer.model.checkpoint import save_model
from edgefinfer.decoding.eager import generate_ids, generate_text
from edgefinfer.errors import UserError
from edgefinfer.runtime.engine import Engine, KVOption, SpeculativeOption
from edgefinfer.decoding.sampling import SamplingParams
from tests.helpers import tiny_model, tiny_tokenizer

PROMPT = "It is a truth universally acknowledged, that a single man"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    tok = tiny_tokenizer()
    tok.eos_token = None  # random weights: let generations run to max_tokens
    target = tiny_model(seed=0, vocab_size=tok.vocab_size, eos_token_id=None, max_position_embeddings=256)
    draft = tiny_model(seed=1, vocab_size=tok.vocab_size, eos_token_id=None, max_position_embeddings=256,
                       num_hidden_layers=1)
    for name, m in [("target", target), ("draft", draft)]:
        save_model(m, root / name)
        tok.save(root / name)
    return root, target, tok


def test_engine_equals_core_generator(folders):
    root, target, tok = folders
    engine = Engine.load(root / "target")
    got = engine.generate(PROMPT, max_tokens=40)
    want = generate_text(target, tok, PROMPT, max_new_tokens=40)
    assert got.token_ids == want.token_ids and got.text == want.text
    assert got.stats.generated_tokens == 40 and got.stats.peak_rss_mb > 0


@pytest.mark.parametrize("kv", ["static", "window:16", "window:16,sinks:4", "paged:4"])
@pytest.mark.parametrize("spec", ["lookup:2,4", "draft:{root}/draft,3", "draft:{root}/target,5"])
def test_greedy_speculative_decoding_is_exact(folders, kv, spec):
    root, _, _ = folders
    plain = Engine.load(root / "target", kv=kv).generate(PROMPT, max_tokens=48)
    engine = Engine.load(root / "target", kv=kv, speculative=spec.format(root=root))
    fast = engine.generate(PROMPT, max_tokens=48)
    assert fast.token_ids == plain.token_ids
    stats = engine.speculation.stats
    assert stats.proposed > 0
    if "target" in spec:  # the target drafting for itself: every draft is accepted
        assert stats.accepted == stats.proposed


def test_paged_cache_equals_static_and_reuses_the_prompt_blocks(folders):
    root, _, _ = folders
    static = Engine.load(root / "target").generate(PROMPT, max_tokens=30)
    engine = Engine.load(root / "target", kv="paged:4")
    first = engine.generate(PROMPT, max_tokens=30)
    again = engine.generate(PROMPT, max_tokens=30)  # the freed prompt blocks are served from the prefix cache
    assert first.token_ids == static.token_ids == again.token_ids
    assert engine.backend.manager.stats().prefix_hits > 0


def test_window_cache_streams_past_the_context(folders):
    root, target, _ = folders
    # 256 positions of context; a window cache generates far beyond while the static cache refuses.
    with pytest.raises(UserError, match="exceeds the context of 256 tokens"):
        Engine.load(root / "target").generate(PROMPT, max_tokens=300)
    out = Engine.load(root / "target", kv="window:32").generate(PROMPT, max_tokens=300)
    assert out.stats.generated_tokens == 300


def test_sampling_is_seeded_and_speculation_keeps_it_running(folders):
    root, _, _ = folders
    params = SamplingParams(temperature=0.8, top_k=40, seed=7)
    a = Engine.load(root / "target").generate(PROMPT, max_tokens=30, params=params)
    b = Engine.load(root / "target").generate(PROMPT, max_tokens=30, params=params)
    assert a.token_ids == b.token_ids
    spec = Engine.load(root / "target", speculative=f"draft:{root}/draft,3").generate(PROMPT, max_tokens=30,
                                                                                      params=params)
    assert len(spec.token_ids) == 30


def test_cancel_and_close_stop_decoding_and_free_the_engine(folders):
    root, _, _ = folders
    engine = Engine.load(root / "target")
    cancel = threading.Event()
    seen = []

    def on_token(t):
        seen.append(t)
        if len(seen) == 5:
            cancel.set()

    engine.generate(PROMPT, max_tokens=50, cancel=cancel, on_token=on_token)
    assert len(seen) == 5
    stream = engine.stream(PROMPT, max_tokens=50)
    next(stream)
    stream.close()  # an abandoned stream releases the engine at once
    assert len(engine.generate(PROMPT, max_tokens=3).token_ids) == 3


def test_bad_options_and_paths(folders, tmp_path):
    root, _, _ = folders
    for bad in ["window:0", "window:8,sink:2", "paged:x", "ring"]:
        with pytest.raises(UserError, match="bad --kv"):
            KVOption.parse(bad)
    for bad in ["draft:", "lookup:x", "medusa"]:
        with pytest.raises(UserError, match="bad --speculative"):
            SpeculativeOption.parse(bad)
    with pytest.raises(UserError, match="does not exist"):
        Engine.load(tmp_path / "nothing")
    with pytest.raises(UserError, match="--kv paged runs on the torch backend"):
        Engine.load(root / "target", kv="paged:16", backend="llamacpp")
    with pytest.raises(UserError, match="repetition_penalty"):
        Engine.load(root / "target", speculative="lookup").generate(
            PROMPT, max_tokens=4, params=SamplingParams(repetition_penalty=1.2))
