"""Speculative decoding core: verifier (exact and distributional), proposers, adaptive k."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edgefinfer.model.kv_cache import StaticCache
from edgefinfer.decoding.eager import generate_ids
from edgefinfer.errors import UserError
from edgefinfer.runtime.speculative import verify as verify_mod
from edgefinfer.runtime.speculative.adaptive import (AdaptiveK, CostModel, KState, best_k, expected_speedup,
                                                     expected_tokens)
from edgefinfer.runtime.speculative.proposers import (Draft, DraftModelProposer, PromptLookupProposer, Proposer,
                                                      torch_model_step)
from edgefinfer.runtime.speculative.verify import (SpecStats, VerifyResult, greedy_accept, rejection_sample,
                                                   residual_probs, verify, verify_greedy, verify_sampling)
from edgefinfer.decoding.sampling import SamplingParams, logits_to_probs
from tests.helpers import tiny_model


def one_hot_logits(ids: list[int], V: int = 8) -> torch.Tensor:
    """Logits [len(ids), V] whose argmax row by row is `ids`."""
    return F.one_hot(torch.tensor(ids), V).float() * 5.0 + torch.linspace(0, 0.1, V)


# --- greedy verification ---------------------------------------------------------------------------


def test_greedy_all_accepted_emits_k_plus_one_with_bonus():
    res = verify_greedy([3, 1, 4], one_hot_logits([3, 1, 4, 6]))
    assert res == VerifyResult(tokens=[3, 1, 4, 6], num_accepted_draft=3, num_drafted=3)
    assert res.all_accepted


def test_greedy_first_rejected_emits_target_argmax_only():
    res = verify_greedy([3, 1, 4], one_hot_logits([2, 1, 4, 6]))
    assert res == VerifyResult(tokens=[2], num_accepted_draft=0, num_drafted=3)


def test_greedy_rejection_in_the_middle_ignores_later_matches():
    # d_3 would match row 2, but d_2 was rejected: everything after the first mismatch is dropped.
    res = verify_greedy(torch.tensor([3, 1, 4]), one_hot_logits([3, 5, 4, 6]))
    assert res.tokens == [3, 5] and res.num_accepted_draft == 1


def test_greedy_without_drafts_is_a_plain_step():
    assert verify_greedy([], one_hot_logits([7])).tokens == [7]


def test_greedy_ties_break_like_argmax():
    logits = torch.zeros(2, 4)
    logits[:, 2] = logits[:, 3] = 1.0  # tie between 2 and 3: argmax (and next_token) pick 2
    assert verify_greedy([3], logits).tokens == [2]
    assert verify_greedy([2], logits).tokens == [2, 2]


def test_greedy_accept_batched():
    drafts = torch.tensor([[1, 2], [1, 2], [0, 2]])
    logits = torch.stack([one_hot_logits([1, 2, 3]), one_hot_logits([1, 5, 3]), one_hot_logits([4, 2, 3])])
    n, nxt = greedy_accept(drafts, logits)
    assert n.tolist() == [2, 1, 0] and nxt.tolist() == [3, 5, 4]


def test_shape_mismatch_is_reported():
    with pytest.raises(ValueError, match="k\\+1 = 3 rows"):
        verify_greedy([1, 2], torch.zeros(2, 8))
    with pytest.raises(ValueError, match="draft_probs must be"):
        verify_sampling([1, 2], torch.zeros(2, 7), torch.zeros(3, 8))


# --- sampling verification: exact properties -------------------------------------------------------


def test_residual_probs():
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.5, 0.3])
    assert torch.equal(residual_probs(p, q), torch.tensor([1.0, 0.0, 0.0]))
    q2 = torch.tensor([0.3, 0.1, 0.6])
    torch.testing.assert_close(residual_probs(p, q2), torch.tensor([0.5, 0.5, 0.0]))
    # p <= q everywhere (p == q, or p just below q by rounding): the residual is empty -> p itself.
    assert torch.equal(residual_probs(p, p), p)
    below = torch.tensor([0.4999, 0.5])
    assert torch.equal(residual_probs(below, torch.tensor([0.5, 0.5])), below)


def test_one_hot_target_reduces_sampling_to_greedy():
    g = torch.Generator().manual_seed(0)
    V = 5
    for k in range(5):
        for _ in range(40):
            target_logits = torch.randn(k + 1, V, generator=g)
            draft_probs = torch.distributions.Dirichlet(torch.ones(V)).sample((k,))
            draft_probs[:, 0] = 0.0  # token 0, if drafted, has draft probability 0 (treated as a point mass)
            drafts = torch.randint(0, V, (k,), generator=g)
            drafts[: k // 2] = target_logits[: k // 2].argmax(-1)  # make long accepted prefixes common
            greedy = verify_greedy(drafts, target_logits)
            sampled = verify_sampling(drafts, draft_probs, logits_to_probs(target_logits, 0.0), g)
            assert sampled == greedy


def test_identical_draft_and_target_accept_everything():
    g = torch.Generator().manual_seed(1)
    B, k, V = 2000, 4, 6
    probs = torch.softmax(torch.randn(B, k + 1, V, generator=g), -1)
    drafts = torch.multinomial(probs[:, :k].reshape(-1, V), 1, generator=g).reshape(B, k)
    n, _ = rejection_sample(drafts, probs[:, :k], probs, g)
    assert (n == k).all()


def test_deterministic_draft_forms_are_equivalent():
    """None, one-hot rows, and rows giving the drafted token probability 0 all mean 'a point mass'."""
    B, k, V = 500, 3, 6
    target = torch.softmax(torch.randn(B, k + 1, V, generator=torch.Generator().manual_seed(2)), -1)
    drafts = torch.randint(0, V, (B, k), generator=torch.Generator().manual_seed(3))
    one_hot = F.one_hot(drafts, V).float()
    zero_at_draft = torch.softmax(torch.randn(B, k, V), -1).scatter(-1, drafts[..., None], 0.0)
    outs = [rejection_sample(drafts, q, target, torch.Generator().manual_seed(4))
            for q in (None, one_hot, zero_at_draft)]
    for n, nxt in outs[1:]:
        assert torch.equal(n, outs[0][0]) and torch.equal(nxt, outs[0][1])
    # And a rejected deterministic draft is never re-emitted (the residual excludes it).
    n, nxt = outs[0]
    rejected = n < k
    assert (nxt[rejected] != drafts[rejected, n[rejected]]).all()


def test_verify_dispatches_on_params():
    logits = one_hot_logits([3, 1, 4])
    assert verify([3, 1], None, logits, SamplingParams()).tokens == [3, 1, 4]
    # Sharp logits at temperature 1: target probs are ~one-hot, so a matching draft is accepted.
    res = verify([3, 1], None, logits * 10, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert res.tokens == [3, 1, 4]


# --- sampling verification: losslessness ------------------------------------------------------------

V = 6
N_DRAWS = 20_000


def chi_square_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's goodness-of-fit test of integer samples against category probabilities."""
    observed = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double().flatten() * samples.numel()
    assert expected.min() >= 5, "too few draws per category for the chi-square approximation"
    stat = ((observed - expected) ** 2 / expected).sum()
    df = torch.tensor(probs.numel() - 1.0, dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))  # P(chi2_df >= stat)


def bigram_tables(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A target and a draft 'model': next-token distributions [V, V] given the previous token."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V, V, generator=g), -1), torch.softmax(torch.randn(V, V, generator=g), -1)


def spec_round(last: torch.Tensor, k: int, target: torch.Tensor, draft: torch.Tensor | None, g: torch.Generator,
               verifier=rejection_sample) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One round for N independent sequences whose last token is `last` [N].

    draft None: a deterministic proposer that always drafts 'previous token + 1'.
    -> drafts [N, k], num_accepted [N], next_token [N].
    """
    drafts, draft_rows, prev = [], [], last
    for _ in range(k):
        if draft is None:
            tok = (prev + 1) % V
        else:
            draft_rows.append(draft[prev])  # [N, V]
            tok = torch.multinomial(draft[prev], 1, generator=g)[:, 0]
        drafts.append(tok)
        prev = tok
    drafts_t = torch.stack(drafts, 1)  # [N, k]
    draft_probs = torch.stack(draft_rows, 1) if draft is not None else None  # [N, k, V]
    target_probs = target[torch.cat([last[:, None], drafts_t], 1)]  # [N, k+1, V]: row i follows token i
    n, nxt = verifier(drafts_t, draft_probs, target_probs, g)
    return drafts_t, n, nxt


def first_two_tokens(k: int, draft: torch.Tensor | None, verifier=rejection_sample, seed: int = 0):
    """Run speculative decoding from prompt token 0 until 2 tokens are out; -> first [N], second [N], n [N]."""
    target, _ = bigram_tables()
    g = torch.Generator().manual_seed(seed)
    last = torch.zeros(N_DRAWS, dtype=torch.long)
    drafts, n, y = spec_round(last, k, target, draft, g, verifier)
    first = torch.where(n >= 1, drafts[:, 0], y)
    drafts2, n2, y2 = spec_round(y, k, target, draft, g, verifier)  # used only where round 1 emitted 1 token
    round2_first = torch.where(n2 >= 1, drafts2[:, 0], y2)
    accepted_d2 = drafts[:, min(1, k - 1)]  # n >= 2 needs k >= 2; the clamp only keeps the index valid
    second = torch.where(n >= 2, accepted_d2, torch.where(n == 1, y, round2_first))
    return first, second, n


@pytest.mark.parametrize("k, deterministic_draft", [(1, False), (2, False), (3, False), (2, True)])
def test_speculative_sampling_is_lossless(k, deterministic_draft):
    target, draft = bigram_tables()
    first, second, n = first_two_tokens(k, None if deterministic_draft else draft)
    # First token ~ target[0]; (first, second) ~ target[0][a] * target[a][b]. With k = 1 the second token
    # is often the bonus; with k >= 2 often an accepted draft or a correction.
    assert chi_square_pvalue(first, target[0]) > 1e-4
    joint = target[0][:, None] * target
    assert chi_square_pvalue(first * V + second, joint) > 1e-4
    # The first draft is accepted with probability sum_x min(p(x), q(x)) (1 - TV distance).
    q0 = F.one_hot(torch.tensor(1), V).float() if deterministic_draft else draft[0]
    accept = torch.minimum(target[0], q0).sum()
    rate = (n >= 1).double().mean()
    assert abs(rate - accept) < 4 * (accept * (1 - accept) / N_DRAWS) ** 0.5


def always_accept(drafts, draft_probs, target_probs, g):
    """A broken verifier: keeps every draft (its output follows the draft, not the target)."""
    k = drafts.shape[1]
    return torch.full((drafts.shape[0],), k), torch.multinomial(target_probs[:, k], 1, generator=g)[:, 0]


def test_chi_square_check_rejects_a_verifier_that_always_accepts():
    target, draft = bigram_tables()
    first, second, _ = first_two_tokens(2, draft, verifier=always_accept)
    assert chi_square_pvalue(first, target[0]) < 1e-12
    assert chi_square_pvalue(first * V + second, target[0][:, None] * target) < 1e-12


def test_chi_square_check_rejects_resampling_from_the_target_after_a_rejection(monkeypatch):
    """The classic bug: after a rejection, sampling from p instead of normalize(max(0, p - q))."""
    monkeypatch.setattr(verify_mod, "residual_probs", lambda p, q: p)
    target, draft = bigram_tables()
    first, _, _ = first_two_tokens(2, draft)
    assert chi_square_pvalue(first, target[0]) < 1e-12


# --- statistics ------------------------------------------------------------------------------------


def test_spec_stats():
    stats = SpecStats()
    for r in (VerifyResult([1, 2, 3], 2, 4), VerifyResult([5], 0, 4), VerifyResult([1, 2, 3, 4, 5], 4, 4),
              VerifyResult([7], 0, 0)):
        stats.record(r)
    assert (stats.proposed, stats.accepted, stats.target_steps, stats.emitted) == (12, 6, 4, 10)
    assert stats.acceptance_rate == 0.5 and stats.tokens_per_step == 2.5
    assert SpecStats().acceptance_rate == 0.0 and SpecStats().tokens_per_step == 0.0


# --- prompt lookup ---------------------------------------------------------------------------------


def naive_lookup(context: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The definition, scanned backwards without an index (reference for the incremental proposer)."""
    N = len(context)
    for n in range(max_ngram, min_ngram - 1, -1):
        if N < n + 1:
            continue
        gram = context[N - n:]
        for end in range(N - 2, n - 2, -1):
            if context[end + 1 - n:end + 1] == gram:
                out = []
                for i in range(end + 1, end + 1 + k):
                    out.append(context[i] if i < N else out[i - N])
                return out
    return []


def test_prompt_lookup_copies_what_followed_the_match():
    p = PromptLookupProposer()
    assert isinstance(p, Proposer)
    assert p.propose([10, 11, 12, 13, 14, 99, 11, 12], 3) == Draft([13, 14, 99])


def test_prompt_lookup_prefers_the_longest_ngram():
    # The bigram (1, 2) last occurred at the start; the unigram 2 occurred more recently (followed by 8).
    ctx = [1, 2, 7, 5, 2, 8, 9, 1, 2]
    assert PromptLookupProposer(max_ngram=3).propose(ctx, 3).tokens == [7, 5, 2]
    assert PromptLookupProposer(max_ngram=1).propose(ctx, 3).tokens == [8, 9, 1]


def test_prompt_lookup_takes_the_most_recent_match():
    assert PromptLookupProposer().propose([1, 2, 3, 1, 2, 4, 1, 2], 2).tokens == [4, 1]


def test_prompt_lookup_without_match_proposes_nothing():
    p = PromptLookupProposer(min_ngram=2)
    assert p.propose([1, 2, 3, 4, 2], 4) == Draft([])  # the unigram 2 repeats, but min_ngram is 2
    assert p.propose([5], 4).tokens == []
    assert PromptLookupProposer().propose([1, 2, 3], 0).tokens == []


def test_prompt_lookup_extends_a_repeating_pattern():
    assert PromptLookupProposer().propose([9, 5, 6, 5, 6], 5).tokens == [5, 6, 5, 6, 5]
    assert PromptLookupProposer().propose([4, 4], 3).tokens == [4, 4, 4]


def test_prompt_lookup_incremental_index_matches_the_definition():
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, 5, (300,), generator=g).tolist()
    p = PromptLookupProposer(max_ngram=3, min_ngram=1)
    for N in range(1, len(seq), 7):  # the context grows by several tokens between calls
        assert p.propose(seq[:N], 4).tokens == naive_lookup(seq[:N], 4, 3, 1), N
    other = torch.randint(0, 5, (50,), generator=g).tolist()  # a new sequence: the index is rebuilt
    assert p.propose(other, 4).tokens == naive_lookup(other, 4, 3, 1)
    assert p.propose(tuple(seq[:100]), 4).tokens == naive_lookup(seq[:100], 4, 3, 1)


def test_prompt_lookup_rejects_bad_ngram_bounds():
    with pytest.raises(UserError, match="1 <= min_ngram <= max_ngram, got min_ngram=3, max_ngram=2"):
        PromptLookupProposer(max_ngram=2, min_ngram=3)


# --- draft model proposer --------------------------------------------------------------------------

DV = 16  # the fake draft's vocabulary


def prefix_logits(prefix: list[int]) -> torch.Tensor:
    """A deterministic 'model' whose next-token logits [DV] depend on the WHOLE prefix."""
    h = 7
    for t in prefix:
        h = (h * 1_000_003 + t + 1) % 2_147_483_647
    return torch.randn(DV, generator=torch.Generator().manual_seed(h))


class FakeDraft:
    """A draft 'model' with a position-indexed cache; logits are computed from the cached tokens.

    explicit_rollback=False behaves like a StaticCache (stale slots are simply overwritten);
    True behaves like llama.cpp (the cache must be truncated before feeding from an earlier position).
    """

    def __init__(self, explicit_rollback: bool):
        self.cache: list[int] = []
        self.explicit_rollback = explicit_rollback
        self.calls: list[tuple[int, int]] = []  # (start_pos, number of tokens)

    def step(self, tokens: list[int], start_pos: int) -> torch.Tensor:
        self.calls.append((start_pos, len(tokens)))
        if self.explicit_rollback:
            assert start_pos == len(self.cache), "fed without rolling back first"
        assert start_pos <= len(self.cache), "a gap in the cache"
        self.cache[start_pos:start_pos + len(tokens)] = tokens
        return torch.stack([prefix_logits(self.cache[:start_pos + i + 1]) for i in range(len(tokens))])

    def rollback(self, keep: int) -> None:
        del self.cache[keep:]


def greedy_reference(context: list[int], k: int, logits_fn) -> list[int]:
    out = list(context)
    for _ in range(k):
        out.append(int(logits_fn(out).argmax()))
    return out[len(context):]


@pytest.mark.parametrize("explicit_rollback", [False, True])
def test_draft_model_proposer_feeds_only_new_tokens_and_matches_no_cache_decoding(explicit_rollback):
    fake = FakeDraft(explicit_rollback)
    proposer = DraftModelProposer(fake.step, rollback=fake.rollback if explicit_rollback else None)
    assert isinstance(proposer, Proposer)
    g = torch.Generator().manual_seed(0)
    context = torch.randint(0, DV, (10,), generator=g).tolist()
    k = 4
    for n_accept in [4, 0, 2, 4, 1, 3, 0]:
        draft = proposer.propose(context, k)
        assert draft.tokens == greedy_reference(context, k, prefix_logits)
        assert proposer.seen == context + draft.tokens[:-1]
        y = (draft.tokens[n_accept] + 1) % DV if n_accept < k else 5  # a correction differs from the draft
        context = context + draft.tokens[:n_accept] + [y]
    # Round 1: prefill 10, then d1..d3 one by one. Round 2 (all accepted): [d4, y] at 13, then 3 singles.
    assert fake.calls[:8] == [(0, 10), (10, 1), (11, 1), (12, 1), (13, 2), (15, 1), (16, 1), (17, 1)]
    # Round 3 (none accepted): only [y] after the 15 committed tokens at position 15.
    assert fake.calls[8] == (15, 1)


def test_draft_model_proposer_resyncs_on_a_new_sequence_and_respects_max_len():
    fake = FakeDraft(explicit_rollback=True)
    proposer = DraftModelProposer(fake.step, rollback=fake.rollback, max_len=12)
    assert proposer.propose([1, 2, 3, 4, 5, 6, 7, 8], 3).tokens == greedy_reference([1, 2, 3, 4, 5, 6, 7, 8], 3,
                                                                                    prefix_logits)
    # Another sequence, longer than what the draft has seen, sharing only [1, 2] with it.
    other = [1, 2, 9, 9, 9, 9, 9, 9, 9, 9]
    assert proposer.propose(other, 2).tokens == greedy_reference(other, 2, prefix_logits)
    assert fake.calls[-2] == (2, 8)  # kept the common prefix [1, 2], fed the rest
    ctx = list(range(10))
    draft = proposer.propose(ctx, 8)  # positions 10, 11 left: d1, d2 fed, d3 not
    assert draft.tokens == greedy_reference(ctx, 3, prefix_logits)
    assert proposer.propose(list(range(14)), 8).tokens == []
    with pytest.raises(ValueError, match="at least one context token"):
        proposer.propose([], 2)


def test_draft_model_proposer_sampling_returns_the_distributions_it_drew_from():
    params = SamplingParams(temperature=0.8, top_k=8)
    context = [3, 1, 4, 1, 5]
    drafts = []
    for _ in range(2):
        fake = FakeDraft(explicit_rollback=False)
        proposer = DraftModelProposer(fake.step, params, generator=torch.Generator().manual_seed(0))
        drafts.append(proposer.propose(context, 4))
    draft = drafts[0]
    assert draft.tokens == drafts[1].tokens  # seeded: reproducible
    assert draft.probs.shape == (4, DV)
    for i, tok in enumerate(draft.tokens):
        expected = logits_to_probs(prefix_logits(context + draft.tokens[:i]), 0.8, 8)
        torch.testing.assert_close(draft.probs[i], expected)
        assert draft.probs[i, tok] > 0


def tiny_draft_config() -> dict:
    return dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2)


def test_draft_model_proposer_with_a_transformer_and_static_cache():
    model = tiny_model(seed=1, **tiny_draft_config())
    cache = StaticCache(model.config, 1, 64)
    proposer = DraftModelProposer(torch_model_step(model, cache), max_len=64)

    @torch.inference_mode()
    def no_cache_logits(prefix: list[int]) -> torch.Tensor:
        return model(torch.tensor(prefix)[None])[0, -1]

    g = torch.Generator().manual_seed(0)
    context = torch.randint(0, 64, (9,), generator=g).tolist()
    for n_accept in [0, 4, 2, 1]:
        draft = proposer.propose(context, 4)
        assert draft.tokens == greedy_reference(context, 4, no_cache_logits)
        y = int(torch.randint(0, 64, (1,), generator=g))
        context = context + draft.tokens[:n_accept] + [y]


# --- the pieces composed: greedy speculative decoding equals target-only decoding -------------------


def speculative_greedy(target, proposer: Proposer, prompt: list[int], max_new: int, k: int) -> list[int]:
    """A minimal decode loop. The target has seen every committed token but the last one."""
    cache = StaticCache(target.config, 1, len(prompt) + max_new + k + 1)
    step = torch_model_step(target, cache)
    context = list(prompt)
    step(context[:-1], 0)
    while len(context) < len(prompt) + max_new:
        draft = proposer.propose(context, k)
        logits = step([context[-1]] + draft.tokens, len(context) - 1)  # [k+1, V]
        context += verify_greedy(draft.tokens, logits).tokens
    return context[len(prompt):len(prompt) + max_new]


@pytest.mark.parametrize("draft_seed", [0, 1, None])
def test_greedy_speculative_decoding_equals_target_only(draft_seed):
    target = tiny_model(seed=0, **tiny_draft_config())
    prompt = [5, 9, 5, 9, 5, 2, 7]
    if draft_seed is None:
        proposer: Proposer = PromptLookupProposer()
    else:  # seed 0: the draft IS the target (everything accepted); seed 1: a different model
        draft = tiny_model(seed=draft_seed, **tiny_draft_config())
        proposer = DraftModelProposer(torch_model_step(draft, StaticCache(draft.config, 1, 64)), max_len=64)
    expected = list(generate_ids(target, prompt, 24))
    assert speculative_greedy(target, proposer, prompt, 24, k=4) == expected


# --- adaptive k ------------------------------------------------------------------------------------


def test_expected_tokens_and_speedup():
    assert expected_tokens(0.5, 2) == 1.75
    assert expected_tokens(1.0, 3) == 4.0 and expected_tokens(0.0, 5) == 1.0
    cost = CostModel(draft_step=0.1, verify_per_token=0.05)
    assert expected_speedup(0.8, 4, cost) == pytest.approx(3.3616 / 1.6)
    assert expected_speedup(0.3, 0, cost) == 1.0
    # speedups for k = 1..6: 1.565, 1.877, 2.036, 2.101, 2.108, 2.080
    assert best_k(0.8, cost, 1, 8) == (5, pytest.approx(3.68928 / 1.75))
    assert best_k(0.8, cost, 1, 3)[0] == 3
    assert best_k(1.0, CostModel(), 1, 8)[0] == 8
    assert best_k(0.0, CostModel(), 2, 8) == (2, 1.0)  # nothing to gain: the smallest k


def test_adaptive_k_trajectory():
    ctl = AdaptiveK(k_min=1, k_max=6, cost=CostModel(draft_step=0.1, verify_per_token=0.05), decay=0.5,
                    prior_acceptance=0.6, prior_weight=4.0)
    state = ctl.initial()
    # alpha = 0.6: speedups for k = 1, 2, 3 are 1.6/1.15 = 1.391, 1.96/1.3 = 1.508, 2.176/1.45 = 1.501.
    assert (state.k, state.acceptance) == (2, 0.6)
    ks = []
    for accepted in ["all"] * 4 + [1, 0, 0, 0, 0, 0]:
        drafted = state.k
        state = ctl.update(state, drafted, drafted if accepted == "all" else accepted)
        ks.append(state.k)
    # Round 1: alpha = (0.5 * 2.4 + 2) / (0.5 * 4 + 2) = 0.8 -> k = 5 (see test_expected_tokens_and_speedup).
    # Last round: alpha = 0.0912, so even k = 1 expects 1.0912 / 1.15 < 1: speculation switches off.
    assert ks == [5, 6, 6, 6, 6, 3, 2, 1, 1, 0]
    assert state.acceptance == pytest.approx(0.19765625 / 2.16796875)


def test_acceptance_counts_only_tested_drafts():
    ctl = AdaptiveK(decay=0.0)  # no memory: the estimate is the last round's
    s = ctl.update(ctl.initial(), 4, 1)  # kept d1, rejected d2; d3, d4 were never tested
    assert (s.successes, s.trials, s.acceptance) == (1.0, 2.0, 0.5)
    s = ctl.update(s, 4, 4)
    assert (s.successes, s.trials) == (4.0, 4.0)
    with pytest.raises(ValueError):
        ctl.update(s, 2, 3)


def test_adaptive_k_switches_off_then_probes():
    ctl = AdaptiveK(k_min=1, k_max=4, cost=CostModel(draft_step=0.3), decay=0.5, probe_every=3)
    state = ctl.initial()
    assert state.k > 0
    while state.k > 0:
        state = ctl.update(state, state.k, 0)
    assert expected_speedup(state.acceptance, 1, ctl.cost) < 1.0
    # Off: plain steps count up to the probe, which drafts k_min once.
    ks = []
    for _ in range(3):
        state = ctl.update(state, 0, 0)
        ks.append(state.k)
    assert ks == [0, 0, 1]
    state = ctl.update(state, 1, 0)  # the probe failed: off again, the count restarts
    assert (state.k, state.plain_steps) == (0, 0)
    # An empty proposal while on is no evidence.
    on = KState(k=2, successes=3.0, trials=4.0)
    assert ctl.update(on, 0, 0) == on


def test_adaptive_k_never_switches_off_when_speculation_is_free():
    ctl = AdaptiveK(k_max=5, cost=CostModel())  # prompt lookup on a memory-bound target
    state = ctl.initial()
    for _ in range(20):
        state = ctl.update(state, state.k, 0)
    assert state.k == 5  # even at alpha ~ 0 a free draft costs nothing


def test_adaptive_k_rejects_bad_settings():
    with pytest.raises(UserError, match="1 <= k_min <= k_max"):
        AdaptiveK(k_min=4, k_max=2)
    with pytest.raises(UserError, match="non-negative costs"):
        CostModel(draft_step=-0.1)
    with pytest.raises(UserError, match="decay"):
        AdaptiveK(decay=1.0)
