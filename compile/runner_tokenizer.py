"""tokenizer.json files that the peers' own runners encode exactly as `tokenizers` does.

A bundle's tokenizer.json is read by three tokenizer libraries besides `tokenizers`: ExecuTorch's
runners (`TextLLMRunner`, `llama_main`, its Android and iOS demo apps) use the C++ `HFTokenizer` of
pytorch_tokenizers; onnxruntime-genai uses onnxruntime-extensions; llama.cpp reads the GGUF's own
vocabulary (its ids are checked by the tests, not rewritten here). Each implements a subset of
tokenizer.json, and the subsets differ. On SmolLM2's file (as transformers converts it from GGUF:
`Split(\\p{N}, Isolated)`, then GPT-2's split pattern without its final `|\\s+`, then a ByteLevel
without regex):

- ExecuTorch keeps only a Split regex's matches, where `tokenizers` also keeps the text between them
  as pieces: the digit split drops every non-digit ("The capital of France is" -> zero tokens). It
  does implement `Digits` and `ByteLevel(use_regex=true)` (GPT-2's split, look-ahead included, by
  llama.cpp's hand-written Unicode splitter);
- onnxruntime-extensions mis-splits `\\s+(?!\\S)` unless the pattern ends with GPT-2's `|\\s+`
  ("user\\nWhat is" -> "What", " ", "is" instead of "What", " is"), and its `Digits` is ASCII-only.

So each runner gets the file rewritten into an equivalent form it implements (`DIALECTS`):

    executorch:          Split(\\p{N}, Isolated) -> Digits(individual_digits=true);
                         Split(GPT-2), ByteLevel(no regex) -> ByteLevel(use_regex=true)
    onnxruntime-genai:   Split(GPT-2 without `|\\s+`) -> Split(GPT-2 with it)

Both rewrites are exact for `tokenizers` itself: \\p{N} is Rust's `char::is_numeric` (Nd, Nl, No);
the pieces GPT-2's pattern without `|\\s+` leaves between matches are single whitespace characters
followed by a non-space, which `\\s+` matches alone. Neither claim is assumed: the rewritten file must
give the original's ids in `tokenizers` and in the runner's own library, on `PROBE_TEXTS` (Unicode,
digits, runs of spaces, tabs, newlines, special tokens) plus any text the caller adds. A tokenizer a
runner cannot represent exactly is refused with the features it uses, never shipped.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal

from edgefinfer.errors import UserError

# GPT-2's split pattern as Hugging Face byte-level tokenizers spell it in a `Split` pre-tokenizer;
# converters sometimes drop the final catch-all `|\s+` (transformers' GGUF conversion does).
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
GPT2_PATTERNS = (GPT2_PATTERN, GPT2_PATTERN + r"|\s+")
DIGIT_PATTERN = r"\p{N}"

# Strings on which the runner's ids must equal tokenizers' ids (the build adds real text).
PROBE_TEXTS: tuple[str, ...] = (
    "The capital of France is",
    "Hello, world! How are you?",
    "  two leading spaces",
    "trailing spaces   ",
    "tabs\tand\nnewlines\n\n\nthree",
    "12345 apples cost $6.78 (or 9,000.5)",
    "mixed123abc456 x2 3D",
    "3.14159e-10 -42 +7",
    "café naïve résumé Ωμέγα",
    "日本語のテキスト 中文 한국어",
    "emoji 🤖 👍🏽 family 👨\u200d👩\u200d👧",
    "Ⅻ ½ ² ٣ numbers of other scripts",
    "don't you'll I'm we've she'd they're",
    "x  y   z    w",
    "line one\r\nline two\r\n",
    "def f(x):\n    return x ** 2  # code\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after a special token",
    "\u00a0non-breaking\u2009thin\u3000ideographic spaces",
    "",
)


Dialect = Literal["executorch", "onnxruntime-genai"]
DIALECTS: tuple[str, ...] = ("executorch", "onnxruntime-genai")


def runner_tokenizer(tokenizer_json: dict[str, Any], dialect: Dialect, extra_texts: Iterable[str] = (),
                     runner_encode: Callable[[str], list[int]] | None = None) -> dict[str, Any]:
    """`tokenizer_json` rewritten for `dialect`'s runner, checked to encode exactly as the original.

    runner_encode: the runner's own encoder of the rewritten file; default: ExecuTorch's C++ library
    for "executorch"; for "onnxruntime-genai" (whose tokenizer needs a model folder) the check runs
    on `tokenizers` only here, and again with the runner through `check_runner` once the bundle exists.
    """
    if dialect not in DIALECTS:
        raise UserError(f"unknown tokenizer dialect {dialect!r}: use one of {', '.join(DIALECTS)}")
    rewritten = copy.deepcopy(tokenizer_json)
    if rewritten.get("pre_tokenizer") is not None:
        rewritten["pre_tokenizer"] = rewrite_pre_tokenizer(rewritten["pre_tokenizer"], dialect)
    encoders: dict[str, Callable[[str], list[int]]] = {"tokenizers (rewritten)": _hf_encoder(rewritten)}
    if runner_encode is None and dialect == "executorch":
        runner_encode = _runner_encoder(rewritten)
    if runner_encode is not None:
        encoders[RUNNER_NAMES[dialect]] = runner_encode
    check_runner(tokenizer_json, rewritten, encoders, extra_texts)
    return rewritten


RUNNER_NAMES = {"executorch": "ExecuTorch's runner", "onnxruntime-genai": "onnxruntime-genai"}


def runner_tokenizer_class(tokenizer_json: dict[str, Any], dialect: Dialect) -> str | None:
    """The tokenizer_class to ship for `dialect`'s runner; None: the default (PreTrainedTokenizerFast).

    onnxruntime-extensions takes its SentencePiece path for a BPE whose decoder turns "▁" back into
    spaces, and there, under any class but Gemma's, splits a numeral from the space before it: Gemma
    3's ' ½' became '▁', '½' instead of '▁½' (and ' ①', ' ²', ' ٣' alike), measured with
    onnxruntime-genai 0.18. As "GemmaTokenizer" it merges them as SentencePiece does. Only the ids
    on the finished bundle (`check_runner`) say whether that is exact for a given vocabulary."""
    from edgefinfer.tokenization.tokenizer import sentencepiece_style

    return "GemmaTokenizer" if dialect == "onnxruntime-genai" and sentencepiece_style(tokenizer_json) else None


def check_runner(original: dict[str, Any], rewritten: dict[str, Any], encoders: dict[str, Callable[[str], list[int]]],
                 extra_texts: Iterable[str] = ()) -> None:
    """UserError naming the tokenizer's features if any encoder gives other ids than the original."""
    texts = list(PROBE_TEXTS) + [t for t in extra_texts if t]
    mismatch = first_mismatch(original, encoders, texts)
    if mismatch is not None:
        text, want, got, who = mismatch
        raise UserError(f"{who} cannot represent this tokenizer exactly ({describe(rewritten)}): it encodes "
                        f"{text[:40]!r} to {got[:8]}... instead of {want[:8]}...; ship a tokenizer without these "
                        "features or build for another target")


def rewrite_pre_tokenizer(node: dict[str, Any], dialect: Dialect) -> dict[str, Any]:
    """The equivalent pre-tokenizer in the forms `dialect`'s tokenizer library implements."""
    steps = node["pretokenizers"] if node.get("type") == "Sequence" else [node]
    if dialect == "onnxruntime-genai":
        out = [_complete_gpt2_split(step) for step in steps]
    else:
        out = []
        for step in (_digits_split_to_digits(step) for step in steps):
            if out and _is_gpt2_split(out[-1]) and _is_plain_byte_level(step):
                out[-1] = {"type": "ByteLevel", "add_prefix_space": False,
                           "trim_offsets": step.get("trim_offsets", True), "use_regex": True}
            else:
                out.append(step)
    return out[0] if len(out) == 1 and node.get("type") != "Sequence" else {"type": "Sequence", "pretokenizers": out}


def _split_regex(step: dict[str, Any]) -> str | None:
    if step.get("type") == "Split" and step.get("behavior") == "Isolated" and not step.get("invert"):
        return step.get("pattern", {}).get("Regex")
    return None


def _digits_split_to_digits(step: dict[str, Any]) -> dict[str, Any]:
    return {"type": "Digits", "individual_digits": True} if _split_regex(step) == DIGIT_PATTERN else step


def _complete_gpt2_split(step: dict[str, Any]) -> dict[str, Any]:
    if _split_regex(step) == GPT2_PATTERN:
        return dict(step, pattern={"Regex": GPT2_PATTERN + r"|\s+"})
    return step


def _is_gpt2_split(step: dict[str, Any]) -> bool:
    return _split_regex(step) in GPT2_PATTERNS


def _is_plain_byte_level(step: dict[str, Any]) -> bool:
    # With add_prefix_space, tokenizers would prefix every split piece; the merged form only the first.
    return step.get("type") == "ByteLevel" and not step.get("use_regex", True) and not step.get("add_prefix_space")


def describe(tokenizer_json: dict[str, Any]) -> str:
    """The features of a tokenizer.json that decide whether the C++ runner reproduces it."""
    def pre(node: dict[str, Any] | None) -> str:
        if node is None:
            return "none"
        if node.get("type") == "Sequence":
            return " + ".join(pre(n) for n in node["pretokenizers"])
        if node.get("type") == "Split":
            return f"Split({node.get('pattern')}, {node.get('behavior')})"
        return str(node.get("type"))

    model = tokenizer_json.get("model", {})
    normalizer = (tokenizer_json.get("normalizer") or {}).get("type", "none")
    return (f"model {model.get('type')}{', byte_fallback' if model.get('byte_fallback') else ''}, "
            f"normalizer {normalizer}, pre-tokenizer {pre(tokenizer_json.get('pre_tokenizer'))}")


def first_mismatch(original: dict[str, Any], encoders: dict[str, Callable[[str], list[int]]], texts: list[str]
                   ) -> tuple[str, list[int], list[int], str] | None:
    """(text, tokenizers' ids of the original, other ids, which encoder) for the first text some
    encoder gets wrong; None if every encoder agrees on every text."""
    reference = _hf_encoder(original)
    for text in texts:
        want = reference(text)
        for who, encode in encoders.items():
            got = encode(text)
            if got != want:
                return text, want, got, who
    return None


def _hf_encoder(tokenizer_json: dict[str, Any]) -> Callable[[str], list[int]]:
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_str(json.dumps(tokenizer_json))
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def _runner_encoder(tokenizer_json: dict[str, Any]) -> Callable[[str], list[int]]:
    try:
        tok = load_runner_tokenizer(tokenizer_json)
    except RuntimeError:  # the C++ loader refuses what it does not implement, with its reason on stderr
        raise UserError(f"ExecuTorch's tokenizer cannot load this tokenizer ({describe(tokenizer_json)}); ship "
                        "a tokenizer without these features or build for another target") from None
    return lambda text: list(tok.encode(text, 0, 0))


def genai_encoder(folder: str | Path) -> Callable[[str], list[int]]:
    """onnxruntime-genai's own tokenizer (onnxruntime-extensions) of a bundle with genai_config.json."""
    try:
        import onnxruntime_genai as og
    except ImportError:
        raise UserError("onnxruntime-genai is needed to check the tokenizer it will use: "
                        "pip install onnxruntime-genai==0.18.0") from None
    tok = og.Tokenizer(og.Model(str(folder)))
    return lambda text: [int(i) for i in tok.encode(text)]


def load_runner_tokenizer(tokenizer_json: dict[str, Any] | str | Path):
    """pytorch_tokenizers' C++ HFTokenizer (the library ExecuTorch's runners link) loaded with a file."""
    try:
        with quiet_native_stderr():
            CppHFTokenizer = _cpp_tokenizer_class()
    except ImportError:
        raise UserError("pytorch_tokenizers (installed with executorch==1.5.1) is needed to check the tokenizer "
                        "ExecuTorch's runner will use: pip install 'edgefinfer[compile]'") from None
    tok = CppHFTokenizer()
    with contextlib.ExitStack() as stack:
        if isinstance(tokenizer_json, dict):
            folder = stack.enter_context(tempfile.TemporaryDirectory())
            path = Path(folder) / "tokenizer.json"
            path.write_text(json.dumps(tokenizer_json, ensure_ascii=False))
        else:
            path = Path(tokenizer_json)
        with quiet_native_stderr():
            tok.load(str(path))
    return tok


def _cpp_tokenizer_class():
    """pytorch_tokenizers' C++ HFTokenizer, its extension loaded with RTLD_DEEPBIND: it carries its own
    RE2, and onnxruntime-qnn's HTP library (libQnnHtp.so, loaded by any QNN session) exports another,
    incompatible RE2 into the process. Bound the default way, a tokenizer loaded after a QNN session
    calls into QNN's copy and the process dies (seen: SIGSEGV in re2::Prog::~Prog from libQnnHtp.so
    while loading SmolLM2's tokenizer.json). Deep binding makes the extension use its own copy first.
    (Only the first import decides; later ones reuse the loaded module.)"""
    flags = sys.getdlopenflags()
    sys.setdlopenflags(flags | getattr(os, "RTLD_DEEPBIND", 0))
    try:
        from pytorch_tokenizers import CppHFTokenizer
    finally:
        sys.setdlopenflags(flags)
    return CppHFTokenizer


@contextlib.contextmanager
def quiet_native_stderr() -> Iterator[None]:
    """The C++ library logs every load step (and RE2's complaints) straight to fd 2."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
