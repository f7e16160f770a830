"""Turning logits into the next token: temperature, top-k, top-p, repetition penalty.

Pure functions on tensors. `logits_to_probs` is the one definition of "the distribution we sample
from"; speculative decoding's verifier uses the same function for target and draft, which is what
makes rejection sampling lossless.

torch is imported by the functions that use it, not by the module: `SamplingParams` and greedy
decoding must not load torch, so that the runtime's ONNX Runtime and llama.cpp paths run without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from edgefinfer.errors import UserError

if TYPE_CHECKING:
    import torch
    from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise UserError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise UserError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def apply_repetition_penalty(logits: Tensor, previous_tokens: Tensor, penalty: float) -> Tensor:
    """CTRL-style penalty (as in transformers): divide positive, multiply negative logits of seen tokens.

    logits: [..., V]; previous_tokens: [..., N] token ids already in the context.
    """
    import torch

    if penalty == 1.0 or previous_tokens.numel() == 0:
        return logits
    seen = logits.gather(-1, previous_tokens)
    seen = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits.scatter(-1, previous_tokens, seen)


def logits_to_probs(logits: Tensor, temperature: float = 1.0, top_k: int | None = None,
                    top_p: float | None = None) -> Tensor:
    """logits [..., V] -> probabilities [..., V] after temperature, top-k and top-p (nucleus) filtering.

    temperature 0 means greedy and returns the one-hot distribution of the argmax.
    """
    import torch

    if temperature == 0.0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float32)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the tokens ranked above it already reach top_p; the first always stays.
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        drop_sorted[..., 0] = False  # also when top_p underflows to 0 in float32 (top_p=1e-300)
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample_from_probs(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Draw one token per row: probs [..., V] -> ids [...]."""
    import torch

    flat = probs.reshape(-1, probs.shape[-1])
    ids = torch.multinomial(flat, 1, generator=generator)
    return ids.reshape(probs.shape[:-1])


def next_token(logits: Tensor, params: SamplingParams, previous_tokens: Tensor | None = None,
               generator: torch.Generator | None = None) -> Tensor:
    """logits [B, V] -> token ids [B] under `params`."""
    if previous_tokens is not None:
        logits = apply_repetition_penalty(logits, previous_tokens, params.repetition_penalty)
    if params.greedy:
        return logits.argmax(-1)
    return sample_from_probs(logits_to_probs(logits, params.temperature, params.top_k, params.top_p), generator)
