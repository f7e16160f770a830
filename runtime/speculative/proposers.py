"""Proposers: cheap guesses of the next k tokens, checked afterwards by the target (see `verify`).

The contract every proposer follows:

* `propose(context, k)` gets the COMMITTED sequence (prompt + every emitted token, never unverified
  drafts) and returns a `Draft` of at most k tokens; fewer, even none, is allowed (the decode loop
  then verifies what there is, or takes a plain step).
* `Draft.probs[i]` is the distribution `Draft.tokens[i]` was drawn from, or `probs is None` for a
  deterministic proposer; the sampling verifier needs it to stay lossless.
* A proposer may keep state about ONE sequence between calls (an index, a KV cache). It checks that
  each context extends what it saw before and resynchronises by itself when it does not (after
  partial acceptance, or for a new sequence), so the decode loop never has to tell it what was
  accepted. Use one instance per concurrent sequence.

Nothing here knows a backend: a draft model is any `DraftStep` callable (`torch_model_step` adapts
an `edgefinfer.model.transformer.Transformer` with a `StaticCache`; an ONNX or llama.cpp draft needs a few lines).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from edgefinfer.errors import UserError
from edgefinfer.decoding.sampling import SamplingParams, logits_to_probs, sample_from_probs


@dataclass(frozen=True)
class Draft:
    tokens: list[int]
    probs: Tensor | None = None  # [len(tokens), V]: what each token was drawn from; None = deterministic

    def __len__(self) -> int:
        return len(self.tokens)


@runtime_checkable
class Proposer(Protocol):
    def propose(self, context: Sequence[int], k: int) -> Draft:
        """At most k tokens likely to follow `context` (the committed tokens of one sequence)."""
        ...


# --- prompt lookup (n-gram) ------------------------------------------------------------------------


class PromptLookupProposer:
    """Propose what followed the most recent earlier occurrence of the context's last n-gram.

    n runs from `max_ngram` down to `min_ngram`; the first n with a match wins (a longer match is
    better evidence). The proposal copies the tokens after the match; when the match is closer to
    the end than k tokens, the copy runs on into the tokens it just proposed, i.e. it extends the
    repeating pattern ("a b a b" proposes "a b a b ..."), which is what a model stuck in a loop emits.

    Cost: an incremental index {n-gram -> end position of its latest occurrence}, one dict per n,
    updated only with the tokens appended since the previous call, so a lookup is O(max_ngram) and
    keeping the index is O(max_ngram) per new token (memory: max_ngram dict entries per context
    token). Checking that the context extends the indexed one is a C-speed list comparison, O(N)
    but about a microsecond per thousand tokens; a context that does not extend it is re-indexed.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise UserError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, "
                            f"max_ngram={max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.reset()

    def reset(self) -> None:
        self._tokens: list[int] = []  # the context the index describes
        # _last_end[n][gram] = end position of the latest occurrence of `gram` (length n) that has a
        # token after it in _tokens, i.e. every end <= len(_tokens) - 2.
        self._last_end: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(self.min_ngram, self.max_ngram + 1)}

    def propose(self, context: Sequence[int], k: int) -> Draft:
        if k <= 0:
            return Draft([])
        self._sync(context if isinstance(context, list) else list(context))
        tokens, N = self._tokens, len(self._tokens)
        for n in range(min(self.max_ngram, N - 1), self.min_ngram - 1, -1):
            end = self._last_end[n].get(tuple(tokens[N - n:]))
            if end is not None:
                return Draft(_copy_forward(tokens, end + 1, k))
        return Draft([])

    def _sync(self, context: list[int]) -> None:
        """Bring the index up to `context`: extend it, or rebuild it when `context` is not an extension."""
        seen = len(self._tokens)
        if len(context) < seen or context[:seen] != self._tokens:
            self.reset()
            seen = 0
        self._tokens.extend(context[seen:])
        tokens = self._tokens
        # n-grams ending at seen-1 .. N-2 gained a following token since the last call. Ascending
        # order, so a later occurrence overwrites an earlier one: the index keeps the most recent.
        for end in range(max(seen - 1, 0), len(tokens) - 1):
            for n, index in self._last_end.items():
                if end + 1 >= n:
                    index[tuple(tokens[end + 1 - n:end + 1])] = end


def _copy_forward(tokens: list[int], start: int, k: int) -> list[int]:
    """k tokens read from tokens[start:], continuing into the output itself past the end (start < len)."""
    out: list[int] = []
    N = len(tokens)
    for i in range(start, start + k):
        out.append(tokens[i] if i < N else out[i - N])
    return out


# --- draft model -----------------------------------------------------------------------------------


class DraftStep(Protocol):
    def __call__(self, tokens: list[int], start_pos: int) -> Tensor:
        """Run the draft on `tokens` at positions start_pos.. and return logits [S', V] whose LAST row
        predicts the token after tokens[-1] (S' = len(tokens), or 1 for an implementation that
        computes only the last row).

        The callee keeps its own cache: on return it holds positions 0..start_pos+len(tokens)-1. The
        proposer only ever calls it with start_pos <= the number of positions already held, and, when
        start_pos is smaller, calls `rollback(start_pos)` first if it was given one.
        """
        ...


class DraftModelProposer:
    """Draft with a small autoregressive model, feeding it only tokens it has not seen yet.

    Bookkeeping: `seen` is the token list whose keys/values the draft holds, position i for seen[i].
    A round drafting d_1..d_k after context c feeds the draft whatever part of c it lacks, then
    d_1..d_{k-1} one at a time (d_k is never fed: nothing needs the logits after it), so afterwards
    seen = c + d_1..d_{k-1}. The next context is c + d_1..d_n + y (n accepted, y from the target);
    the draft keeps the longest common prefix of `seen` and that context, drops the rest (positions
    past it are stale: `rollback(keep)` tells caches that need explicit truncation, e.g. llama.cpp's
    seq_rm; a static cache needs nothing, since the next writes overwrite those slots and causality
    masks any still beyond) and feeds the remaining tokens: [y] after a rejection, [d_k, y] after
    full acceptance. It always re-feeds at least the last context token, because it keeps no logits
    between calls.

    Sampling: tokens are drawn from `logits_to_probs` with `params` (greedy when temperature is 0),
    and `Draft.probs` holds those distributions. Whatever the draft's params, the verifier stays
    lossless; matching the target's params maximises acceptance. A repetition penalty in `params` is
    not applied to the draft (it would only change the acceptance rate).
    """

    def __init__(self, step: DraftStep, params: SamplingParams = SamplingParams(),
                 rollback: Callable[[int], None] | None = None, generator: torch.Generator | None = None,
                 max_len: int | None = None):
        self.step = step
        self.params = params
        self.rollback = rollback
        self.generator = generator
        self.max_len = max_len  # the draft cache's capacity in positions; proposals are shortened to fit
        self.seen: list[int] = []
        self._committed = 0  # len(context) at the previous call: that prefix is usually still valid

    def reset(self) -> None:
        """Forget the sequence (the cache is resynchronised lazily on the next call)."""
        self.seen = []
        self._committed = 0

    def propose(self, context: Sequence[int], k: int) -> Draft:
        if not context:
            raise ValueError("a draft model needs at least one context token")
        context = context if isinstance(context, list) else list(context)
        if self.max_len is not None:  # the last fed token, d_{k-1}, sits at position len(context) + k - 2
            k = min(k, self.max_len - len(context) + 1)
        if k <= 0:
            return Draft([])
        start = min(_common_prefix(self.seen, context, self._committed), len(context) - 1)
        if start < len(self.seen):
            if self.rollback is not None:
                self.rollback(start)
            del self.seen[start:]
        self._committed = len(context)

        logits = self._feed(context[start:])  # [V]
        tokens: list[int] = []
        probs: list[Tensor] = []
        for i in range(k):
            p = logits_to_probs(logits, self.params.temperature, self.params.top_k, self.params.top_p)  # [V]
            tok = int(p.argmax()) if self.params.greedy else int(sample_from_probs(p, self.generator))
            tokens.append(tok)
            probs.append(p)
            if i < k - 1:
                logits = self._feed([tok])
        return Draft(tokens, torch.stack(probs))  # probs [k, V]

    def _feed(self, tokens: list[int]) -> Tensor:
        logits = self.step(tokens, len(self.seen))  # [S', V]
        self.seen.extend(tokens)
        return logits[-1]


def _common_prefix(a: list[int], b: list[int], hint: int) -> int:
    """Length of the longest common prefix of a and b; `hint` is a length that probably matches."""
    n = min(len(a), len(b))
    i = min(hint, n)
    if a[:i] != b[:i]:  # rare (a new sequence): fall back to a full scan
        i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def torch_model_step(model: Callable[..., Tensor], cache: object, device: torch.device | str = "cpu") -> DraftStep:
    """A `DraftStep` for `model(tokens [1, S], input_pos [S], cache) -> logits [1, S, V]`.

    Fits `edgefinfer.model.transformer.Transformer` with a batch-1 `StaticCache`, whose slots are indexed by
    position, so no rollback callback is needed.
    """
    @torch.inference_mode()
    def step(tokens: list[int], start_pos: int) -> Tensor:
        ids = torch.tensor(tokens, device=device)[None]  # [1, S]
        pos = torch.arange(start_pos, start_pos + len(tokens), device=device)  # [S]
        return model(ids, pos, cache)[0]  # [S, V]
    return step
