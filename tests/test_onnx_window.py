"""ONNX Runtime's windowed KV cache (`export_onnx(kv="window")`, GroupQueryAttention's
`sliding_window_cache`): the host mirror of its layout is exact, logits match the torch
sliding-window cache across compactions and rollbacks and far past the model's RoPE range, and
speculative decoding through the Engine gives exactly the greedy tokens."""

import numpy as np
import pytest

from edgefinfer.compile.onnx_export import export_onnx
from edgefinfer.errors import UserError
from edgefinfer.runtime.backends.base import UNBOUNDED
from edgefinfer.runtime.backends.ort import OrtBackend
from edgefinfer.runtime.backends.ort_window import resident_rows
from edgefinfer.runtime.backends.torch_eager import TorchBackend
from edgefinfer.runtime.engine import Engine
from tests.helpers import tiny_model, tiny_tokenizer

WINDOW, LOOKAHEAD = 8, 3  # 11 slots: the operator compacts 4 rows every 4 tokens


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("onnx-window")
    tok = tiny_tokenizer(320)
    tok.eos_token = None
    # 64 positions: every stream below runs past them, which a RoPE table would not allow.
    model = tiny_model(vocab_size=tok.vocab_size, max_position_embeddings=64, eos_token_id=None)
    meta = export_onnx(model, root / "window", kv="window", window=WINDOW, lookahead=LOOKAHEAD)
    export_onnx(model, root / "static", max_seq_len=64, window=WINDOW)  # the same attention, a full buffer
    tok.save(root / "window")
    return model, root, meta


def test_export_metadata_and_inputs(exported):
    _, root, meta = exported
    assert meta["kv"] == {"layout": "window", "max_seq_len": None, "window": WINDOW, "lookahead": LOOKAHEAD}
    assert meta["inputs"][:2] == ["input_ids", "position_ids"] and meta["kv_layout"]["sliding_window_cache"]
    assert not (root / "window" / "genai_config.json").exists()  # onnxruntime-genai cannot drive this graph
    backend = OrtBackend(root / "window", threads=1)
    assert (backend.window, backend.max_seq_len) == (WINDOW, UNBOUNDED)
    assert backend.kv_buffers[0].shape[2] == WINDOW + LOOKAHEAD


def test_resident_rows_follow_the_operator_contract():
    # C = 11, W = 8, G = 4: fills to 11, then drops 4 rows at once every 4 tokens.
    assert [resident_rows(t, 11, 8) for t in range(8, 21)] == [8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11, 8]
    assert resident_rows(3, 11, 8) == 3


def test_buffers_hold_the_layout_the_mirror_describes(exported):
    """Row r of the window buffer holds position T - L(T) + r: the same key as slot T - L(T) + r of
    the static graph's buffer (both store keys after RoPE)."""
    _, root, _ = exported
    window, static = OrtBackend(root / "window", threads=1), OrtBackend(root / "static", threads=1)
    tokens = np.random.default_rng(1).integers(0, 300, 60).tolist()
    pos = 0
    for n in [5, 1, 1, 3, 1, 4, 1, 1, 2, 7, 1, 1, 1, 13, 1, 2, 3, 1, 1, 1, 6, 3]:
        chunk = tokens[pos:pos + n]
        window.forward(chunk, pos)
        static.forward(chunk, pos)
        pos += n
        rows = window.windowed.rows(pos)
        for w, s in zip(window.kv_buffers, static.kv_buffers):
            np.testing.assert_allclose(w[:, :, :rows], s[:, :, pos - rows:pos], atol=1e-5)
    assert pos == 60


def test_logits_match_the_torch_window_cache_across_compactions_and_rollbacks(exported):
    model, root, _ = exported
    ort_backend = OrtBackend(root / "window", threads=1)
    reference = TorchBackend(model, window=WINDOW, num_sinks=0, lookahead=LOOKAHEAD)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 300, 400).tolist()
    pos, worst, rollbacks = 0, 0.0, 0
    while pos < 300:  # ~5x the model's positions
        n = int(rng.integers(1, LOOKAHEAD + 2)) if pos and rng.random() < 0.9 else int(rng.integers(5, 25))
        chunk = tokens[pos:pos + n]
        worst = max(worst, float(np.abs(ort_backend.forward(chunk, pos) - reference.forward(chunk, pos)).max()))
        accepted = int(rng.integers(1, n + 1)) if n <= LOOKAHEAD + 1 and rng.random() < 0.5 else n
        rollbacks += accepted < n
        pos += accepted  # the next forward starts at the first rejected position
    assert worst < 1e-4
    assert rollbacks > 10 and ort_backend.windowed.restores > 0  # rollbacks across a compaction were exercised


def test_rollback_beyond_the_last_step_is_refused(exported):
    _, root, _ = exported
    backend = OrtBackend(root / "window", threads=1)
    tokens = list(range(40))
    backend.forward(tokens[:20], 0)
    backend.forward(tokens[20:23], 20)
    backend.forward(tokens[23:26], 23)  # 26 tokens: compacted at 24, the rows of 12..15 are gone
    with pytest.raises(ValueError, match="roll back only into the last step"):
        backend.forward([1], 21)
    backend.reset()
    assert backend.forward(tokens[:3], 0).shape == (3, 320)  # a new sequence is always fine


def test_speculative_decoding_on_the_window_graph_is_exact(exported):
    _, root, _ = exported
    prompt = "It is a truth universally acknowledged. " * 3
    plain = Engine.load(root / "window").generate(prompt, max_tokens=120)
    spec = Engine.load(root / "window", speculative="lookup:2,3")
    fast = spec.generate(prompt, max_tokens=120)
    assert fast.token_ids == plain.token_ids
    assert spec.speculation.stats.proposed > 0


def test_bad_requests_are_user_errors(exported, tmp_path):
    model, root, _ = exported
    with pytest.raises(UserError, match="needs window=N"):
        export_onnx(model, tmp_path / "a", kv="window")
    with pytest.raises(UserError, match="no length limit"):
        export_onnx(model, tmp_path / "b", kv="window", window=8, max_seq_len=64)
    with pytest.raises(UserError, match="lookahead applies to kv='window'"):
        export_onnx(model, tmp_path / "c", lookahead=4)
    with pytest.raises(UserError, match="unknown kv layout"):
        export_onnx(model, tmp_path / "d", kv="ring")
    # The layout is fixed at export: --kv must agree with it.
    with pytest.raises(UserError, match="has a static cache; rebuild with `edgefinfer build --kv window:16`"):
        Engine.load(root / "static", backend="onnxruntime", kv="window:16")  # (its attention window is 8)
    with pytest.raises(UserError, match="window cache of 8"):
        Engine.load(root / "window", kv="window:16")
    assert Engine.load(root / "window", kv=f"window:{WINDOW}").backend.window == WINDOW
    # A verify step longer than the window would evict its own tokens: the Engine refuses such a K.
    with pytest.raises(UserError, match="at most 7 speculative tokens"):
        Engine.load(root / "window", speculative="lookup:2,8")
