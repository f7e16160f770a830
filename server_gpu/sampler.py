"""The server's own parts of sampling: OpenAI's `logit_bias` and `logprobs`, and one random stream
per choice.

Drawing a token and verifying a draft are the runtime's (`edgefinfer.runtime.decode.sample_row`
and `verify_draft`), so a server sequence samples exactly like the on-device runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from edgefinfer.runtime.decode import seeded_generator
from edgefinfer.decoding.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Log-probability of a sampled token under the model's raw distribution, and the top alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), best first


def apply_bias(logits: np.ndarray, bias: tuple[tuple[int, float], ...], in_place: bool = False) -> np.ndarray:
    """logits [..., V] with OpenAI's `logit_bias` added: a copy, so that the raw logits still give
    logprobs, or `in_place` where nobody needs them again (a 200 KB copy per sequence and step saved)."""
    if not bias:
        return logits
    out = logits if in_place else logits.copy()
    # A few scalar adds: numpy's fancy indexing costs far more than they do at one row a step
    # (bias ids are unique: they come from a JSON object's keys). A 1-D row is indexed by the bare
    # id: an index with an Ellipsis takes numpy's slow path, 8x slower per add.
    if out.ndim == 1:
        for token_id, value in bias:
            out[token_id] += value
    else:
        for token_id, value in bias:
            out[:, token_id] += value
    return out


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
    if params.greedy or params.seed is not None:
        return seeded_generator(params, index)
    return torch.Generator().manual_seed(int.from_bytes(np.random.bytes(8), "little") >> 1)
