"""The token loop over any backend: prefill, plain decoding, and speculative decoding.

Cache convention (shared with the speculative proposers): after every step the backend holds every
committed token except the last one. A plain step feeds `[context[-1]]` at position
`len(context) - 1`; a speculative round feeds `[context[-1]] + drafts` at the same position and
gets k+1 rows of logits in one target call, which the verifier turns into the accepted drafts plus
one token of the target's own. The backend is then rolled back to `len(context) + accepted`, the
positions it holds that are still right.

Greedy speculative decoding returns exactly the tokens of plain greedy decoding; with temperature
> 0, rejection sampling keeps the target's distribution (see `edgefinfer.runtime.speculative.verify`).

A `TokenMatcher` (structured output, `edgefinfer.decoding.structured`) masks every row before a token is
drawn from it; drafts are cut at the first token its grammar rejects and each verification row is
masked with the grammar's state after the drafts before it, so constrained speculative decoding
returns the tokens of constrained plain decoding.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np

from edgefinfer.errors import UserError
from edgefinfer.decoding.generation import GenerationStats
from edgefinfer.runtime.backends.base import Backend, last_logits
from edgefinfer.decoding.sampling import SamplingParams
from edgefinfer.decoding.structured import TokenMatcher, trim_draft

if TYPE_CHECKING:  # torch is loaded only for sampling with temperature, penalties or speculation
    import torch

    from edgefinfer.runtime.speculative.adaptive import AdaptiveK
    from edgefinfer.runtime.speculative.proposers import Draft, Proposer
    from edgefinfer.runtime.speculative.verify import SpecStats, VerifyResult


def _new_spec_stats() -> SpecStats:
    from edgefinfer.runtime.speculative.verify import SpecStats

    return SpecStats()


@dataclass
class Speculation:
    """How to speculate: a proposer, the number of draft tokens, and optionally adaptive k."""

    proposer: Proposer
    k: int = 4
    adaptive: AdaptiveK | None = None
    stats: SpecStats = field(default_factory=_new_spec_stats)


# ---- sampling from numpy logits: the runtime's loop below and the server's scheduler ----------------
def sample_row(logits: np.ndarray, params: SamplingParams, context: Sequence[int],
               generator: torch.Generator | None) -> int:
    """One token from one row of logits [V] (repetition penalty against `context`). Greedy picks the
    first maximum, as torch.argmax does."""
    if params.greedy and params.repetition_penalty == 1.0:
        return int(logits.argmax())  # the first maximum, as torch.argmax (the method: np.argmax's wrapper costs more)
    import torch

    from edgefinfer.decoding.sampling import next_token

    history = torch.tensor([list(context)]) if params.repetition_penalty != 1.0 else None
    return int(next_token(torch.from_numpy(np.asarray(logits))[None], params, history, generator)[0])


def seeded_generator(params: SamplingParams, stream: int = 0) -> torch.Generator | None:
    """The random stream `stream` of a seeded request (seed + stream); None when greedy decoding draws
    nothing or no seed is set (then torch's global generator draws)."""
    if params.seed is None or params.greedy:
        return None
    import torch

    return torch.Generator().manual_seed(params.seed + stream)


def verify_draft(logits: np.ndarray, draft: Draft, params: SamplingParams,
                 generator: torch.Generator | None) -> VerifyResult:
    """logits [k+1, V] for [last, *draft] -> the accepted drafts plus one target token (lossless)."""
    import torch

    from edgefinfer.runtime.speculative.verify import verify

    return verify(draft.tokens, draft.probs, torch.from_numpy(np.ascontiguousarray(logits)), params, generator)


def pick_token(logits: np.ndarray, params: SamplingParams, context: Sequence[int],
               generator: torch.Generator | None, matcher: TokenMatcher | None) -> int:
    """One token from a row of logits [V], within the grammar when there is one (which then advances)."""
    if matcher is None:
        return sample_row(logits, params, context, generator)
    tok = sample_row(matcher.mask(logits), params, context, generator)
    matcher.accept(tok)
    return tok


def check_fits(backend: Backend, prompt_len: int, max_new_tokens: int) -> None:
    """Refuse, before the cache is touched, a prompt that a static cache cannot hold with its reply."""
    if prompt_len == 0:
        raise UserError("the prompt is empty: give at least one token")
    if backend.window is None and prompt_len + max_new_tokens > backend.max_seq_len:
        raise UserError(f"prompt ({prompt_len} tokens) + max_tokens ({max_new_tokens}) exceeds the "
                        f"context of {backend.max_seq_len} tokens; shorten the prompt, lower max_tokens, "
                        f"or use a sliding-window cache")


def generate_tokens(backend: Backend, prompt_ids: Sequence[int], max_new_tokens: int,
                    params: SamplingParams = SamplingParams(), stop_ids: Sequence[int] = (),
                    speculation: Speculation | None = None, stats: GenerationStats | None = None,
                    cancel: threading.Event | None = None, matcher: TokenMatcher | None = None,
                    cached: int = 0, cuts: Sequence[int] = ()) -> Iterator[int]:
    """Yield generated token ids (a stop id is yielded, then the loop ends). With a `matcher` every
    token is drawn within its grammar.

    `cached`: how many leading prompt tokens the backend already holds at positions 0.. (a session's
    kept prefix, `edgefinfer.runtime.session`); the backend is rolled back to them and only the rest
    is prefilled. 0: a new sequence, the cache is reset.

    `cuts`: positions where the prefill ends one call and starts the next (a conversation's reply
    boundaries on a backend whose rows depend on them: `runtime.session.conversation_cuts`)."""
    check_fits(backend, len(prompt_ids), max_new_tokens)
    if not 0 <= cached < len(prompt_ids):
        raise ValueError(f"cached={cached} must leave at least one of the {len(prompt_ids)} prompt tokens to feed")
    if speculation is not None and params.repetition_penalty != 1.0:
        raise UserError("speculative decoding does not support repetition_penalty != 1 yet; drop one of them")
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt_ids)
    generator = seeded_generator(params)
    stop = set(stop_ids)
    if cached:
        backend.rollback(cached)
    else:
        backend.reset()

    t0 = time.perf_counter()
    context = list(prompt_ids)
    start = cached
    for cut in sorted(c for c in cuts if cached < c < len(context)):
        last_logits(backend, context[start:cut], start)  # an earlier call of the prefill: its logits are not used
        start = cut
    tok = pick_token(last_logits(backend, context[start:], start), params, context, generator, matcher)
    stats.prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    produced = 0
    k_state = speculation.adaptive.initial() if speculation and speculation.adaptive else None
    while True:
        context.append(tok)
        produced += 1
        stats.generated_tokens = produced
        yield tok
        if (tok in stop or produced >= max_new_tokens or (cancel is not None and cancel.is_set())
                or (matcher is not None and matcher.finished)):
            return
        k = _draft_len(speculation, k_state, max_new_tokens - produced)
        draft = trim_draft(matcher, speculation.proposer.propose(context, k)) if k > 0 else None
        if draft is None or not draft.tokens:
            logits = backend.forward([context[-1]], len(context) - 1)[-1]
            tok = pick_token(logits, params, context, generator, matcher)
        else:
            pending = _verify_round(backend, context, draft, params, generator, speculation, matcher)
            if k_state is not None:
                k_state = speculation.adaptive.update(k_state, len(draft.tokens), len(pending) - 1)
            for tok in pending[:-1]:
                context.append(tok)
                produced += 1
                stats.generated_tokens = produced
                yield tok
                if tok in stop or produced >= max_new_tokens:
                    return
            tok = pending[-1]
        stats.decode_s = time.perf_counter() - t0


def _draft_len(speculation: Speculation | None, k_state, remaining: int) -> int:
    if speculation is None or remaining <= 1:
        return 0
    k = k_state.k if k_state is not None else speculation.k
    return min(k, remaining - 1)


def _verify_round(backend: Backend, context: list[int], draft, params: SamplingParams,
                  generator: torch.Generator | None, speculation: Speculation,
                  matcher: TokenMatcher | None) -> list[int]:
    """One target call over `[last] + drafts`; returns the accepted drafts plus the target's token."""
    logits = backend.forward([context[-1], *draft.tokens], len(context) - 1)  # [k+1, V]
    if matcher is not None:
        logits = matcher.mask_rows(logits, draft.tokens)
    result = verify_draft(logits, draft, params, generator)
    speculation.stats.record(result)
    backend.rollback(len(context) + result.num_accepted_draft)
    tokens = list(result.tokens)
    return tokens[:matcher.accept_until_finished(tokens)] if matcher is not None else tokens
