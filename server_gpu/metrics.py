"""Prometheus metrics in the text exposition format (version 0.0.4), without a client library.

The engine thread records; the HTTP thread renders. Every mutation and the rendering hold one lock,
so a scrape never sees half an update. Gauges that describe the engine's state (queue, running
sequences, KV blocks) are read from the engine's last published snapshot at scrape time.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

PREFIX = "edgefinfer"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
STEP_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def _fmt(x: float) -> str:
    x = float(x)
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return str(int(x)) if x.is_integer() and abs(x) < 1e15 else repr(x)


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    esc = (v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for v in labels.values())
    return "{" + ",".join(f'{k}="{v}"' for k, v in zip(labels, esc)) + "}"


class Histogram:
    def __init__(self, buckets: Sequence[float]):
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def lines(self, name: str) -> list[str]:
        out, cum = [], 0
        for bound, count in zip((*self.bounds, math.inf), self.counts):
            cum += count
            out.append(f'{name}_bucket{{le="{_fmt(bound)}"}} {cum}')
        out += [f"{name}_sum {_fmt(self.sum)}", f"{name}_count {cum}"]
        return out


class Metrics:
    """Counters and histograms the engine records, plus gauges read from a snapshot callback."""

    def __init__(self, snapshot: Callable[[], dict[str, float]] | None = None, window_s: float = 10.0):
        self._lock = threading.Lock()
        self.snapshot = snapshot or (lambda: {})
        self.counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.step = Histogram(STEP_BUCKETS)
        self._window_s = window_s
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens generated) for tokens/s

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self.counters[key] = self.counters.get(key, 0.0) + value

    def record_step(self, seconds: float, generated: int, ttft: Sequence[float], itl: Sequence[float],
                    prompt_tokens: int = 0) -> None:
        """One engine step, its token counters included: one lock a step (at one request a step is a
        token, and the engine thread's Python between llama_decode calls is what C = 1 pays for)."""
        now = time.monotonic()
        with self._lock:
            counters = self.counters
            if generated:
                counters[_GENERATED] = counters.get(_GENERATED, 0.0) + generated
            if prompt_tokens:
                counters[_PROMPT] = counters.get(_PROMPT, 0.0) + prompt_tokens
            self.step.observe(seconds)
            for x in ttft:
                self.ttft.observe(x)
            for x in itl:
                self.itl.observe(x)
            if generated:
                self._recent.append((now, generated))
            self._trim(now)

    def tokens_per_second(self) -> float:
        with self._lock:
            now = time.monotonic()
            self._trim(now)
            return sum(n for _, n in self._recent) / self._window_s

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self._window_s:
            self._recent.popleft()

    def render(self) -> str:
        gauges = self.snapshot()
        tok_s = self.tokens_per_second()
        lines: list[str] = []
        declared: set[str] = set()

        def gauge(name: str, help_: str, value: float, kind: str = "gauge", **labels: str) -> None:
            if name not in declared:  # one HELP/TYPE header per metric, however many label sets
                declared.add(name)
                lines.extend([f"# HELP {PREFIX}_{name} {help_}", f"# TYPE {PREFIX}_{name} {kind}"])
            lines.append(f"{PREFIX}_{name}{_labels(labels)} {_fmt(value)}")

        gauge("num_requests_waiting", "Sequences waiting to be scheduled.", gauges.get("waiting", 0))
        gauge("num_requests_running", "Sequences in the running batch.", gauges.get("running", 0))
        for state in ("used", "free", "cached"):
            gauge("kv_blocks", "Paged-KV blocks by state (free includes cached).", gauges.get(f"kv_{state}", 0),
                  state=state)
        gauge("kv_blocks_total", "Paged-KV blocks in the pool.", gauges.get("kv_total", 0))
        gauge("kv_usage_ratio", "Fraction of KV blocks in use.", gauges.get("kv_usage", 0.0))
        gauge("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens looked up.",
              gauges.get("prefix_hit_rate", 0.0))
        # The two counts behind the rate: a client takes differences to get the rate of a time window.
        gauge("prefix_cache_hits_total", "Prompt tokens served from the prefix cache.", gauges.get("prefix_hits", 0),
              kind="counter")
        gauge("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
              gauges.get("prefix_queries", 0), kind="counter")
        gauge("kv_retained_prefixes", "Finished requests' prompts kept in KV for later prefix hits.",
              gauges.get("kv_retained", 0))
        gauge("generation_tokens_per_second", f"Tokens generated over the last {self._window_s:g} s, per second.",
              tok_s)
        gauge("speculative_acceptance_rate", "Accepted / drafted tokens since start.",
              gauges.get("spec_acceptance", 0.0))
        with self._lock:
            names: dict[str, list[str]] = {}
            for (name, labels), value in sorted(self.counters.items()):
                names.setdefault(name, []).append(f"{PREFIX}_{name}{_labels(dict(labels))} {_fmt(value)}")
            for name, rows in names.items():
                lines.extend([f"# HELP {PREFIX}_{name} {_COUNTER_HELP.get(name, name)}",
                              f"# TYPE {PREFIX}_{name} counter", *rows])
            for name, hist, help_ in (("time_to_first_token_seconds", self.ttft, "Time to first token."),
                                      ("inter_token_latency_seconds", self.itl, "Time between output tokens."),
                                      ("step_duration_seconds", self.step, "Wall time of one engine step.")):
                lines.extend([f"# HELP {PREFIX}_{name} {help_}", f"# TYPE {PREFIX}_{name} histogram"])
                lines.extend(hist.lines(f"{PREFIX}_{name}"))
        return "\n".join(lines) + "\n"


_GENERATED, _PROMPT = ("generation_tokens_total", ()), ("prompt_tokens_total", ())  # `counters` keys

_COUNTER_HELP = {
    "prompt_tokens_total": "Prompt tokens computed (prefix-cache hits excluded, recomputation included).",
    "generation_tokens_total": "Tokens generated.",
    "requests_total": "Finished requests by finish reason.",
    "preemptions_total": "Sequences preempted for lack of KV blocks.",
    "spec_draft_tokens_total": "Draft tokens verified.",
    "spec_accepted_tokens_total": "Draft tokens accepted.",
    "http_requests_total": "HTTP requests by route and status code.",
}
