"""Distillation losses: forward KL on temperature-scaled logits (full or top-k teacher), CE, hidden MSE.

**Top-k teacher.** Caching all V logits per token costs V * 2 bytes (98 KB for a 49k vocabulary), so
the teacher cache keeps its k largest logits z_i, their token ids, and lse_T = logsumexp(z / T) over
the whole vocabulary. Two ways to turn that into a target, both exact (= the full forward KL) when
k = V; q = softmax(s / T) is always the student's full-vocabulary distribution:

- `tail="bucket"` (default): the teacher's true probabilities p_i = exp(z_i / T - lse_T) on the top k,
  and the remaining mass r = 1 - sum_i p_i as one extra outcome "any other token":

      KL = sum_{i in topk} p_i (log p_i - log q_i)  +  r (log r - log q_tail),   q_tail = 1 - sum_{topk} q_i

  This is the KL between the two distributions coarsened to k + 1 outcomes, so it never overstates the
  full KL, and the student keeps the teacher's tail mass instead of being taught that it is zero.
- `tail="renormalize"`: the teacher truncated to its top k and renormalised to sum to 1,
  p_i = exp(z_i / T) / sum_{j in topk} exp(z_j / T); KL = sum_{topk} p_i (log p_i - log q_i). It needs
  no lse, but it asks the student to move the tail mass onto the top k (sharper than the teacher):
  fine when the top k holds nearly all of the mass, harmful when it does not (small k, flat teachers).

Both are multiplied by T^2, which keeps gradient magnitudes comparable across temperatures
(Hinton et al. 2015).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

TAILS = ("bucket", "renormalize")


def forward_kl_topk(student_logits: Tensor, teacher_values: Tensor, teacher_indices: Tensor,
                    temperature: float = 1.0, teacher_lse: Tensor | None = None, tail: str = "bucket") -> Tensor:
    """Mean over tokens of the top-k forward KL * T^2 (see the module docstring).

    student_logits [..., V]; teacher_values [..., k] raw teacher logits; teacher_indices [..., k] token ids;
    teacher_lse [...]: logsumexp of the teacher's logits / T over all V (needed by tail="bucket").
    """
    T = float(temperature)
    V, k = student_logits.shape[-1], teacher_indices.shape[-1]
    log_q = F.log_softmax(student_logits.float() / T, dim=-1)  # [..., V]
    idx = teacher_indices.long()
    log_q_k = log_q.gather(-1, idx)  # [..., k]
    if tail == "renormalize" or k == V:
        log_p = F.log_softmax(teacher_values.float() / T, dim=-1)  # [..., k] sums to 1 over the top k
        kl = (log_p.exp() * (log_p - log_q_k)).sum(-1)
        return kl.mean() * T * T
    if tail != "bucket":
        raise ValueError(f"tail must be one of {TAILS}, got {tail!r}")
    if teacher_lse is None:
        raise ValueError("tail='bucket' needs the teacher's logsumexp (teacher_lse)")
    log_p = teacher_values.float() / T - teacher_lse.float()[..., None]  # [..., k] true log-probabilities
    p = log_p.exp()
    r = (1.0 - p.sum(-1)).clamp_min(0.0)  # [...] teacher mass outside the top k
    log_q_tail = log_q.scatter(-1, idx, float("-inf")).logsumexp(-1)  # [...] log of the student's tail mass
    tail_kl = torch.where(r > 0, r * (torch.log(r.clamp_min(1e-30)) - log_q_tail), torch.zeros_like(r))
    kl = (p * (log_p - log_q_k)).sum(-1) + tail_kl
    return kl.mean() * T * T


def forward_kl(student_logits: Tensor, teacher_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Full-vocabulary forward KL(p || q) * T^2, mean over tokens (the k = V case)."""
    T = float(temperature)
    log_p = F.log_softmax(teacher_logits.float() / T, dim=-1)
    log_q = F.log_softmax(student_logits.float() / T, dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean() * T * T


def next_token_ce(logits: Tensor, tokens: Tensor) -> Tensor:
    """Cross-entropy of logits [B, S, V] against the next tokens of `tokens` [B, S] (last position unscored)."""
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def hidden_mse(student_hidden: Tensor, teacher_hidden: Tensor, projection: torch.nn.Module | None = None) -> Tensor:
    """Mean squared error between (projected) student states [..., d_s] and teacher states [..., d_t]."""
    h = student_hidden.float() if projection is None else projection(student_hidden.float())
    return F.mse_loss(h, teacher_hidden.float())


def topk_coverage(teacher_values: Tensor, teacher_lse: Tensor, temperature: float = 1.0) -> Tensor:
    """Mean probability mass of the cached top k at temperature T: sum exp(z_topk / T - lse_T)."""
    return (teacher_values.float() / temperature - teacher_lse.float()[..., None]).exp().sum(-1).mean()
