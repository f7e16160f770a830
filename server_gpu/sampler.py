"""Turning one sequence's logits into tokens: sampling, speculative verification, logprobs.

The distributions are the shared ones (`edgefinfer.sampling.logits_to_probs`, the verifier of
`edgefinfer.runtime.speculative.verify`), so a server sequence samples exactly like the on-device
runtime. Greedy picks `argmax` with ties to the lowest id, like `torch.argmax`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from edgefinfer.runtime.speculative.proposers import Draft
from edgefinfer.runtime.speculative.verify import VerifyResult, verify
from edgefinfer.sampling import SamplingParams, logits_to_probs, sample_from_probs


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Log-probability of a sampled token under the model's raw distribution, and the top alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), best first


def apply_bias(logits: np.ndarray, bias: tuple[tuple[int, float], ...]) -> np.ndarray:
    """logits [..., V] with OpenAI's `logit_bias` added (a copy; the raw logits still give logprobs)."""
    if not bias:
        return logits
    out = logits.copy()
    ids, values = zip(*bias)
    out[..., list(ids)] += np.asarray(values, dtype=out.dtype)
    return out


def sample(logits: np.ndarray, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits [V] -> one token id."""
    if params.greedy:
        return int(np.argmax(logits))
    probs = logits_to_probs(torch.from_numpy(logits), params.temperature, params.top_k, params.top_p)  # [V]
    return int(sample_from_probs(probs, generator))


def verify_draft(logits: np.ndarray, draft: Draft, params: SamplingParams,
                 generator: torch.Generator | None) -> VerifyResult:
    """logits [k+1, V] for [last, *draft] -> accepted drafts plus one target token (lossless)."""
    return verify(draft.tokens, draft.probs, torch.from_numpy(logits), params, generator)


def logprobs(logits: np.ndarray, token_ids: list[int], top_n: int) -> list[TokenLogprob]:
    """logits [N, V] (row i scored token_ids[i]) -> per-token logprobs of the unprocessed distribution,
    as OpenAI reports them, with the `top_n` most likely alternatives."""
    x = logits.astype(np.float64, copy=False)
    m = x.max(-1, keepdims=True)
    logz = m + np.log(np.exp(x - m).sum(-1, keepdims=True))
    lp = x - logz  # [N, V]
    out = []
    for row, tok in zip(lp, token_ids):
        top: tuple[tuple[int, float], ...] = ()
        if top_n > 0:
            idx = np.argpartition(-row, top_n - 1)[:top_n]
            idx = idx[np.argsort(-row[idx], kind="stable")]
            top = tuple((int(i), float(row[i])) for i in idx)
        out.append(TokenLogprob(int(tok), float(row[tok]), top))
    return out


def make_generator(params: SamplingParams, index: int) -> torch.Generator | None:
    """Choice `index` of a request draws from its own stream: seed + index when seeded, else fresh entropy."""
    if params.greedy:
        return None
    seed = params.seed + index if params.seed is not None else int.from_bytes(np.random.bytes(8), "little") >> 1
    return torch.Generator().manual_seed(seed)
