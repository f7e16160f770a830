"""Cross-backend conformance: one float model exported to every format, run through the Engine.

Greedy generation of 64 tokens from 5 prompts gives the same tokens on torch, ExecuTorch, ONNX
Runtime and llama.cpp; prefill logits agree within each format's float tolerance; speculative
decoding (prompt lookup) returns exactly the plain greedy tokens on each backend; the compiled
sliding-window caches stream 10x their window at flat resident memory.
"""

import re

import numpy as np
import pytest

from edgefinfer.model.checkpoint import save_model
from edgefinfer.compile.executorch_export import export_pte
from edgefinfer.compile.gguf_export import export_gguf
from edgefinfer.compile.onnx_export import export_onnx
from edgefinfer.runtime.engine import Engine
from tests.helpers import tiny_model, tiny_tokenizer

PROMPTS = ["It is a truth universally acknowledged", "However little known the feelings",
           "Prices: 12, 345, 6789", "naïve café déjà vu", "a single man in possession of a good fortune"]
N = 64


@pytest.fixture(scope="module")
def artefacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("conformance")
    tok = tiny_tokenizer(320)
    tok.eos_token = None
    model = tiny_model(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, max_position_embeddings=128,
                       eos_token_id=None)
    save_model(model, root / "hf")
    tok.save(root / "hf")
    export_pte(model, root / "pte" / "model.pte", recipe="fp32", max_seq_len=128, progress=False)
    export_onnx(model, root / "onnx", max_seq_len=128)
    (root / "gguf").mkdir()
    export_gguf(model, tok, root / "gguf" / "model.gguf", "f32")
    for sub in ("pte", "onnx", "gguf"):
        tok.save(root / sub)
    return {"torch": root / "hf", "executorch": root / "pte" / "model.pte", "onnxruntime": root / "onnx",
            "llamacpp": root / "gguf" / "model.gguf"}


@pytest.fixture(scope="module")
def engines(artefacts):
    engines = {name: Engine.load(path, backend=name, max_seq_len=128) for name, path in artefacts.items()}
    # The model names no EOS, but the bare GGUF stops where llama.cpp does: at its end-of-generation control
    # token <|im_end|> (edgefinfer.bundle.resolve.ModelSource.stop_ids, the rule run and serve share). This module
    # compares the numerics of the formats, so no engine stops early.
    assert engines["llamacpp"].eos_ids == (engines["llamacpp"].tokenizer.encode("<|im_end|>")[0],)
    assert all(e.eos_ids == () for name, e in engines.items() if name != "llamacpp")
    for engine in engines.values():
        engine.eos_ids = ()
    return engines


def test_greedy_tokens_are_identical_on_every_backend(engines):
    for prompt in PROMPTS:
        outputs = {name: e.generate(prompt, max_tokens=N).token_ids for name, e in engines.items()}
        reference = outputs["torch"]
        assert len(reference) == N
        for name, ids in outputs.items():
            assert ids == reference, (name, prompt)


def test_prefill_logits_agree_within_float_tolerance(engines):
    ids = engines["torch"].tokenizer.encode(PROMPTS[0] + " " + PROMPTS[4])
    logits = {}
    for name, e in engines.items():
        e.backend.reset()
        logits[name] = e.backend.forward(ids, 0)
    for name, value in logits.items():
        assert np.abs(value - logits["torch"]).max() < 1e-3, name


@pytest.mark.parametrize("backend", ["torch", "executorch", "onnxruntime", "llamacpp"])
def test_speculative_decoding_is_exact_on_each_backend(artefacts, engines, backend):
    plain = engines[backend].generate(PROMPTS[0] * 3, max_tokens=40).token_ids
    spec = Engine.load(artefacts[backend], backend=backend, max_seq_len=128, speculative="lookup:2,4")
    fast = spec.generate(PROMPTS[0] * 3, max_tokens=40)
    assert fast.token_ids == plain
    assert spec.speculation.stats.proposed > 0


REGEX = r"[a-z ,]{10,40}[.]"  # text the tiny model writes, bounded so every backend finishes


def test_constrained_tokens_are_identical_on_every_backend(engines):
    from edgefinfer.decoding.structured import Constraint

    for prompt in PROMPTS[:3]:
        outputs = {name: e.generate(prompt, max_tokens=N, response_format=Constraint.regex(REGEX))
                   for name, e in engines.items()}
        reference = outputs["torch"]
        assert re.fullmatch(REGEX, reference.text) and reference.finish_reason == "stop", reference.text
        for name, out in outputs.items():
            assert out.token_ids == reference.token_ids, (name, prompt)


@pytest.mark.parametrize("backend", ["torch", "executorch", "onnxruntime", "llamacpp"])
def test_constrained_speculative_decoding_is_exact_on_each_backend(artefacts, engines, backend):
    from edgefinfer.decoding.structured import Constraint

    prompt = PROMPTS[0] * 3
    regex = r"[a-z ]{20,60}[.]"
    plain = engines[backend].generate(prompt, max_tokens=N, response_format=Constraint.regex(regex))
    spec = Engine.load(artefacts[backend], backend=backend, max_seq_len=128, speculative="lookup:2,4")
    fast = spec.generate(prompt, max_tokens=N, response_format=Constraint.regex(regex))
    assert fast.token_ids == plain.token_ids and re.fullmatch(regex, fast.text)
    assert spec.speculation.stats.proposed > 0


TORCH_FREE = """
import json, sys
from edgefinfer.runtime.engine import Engine
out = Engine.load(sys.argv[1], backend=sys.argv[2], max_seq_len=128).generate(sys.argv[3], max_tokens=32)
print(json.dumps({"ids": out.token_ids, "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch")}))
"""


@pytest.mark.parametrize("backend", ["onnxruntime", "llamacpp"])
def test_greedy_generation_runs_without_torch(artefacts, engines, backend):
    """ONNX Runtime and llama.cpp need no torch for greedy decoding (~190 MB less resident memory);
    numpy's argmax picks the same tokens as the torch sampler."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", TORCH_FREE, str(artefacts[backend]), backend, PROMPTS[1]],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["torch"] == []
    assert out["ids"] == engines["torch"].generate(PROMPTS[1], max_tokens=32).token_ids


@pytest.mark.parametrize("backend", ["executorch", "onnxruntime"])
def test_window_cache_streams_ten_windows_at_flat_memory(tmp_path, backend):
    """The compiled sliding-window caches (ExecuTorch's ring, ONNX Runtime's windowed GQA buffer):
    10x the window through the Engine, far past the model's 64 positions; resident memory stays flat."""
    from edgefinfer.runtime.engine import rss_mb

    tok = tiny_tokenizer(320)
    tok.eos_token = None
    model = tiny_model(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, max_position_embeddings=64,
                       eos_token_id=None)
    window = 32
    if backend == "executorch":
        export_pte(model, tmp_path / "model.pte", recipe="fp32", kv="window", window=window, num_sinks=4,
                   lookahead=8, progress=False)
        path = tmp_path / "model.pte"
    else:
        export_onnx(model, tmp_path, kv="window", window=window, lookahead=8)
        path = tmp_path
    tok.save(tmp_path)
    engine = Engine.load(path)
    assert engine.backend.name == backend and engine.backend.window == window
    samples = []

    def on_token(_):
        if len(samples) < 10 * window:
            samples.append(rss_mb())

    out = engine.generate("It is a truth", max_tokens=10 * window, on_token=on_token)
    assert out.stats.generated_tokens == 10 * window  # far past the 40-slot cache and the 64-position model
    growth = max(samples[2 * window:]) - samples[2 * window]
    assert growth < 2.0, f"resident memory grew {growth:.2f} MiB while streaming"
