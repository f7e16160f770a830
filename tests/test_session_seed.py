"""A device conversation continued on the server: `edgefinfer serve GGUF --session FILE` (issue 31).

A llama.cpp session saved by the runtime seeds the server's prefix cache; over real HTTP, the request
that continues the conversation computes only the tokens past the seeded blocks and gets the device's
own greedy continuation. Files from another model, backend or cache layout, files without cells, and
flags that contradict the device's cell format are refused in one line (exit code 2 on the CLI) before
the model loads.
"""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys

import httpx
import pytest

from edgefinfer.errors import UserError
from edgefinfer.runtime.session import MAGIC, common_prefix
from tests.server_harness import ROOT, metrics, tiny_gguf

pytest.importorskip("llama_cpp")
pytest.importorskip("fastapi")

pytestmark = pytest.mark.llamacpp

CTX = 256
BLOCK = 16  # the server's default --block-size
TURNS = ["def wrap(text, width):", "\n    lines = []", "\n    return"]
REPLY = 24


def _drain(stream) -> str:
    return "".join(stream)


@pytest.fixture(scope="module")
def conversation(tmp_path_factory):
    """Two turns on the device (runtime, llama.cpp backend), saved; then the device's own third turn."""
    from edgefinfer.runtime.engine import Engine

    root = tmp_path_factory.mktemp("seed")
    gguf = tiny_gguf(root / "tiny.gguf")
    engine = Engine.load(gguf, threads=1, max_seq_len=CTX)
    session = engine.session()
    for text in TURNS[:2]:
        _drain(session.stream(text, max_tokens=REPLY))
    file = session.save(root / "chat.efs")
    transcript, cached = session.transcript, list(session.cached)
    ids: list[int] = []
    reply = _drain(session.stream(TURNS[2], max_tokens=REPLY, on_token=ids.append))
    prompt_ids = engine.tokenizer.encode(transcript + TURNS[2], add_special_tokens=False)
    return {"gguf": gguf, "file": file, "root": root, "prompt": transcript + TURNS[2], "cached": cached,
            "reply": reply, "reply_ids": ids, "prompt_ids": prompt_ids}


def _options(c, **kw):
    from edgefinfer.server_gpu.loader import ServeOptions

    return ServeOptions(str(c["gguf"]), **{"max_num_seqs": 1, "max_model_len": CTX, "threads": 1, **kw})


def test_seeded_server_continues_the_device_conversation(conversation):
    from edgefinfer.server_gpu.api import create_app
    from edgefinfer.server_gpu.launch import BackgroundServer
    from edgefinfer.server_gpu.loader import build_engine

    c = conversation
    engine, name = build_engine(_options(c, sessions=(str(c["file"]),)))
    with BackgroundServer(create_app(engine, name)) as srv:
        before = metrics(srv.url)
        assert before["edgefinfer_kv_retained_prefixes"] == 1  # the seed, before any request
        body = {"model": name, "prompt": c["prompt"], "max_tokens": REPLY, "temperature": 0}
        got = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
        after = metrics(srv.url)
    computed = after.get("edgefinfer_prompt_tokens_total", 0) - before.get("edgefinfer_prompt_tokens_total", 0)
    # The manager shares the seeded ids that the prompt starts with, to the token (a retained prefix keeps
    # its partial last block too), all but the prompt's last token at most; the rest is computed.
    shared = min(common_prefix(c["cached"], c["prompt_ids"]), len(c["prompt_ids"]) - 1)
    assert shared >= 2 * BLOCK, (len(c["cached"]), shared)  # the seed covers most of the prompt
    assert got["usage"]["prompt_tokens"] == len(c["prompt_ids"])
    assert computed == len(c["prompt_ids"]) - shared
    assert got["choices"][0]["text"] == c["reply"]  # the device's own greedy continuation


def test_unseeded_server_computes_the_whole_prompt(conversation):
    """The control: without --session the same request computes every prompt token (and says the same)."""
    from edgefinfer.server_gpu.api import create_app
    from edgefinfer.server_gpu.launch import BackgroundServer
    from edgefinfer.server_gpu.loader import build_engine

    c = conversation
    engine, name = build_engine(_options(c, kv_dtype="f32", flash_attn=False))
    with BackgroundServer(create_app(engine, name)) as srv:
        body = {"model": name, "prompt": c["prompt"], "max_tokens": REPLY, "temperature": 0}
        httpx.post(srv.url + "/v1/completions", json=body, timeout=60).raise_for_status()
        assert metrics(srv.url)["edgefinfer_prompt_tokens_total"] == len(c["prompt_ids"])


def _rewrite(src, dst, **changes):
    """A copy of a session file with header fields changed (the payload and its checksum kept, but for
    state "tokens": none)."""
    data = src.read_bytes()
    (n,) = struct.unpack_from("<Q", data, len(MAGIC))
    at = len(MAGIC) + 8
    header = {**json.loads(data[at:at + n]), **changes}
    head = json.dumps(header).encode()
    payload = b"" if changes.get("state") == "tokens" else data[at + n:]
    dst.write_bytes(MAGIC + struct.pack("<Q", len(head)) + head + payload)
    return dst


@pytest.mark.parametrize("changes, options, message", [
    ({"artefact_sha256": "0" * 64}, {}, "was saved with another model (artefact sha256 0000"),
    ({"backend": "onnxruntime"}, {}, "was saved on the onnxruntime backend; only a llama.cpp session"),
    ({"cache": "LlamaCppBackend max_seq_len=18446744073709551615 window=64"}, {}, "was saved with a window cache"),
    ({"state": "tokens", "arrays": [], "payload_sha256": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
     {}, "holds no llama.cpp cache (state 'tokens')"),
    ({}, {"kv_dtype": "f16"}, "need the unified pool with f32 K/V without flash attention (as `edgefinfer "
                              "run` keeps them for this model); drop --kv-dtype f16"),
    ({}, {"batch_invariant": True}, "drop --batch-invariant"),
    ({}, {"max_model_len": 32}, "raise it above the conversation"),
])
def test_refusals(conversation, tmp_path, changes, options, message):
    from edgefinfer.server_gpu.loader import build_engine

    c = conversation
    file = _rewrite(c["file"], tmp_path / "other.efs", **changes)
    with pytest.raises(UserError, match=re.escape(message)):
        build_engine(_options(c, sessions=(str(file),), **options))


def test_cli_refuses_in_one_line(conversation, tmp_path):
    c = conversation
    file = _rewrite(c["file"], tmp_path / "other.efs", artefact_sha256="0" * 64)
    proc = subprocess.run([sys.executable, "-m", "edgefinfer", "serve", str(c["gguf"]), "--session", str(file),
                           "--threads", "1"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "was saved with another model" in lines[0], proc.stderr
