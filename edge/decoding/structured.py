"""Structured output: decoding constrained to a JSON schema, a regex or a grammar.

One implementation for the device runtime's token loop (`edgefinfer.runtime.decode`) and the
server's scheduler, so a constraint gives the same tokens on a phone and on the server:

    compiler = GrammarCompiler(tokenizer, vocab_size, stop_ids)      # once per model (~0.5 s)
    grammar = compiler.compile(Constraint.json_schema(schema))       # per request; bad input -> UserError
    matcher = grammar.matcher()                                      # per sequence
    logits = matcher.mask(logits)          # [V]: tokens the grammar forbids get -inf
    matcher.accept(token)                  # after sampling; EOS is allowed only where the grammar may end
    matcher.finished                       # the grammar can take nothing more: the generation ends ("stop")

The grammar engine is llguidance (Microsoft's Rust Earley parser over a token-trie lexer), chosen
over xgrammar by bench/grammar_libs.py on this CPU, 50 JSON schemas, the reference tokenizer:
llguidance compiles a schema in 1.6 ms (xgrammar: 1.07 s, which every request with a new schema
would add to its time to first token), and its mask costs 55 us per token at the median and
0.8 ms at p99 (xgrammar: 26 us and 7.1 ms): either median is under 0.5% of a 12 ms decode step,
and llguidance's tail is 9x shorter. It is one
3 MB wheel with no dependency; xgrammar needs torch, transformers and triton, which a phone-side
install does not want.

Speculative decoding stays lossless: `trim_draft` drops the drafted tokens from the first one the
grammar rejects, and `mask_rows` masks each verification row with the grammar's state after the
drafts before it, so the verifier compares drafts with the very distribution constrained decoding
samples from.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal, Sequence

import numpy as np

from edgefinfer.errors import UserError

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

    from edgefinfer.tokenization.tokenizer import Tokenizer

Kind = Literal["json_schema", "json_object", "regex", "grammar"]

# A grammar's JSON may use any whitespace; ours is compact JSON with one space after ':' and ',',
# as json.dumps writes it. Free whitespace lets a small model ramble spaces and newlines until
# max_tokens; a fixed separator keeps every reply short and equal on every backend.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Constraint:
    """What the output must match: a JSON schema (as JSON text), any JSON object, a regex, or a grammar
    (Lark, or llama.cpp's GBNF)."""

    kind: Kind
    source: str = ""

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> "Constraint":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise UserError(f"the JSON schema is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") \
                    from None
        if not isinstance(schema, (dict, bool)):
            raise UserError(f"a JSON schema is an object (or true/false), got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema))  # key order matters: properties come in schema order

    @classmethod
    def json_object(cls) -> "Constraint":
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        if not pattern:
            raise UserError("the regex is empty")
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, text: str) -> "Constraint":
        if not text.strip():
            raise UserError("the grammar is empty")
        return cls("grammar", text)

    @classmethod
    def from_response_format(cls, response_format: dict[str, Any] | None) -> "Constraint | None":
        """OpenAI's `response_format`: {"type": "text"} (None), {"type": "json_object"}, or
        {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}."""
        if response_format is None:
            return None
        if not isinstance(response_format, dict):
            raise UserError("response_format must be an object such as {\"type\": \"json_object\"}")
        kind = response_format.get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_object()
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise UserError("response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}")
            return cls.json_schema(spec["schema"])
        raise UserError(f"unknown response_format type {kind!r}: use text, json_object or json_schema")

    def llguidance_grammar(self) -> str:
        """This constraint as an llguidance grammar (not yet checked against a tokenizer)."""
        from llguidance import LLMatcher, grammar_from

        try:
            if self.kind == "json_object":
                return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=_JSON_OPTIONS)
            if self.kind == "json_schema":
                return LLMatcher.grammar_from_json_schema(self.source, overrides=_JSON_OPTIONS)
            if self.kind == "regex":
                return LLMatcher.grammar_from_regex(self.source)
            return grammar_from("grammar", self.source)  # Lark, or GBNF (converted to Lark)
        except Exception as e:  # any input: the library raises ValueError, its GBNF converter anything
            raise UserError(f"the {self.describe()} does not compile: {_first_line(e)}") from None

    def describe(self) -> str:
        return {"json_schema": "JSON schema", "json_object": "JSON object constraint", "regex": "regex",
                "grammar": "grammar"}[self.kind]


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer. Building llguidance's token trie takes about
    half a second for a 49k vocabulary, so it happens once per compiler, on first use."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = tuple(s for s in stop_ids if 0 <= s < vocab_size)

    @cached_property
    def ll_tokenizer(self) -> LLTokenizer:
        from llguidance import LLTokenizer

        # n_vocab is the logits' width (it may exceed the tokenizer's: padded vocabularies). A model with
        # no end-of-sequence token gets a phantom special token past the logits: never sampled, so the
        # grammar's end is seen through `TokenMatcher.finished`.
        spec = json.loads(self.tokenizer.backend.to_str())
        eos = list(self.stop_ids)
        if not eos:
            eos = [max(self.vocab_size, self.tokenizer.vocab_size)]
            spec.setdefault("added_tokens", []).append(
                {"id": eos[0], "content": "<|edgefinfer:end-of-grammar|>", "single_word": False, "lstrip": False,
                 "rstrip": False, "normalized": False, "special": True})
        return LLTokenizer(json.dumps(spec), n_vocab=max(self.vocab_size, eos[-1] + 1), eos_token=eos)

    def compile(self, constraint: Constraint) -> Grammar:
        """A checked grammar, or a one-line UserError with the library's reason."""
        from llguidance import LLMatcher

        source = constraint.llguidance_grammar()
        try:
            is_error, messages = LLMatcher.validate_grammar_with_warnings(source, self.ll_tokenizer)
        except Exception as e:  # a grammar that passes conversion but trips the validator itself
            is_error, messages = True, [str(e)]
        if is_error:
            raise UserError(f"the {constraint.describe()} does not compile: {_first_line(messages[0])}")
        return Grammar(constraint, source, self)


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled constraint; `matcher()` starts one sequence's parse."""

    constraint: Constraint
    source: str
    compiler: GrammarCompiler

    def matcher(self) -> TokenMatcher:
        from llguidance import LLMatcher

        m = LLMatcher(self.compiler.ll_tokenizer, self.source, log_level=0)
        if m.is_error():
            raise UserError(f"the {self.constraint.describe()} does not compile: {_first_line(m.get_error())}")
        c = self.compiler
        return TokenMatcher(m, c.vocab_size, c.ll_tokenizer.vocab_size, c.stop_ids)


class TokenMatcher:
    """One sequence's position in its grammar: which tokens may come next, and the tokens so far."""

    def __init__(self, matcher: LLMatcher, vocab_size: int, n_vocab: int, stop_ids: tuple[int, ...]):
        self._m = matcher
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids
        self._words = np.zeros((n_vocab + 31) // 32, dtype=np.int32)  # llguidance's bitmask, 1 bit/token

    def allowed(self) -> np.ndarray:
        """[V] bool: the tokens the grammar allows next (end-of-sequence ids once it may end). A matcher
        that has failed allows only end-of-sequence, so a generation always ends, never hangs."""
        if self._m.is_error():
            return self._stops_only()
        self._m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")[:self.vocab_size].astype(bool)
        return bits if bits.any() else self._stops_only()

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """logits [V] -> a copy where every token the grammar forbids is -inf."""
        return np.where(self.allowed(), logits, np.float32(-np.inf)).astype(logits.dtype, copy=False)

    def accept(self, token: int) -> None:
        """Advance past a sampled token (one `mask` allowed)."""
        if not self._m.consume_token(int(token)):
            raise RuntimeError(f"the grammar rejected token {token}: {self._m.get_error()}")

    def accept_until_finished(self, tokens: Sequence[int]) -> int:
        """Advance past `tokens` until the grammar is complete; returns how many it took (the rest, at
        most end-of-sequence ids, are not part of the output)."""
        for n, t in enumerate(tokens, 1):
            self.accept(t)
            if self.finished:
                return n
        return len(tokens)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the grammar accepts from here (nothing is consumed)."""
        return self._m.validate_tokens([int(t) for t in tokens]) if tokens else 0

    def mask_rows(self, rows: np.ndarray, drafts: Sequence[int]) -> np.ndarray:
        """rows [k+1, V] scored [last, *drafts] -> each row masked with the state after the drafts before
        it (drafts must be a valid prefix, see `valid_prefix`). The matcher ends where it started."""
        out = np.empty_like(rows)
        for i in range(len(rows)):
            out[i] = self.mask(rows[i])
            if i < len(drafts):
                self.accept(drafts[i])
        self._m.rollback(len(drafts))
        return out

    @property
    def finished(self) -> bool:
        """The output is complete: the grammar can take nothing but end-of-sequence. Generation ends
        here ("stop") without a forward for that token, on the device and on the server alike."""
        return self._m.is_stopped()

    def _stops_only(self) -> np.ndarray:
        allowed = np.zeros(self.vocab_size, dtype=bool)
        allowed[[s for s in self.stop_ids if s < self.vocab_size]] = True
        return allowed


def trim_draft(matcher: TokenMatcher | None, draft):
    """A speculative draft cut before its first token the grammar rejects (None if nothing is left)."""
    if draft is None or matcher is None:
        return draft
    n = matcher.valid_prefix(draft.tokens)
    if n == len(draft.tokens):
        return draft
    if n == 0:
        return None
    return type(draft)(list(draft.tokens[:n]), None if draft.probs is None else draft.probs[:n])


def _first_line(error: object) -> str:
    """The library's message on one line (a regex error spans several: the pattern, a caret, the reason)."""
    text = re.sub(r"\s+", " ", str(error).strip() or "unknown error")
    text = re.sub(r"^at \d+\(\d+\): ", "", text)  # a position in the generated grammar, not in the input
    return text[:300]
