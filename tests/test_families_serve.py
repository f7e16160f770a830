"""Every family's GGUF through `edgefinfer run`'s engine and through `serve`, over real HTTP.

Each tiny family model (tests/families.py, as llama.cpp runs it) is written as an F32 GGUF with a
byte-level tokenizer. On that one file: the runtime's greedy tokens are the server's (with
--batch-invariant, the exactness contract with `run`) and the finish reason is the same; prompt-lookup
speculation gives the runtime's tokens again (greedy verification is exact); a regex-constrained reply
matches its regex on both sides.
"""

from __future__ import annotations

import re

import httpx
import pytest

from tests.families import NAMES, family_gguf

pytest.importorskip("llama_cpp")
pytest.importorskip("fastapi")

pytestmark = pytest.mark.llamacpp

PROMPT = "abcabcabcabcabc"  # the byte tokenizer has no space; repetition gives prompt lookup its n-grams
TOKENS = 12
DIGITS = "[0-9]{5}"


# llama.cpp picks Phi-3's long or short RoPE factors by the context it was created with: per sequence
# (`run`'s --max-seq-len, `serve --batch-invariant`'s --max-model-len), or the whole pool when the cells are
# unified (serve's default, as llama-server's). So both sides get the same per-sequence context here.
MAX_LEN = 64


@pytest.fixture(scope="module", params=NAMES)
def gguf_file(request, tmp_path_factory):
    return family_gguf(request.param, tmp_path_factory.mktemp(request.param))[1]


def test_run_and_serve_agree_on_every_family(gguf_file):
    from edgefinfer.runtime.engine import Engine
    from edgefinfer.server_gpu.api import create_app
    from edgefinfer.server_gpu.launch import BackgroundServer
    from edgefinfer.server_gpu.loader import ServeOptions, build_engine
    from edgefinfer.decoding.structured import Constraint

    runtime = Engine.load(gguf_file, threads=1, max_seq_len=MAX_LEN)
    expect = runtime.generate(PROMPT, max_tokens=TOKENS)
    assert expect.token_ids  # something was generated to compare
    lookup = Engine.load(gguf_file, speculative="lookup:2,3", threads=1, max_seq_len=MAX_LEN).generate(
        PROMPT, max_tokens=TOKENS)
    assert (lookup.token_ids, lookup.finish_reason) == (expect.token_ids, expect.finish_reason)
    digits = runtime.generate(PROMPT, max_tokens=TOKENS, response_format=Constraint.regex(DIGITS))
    assert re.fullmatch(DIGITS, digits.text), digits.text

    engine, name = build_engine(ServeOptions(str(gguf_file), max_num_seqs=2, max_model_len=MAX_LEN, threads=1,
                                             batch_invariant=True))
    with BackgroundServer(create_app(engine, name)) as srv:
        body = {"model": name, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
        got = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
        regex = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            **body, "structured_outputs": {"regex": DIGITS}}).json()["choices"][0]
    assert (got["text"], got["finish_reason"]) == (expect.text, expect.finish_reason)
    assert re.fullmatch(DIGITS, regex["text"]), regex
