"""A generation as a caller sees it: its statistics and result, stop strings, and the incremental
detokenization that turns a stream of token ids into text deltas.

Torch-free on purpose: the runtime's ONNX Runtime and llama.cpp paths generate greedily without
loading torch (`edgefinfer.decoding.eager` holds the eager torch token loop).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Literal

from edgefinfer.tokenization.tokenizer import Tokenizer


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0  # time to first token
    decode_s: float = 0.0
    peak_rss_mb: float = 0.0  # resident-memory high-water mark of the process, when measured

    @property
    def decode_tok_s(self) -> float:
        # The first token comes from prefill; the rest from decode steps.
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str  # `finish_reason`'s answer: "stop" | "length"
    stats: GenerationStats = field(default_factory=GenerationStats)


class StopStringMatcher:
    """Emits text while holding back any tail that could still grow into a stop string."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def push(self, delta: str) -> tuple[str, bool]:
        """-> (text safe to emit, stopped)."""
        if not self.stops:  # nothing to hold back (most requests: a step's token costs no more)
            return delta, False
        self.pending += delta
        for stop in self.stops:
            at = self.pending.find(stop)
            if at >= 0:
                out, self.pending = self.pending[:at], ""
                return out, True
        hold = max((_overlap(self.pending, s) for s in self.stops), default=0)
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out):]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if stop.startswith(text[-n:]):
            return n
    return 0


def encode_prompt(tokenizer: Tokenizer, prompt: str, chat: bool, add_special_tokens: bool = False) -> list[int]:
    """A chat prompt through the template (which writes BOS itself); a plain one with the tokenizer's
    specials, so a model trained to see BOS first gets it (Gemma; as llama.cpp and the server's
    completions do)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    return tokenizer.encode(text, add_special_tokens=add_special_tokens or not chat)


FinishReason = Literal["stop", "length"]


def finish_reason(*, stop_id: bool = False, stop_string: bool = False, grammar_done: bool = False,
                  at_limit: bool = False) -> FinishReason | None:
    """Why a generation ends after its latest token, or None while it goes on: the one rule of the
    device loop (`detokenize`, `Engine.stream_ids`) and the server's scheduler (`Scheduler._emit`).
    A stop id, a matched stop string or a complete grammar end it as "stop" (the output is whole,
    even when that token was also the last one allowed); the length limit (max_tokens, the context)
    as "length". The callers test a stop id before the token becomes text (it is never shown)."""
    if stop_id or stop_string or grammar_done:
        return "stop"
    return "length" if at_limit else None


def stop_token_ids(eos_ids: Iterable[int], tokenizer: Tokenizer) -> tuple[int, ...]:
    """The ids that end a generation: the model's end-of-sequence ids, then the tokenizer's, each once."""
    ids = [*eos_ids, *([tokenizer.eos_id] if tokenizer.eos_id is not None else [])]
    return tuple(dict.fromkeys(ids))


def detokenize(tokenizer: Tokenizer, tokens: Iterator[int], stop_ids: tuple[int, ...], stop: list[str] | None,
               result: Generation, on_token: Callable[[int], None] | None = None) -> Iterator[str]:
    """Turn a stream of token ids into text deltas, ending at a stop id or a stop string.

    Closing the returned generator closes `tokens` too, so an abandoned stream stops decoding.
    """
    decoder, matcher = tokenizer.stream_decoder(), StopStringMatcher(stop or [])
    try:
        for tok in tokens:
            if on_token is not None:
                on_token(tok)
            if reason := finish_reason(stop_id=tok in stop_ids):
                result.finish_reason = reason
                break
            result.token_ids.append(tok)
            out, stopped = matcher.push(decoder.push(tok))
            result.text += out
            if out:
                yield out
            if reason := finish_reason(stop_string=stopped):
                result.finish_reason = reason
                return
        out, _ = matcher.push(decoder.flush())
        out += matcher.flush()
        result.text += out
        if out:
            yield out
    finally:
        close = getattr(tokens, "close", None)
        if close is not None:
            close()
