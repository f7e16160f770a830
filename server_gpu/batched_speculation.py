"""Speculative decoding inside a continuous batch: when it pays, measured from the steps themselves.

A sequence that speculates feeds `[last, d_1..d_k]` instead of `[last]`; all of a step's sequences
still go through one forward. Whether that pays depends on the load. With B sequences decoding, a
step costs about `a + b * tokens` (a: reading the weights and fixed overheads, b: per token). If
every sequence adds k drafts, the round costs

    (a + b * B * (k + 1)) / (a + b * B) = 1 + k * b*B / (a + b*B)

plain steps, so the verifier's per-token cost in `AdaptiveK`'s cost model is v(B) = b*B / (a + b*B):
near 0 for one sequence on a memory-bound device (speculation pays), near 1 for a full,
compute-bound batch (it pays only if almost every draft is accepted). `StepCostModel` fits a and b
online from each step's wall time; `AdaptiveK` (the shared controller) then picks each sequence's
k, or switches speculation off (k = 0) and re-probes it every `probe_every` plain steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from edgefinfer.errors import UserError
from edgefinfer.runtime.speculative.adaptive import AdaptiveK, CostModel, KState
from edgefinfer.runtime.speculative.proposers import Proposer


@dataclass
class SpeculationConfig:
    """make_proposer(seq_id) builds one proposer per sequence; release(seq_id) frees what it holds."""

    make_proposer: Callable[[int], Proposer]
    k_max: int = 4
    adaptive: bool = True  # False: always draft k_max tokens
    release: Callable[[int], None] | None = None
    name: str = "lookup"

    def __post_init__(self) -> None:
        if self.k_max < 1:
            raise UserError(f"speculative k must be at least 1, got {self.k_max}")


@dataclass
class StepCostModel:
    """Least-squares fit of step time = a + b * tokens over recent steps (exponential forgetting)."""

    decay: float = 0.98
    default_verify_cost: float = 0.1  # before two different step sizes have been seen
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # S1, Sn, Snn, St, Snt
    draft_s_per_token: float = 0.0  # moving average of proposer time per drafted token

    def observe(self, num_tokens: int, seconds: float) -> None:
        n, t = float(num_tokens), seconds
        self._sums = [self.decay * s + x for s, x in zip(self._sums, (1.0, n, n * n, t, n * t))]

    def observe_draft(self, num_drafted: int, seconds: float) -> None:
        if num_drafted > 0:
            self.draft_s_per_token = 0.9 * self.draft_s_per_token + 0.1 * seconds / num_drafted

    def fit(self) -> tuple[float, float] | None:
        """(a, b) in seconds, or None while the observed step sizes do not determine them."""
        s1, sn, snn, st, snt = self._sums
        det = s1 * snn - sn * sn
        if s1 <= 0 or det <= 1e-9 * max(s1 * snn, 1e-30):
            return None
        b = max((s1 * snt - sn * st) / det, 0.0)
        a = max((st - b * sn) / s1, 1e-6)
        return a, b

    def cost(self, num_decoding: int) -> CostModel:
        """AdaptiveK's cost model for a step with `num_decoding` sequences decoding."""
        fitted = self.fit()
        if fitted is None:
            return CostModel(draft_step=0.0, verify_per_token=self.default_verify_cost)
        a, b = fitted
        batch = max(num_decoding, 1)
        plain_step = a + b * batch
        return CostModel(draft_step=self.draft_s_per_token / plain_step, verify_per_token=b * batch / plain_step)


@dataclass
class AcceptanceEstimate:
    """Server-wide acceptance rate (moving averages over every verified round), the prior a new
    sequence starts from: requests are often shorter than what one sequence needs to learn alone
    that its drafts are not accepted. Counts like `AdaptiveK`: drafts after the first rejection
    were never tested."""

    decay: float = 0.99
    successes: float = 0.6 * 4  # the shared controller's default prior, worth four tested drafts
    trials: float = 4.0

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.successes = self.decay * self.successes + accepted
            self.trials = self.decay * self.trials + accepted + (accepted < drafted)

    @property
    def rate(self) -> float:
        return self.successes / self.trials


def controller(config: SpeculationConfig, cost: CostModel, prior: float = 0.6) -> AdaptiveK:
    return AdaptiveK(k_min=1, k_max=config.k_max, cost=cost, prior_acceptance=prior)


def initial_state(config: SpeculationConfig, cost: CostModel, prior: float = 0.6) -> KState:
    if not config.adaptive:
        return KState(config.k_max, 0.0, 0.0)
    return controller(config, cost, prior).initial()


def next_state(config: SpeculationConfig, cost: CostModel, state: KState, drafted: int, accepted: int) -> KState:
    if not config.adaptive:
        return state
    return controller(config, cost).update(state, drafted, accepted)
