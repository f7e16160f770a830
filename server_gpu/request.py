"""Requests, their sequences (one per choice), and what the engine hands back after each step.

A request asks for `n` choices of one prompt. Its first sequence prefills the prompt; when the
prompt's logits arrive, the other n-1 sequences are forked from it (they share its KV blocks) and
each samples its own first token. Every sequence keeps ALL its tokens (`tokens`: prompt, then
output); the KV cache holds all of them but the last, which the next step feeds.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass
from typing import Callable

import torch

from edgefinfer.decoding.generation import StopStringMatcher
from edgefinfer.runtime.speculative.adaptive import KState
from edgefinfer.runtime.speculative.proposers import Proposer
from edgefinfer.decoding.sampling import SamplingParams
from edgefinfer.server_gpu.sampler import TokenLogprob
from edgefinfer.decoding.structured import Grammar, TokenMatcher
from edgefinfer.tokenization.tokenizer import Tokenizer


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    n: int = 1
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob and the top k
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit) before sampling
    grammar: Grammar | None = None  # structured output: every choice's tokens stay within it


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class ChoiceDelta:
    """What one choice produced in one step."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    deltas: list[ChoiceDelta]
    finished: bool  # every choice has finished
    num_prompt_tokens: int
    num_output_tokens: int  # over all choices so far
    error: str | None = None


class TextStream:
    """Token ids -> text deltas for one choice: incremental UTF-8-safe decoding plus stop strings."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]):
        self.decoder = tokenizer.stream_decoder()
        self.matcher = StopStringMatcher(list(stop))

    def push(self, token_id: int) -> tuple[str, bool]:
        """-> (text safe to emit, a stop string was hit)."""
        return self.matcher.push(self.decoder.push(token_id))

    def flush(self) -> str:
        out, _ = self.matcher.push(self.decoder.flush())
        return out + self.matcher.flush()


_seq_ids = itertools.count()


class Seq:
    """One choice of a request: the unit the scheduler runs and the KV manager tracks."""

    def __init__(self, request: Request, index: int, tokens: list[int], text: TextStream,
                 generator: torch.Generator | None):
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index
        self.tokens = tokens
        self.text = text
        self.generator = generator
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        # Leading tokens whose KV is in storage. The KV manager holds the planned ones: all tokens
        # while a prompt is prefilling, all but the last (not fed yet) while decoding.
        self.num_computed = 0
        # Leading tokens computed as prompt chunks aligned to the chunk size from position 0; only
        # these may be lent to another sequence when results must not depend on the batch.
        self.chunked_len = 0
        self.swapped: int | None = None  # tokens whose KV waits in host memory (swap-out preemption)
        self.proposer: Proposer | None = None
        self.k_state: KState | None = None
        self.num_preemptions = 0
        self.last_emit_time: float | None = None
        # Structured output: where this choice's output stands in its grammar (dropped when it ends).
        grammar = request.params.grammar
        self.matcher: TokenMatcher | None = grammar.matcher() if grammar is not None else None

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.request.num_prompt

    def __repr__(self) -> str:
        return f"Seq({self.seq_id}, req={self.request.request_id}, n={len(self.tokens)}, {self.status.value})"


class Request:
    def __init__(self, request_id: str, prompt_ids: list[int], params: GenerationParams,
                 sink: Callable[[RequestOutput], None], arrival_time: float | None = None):
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.sink = sink
        self.arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.seqs: list[Seq] = []
        self.forked = params.n == 1  # the other choices exist once the prompt is computed
        self.num_finished = 0

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.forked and self.num_finished == len(self.seqs)

    def num_output_tokens(self) -> int:
        return sum(s.num_output for s in self.seqs)
