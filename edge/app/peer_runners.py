"""Run a bundle in its peers' own runners and compare with `edgefinfer run`.

A bundle is only deployable if the runner a developer takes it to runs it unmodified:
- android / linux-arm64 (.pte): ExecuTorch's C++ `TextLLMRunner` (behind `llama_main` and the demo
  apps), with the bundle's tokenizer.json read by its own C++ tokenizer;
- linux-x86_64 (.onnx): onnxruntime-genai's generator, reading genai_config.json and tokenizer.json
  with its own tokenizer (onnxruntime-extensions);
- gpu-server (.gguf): llama.cpp's tokenizer, chat template and generation loop, read from the GGUF
  (through llama-cpp-python);
- qnn: the context binaries on ONNX Runtime's QNN execution provider (the HTP emulator on x86)
  against the CPU EP on the same QDQ graphs (no other runner exists for them off a device).

Each check compares what the peer does with what edgefinfer does on the same artefact: the greedy
tokens of a prompt (exact: both take the argmax of the same program's logits) and the token ids of
`PROBE_TEXTS`. `check_bundle` returns one row per (runner, prompt); bench/deploy.py and the tests
call it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from edgefinfer.errors import UserError

PLAIN_PROMPT = "The capital of France is"
CHAT_QUESTION = "What is the capital of France? Answer in one sentence."


@dataclass
class PeerRow:
    target: str
    runner: str
    prompt: str  # "plain" | "chat"
    tokens_match: bool  # the peer's greedy tokens equal edgefinfer's
    ids_match: bool  # the peer's ids of the prompt and of every PROBE_TEXTS string equal tokenizers'
    ours: str = ""  # what edgefinfer generated (text), for the person reading the result
    theirs: str = ""
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_bundle(bundle: str | Path, max_new_tokens: int = 32) -> list[PeerRow]:
    """Run `bundle` in its peer's runner: greedy tokens for a plain and a chat prompt, and probe ids."""
    from edgefinfer.bundle.manifest import load_manifest

    folder = Path(bundle)
    manifest = load_manifest(folder)
    model = manifest.artefact("model")
    fmt = model.format if model else None
    check = {"pte": _check_executorch, "onnx": _check_genai, "gguf": _check_llamacpp, "qnn-context": _check_qnn}.get(fmt)
    if check is None:
        raise UserError(f"{folder}: no peer runner to check a {fmt} bundle against (pte, onnx, gguf and qnn have one)")
    return check(folder, manifest.target, folder / model.path, max_new_tokens)


# ---- edgefinfer's side -----------------------------------------------------------------------------

def edgefinfer_greedy(bundle: Path, prompt: str, max_new_tokens: int) -> tuple[list[int], list[int], str]:
    """(prompt ids, generated ids, text) of `edgefinfer run` with greedy decoding; the ids end with the
    stop token when one ended the generation (edgefinfer does not print it; the peers' loops see it)."""
    from edgefinfer.runtime.engine import Engine

    engine = Engine.load(bundle)
    stops: list[int] = []
    result = engine.generate(prompt, max_tokens=max_new_tokens,
                             on_token=lambda t: stops.append(t) if t in engine.eos_ids else None)
    return engine.tokenizer.encode(prompt), list(result.token_ids) + stops[:1], result.text


def _prompts(tokenizer) -> dict[str, str]:
    prompts = {"plain": PLAIN_PROMPT}
    if tokenizer.chat_template:
        prompts["chat"] = tokenizer.apply_chat_template([{"role": "user", "content": CHAT_QUESTION}])
    return prompts


# ---- ExecuTorch -------------------------------------------------------------------------------------

# TextLLMRunner prints each generated piece to stdout (C printf, so only fd-level capture sees it),
# then a "PyTorchObserver {json}" statistics line. A subprocess keeps that stdout apart from ours.
_ET_RUNNER = textwrap.dedent("""
    import json, sys
    import executorch.kernels.quantized, executorch.extension.llm.custom_ops.custom_ops  # kernels
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner
    pte, tokenizer, prompt, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    runner = TextLLMRunner(pte, tokenizer)
    stats = []
    runner.generate(prompt, GenerationConfig(echo=False, max_new_tokens=n, temperature=0.0),
                    stats_callback=stats.append)
    sys.stdout.flush()
    print("@@stats " + json.dumps({"prompt_tokens": stats[0].num_prompt_tokens}), file=sys.stderr)
""")


def executorch_runner_text(pte: Path, tokenizer_json: Path, prompt: str, max_new_tokens: int) -> tuple[bytes, int]:
    """(bytes TextLLMRunner printed for its greedy tokens, number of prompt tokens it encoded)."""
    proc = subprocess.run([sys.executable, "-c", _ET_RUNNER, str(pte), str(tokenizer_json), prompt,
                           str(max_new_tokens)], capture_output=True, timeout=600)
    err = proc.stderr.decode("utf-8", "replace")
    if proc.returncode != 0 or "@@stats " not in err:
        raise RuntimeError(f"TextLLMRunner failed (exit {proc.returncode}): {err.strip().splitlines()[-1:]}")
    stats = json.loads(err.split("@@stats ", 1)[1].splitlines()[0])
    text = proc.stdout.split(b"\nPyTorchObserver ", 1)[0]
    return text, stats["prompt_tokens"]


def runner_printed_bytes(tokenizer, ids: list[int]) -> bytes:
    """What TextLLMRunner prints for `ids`: each piece's bytes, except single bytes that are neither
    printable ASCII nor whitespace, which its safe_printf drops."""
    decoder = _byte_level_decoder()
    out = b""
    for t in ids:
        piece = tokenizer.backend.id_to_token(t)
        raw = piece.encode() if piece in _special_tokens(tokenizer) else bytes(decoder[c] for c in piece)
        if len(raw) == 1 and not (32 <= raw[0] < 127 or raw[0] in b" \t\n\r\x0b\x0c"):
            continue
        out += raw
    return out


def _special_tokens(tokenizer) -> set[str]:
    return {t.content for t in tokenizer.backend.get_added_tokens_decoder().values()}


def _byte_level_decoder() -> dict[str, int]:
    """Byte-level BPE's printable stand-in characters -> the bytes they stand for (GPT-2's table)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _check_executorch(bundle: Path, target: str, pte: Path, n: int) -> list[PeerRow]:
    from edgefinfer.compile.runner_tokenizer import load_runner_tokenizer
    from edgefinfer.tokenization.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(bundle)
    cpp = load_runner_tokenizer(bundle / "tokenizer.json")
    encode = lambda text: list(cpp.encode(text, 0, 0))  # noqa: E731
    probes = _probe_agreement(encode, tokenizer)
    stops = _stop_ids(bundle)
    rows = []
    for name, prompt in _prompts(tokenizer).items():
        prompt_ids, ids, text = edgefinfer_greedy(bundle, prompt, n)
        printed, n_prompt = executorch_runner_text(pte, bundle / "tokenizer.json", prompt, n)
        # After a stop token TextLLMRunner prints that token's text and a newline.
        expected = runner_printed_bytes(tokenizer, ids) + (b"\n" if ids and ids[-1] in stops else b"")
        rows.append(PeerRow(target, "executorch TextLLMRunner", name, printed == expected,
                            n_prompt == len(prompt_ids) and encode(prompt) == prompt_ids and probes[0] == probes[1],
                            text, printed.decode("utf-8", "replace"),
                            f"{len(ids)} tokens; prompt {n_prompt} tokens; probe strings {probes[0]}/{probes[1]}"))
    return rows


def _probe_agreement(encode, tokenizer) -> tuple[int, int]:
    """(how many PROBE_TEXTS `encode` gives tokenizers' ids for, how many there are)."""
    from edgefinfer.compile.runner_tokenizer import PROBE_TEXTS

    return sum(encode(t) == tokenizer.encode(t) for t in PROBE_TEXTS), len(PROBE_TEXTS)


# ---- onnxruntime-genai ------------------------------------------------------------------------------

def genai_greedy(bundle: Path, prompt: str, max_new_tokens: int) -> tuple[list[int], list[int]]:
    """(prompt ids, generated ids) of onnxruntime-genai's own generator, greedy, its own tokenizer."""
    import onnxruntime_genai as og

    model = og.Model(str(bundle))
    tokenizer = og.Tokenizer(model)
    prompt_ids = [int(i) for i in tokenizer.encode(prompt)]
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt_ids) + max_new_tokens, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt_ids)
    while not generator.is_done():
        generator.generate_next_token()
    return prompt_ids, [int(i) for i in generator.get_sequence(0)][len(prompt_ids):]


def _check_genai(bundle: Path, target: str, model: Path, n: int) -> list[PeerRow]:
    from edgefinfer.compile.runner_tokenizer import genai_encoder
    from edgefinfer.tokenization.tokenizer import Tokenizer

    if not (bundle / "genai_config.json").is_file():
        raise UserError(f"{bundle} has no genai_config.json (a --kv window bundle): onnxruntime-genai cannot run it")
    tokenizer = Tokenizer.from_dir(bundle)
    probes = _probe_agreement(genai_encoder(bundle), tokenizer)
    stops = _stop_ids(bundle)  # genai's sequence leaves out the stop token that ended it
    rows = []
    for name, prompt in _prompts(tokenizer).items():
        prompt_ids, ids, text = edgefinfer_greedy(bundle, prompt, n)
        their_prompt, theirs = genai_greedy(bundle, prompt, n)
        theirs = _until_stop(theirs, stops)
        same = _without_stop(theirs, stops) == _without_stop(ids, stops)
        rows.append(PeerRow(target, "onnxruntime-genai Generator", name, same,
                            their_prompt == prompt_ids and probes[0] == probes[1], text, tokenizer.decode(theirs),
                            f"{len(ids)} vs {len(theirs)} tokens; probe strings {probes[0]}/{probes[1]}"))
    return rows


def _stop_ids(bundle: Path) -> set[int]:
    """The bundle's stop ids, by the rule `edgefinfer run` and `serve` use (`ModelSource.stop_ids`)."""
    from edgefinfer.bundle.resolve import resolve

    src = resolve(bundle)
    return set(src.stop_ids(src.tokenizer()))


def _without_stop(ids: list[int], stops: set[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in stops else ids


def _until_stop(ids: list[int], stops: set[int]) -> list[int]:
    """A peer's generated ids up to and including the first stop token."""
    for i, t in enumerate(ids):
        if t in stops:
            return ids[:i + 1]
    return ids


# ---- llama.cpp ---------------------------------------------------------------------------------------

def llamacpp_vocab(gguf: Path):
    """llama.cpp's tokenizer of a GGUF (vocabulary only: no weights are loaded)."""
    from llama_cpp import Llama

    return Llama(str(gguf), vocab_only=True, verbose=False)


def llamacpp_chat_prompt(llm, messages: list[dict[str, str]]) -> str:
    """The GGUF's chat template rendered the way llama-cpp-python's chat completion renders it."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = llm.metadata.get("tokenizer.chat_template")
    if template is None:
        raise UserError("the GGUF carries no tokenizer.chat_template")
    bos, eos = (llm.detokenize([t], special=True).decode() for t in (llm.token_bos(), llm.token_eos()))
    return Jinja2ChatFormatter(template, eos_token=eos, bos_token=bos)(messages=messages).prompt


def llamacpp_greedy(llm, prompt: str, max_new_tokens: int, stops: set[int]) -> tuple[list[int], list[int]]:
    """(prompt ids, generated ids up to a stop token) of llama-cpp-python's own generation loop, temperature 0."""
    prompt_ids = llm.tokenize(prompt.encode(), add_bos=False, special=True)
    out: list[int] = []
    for token in llm.generate(prompt_ids, temp=0.0, top_k=1):
        out.append(token)
        if token in stops or len(out) >= max_new_tokens:
            break
    return prompt_ids, out


def _check_llamacpp(bundle: Path, target: str, gguf: Path, n: int) -> list[PeerRow]:
    from llama_cpp import Llama

    from edgefinfer.tokenization.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(bundle)
    # The context edgefinfer's llama.cpp backend opens (2048 cells, F32 KV, 512-token batches): with
    # llama.cpp's default F16 KV the two would not compute the same logits, and greedy ties could differ.
    llm = Llama(str(gguf), n_ctx=2048, n_batch=512, type_k=0, type_v=0, n_threads=1, verbose=False)
    probes = _probe_agreement(lambda t: llm.tokenize(t.encode(), add_bos=False, special=True), tokenizer)
    stops = _stop_ids(bundle)
    rows = []
    for name, prompt in _prompts(tokenizer).items():
        prompt_ids, ids, text = edgefinfer_greedy(bundle, prompt, n)
        their_prompt, theirs = llamacpp_greedy(llm, prompt, n, stops)
        template_ok = True
        if name == "chat":  # the prompt as llama.cpp's side renders the GGUF's own template
            messages = [{"role": "user", "content": CHAT_QUESTION}]
            template_ok = llamacpp_chat_prompt(llm, messages) == tokenizer.apply_chat_template(messages)
        rows.append(PeerRow(target, "llama.cpp (llama-cpp-python generate, GGUF tokenizer and template)", name,
                            theirs == ids, their_prompt == prompt_ids and probes[0] == probes[1] and template_ok,
                            text, tokenizer.decode(theirs),
                            f"{len(ids)} vs {len(theirs)} tokens; probe strings {probes[0]}/{probes[1]}"
                            + ("; chat template equal" if name == "chat" and template_ok else "")))
    return rows


# ---- Qualcomm QNN -------------------------------------------------------------------------------------

def _check_qnn(bundle: Path, target: str, model: Path, n: int) -> list[PeerRow]:
    from edgefinfer.bundle.resolve import resolve
    from edgefinfer.runtime.backends.ort import open_qnn
    from edgefinfer.runtime.engine import Engine

    src = resolve(bundle)
    meta, tokenizer = src.entry.meta, src.tokenizer()
    eos = src.stop_ids(tokenizer)
    engines = {ep: Engine(open_qnn(bundle, meta, ep=ep, threads=1), tokenizer, eos) for ep in ("qnn", "cpu")}
    rows = []
    for name, prompt in _prompts(tokenizer).items():
        htp, cpu = (engines[ep].generate(prompt, max_tokens=n) for ep in ("qnn", "cpu"))
        # Not bit-exact by construction: the HTP computes the QDQ graph in fixed point, the CPU EP in
        # float; the row says where greedy decoding first parts, if it does.
        first = next((i for i, (a, b) in enumerate(zip(htp.token_ids, cpu.token_ids)) if a != b), None)
        rows.append(PeerRow(target, "onnxruntime QNN EP (HTP emulator) vs CPU EP", name,
                            htp.token_ids == cpu.token_ids, True, cpu.text, htp.text,
                            f"{len(cpu.token_ids)} vs {len(htp.token_ids)} tokens"
                            + (f"; first different token at {first}" if first is not None else "")
                            + "; both sides tokenize with tokenizers"))
    return rows
