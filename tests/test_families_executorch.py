"""ExecuTorch export of every supported family (tests/families.py): real .pte files against eager torch.

Each family's tiny model is lowered once (fp32, ExecuTorch's custom attention ops, static cache of 32
slots) and run by ExecuTorch's runtime: a 12-token prompt then greedy single-token steps give the
eager model's logits and tokens. Gemma 3 (interleaved sliding / global layers) is also exported with
the runtime's ring cache (`kv="window"`), and driven by ExecuTorch's own C++ TextLLMRunner; Qwen 3
(q/k norms) is exported as 8da4w.

A lowering costs 1-4 minutes on a shared 2-core box, so by default the fp32 parity runs for Gemma 3
only, the family whose features change the exported graph most (q/k norms, sandwich norms, embedding
scale, GELU-tanh, attention scale, per-layer windows and RoPEs); the others run with
EDGEFINFER_ET_FAMILIES=all (or a comma-separated list of names). The eager source transformation is
checked for every family in seconds by test_swapped_attention_matches_the_model.

The models use a 300-token vocabulary (the tiny tokenizer's, so TextLLMRunner can drive them) and the
tokenizer's BOS / EOS ids; every other size is tests/families.py's.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("executorch")
pytest.importorskip("torchao")

from edgefinfer.model.checkpoint import load_model  # noqa: E402
from edgefinfer.compile.et_quant import quantize_for_xnnpack  # noqa: E402
from edgefinfer.compile.executorch_export import export_pte, pte_delegates  # noqa: E402
from edgefinfer.runtime.backends.executorch import ExecuTorchBackend  # noqa: E402
from edgefinfer.runtime.backends.torch_eager import TorchBackend  # noqa: E402
from tests import families  # noqa: E402
from tests.helpers import tiny_tokenizer  # noqa: E402

VOCAB = 300
MAX_SEQ = 32
PROMPT = [1, 17, 33, 5, 99, 64, 12, 7, 81, 40, 3, 120]  # 12 > 2 x families.WINDOW positions
STEPS = 6
DEFAULT_FAMILIES = ("gemma3",)


def _selected() -> tuple[str, ...]:
    value = os.environ.get("EDGEFINFER_ET_FAMILIES", "").strip()
    if value == "all":
        return families.NAMES
    return tuple(n.strip() for n in value.split(",") if n.strip()) if value else DEFAULT_FAMILIES


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer(VOCAB)


class Programs:
    """Models and lowered programs, each built once per module on first use."""

    def __init__(self, tokenizer, tmp_path_factory):
        self.tokenizer = tokenizer
        self.tmp = tmp_path_factory
        self.store = None  # the shared artefact cache: each program is lowered once per machine (see its key)
        self._models: dict[str, torch.nn.Module] = {}
        self._ptes: dict[tuple, tuple] = {}

    def model(self, name: str):
        if name not in self._models:
            folder = self.tmp.mktemp(name)
            sizes = dict(vocab_size=VOCAB, bos_token_id=self.tokenizer.bos_id, eos_token_id=self.tokenizer.eos_id)
            with pytest.MonkeyPatch.context() as mp:
                for key, value in sizes.items():
                    mp.setitem(families._SIZES, key, value)
                families.save_hf(name, folder)
            self._models[name] = load_model(folder).float().eval()
        return self._models[name]

    def pte(self, name: str, **options):
        key = (name, tuple(sorted(options.items())))
        if key not in self._ptes:
            path = self.tmp.mktemp("pte") / f"{name}.pte"
            meta = export_pte(self.model(name), path, cache_dir=self.store, progress=False, **options)
            self._ptes[key] = path, meta
        return self._ptes[key]

    def static(self, name: str):
        return self.pte(name, max_seq_len=MAX_SEQ)


@pytest.fixture(scope="module")
def programs(tokenizer, tmp_path_factory):
    return Programs(tokenizer, tmp_path_factory)


def greedy_run(backend, prompt: list[int], steps: int) -> tuple[list[np.ndarray], list[int]]:
    """Prefill `prompt`, then `steps` greedy single-token steps: every logits row and the tokens chosen."""
    rows = [backend.forward(prompt, 0)]
    tokens = []
    for i in range(steps):
        tokens.append(int(rows[-1][-1].argmax()))
        rows.append(backend.forward([tokens[-1]], len(prompt) + i))
    return rows, tokens


def max_diff(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    return max(float(np.abs(g - w).max()) for g, w in zip(got, want))


# ---- the source transformation in eager torch, every family (seconds) ----------------------------------

@pytest.mark.parametrize("name", families.NAMES)
@torch.no_grad()
def test_swapped_attention_matches_the_model(name, programs):
    """ExecuTorch's custom-op attention (eager CPU kernels) reproduces our model in chunks: static cache
    against `StaticCache`, ring cache against the runtime's `SlidingWindowCache` (window 4)."""
    from edgefinfer.model.kv_cache import StaticCache
    from edgefinfer.compile.et_attention import EtRingCache, EtStaticCache, ExportableLM, swap_attention
    from edgefinfer.runtime.kv.window import SlidingWindowCache

    model = programs.model(name)
    tokens = torch.tensor([PROMPT + [9, 44, 70, 2, 8, 100]])  # 18 positions

    def run(lm, chunks):
        out, start = [], 0
        for n in chunks:
            out.append(lm(tokens[:, start:start + n], torch.tensor([start])))
            start += n
        return torch.cat(out, 1)

    positions = torch.arange(tokens.shape[1])[None]
    want = model(tokens, positions, StaticCache(model.config, 1, MAX_SEQ))
    got = run(ExportableLM(swap_attention(model), EtStaticCache(model.config, MAX_SEQ)), [12, 1, 1, 4])
    assert (got - want).abs().max() < 1e-4
    w = families.WINDOW
    want = model(tokens, positions, SlidingWindowCache(model.config, 1, w, 0, w))
    got = run(ExportableLM(swap_attention(model), EtRingCache(model.config, w, 0, w)), [5, 5, 1, 1, 5, 1])
    assert (got - want).abs().max() < 1e-4


# ---- fp32 parity, every family ------------------------------------------------------------------------

@pytest.mark.parametrize("name", families.NAMES)
def test_family_pte_matches_eager(name, programs):
    if name not in _selected():
        pytest.skip(f"{name}: lowering is slow; EDGEFINFER_ET_FAMILIES=all (or ={name}) runs it")
    model = programs.model(name)
    path, meta = programs.static(name)
    got, got_tokens = greedy_run(ExecuTorchBackend(path, threads=1), PROMPT, STEPS)
    want, want_tokens = greedy_run(TorchBackend(model, max_seq_len=MAX_SEQ), PROMPT, STEPS)
    assert got[0].shape == (len(PROMPT), VOCAB)
    diff = max_diff(got, want)
    assert diff < 1e-4, f"{name}: max |logit difference| {diff:.2e}"
    assert got_tokens == want_tokens
    ops = pte_delegates(path)["forward"]["operators"]
    assert "llama::custom_sdpa.out" in ops and "llama::update_cache.out" in ops, ops
    assert meta["custom_ops"] and meta["kv"]["layout"] == "static"


# ---- Gemma 3: interleaved windows under the runtime's ring cache ---------------------------------------

def test_gemma3_ring_cache_matches_eager_window_cache_past_the_window(programs):
    """kv=window:4 (ring of 4 + 4 lookahead slots): the sliding layers keep their own window, the global
    layer gets the ring's (the runtime's --kv window:N policy); 18 positions run well past it."""
    window = families.WINDOW
    model = programs.model("gemma3")
    path, meta = programs.pte("gemma3", kv="window", window=window)
    backend = ExecuTorchBackend(path, threads=1)
    assert backend.window == window and backend.max_chunk == window + 1  # the prompt goes in 3 chunks
    got, got_tokens = greedy_run(backend, PROMPT, STEPS)
    want, want_tokens = greedy_run(TorchBackend(model, window=window, lookahead=window), PROMPT, STEPS)
    diff = max_diff(got, want)
    assert diff < 1e-4, f"max |logit difference| {diff:.2e}"
    assert got_tokens == want_tokens
    # The ring really cuts the global layer's attention: the full-context model differs past the window.
    full, _ = greedy_run(TorchBackend(model, max_seq_len=MAX_SEQ), PROMPT + got_tokens, 0)
    assert np.abs(full[0][-1] - got[-1][-1]).max() > 1e-2


# ---- ExecuTorch's own runner on a non-Llama family ----------------------------------------------------

def test_textllmrunner_runs_gemma3(programs, tokenizer, tmp_path, capfd):
    """ExecuTorch's C++ TextLLMRunner reads our metadata methods and generates the eager model's greedy
    tokens (compared as the bytes it prints; see tests/test_executorch_export.py)."""
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    from edgefinfer.app.peer_runners import runner_printed_bytes

    path, _ = programs.static("gemma3")
    tokenizer.save(tmp_path)
    text = "It is a truth universally"
    steps = 8
    runner = TextLLMRunner(str(path), str(tmp_path / "tokenizer.json"))
    stats = []
    capfd.readouterr()
    runner.generate(text, GenerationConfig(echo=False, max_new_tokens=steps, temperature=0.0),
                    stats_callback=stats.append)
    printed = capfd.readouterr().out.encode("utf-8", "surrogateescape")

    ids = tokenizer.encode(text)
    _, tokens = greedy_run(TorchBackend(programs.model("gemma3"), max_seq_len=MAX_SEQ), ids, steps)
    tokens = tokens[: tokens.index(tokenizer.eos_id) + 1] if tokenizer.eos_id in tokens else tokens
    expected = runner_printed_bytes(tokenizer, tokens)
    assert stats and stats[0].num_prompt_tokens == len(ids)
    assert printed.startswith(expected.decode("utf-8", "replace").encode()), (printed[:80], expected)
    assert len(expected) > 3  # the comparison saw real text


# ---- quantized lowering with q/k norms ---------------------------------------------------------------

def test_qwen3_8da4w_matches_eager_quantized_model(programs):
    """Qwen 3's per-head q/k norms stay float RMSNorms between XNNPACK's dynamically quantized linears;
    the .pte matches the eager quantized model (tolerances of tests/test_executorch_export.py:
    int8 activation rounding ties may differ by an ulp)."""
    model = programs.model("qwen3")
    path, meta = programs.pte("qwen3", recipe="8da4w", group_size=32, max_seq_len=MAX_SEQ)
    assert "XnnpackBackend" in pte_delegates(path)["forward"]["delegates"]
    quantized = quantize_for_xnnpack(model, "8da4w", 32)
    got, got_tokens = greedy_run(ExecuTorchBackend(path, threads=1), PROMPT, STEPS)
    want, want_tokens = greedy_run(TorchBackend(quantized, max_seq_len=MAX_SEQ), PROMPT, STEPS)
    per_position = np.concatenate([np.abs(g - w).max(-1) for g, w in zip(got, want)])
    assert np.median(per_position) < 1e-4 and per_position.max() < 0.25, per_position
    g, w = np.concatenate(got), np.concatenate(want)
    assert (g.argmax(-1) == w.argmax(-1)).mean() >= 0.95
    # ... and quantization really happened
    float_rows, _ = greedy_run(TorchBackend(model, max_seq_len=MAX_SEQ), PROMPT, 0)
    assert np.abs(got[0] - float_rows[0]).max() > 1e-2
    assert meta["scheme"] == "8da4w"
