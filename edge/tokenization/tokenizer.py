"""Tokenizer: a `tokenizers.Tokenizer` plus the special tokens and chat template of a HF folder.

Chat templates are Jinja, rendered the way transformers renders them (`messages`,
`add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`), without needing transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from edgefinfer.errors import UserError
from edgefinfer.files.untrusted import MAX_TOKENIZER_BYTES, check_file_size, read_json

if TYPE_CHECKING:
    import jinja2
    from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    def __init__(self, backend: HFTokenizer, bos_token: str | None = None, eos_token: str | None = None,
                 chat_template: str | None = None, add_bos_token: bool | None = None,
                 tokenizer_class: str = "PreTrainedTokenizerFast"):
        self._backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        # Written to tokenizer_config.json; only a device runtime's tokenizer reads it (onnxruntime-genai
        # picks code paths by it, edgefinfer.compile.runner_tokenizer), so a loaded folder's is not kept.
        self.tokenizer_class = tokenizer_class

    @property
    def backend(self) -> HFTokenizer:
        """The `tokenizers` object (a grammar compiler reads its vocabulary from it)."""
        return self._backend

    # ---- loading and saving -----------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise UserError(f"{folder} has no tokenizer.json; edgefinfer needs a fast (tokenizers) tokenizer")
        check_file_size(tok_file, MAX_TOKENIZER_BYTES, _FIX)
        from tokenizers import Tokenizer as HFTokenizer  # here: a GGUF run by llama.cpp never needs it

        try:
            backend = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise UserError(f"{tok_file} could not be read: {str(e).splitlines()[0][:160]}; {_FIX}") from None
        return cls(backend, **read_special_tokens(folder))

    def with_backend_json(self, tokenizer_json: dict[str, Any], tokenizer_class: str | None = None) -> "Tokenizer":
        """The same special tokens and chat template over another tokenizer.json (e.g. one rewritten
        into the forms a device runtime's tokenizer implements), under `tokenizer_class` if given."""
        from tokenizers import Tokenizer as HFTokenizer

        return Tokenizer(HFTokenizer.from_str(json.dumps(tokenizer_json)), self.bos_token, self.eos_token,
                         self.chat_template, self.add_bos_token, tokenizer_class or self.tokenizer_class)

    def save(self, path: str | Path) -> None:
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / "tokenizer.json"))
        cfg = {"tokenizer_class": self.tokenizer_class, "bos_token": self.bos_token,
               "eos_token": self.eos_token, "clean_up_tokenization_spaces": False,
               "model_max_length": 1 << 30}
        if self.add_bos_token is not None:
            cfg["add_bos_token"] = self.add_bos_token
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")

    # ---- ids and text ------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_id(self) -> int | None:
        return self.token_id(self.bos_token)

    @property
    def scoring_prefix(self) -> list[int]:
        """The tokens a text starts with for this model: [BOS] when the tokenizer adds one (Gemma: the
        model was trained to see it first), else none. Perplexity windows put it before each window."""
        return [self.bos_id] if self.add_bos_token and self.bos_id is not None else []

    @property
    def eos_id(self) -> int | None:
        return self.token_id(self.eos_token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Perplexity and chat prompts pass add_special_tokens=False (templates add BOS)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
        """A decoder of one generation's token ids into text deltas that join into `decode` of them all
        (llama.cpp's vocabularies: see `PieceDecoder` for the one rule of a whole-text decode it keeps out)."""
        return IncrementalDecoder(self, skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise UserError("this tokenizer has no chat template; use a plain prompt instead of --chat")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise UserError(f"a chat message needs 'role' and 'content', got {m!r}")
        return _compile_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")


class StreamDecoder(Protocol):
    """Token ids -> text deltas, one token at a time; joined, the deltas of a generation (its `flush`
    included) are its whole text (where a decoder rewrites text already sent, what follows it: see
    `IncrementalDecoder._advance`). A character split over tokens comes whole, once its last byte is in."""

    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas, holding back incomplete UTF-8 sequences.

    Byte-level BPE pieces may split a multi-byte character; decoding such a prefix ends in U+FFFD,
    so we wait for the next token before emitting.

    Each push decodes a short window, not the whole output (which made a 2048-token reply cost
    O(n^2) decoding): ids[prefix:read] were emitted already, and the delta is what decoding
    ids[prefix:] adds to decoding ids[prefix:read]. Starting both decodes at the same token keeps
    context-dependent decoding (a SentencePiece leading space dropped at the start of a text) out of
    the delta. This is the prefix/read-offset scheme of Hugging Face's text-generation-inference
    and vLLM's detokenizer.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # where both decode windows start
        self.read_offset = 0  # ids[:read_offset] have been emitted

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        text = decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        if len(text) <= len(prefix) or (text.endswith("\ufffd") and not final):
            return ""  # nothing new yet, or an incomplete character at the end: wait for the next token
        # The delta is what follows the emitted text's length, whether or not `text` still starts with
        # it: a decoder that rewrites across tokens (a Replace after Fuse) can change text already sent,
        # which no delta takes back, and waiting for the windows to agree again lost the rest of the
        # generation. vLLM's detokenizer slices the same way.
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix):]


_FIX = "fix it or re-download the model's tokenizer files"


def read_special_tokens(folder: Path) -> dict[str, Any]:
    """A HF folder's special tokens and chat template (tokenizer_config.json, chat_template.jinja) as
    `Tokenizer`'s keyword arguments; a one-line UserError where a field has the wrong type."""
    cfg_file = folder / "tokenizer_config.json"
    cfg = read_json(cfg_file, _FIX) if cfg_file.is_file() else {}
    for key in ("bos_token", "eos_token"):
        if cfg.get(key) is not None and _token_text(cfg[key]) is None:
            raise UserError(f"{cfg_file}: {key} is neither a string nor {{\"content\": string}}; {_FIX}")
    if not isinstance(cfg.get("chat_template"), (str, type(None))):
        raise UserError(f"{cfg_file}: chat_template is not a string; {_FIX}")
    if not isinstance(cfg.get("add_bos_token"), (bool, type(None))):
        raise UserError(f"{cfg_file}: add_bos_token is not true or false; {_FIX}")
    template = cfg.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    return {"bos_token": _token_text(cfg.get("bos_token")), "eos_token": _token_text(cfg.get("eos_token")),
            "chat_template": template, "add_bos_token": cfg.get("add_bos_token")}


def _token_text(token: Any) -> str | None:
    # tokenizer_config.json stores a special token as a string or as {"content": ...}.
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _raise(message: str) -> None:
    raise UserError(f"chat template error: {message}")


_TEMPLATES: dict[str, jinja2.Template] = {}


def _compile_template(source: str) -> jinja2.Template:
    # jinja2 on the first template only: a plain prompt never renders one (20 ms of a 0.5 s start).
    import jinja2.sandbox

    if source not in _TEMPLATES:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
        try:
            _TEMPLATES[source] = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise UserError(f"chat template does not parse: {e.message} (line {e.lineno})") from None
    return _TEMPLATES[source]


def bos_eos_processor(bos: str | None, eos: str | None, backend: HFTokenizer) -> Any:
    """A post-processor adding `bos` before and `eos` after each sequence (None: not that one)."""
    from tokenizers import processors

    def wrap(seq: str) -> str:
        return " ".join(p for p in (bos, seq, eos) if p is not None)

    specials = [(t, backend.token_to_id(t)) for t in dict.fromkeys(p for p in (bos, eos) if p is not None)]
    return processors.TemplateProcessing(single=wrap("$A"), pair=f"{wrap('$A')} {wrap('$B:1')}",
                                         special_tokens=specials)


# ---- tokenizer.json features -------------------------------------------------------------------------
def _normalizers(raw: dict[str, Any]) -> list[dict[str, Any]]:
    norm = raw.get("normalizer") or {}
    return norm.get("normalizers", []) if norm.get("type") == "Sequence" else [norm]


def sentencepiece_style(raw: dict[str, Any]) -> bool:
    """A tokenizer.json BPE that writes spaces as "▁" and falls back to bytes (SentencePiece's form, what
    `edgefinfer.tokenization.gguf_spm` builds from a GGUF)."""
    return bool((raw.get("model") or {}).get("byte_fallback")) and any(
        n.get("type") == "Replace" and n.get("content") == "\u2581" for n in _normalizers(raw))


def prepends_space(raw: dict[str, Any]) -> bool:
    """The normalizer puts "▁" before the text (SentencePiece's add_dummy_prefix)."""
    return any(n.get("type") == "Prepend" and n.get("prepend") == "\u2581" for n in _normalizers(raw))

