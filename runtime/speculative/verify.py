"""The speculative-decoding verifier: which drafted tokens the target keeps, and the one it adds.

One round of speculative decoding: a proposer drafts k tokens d_1..d_k after the context; the
target model scores context + d_1..d_k in ONE forward pass, which yields k+1 next-token
distributions (row i predicts the token after d_1..d_i; row k is the "bonus" row after all of
them). The verifier keeps the longest acceptable prefix d_1..d_n and adds exactly one token of the
target's own: the correction at row n when d_{n+1} was rejected, or the bonus when n == k. Every
round therefore emits between 1 and k+1 tokens for one target step.

Two rules, both exact (the output follows the same distribution as target-only decoding):

* greedy (temperature 0): d_i is kept while it equals argmax(target row i-1); ties break like
  `torch.argmax`, i.e. like `edgefinfer.decoding.sampling.next_token`.
* sampling (temperature > 0): rejection sampling (Leviathan et al. 2023, Chen et al. 2023). d_i is
  kept with probability min(1, p(d_i) / q(d_i)); at the first rejection the token is drawn from
  normalize(max(0, p - q)); if every draft is kept the bonus is drawn from p at row k.

Requirements for losslessness, which the caller must meet:

* `target_probs` must be the very distribution target-only decoding would sample from at each row:
  `edgefinfer.decoding.sampling.logits_to_probs(logits, temperature, top_k, top_p)` with the same parameters,
  after any logits processing (e.g. a repetition penalty, computed per row with that row's own prefix
  context, drafted tokens included).
* `draft_probs` row i must be the distribution d_i was actually drawn from. Computing it with the
  same `logits_to_probs` (the draft's own parameters) guarantees that. Pass `None` for a
  deterministic proposer (prompt lookup, greedy draft): each d_i is then a point mass. A row that
  gives d_i probability 0 cannot have produced d_i, so it is treated as a point mass at d_i too.
* The uniforms and the correction sample must be independent of how the drafts were chosen: use a
  generator the proposer does not share in a data-dependent way (sharing one seeded generator in a
  fixed call order, as a decode loop does, is fine).

Everything here is backend-agnostic tensor maths; the decode loop that runs a concrete model and
rolls back caches is built on top. The batched kernels (`greedy_accept`, `rejection_sample`) make
no host synchronisation, so a GPU server can verify a batch of sequences at once; the per-sequence
wrappers (`verify_greedy`, `verify_sampling`) make exactly one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from edgefinfer.decoding.sampling import SamplingParams, logits_to_probs, sample_from_probs


@dataclass(frozen=True)
class VerifyResult:
    """The outcome of one verification round."""

    tokens: list[int]  # the accepted draft prefix, then one token from the target (correction or bonus)
    num_accepted_draft: int  # n: how many drafted tokens were kept
    num_drafted: int  # k

    @property
    def all_accepted(self) -> bool:
        return self.num_accepted_draft == self.num_drafted


@dataclass
class SpecStats:
    """Running counters over verification rounds (one round = one target forward pass)."""

    proposed: int = 0  # drafted tokens shown to the target
    accepted: int = 0  # drafted tokens kept
    target_steps: int = 0  # verification rounds

    def record(self, result: VerifyResult) -> None:
        self.proposed += result.num_drafted
        self.accepted += result.num_accepted_draft
        self.target_steps += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed drafted tokens (vLLM's "draft acceptance rate"); 0 before any draft."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens emitted per target step: 1 for plain decoding, up to k+1."""
        return (self.accepted + self.target_steps) / self.target_steps if self.target_steps else 0.0

    @property
    def emitted(self) -> int:
        return self.accepted + self.target_steps


# --- batched kernels: [B, ...] tensors in, tensors out, no host synchronisation -------------------


def greedy_accept(draft_tokens: Tensor, target_logits: Tensor) -> tuple[Tensor, Tensor]:
    """draft_tokens [B, k], target_logits [B, k+1, V] (or one-hot probs) -> num_accepted [B], next_token [B]."""
    _check_shapes(draft_tokens, target_logits, None)
    k = draft_tokens.shape[1]
    target_ids = target_logits.argmax(-1)  # [B, k+1]
    matches = draft_tokens.to(target_ids.device) == target_ids[:, :k]  # [B, k]
    num_accepted = _prefix_length(matches)  # [B]
    next_token = target_ids.gather(1, num_accepted[:, None])[:, 0]  # [B]
    return num_accepted, next_token


def rejection_sample(draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor,
                     generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Speculative sampling for a batch of sequences drafted to the same length k.

    draft_tokens [B, k]; draft_probs [B, k, V] or None (deterministic drafts); target_probs [B, k+1, V]
    -> num_accepted [B] (n in 0..k), next_token [B] (drawn from the residual at row n, or from
    target_probs[:, k] when n == k).
    """
    _check_shapes(draft_tokens, target_probs, draft_probs)
    B, k = draft_tokens.shape
    device = target_probs.device
    p = target_probs.float()  # [B, k+1, V]
    draft_tokens = draft_tokens.to(device=device, dtype=torch.long)
    rows = torch.arange(B, device=device)

    if k == 0:
        return torch.zeros(B, dtype=torch.long, device=device), sample_from_probs(p[:, 0], generator)

    p_at_draft = p[:, :k].gather(-1, draft_tokens[..., None])[..., 0]  # [B, k]
    if draft_probs is None:
        point_mass = torch.ones(B, k, dtype=torch.bool, device=device)
        q_at_draft = torch.ones(B, k, device=device)
    else:
        q_at_draft = draft_probs.float().gather(-1, draft_tokens[..., None])[..., 0]  # [B, k]
        point_mass = q_at_draft <= 0  # the row cannot have produced d_i: the draft was deterministic
        q_at_draft = torch.where(point_mass, 1.0, q_at_draft)

    # Keep d_i with probability min(1, p/q): u < p/q, written u*q < p so q never divides. u is in
    # [0, 1), so p >= q always keeps and p == 0 never does (a one-hot target is the greedy rule).
    u = torch.rand(B, k, generator=generator, device=device)
    num_accepted = _prefix_length(u * q_at_draft < p_at_draft)  # [B]

    # The row that emits the extra token: the first rejected one, or the bonus row k.
    p_row = p[rows, num_accepted]  # [B, V]
    at = num_accepted.clamp(max=k - 1)  # the rejected draft's row (clamped: unused when n == k)
    q_row = F.one_hot(draft_tokens[rows, at], p.shape[-1]).float()  # [B, V]
    if draft_probs is not None:
        q_row = torch.where(point_mass[rows, at][:, None], q_row, draft_probs[rows, at].float())
    rejected = (num_accepted < k)[:, None]
    next_token = sample_from_probs(torch.where(rejected, residual_probs(p_row, q_row), p_row), generator)
    return num_accepted, next_token


def residual_probs(target_probs: Tensor, draft_probs: Tensor) -> Tensor:
    """normalize(max(0, p - q)) over the last dim [..., V]: the correction distribution after a rejection.

    Where p <= q everywhere (p == q up to rounding) a rejection has probability zero, but rounding can
    still produce one; the residual is then empty and p itself is the right distribution.
    """
    residual = (target_probs - draft_probs).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(residual.dtype).tiny), target_probs)


# --- one sequence: the form a decode loop uses -----------------------------------------------------


def verify_greedy(draft_tokens: Sequence[int] | Tensor, target_logits: Tensor) -> VerifyResult:
    """draft_tokens [k], target_logits [k+1, V] -> the accepted prefix plus the target's argmax after it."""
    drafts = _as_list(draft_tokens)
    num_accepted, next_token = greedy_accept(_as_tensor(drafts, target_logits.device)[None], target_logits[None])
    return _result(drafts, num_accepted, next_token)


def verify_sampling(draft_tokens: Sequence[int] | Tensor, draft_probs: Tensor | None, target_probs: Tensor,
                    generator: torch.Generator | None = None) -> VerifyResult:
    """draft_tokens [k], draft_probs [k, V] or None (deterministic), target_probs [k+1, V] -> VerifyResult.

    See the module docstring for what the probabilities must be for the output to be lossless.
    """
    drafts = _as_list(draft_tokens)
    num_accepted, next_token = rejection_sample(_as_tensor(drafts, target_probs.device)[None],
                                                None if draft_probs is None else draft_probs[None],
                                                target_probs[None], generator)
    return _result(drafts, num_accepted, next_token)


def verify(draft_tokens: Sequence[int] | Tensor, draft_probs: Tensor | None, target_logits: Tensor,
           params: SamplingParams, generator: torch.Generator | None = None) -> VerifyResult:
    """Verify with the rule `params` implies; target_logits [k+1, V] are raw logits.

    The target distribution is `logits_to_probs` with `params`, exactly as `next_token` samples, so
    the result is distributed as target-only decoding. A repetition penalty, if any, must already be
    applied to each row of `target_logits` (and of the draft's logits) with that row's own context.
    """
    if params.greedy:
        return verify_greedy(draft_tokens, target_logits)
    target_probs = logits_to_probs(target_logits, params.temperature, params.top_k, params.top_p)
    return verify_sampling(draft_tokens, draft_probs, target_probs, generator)


# --- helpers ---------------------------------------------------------------------------------------


def _prefix_length(ok: Tensor) -> Tensor:
    """ok [B, k] bool -> [B] length of the leading run of True."""
    return ok.long().cumprod(-1).sum(-1)


def _as_list(tokens: Sequence[int] | Tensor) -> list[int]:
    return tokens.reshape(-1).tolist() if isinstance(tokens, Tensor) else [int(t) for t in tokens]


def _as_tensor(tokens: list[int], device: torch.device) -> Tensor:
    return torch.tensor(tokens, dtype=torch.long, device=device)  # [k]


def _result(drafts: list[int], num_accepted: Tensor, next_token: Tensor) -> VerifyResult:
    n, tok = torch.stack([num_accepted[0], next_token[0]]).tolist()  # the one host sync
    return VerifyResult(tokens=drafts[:n] + [tok], num_accepted_draft=n, num_drafted=len(drafts))


def _check_shapes(draft_tokens: Tensor, target: Tensor, draft_probs: Tensor | None) -> None:
    # Internal contract checks (the decode loop, not the user, builds these tensors): ValueError.
    if draft_tokens.dim() != 2 or target.dim() != 3:
        raise ValueError(f"expected draft_tokens [B, k] and target [B, k+1, V], got "
                         f"{tuple(draft_tokens.shape)} and {tuple(target.shape)}")
    B, k = draft_tokens.shape
    if target.shape[:2] != (B, k + 1):
        raise ValueError(f"target must have k+1 = {k + 1} rows per sequence for {k} drafted tokens "
                         f"(batch {B}), got shape {tuple(target.shape)}")
    if draft_probs is not None and draft_probs.shape != (B, k, target.shape[-1]):
        raise ValueError(f"draft_probs must be [B, k, V] = {(B, k, target.shape[-1])}, got {tuple(draft_probs.shape)}")
