"""The eager torch decoder, the reference path: prefill, decode one token at a time, stream text.

The hot path is two small functions (`prefill`, `decode_one_token`) so that backends and
speculative decoding can reuse them; `generate_ids` is the token loop; `stream_text` adds
detokenization and stop strings on top (`edgefinfer.decoding.generation`, shared with the runtime).
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

import torch
from torch import Tensor

from edgefinfer.model.kv_cache import KVCache, StaticCache
from edgefinfer.errors import UserError
from edgefinfer.decoding.generation import Generation, GenerationStats, detokenize, encode_prompt, stop_token_ids
from edgefinfer.model.transformer import Transformer
from edgefinfer.decoding.sampling import SamplingParams, next_token
from edgefinfer.tokenization.tokenizer import Tokenizer


@torch.inference_mode()
def prefill(model: Transformer, tokens: Tensor, input_pos: Tensor, cache: KVCache) -> Tensor:
    """tokens [B, S], input_pos [B, S] -> logits of the last position [B, V]."""
    return model(tokens, input_pos, cache)[:, -1]


@torch.inference_mode()
def decode_one_token(model: Transformer, token: Tensor, input_pos: Tensor, cache: KVCache) -> Tensor:
    """token [B, 1], input_pos [B, 1] -> logits [B, V]."""
    return model(token, input_pos, cache)[:, -1]


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


def stream_text(model: Transformer, tokenizer: Tokenizer, prompt: str, max_new_tokens: int = 128,
                params: SamplingParams = SamplingParams(), stop: list[str] | None = None, chat: bool = False,
                on_token: Callable[[int], None] | None = None, result: Generation | None = None,
                add_special_tokens: bool = False) -> Iterator[str]:
    """Yield text deltas. With chat=True the prompt is a user message rendered by the chat template.

    `result`, when given, is filled with the full text, ids, finish reason and statistics.
    """
    ids = encode_prompt(tokenizer, prompt, chat, add_special_tokens)
    stop_ids = stop_token_ids(model.config.eos_token_ids, tokenizer)
    result = result if result is not None else Generation("", [], "length")
    tokens = generate_ids(model, ids, max_new_tokens, params, stop_ids, stats=result.stats)
    yield from detokenize(tokenizer, tokens, stop_ids, stop, result, on_token)


def generate_text(model: Transformer, tokenizer: Tokenizer, prompt: str, **kw) -> Generation:
    result = Generation("", [], "length")
    for _ in stream_text(model, tokenizer, prompt, result=result, **kw):
        pass
    return result
