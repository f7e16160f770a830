"""One stop rule for `edgefinfer run` and `serve` (issue 33): the same model, the same prompt, the same
greedy tokens and finish reason from both, over real HTTP for the server.

The model has two end tokens: its EOS (<|endoftext|>) and an end-of-turn control token (<|im_end|>)
that its config lists beside it and that llama.cpp ends generation on. The end-of-turn id is the one
the model greedily produces a few tokens into the reply (found by a first, unstopped generation), so
a side that does not stop on it runs on to the length limit. It comes four ways: a bare .gguf (no
config: the GGUF's metadata names the end tokens), the same .gguf with the tokenizer.json put beside
it, a bundle holding the .gguf, and the HF folder it was written from.
"""

from __future__ import annotations

import re
import shutil

import httpx
import pytest
from click.testing import CliRunner

from tests.families import llamacpp_config, random_hf_model

pytest.importorskip("llama_cpp")
pytest.importorskip("fastapi")

PROMPT = "abcabcabc"
TOKENS = 12
EOS, EOT = "<|endoftext|>", "<|im_end|>"


def _tokenizer(vocab_size: int, specials: dict[int, str] | None = None):
    """The families' byte-level BPE (tests/families.byte_tokenizer) with `specials` (id -> text) put in
    place of those ids' characters as special (control) tokens; the EOS token is <|endoftext|> if given."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    from edgefinfer.tokenization.tokenizer import Tokenizer

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())[:vocab_size - 2] + ["th", "he"]
    for i, text in (specials or {}).items():
        tokens[i] = text
    backend = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[("t", "h"), ("h", "e")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True) for t in (specials or {}).values()])
    return Tokenizer(backend, eos_token=EOS if specials and EOS in specials.values() else None)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{way: MODEL path}, and the greedy ids the model produces when nothing stops it, up to and
    including the one made its end-of-turn token."""
    from edgefinfer.bundle.manifest import BundleWriter
    from edgefinfer.model.checkpoint import load_model
    from edgefinfer.compile.gguf_export import export_gguf
    from edgefinfer.runtime.engine import Engine

    root = tmp_path_factory.mktemp("stop_rule")
    config = llamacpp_config("llama")
    hf = random_hf_model(config, gemma=False)
    hf.save_pretrained(root / "probe")
    plain = _tokenizer(config.vocab_size)
    plain.save(root / "probe")
    free = Engine.load(root / "probe", threads=1).generate(PROMPT, max_tokens=TOKENS).token_ids
    prompt_ids = set(plain.encode(PROMPT))
    # The end-of-turn token: the first generated id that is new (not earlier in the reply, not in the
    # prompt, not a merge) at least two tokens in, so that the reply before it is not empty.
    stop_at = next(i for i in range(2, TOKENS) if free[i] not in free[:i] and free[i] not in prompt_ids
                   and free[i] < config.vocab_size - 2)
    eot = free[stop_at]
    eos = next(i for i in range(config.vocab_size - 2) if i not in free and i not in prompt_ids)
    tokenizer = _tokenizer(config.vocab_size, {eos: EOS, eot: EOT})

    hf.config.eos_token_id = [eos, eot]  # as SmolLM2-style configs list several
    hf.save_pretrained(root / "hf")
    tokenizer.save(root / "hf")
    model = load_model(root / "hf")
    bare = root / "bare" / "model.gguf"
    bare.parent.mkdir()
    export_gguf(model, tokenizer, bare, "f32")
    beside = root / "beside" / "model.gguf"
    beside.parent.mkdir()
    shutil.copy(bare, beside)
    tokenizer.save(beside.parent)
    with BundleWriter(root / "bundle", target="gpu-server",
                      model={"name": "stop-rule", "config": model.config.to_hf()}) as w:
        shutil.copy(bare, w.tmp / "model.gguf")
        w.add("model.gguf", format="gguf", role="model", backend="llamacpp", recipe="fp32")
        tokenizer.save(w.tmp)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            w.add(name, format="tokenizer", role="tokenizer")
        w.commit()
    return {"bare gguf": bare, "gguf beside tokenizer.json": beside, "bundle": root / "bundle",
            "hf folder": root / "hf"}, free[:stop_at + 1]


def _run(model) -> tuple[str, str]:
    """(text, finish reason) printed by `edgefinfer run MODEL -p PROMPT` (greedy)."""
    from edgefinfer.app.cli import cli

    result = CliRunner().invoke(cli, ["run", str(model), "-p", PROMPT, "-n", str(TOKENS), "--no-stream",
                                      "--threads", "1"])
    assert result.exit_code == 0, result.output + result.stderr
    return result.stdout.removesuffix("\n"), re.search(r"finish=(\w+)", result.stderr)[1]


def _serve(model) -> tuple[str, str, int]:
    """(text, finish reason, completion tokens) from `serve MODEL` over HTTP (greedy, batch-invariant)."""
    from edgefinfer.server_gpu.api import create_app
    from edgefinfer.server_gpu.launch import BackgroundServer
    from edgefinfer.server_gpu.loader import ServeOptions, build_engine

    engine, name = build_engine(ServeOptions(str(model), max_num_seqs=2, max_model_len=64, threads=1,
                                             batch_invariant=model.suffix == ".gguf" or (model / "manifest.json").is_file()))
    with BackgroundServer(create_app(engine, name)) as srv:
        body = {"model": name, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
        got = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
    return got["choices"][0]["text"], got["choices"][0]["finish_reason"], got["usage"]["completion_tokens"]


@pytest.mark.parametrize("way", ["bare gguf", "gguf beside tokenizer.json", "bundle", "hf folder"])
def test_run_and_serve_stop_on_the_same_token(models, way):
    from edgefinfer.runtime.engine import Engine

    paths, until_eot = models
    engine = Engine.load(paths[way], threads=1)
    runtime = engine.generate(PROMPT, max_tokens=TOKENS)
    ran = _run(paths[way])
    served_text, served_reason, completion_tokens = _serve(paths[way])
    assert ran == (served_text, served_reason) == (runtime.text, runtime.finish_reason)
    # Each side knows both end tokens, and the reply ends at the end-of-turn token, not at the limit.
    assert len(engine.eos_ids) == 2 and until_eot[-1] in engine.eos_ids
    assert (runtime.token_ids, runtime.finish_reason) == (until_eot[:-1], "stop")
    assert completion_tokens == len(until_eot)  # the reply and its end token, as the server counts them
