"""Autoregressive generation with a KV cache: prefill, decode one token at a time, stream text.

The hot path is two small functions (`prefill`, `decode_one_token`) so that backends and
speculative decoding can reuse them; `generate_ids` is the token loop; `stream_text` adds
detokenization and stop strings on top.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import Tensor

from edgefinfer.cache import KVCache, StaticCache
from edgefinfer.errors import UserError
from edgefinfer.model import Transformer
from edgefinfer.sampling import SamplingParams, next_token
from edgefinfer.tokenizer import IncrementalDecoder, Tokenizer


@torch.inference_mode()
def prefill(model: Transformer, tokens: Tensor, input_pos: Tensor, cache: KVCache) -> Tensor:
    """tokens [B, S], input_pos [B, S] -> logits of the last position [B, V]."""
    return model(tokens, input_pos, cache)[:, -1]


@torch.inference_mode()
def decode_one_token(model: Transformer, token: Tensor, input_pos: Tensor, cache: KVCache) -> Tensor:
    """token [B, 1], input_pos [B, 1] -> logits [B, V]."""
    return model(token, input_pos, cache)[:, -1]


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
    finish_reason: str  # "stop" (EOS or stop string) | "length"
    stats: GenerationStats = field(default_factory=GenerationStats)


def generate_ids(model: Transformer, prompt_ids: list[int], max_new_tokens: int,
                 params: SamplingParams = SamplingParams(), stop_ids: tuple[int, ...] = (),
                 cache: KVCache | None = None, stats: GenerationStats | None = None) -> Iterator[int]:
    """Yield generated token ids one by one (a stop id is yielded, then the loop ends)."""
    if not prompt_ids:
        raise UserError("the prompt is empty: give at least one token")
    max_len = model.config.max_position_embeddings
    if cache is None:
        total = len(prompt_ids) + max_new_tokens
        if total > max_len:
            raise UserError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                            f"model's context of {max_len} tokens; shorten the prompt or lower --max-tokens")
        cache = StaticCache(model.config, 1, total, dtype=next(model.parameters()).dtype)
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt_ids)
    generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    context = torch.tensor(prompt_ids)
    history = context if params.repetition_penalty != 1.0 else None

    t0 = time.perf_counter()
    logits = prefill(model, context[None], torch.arange(len(prompt_ids))[None], cache)
    pos = len(prompt_ids)
    for i in range(max_new_tokens):
        tok = int(next_token(logits, params, None if history is None else history[None], generator)[0])
        if i == 0:
            stats.prefill_s = time.perf_counter() - t0
            t0 = time.perf_counter()
        stats.generated_tokens += 1
        yield tok
        if tok in stop_ids or i == max_new_tokens - 1:
            break
        if history is not None:
            history = torch.cat([history, torch.tensor([tok])])
        logits = decode_one_token(model, torch.tensor([[tok]]), torch.tensor([[pos]]), cache)
        pos += 1
        stats.decode_s = time.perf_counter() - t0


class StopStringMatcher:
    """Emits text while holding back any tail that could still grow into a stop string."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def push(self, delta: str) -> tuple[str, bool]:
        """-> (text safe to emit, stopped)."""
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


def stream_text(model: Transformer, tokenizer: Tokenizer, prompt: str, max_new_tokens: int = 128,
                params: SamplingParams = SamplingParams(), stop: list[str] | None = None, chat: bool = False,
                on_token: Callable[[int], None] | None = None, result: Generation | None = None,
                add_special_tokens: bool = False) -> Iterator[str]:
    """Yield text deltas. With chat=True the prompt is a user message rendered by the chat template.

    `result`, when given, is filled with the full text, ids, finish reason and statistics.
    """
    ids = encode_prompt(tokenizer, prompt, chat, add_special_tokens)
    stop_ids = stop_token_ids(model.config, tokenizer)
    result = result if result is not None else Generation("", [], "length")
    tokens = generate_ids(model, ids, max_new_tokens, params, stop_ids, stats=result.stats)
    yield from detokenize(tokenizer, tokens, stop_ids, stop, result, on_token)


def encode_prompt(tokenizer: Tokenizer, prompt: str, chat: bool, add_special_tokens: bool = False) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def stop_token_ids(config, tokenizer: Tokenizer) -> tuple[int, ...]:
    """End-of-sequence ids: the model config's and the tokenizer's."""
    ids = list(config.eos_token_ids) + [i for i in [tokenizer.eos_id] if i is not None]
    return tuple(dict.fromkeys(ids))


def detokenize(tokenizer: Tokenizer, tokens: Iterator[int], stop_ids: tuple[int, ...], stop: list[str] | None,
               result: Generation, on_token: Callable[[int], None] | None = None) -> Iterator[str]:
    """Turn a stream of token ids into text deltas, ending at a stop id or a stop string.

    Closing the returned generator closes `tokens` too, so an abandoned stream stops decoding.
    """
    decoder, matcher = IncrementalDecoder(tokenizer), StopStringMatcher(stop or [])
    try:
        for tok in tokens:
            if on_token is not None:
                on_token(tok)
            if tok in stop_ids:
                result.finish_reason = "stop"
                break
            result.token_ids.append(tok)
            out, stopped = matcher.push(decoder.push(tok))
            result.text += out
            if out:
                yield out
            if stopped:
                result.finish_reason = "stop"
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


def generate_text(model: Transformer, tokenizer: Tokenizer, prompt: str, **kw) -> Generation:
    result = Generation("", [], "length")
    for _ in stream_text(model, tokenizer, prompt, result=result, **kw):
        pass
    return result
