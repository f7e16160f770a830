"""Quality metrics: strided perplexity, greedy top-1 agreement and KL between two models.

Every metric takes a *logits function* `tokens [1, S] -> logits [1, S, V]`, so the same code scores
an eager model, a quantized one, or an exported artefact run by its own runtime.

Strided perplexity is the standard sliding-window evaluation: windows of `window` tokens advance by
`stride`; each window scores only the tokens no earlier window scored, with up to
`window - stride` tokens of context before them. stride == window gives disjoint windows.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from edgefinfer.errors import UserError

LogitsFn = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class Perplexity:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    tokens: int  # tokens scored
    window: int
    stride: int
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def as_logits_fn(model: torch.nn.Module | LogitsFn) -> LogitsFn:
    if isinstance(model, torch.nn.Module):
        return lambda tokens: model(tokens)
    return model


def windows(n_tokens: int, window: int, stride: int) -> Iterator[tuple[int, int, int]]:
    """(begin, end, first_scored) for each window; every token after the first is scored exactly once."""
    prev_end = 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + window, n_tokens)
        # Token 0 has no context and is never scored; later windows score from where the last stopped.
        first = max(prev_end, begin + 1)
        if first < end:
            yield begin, end, first
        prev_end = end
        if end == n_tokens:
            break


@torch.inference_mode()
def perplexity(model: torch.nn.Module | LogitsFn, ids: list[int] | Tensor, window: int = 512,
               stride: int | None = None, max_tokens: int | None = None, progress: bool = False,
               prefix: list[int] | tuple[int, ...] = ()) -> Perplexity:
    """Strided perplexity of `ids` (a 1-D token sequence, no BOS added) under `model`.

    `prefix`: tokens put before every window and not scored, e.g. the BOS a model was trained to see
    first (Gemma: without it the model is far off its training distribution; llama.cpp's perplexity
    tool adds it too). A window then holds `window - len(prefix)` text tokens, so each call stays
    within `window` positions."""
    window -= len(prefix)
    stride = min(stride or window, window)
    if not 0 < stride <= window:
        raise UserError(f"stride must be in 1..window ({window}), got {stride}")
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if ids.numel() < 2:
        raise UserError("perplexity needs at least 2 tokens of text; the evaluation text is empty or too short")
    fn = as_logits_fn(model)
    head = torch.as_tensor(list(prefix), dtype=torch.long)
    spans = list(windows(ids.numel(), window, stride))
    nll_sum, count, t0 = 0.0, 0, time.perf_counter()
    for i, (begin, end, first) in enumerate(spans):
        chunk = ids[begin:end]
        logits = fn(torch.cat([head, chunk])[None])[0, len(head):].float()  # [S, V] of the window's own tokens
        # logits at position t predict token t+1: score targets first..end-1.
        pred = logits[first - begin - 1: end - begin - 1]
        target = chunk[first - begin:]
        nll_sum += F.cross_entropy(pred, target, reduction="sum").item()
        count += target.numel()
        if progress:
            _progress(i + 1, len(spans), count, nll_sum, t0)
    if progress:
        print(file=sys.stderr)
    nll = nll_sum / count
    return Perplexity(math.exp(nll), nll, count, window, stride, time.perf_counter() - t0)


@dataclass(frozen=True)
class Agreement:
    top1: float  # fraction of positions where both models' argmax agree
    kl: float  # mean KL(reference || candidate) per position, nats
    positions: int


@torch.inference_mode()
def compare(reference: torch.nn.Module | LogitsFn, candidate: torch.nn.Module | LogitsFn, ids: list[int] | Tensor,
            window: int = 512, max_tokens: int | None = 2048) -> Agreement:
    """Teacher-forced greedy top-1 agreement and KL of `candidate` against `reference` on `ids`."""
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()[:max_tokens]
    if ids.numel() == 0:
        raise UserError("comparison needs a non-empty token sequence")
    ref_fn, cand_fn = as_logits_fn(reference), as_logits_fn(candidate)
    agree, kl_sum, n = 0, 0.0, 0
    for begin in range(0, ids.numel(), window):
        chunk = ids[begin: begin + window][None]
        p = ref_fn(chunk)[0].float().log_softmax(-1)
        q = cand_fn(chunk)[0].float().log_softmax(-1)
        agree += (p.argmax(-1) == q.argmax(-1)).sum().item()
        kl_sum += (p.exp() * (p - q)).sum().item()
        n += chunk.shape[1]
    return Agreement(agree / n, kl_sum / n, n)


def _progress(done: int, total: int, tokens: int, nll_sum: float, t0: float) -> None:
    elapsed = time.perf_counter() - t0
    rate = tokens / elapsed if elapsed > 0 else 0.0
    eta = elapsed / done * (total - done)
    print(f"\r  perplexity: window {done}/{total}  ppl {math.exp(nll_sum / tokens):8.3f}  "
          f"{rate:7.1f} tok/s  eta {eta:5.0f}s", end="", file=sys.stderr, flush=True)
