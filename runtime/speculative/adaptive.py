"""How many tokens to draft: k chosen from the measured acceptance rate and a cost model.

The model (Leviathan et al. 2023, section 3): if each drafted token is accepted with probability
alpha, independently, a round that drafts k tokens emits

    E[tokens] = 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)

for a cost, in units of one plain target decode step, of

    cost(k) = 1 + verify_per_token * k + draft_step * k

(verifying k+1 tokens in one pass costs a little more than one token; drafting costs k draft
steps). The expected speedup over plain decoding is E[tokens] / cost(k). The controller picks the
k in [k_min, k_max] that maximises it, so k rises as nearly everything is accepted and falls as
little is, and it stops speculating (k = 0) when even the best k is expected to be slower than
plain decoding. Everything is pure: `AdaptiveK.update(state, drafted, accepted) -> state`.

Estimating alpha: a round that drafts k and keeps n observed n successes and, when n < k, one
failure; the drafts after the first rejection were never tested. Counting them as failures (n / k)
would bias alpha low, more so for larger k, and so push k down for no reason. The controller keeps
exponential moving averages of successes and of tested drafts and takes their ratio, starting from
a prior worth a few tokens so that one unlucky first round cannot switch speculation off.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from edgefinfer.errors import UserError


@dataclass(frozen=True)
class CostModel:
    """Costs of one speculative round, in units of one plain target decode step."""

    draft_step: float = 0.0  # one draft-model step: about draft/target latency; ~0 for prompt lookup
    verify_per_token: float = 0.0  # each extra verified token; ~0 when decoding is memory-bound

    def __post_init__(self) -> None:
        if self.draft_step < 0 or self.verify_per_token < 0:
            raise UserError(f"speculative cost model needs non-negative costs, got draft_step={self.draft_step}, "
                            f"verify_per_token={self.verify_per_token}")

    def round_cost(self, k: int) -> float:
        return 1.0 + (self.verify_per_token + self.draft_step) * k


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one round emits on average when each of k drafts is accepted with probability alpha."""
    return sum(alpha ** i for i in range(k + 1))


def expected_speedup(alpha: float, k: int, cost: CostModel) -> float:
    """Expected tokens per unit of plain-decode time, relative to plain decoding (1.0 at k = 0)."""
    return expected_tokens(alpha, k) / cost.round_cost(k)


def best_k(alpha: float, cost: CostModel, k_min: int, k_max: int) -> tuple[int, float]:
    """The k in [k_min, k_max] with the highest expected speedup (the smallest on a tie), and that speedup."""
    best = max(range(k_min, k_max + 1), key=lambda k: (expected_speedup(alpha, k, cost), -k))
    return best, expected_speedup(alpha, best, cost)


@dataclass(frozen=True)
class KState:
    """What the controller remembers. k == 0 means speculation is off: take plain decode steps."""

    k: int
    successes: float  # moving averages of accepted drafts ...
    trials: float  # ... and of drafts the target actually tested
    plain_steps: int = 0  # plain steps since speculation was switched off

    @property
    def acceptance(self) -> float:
        """The estimated per-token acceptance probability alpha."""
        return self.successes / self.trials if self.trials > 0 else 0.0


@dataclass(frozen=True)
class AdaptiveK:
    k_min: int = 1
    k_max: int = 8
    cost: CostModel = CostModel()
    decay: float = 0.8  # weight of the past per round: evidence fades over roughly 1 / (1 - decay) rounds
    prior_acceptance: float = 0.6  # alpha assumed before any evidence ...
    prior_weight: float = 4.0  # ... worth this many tested drafts
    min_speedup: float = 1.0  # speculate only while the expected speedup is at least this
    probe_every: int = 32  # when off, draft k_min tokens once after this many plain steps, to re-measure

    def __post_init__(self) -> None:
        if not 1 <= self.k_min <= self.k_max:
            raise UserError(f"adaptive speculation needs 1 <= k_min <= k_max, got k_min={self.k_min}, "
                            f"k_max={self.k_max}")
        if not 0.0 <= self.decay < 1.0:
            raise UserError(f"decay must be in [0, 1), got {self.decay}")
        if not 0.0 <= self.prior_acceptance <= 1.0 or self.prior_weight <= 0:
            raise UserError(f"prior_acceptance must be in [0, 1] and prior_weight > 0, got "
                            f"{self.prior_acceptance} and {self.prior_weight}")
        if self.probe_every < 1:
            raise UserError(f"probe_every must be >= 1, got {self.probe_every}")

    def initial(self) -> KState:
        state = KState(0, self.prior_acceptance * self.prior_weight, self.prior_weight)
        return dataclasses.replace(state, k=self._choose(state.acceptance))

    def update(self, state: KState, num_drafted: int, num_accepted: int) -> KState:
        """The state after a round that drafted `num_drafted` tokens and kept `num_accepted` of them.

        num_drafted == 0 is a plain step (speculation off, or the proposer had nothing): no evidence.
        """
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"accepted {num_accepted} of {num_drafted} drafted tokens")
        if num_drafted == 0:
            if state.k > 0:
                return state
            if state.plain_steps + 1 >= self.probe_every:
                return dataclasses.replace(state, k=self.k_min, plain_steps=0)
            return dataclasses.replace(state, plain_steps=state.plain_steps + 1)
        tested = num_accepted + (num_accepted < num_drafted)  # the first rejected draft was tested too
        successes = self.decay * state.successes + num_accepted
        trials = self.decay * state.trials + tested
        return KState(self._choose(successes / trials), successes, trials)

    def _choose(self, alpha: float) -> int:
        k, speedup = best_k(alpha, self.cost, self.k_min, self.k_max)
        return k if speedup >= self.min_speedup else 0
