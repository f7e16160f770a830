"""The serving engine: one background thread that owns the scheduler and the executor.

llama.cpp is not thread-safe and a forward should never wait for the HTTP side, so everything that
touches the model, the KV manager or the scheduler runs in this one thread. The asyncio server talks
to it through a queue of commands (`submit`, `abort`); outputs travel back through
`loop.call_soon_threadsafe`, one hop per step for all the requests that step touched.

Requests that arrive together start together: the HTTP side opens an `Arrival` as a request comes in
and closes it once the request is submitted (or refused), and an idle engine that wakes to a request
holds its first step while others are still being read, validated and tokenized, for at most
`ADMIT_WAIT_S` (`ServingEngine._arrived`). Without it the first of a burst ran alone and the rest
split around that step (the event loop hands requests over one by one, ~1.5-3 ms each): a burst of 16
repeated chats, one token to compute each, took three steps where llama-server, whose HTTP threads hand
a burst over within milliseconds, takes one. A busy engine never waits: its running requests would.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from edgefinfer.runtime.kv.block_pool import sha256_block_hash
from edgefinfer.runtime.kv.paged_manager import PagedKVManager
from edgefinfer.server_gpu.batched_speculation import SpeculationConfig
from edgefinfer.server_gpu.interface import Executor, StepPlan
from edgefinfer.server_gpu.metrics import Metrics
from edgefinfer.server_gpu.request import ChoiceDelta, GenerationParams, Request, RequestOutput, Status
from edgefinfer.server_gpu.scheduler import Scheduler, SchedulerConfig, StepStats
from edgefinfer.decoding.structured import GrammarCompiler
from edgefinfer.tokenization.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_STOP = object()
_ARRIVED = object()  # an Arrival closed: the engine looks again at how many are still coming
# How long an idle engine holds its first step for requests still being read: a burst of 16 takes
# 25-50 ms to hand over on this 2-core host; the first request of a burst waits at most this long.
ADMIT_WAIT_S = 0.05
PUBLISH_INTERVAL_S = 0.05  # how stale /metrics' gauges may be while the engine is busy


@dataclass(frozen=True)
class ServingEngineConfig:
    scheduler: SchedulerConfig
    enable_prefix_caching: bool = True


class ServingEngine:
    def __init__(self, executor: Executor, tokenizer: Tokenizer, stop_ids: tuple[int, ...], config: ServingEngineConfig,
                 speculation: SpeculationConfig | None = None):
        self.executor = executor
        self.tokenizer = tokenizer
        self.config = config
        self.manager = PagedKVManager(executor.num_blocks, executor.block_size,
                                      enable_prefix_caching=config.enable_prefix_caching,
                                      per_sequence_storage=executor.per_sequence_storage, hash_fn=sha256_block_hash,
                                      retain_prefixes=executor.retain_prefixes,
                                      retain_blocks=executor.retain_blocks,
                                      retain_once_blocks=executor.retain_once_blocks,
                                      sliding_window=executor.sliding_window,
                                      adopt_retained=executor.adopt_retained,
                                      max_storage_ids=executor.max_storage_ids)
        self.scheduler = Scheduler(config.scheduler, self.manager, tokenizer, stop_ids, executor.batch_invariant,
                                   speculation, supports_swap=executor.supports_swap)
        self.metrics = Metrics(self.snapshot)
        # Structured output: requests' constraints compile against this model's tokenizer (API side).
        self.grammars = GrammarCompiler(tokenizer, executor.vocab_size, stop_ids)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: dict[str, Request] = {}  # engine-thread view: whom to deliver to
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._snapshot: dict[str, float] = {}
        self._spec_totals = [0, 0]  # drafted, accepted
        self._ending = False  # after end_all: every request ends at once (the server is going away)
        self._arriving = 0  # open Arrivals: requests received and not yet submitted or refused
        self._arriving_lock = threading.Lock()
        self._publish()

    # ------------------------------------------------------------------ any thread
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread; outputs are delivered on `loop` (or in the engine thread if None)."""
        if self._thread is not None:
            return
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="edgefinfer-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Fail what is in flight and end the thread (the executor stays open: see `close`)."""
        if self._thread is None:
            return
        self._inbox.put(_STOP)
        self._thread.join(timeout)
        self._thread = None

    def close(self) -> None:
        """Stop, then free the model and its KV memory."""
        self.stop()
        self.executor.close()

    def submit(self, request_id: str, prompt_ids: list[int], params: GenerationParams,
               sink: Callable[[RequestOutput], None]) -> None:
        """Queue a request; `sink` receives its outputs (on the bound event loop)."""
        self._inbox.put(Request(request_id, prompt_ids, params, sink))

    def arrival(self) -> "Arrival":
        """Mark a request on its way to `submit` (see the module doc); close it when submitted or refused."""
        return Arrival(self)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def end_all(self) -> None:
        """End every request now, its unfinished choices with finish_reason "abort" (a shutdown's grace
        period is over): clients get a normal last chunk instead of a dropped connection. Requests
        submitted afterwards end the same way at once."""
        self._inbox.put(("end_all",))

    def snapshot(self) -> dict[str, float]:
        """The engine state as of its last step (published by the engine thread)."""
        return self._snapshot

    @property
    def arriving(self) -> int:
        """Requests received and not yet submitted or refused (open `Arrival`s)."""
        return self._arriving

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        inbox = self._inbox
        last_publish = 0.0
        while True:
            if not self.scheduler.has_work():
                self._publish()  # what the last step left: an idle server's gauges are exact
                inbox_items = [inbox.get()]  # sleep until there is something to do
                inbox_items += self._arrived(inbox)
            else:
                inbox_items = []
            while not inbox.empty():  # (not a get with timeout 0: its Empty exception costs every step)
                inbox_items.append(inbox.get_nowait())
            for item in inbox_items:
                if item is _STOP:
                    self._fail_all("the server is shutting down")
                    return
                self._command(item)
            if self.scheduler.has_work():
                self._step()
                # While busy, gauges are published every PUBLISH_INTERVAL_S, not every step (a step
                # of one sequence is about 15 ms on CPU, and each snapshot costs 30 us of it).
                now = time.monotonic()
                if now - last_publish >= PUBLISH_INTERVAL_S:
                    self._publish()
                    last_publish = now

    def _arrived(self, inbox: queue.SimpleQueue) -> list[object]:
        """What comes in while requests are still arriving, for at most ADMIT_WAIT_S."""
        items: list[object] = []
        deadline = time.monotonic() + ADMIT_WAIT_S
        while self._arriving > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                items.append(inbox.get(timeout=left))
            except queue.Empty:
                break
        return items

    def _command(self, item: object) -> None:
        if item is _ARRIVED:
            return
        if isinstance(item, Request):
            try:
                self.scheduler.add(item)
            except ValueError as e:  # a duplicate id: refuse this one, keep the other
                log.error("refused request %s: %s", item.request_id, e)
                _call_all([(item.sink, RequestOutput(item.request_id, [], True, item.num_prompt, 0, error=str(e)))])
                return
            self._requests[item.request_id] = item
            if self._ending:
                self._deliver([self._end(item)])
        elif item[0] == "end_all":
            self._ending = True
            self._deliver([self._end(request) for request in list(self._requests.values())])
        else:
            _, request_id = item
            if self._requests.pop(request_id, None) is not None:
                self.scheduler.abort(request_id)
                self.metrics.inc("requests_total", finish_reason="abort")

    def _end(self, request: Request) -> RequestOutput:
        """Abort `request` (its blocks are freed) and say so: each unfinished choice ends with the text
        it held back (a possible stop string's prefix) and finish_reason "abort"."""
        done = {s.index for s in request.seqs if s.status is Status.FINISHED}
        held = {s.index: s.text.flush() for s in request.seqs if s.status is not Status.FINISHED}
        deltas = [ChoiceDelta(i, held.get(i, ""), [], None, "abort") for i in range(request.params.n) if i not in done]
        num_output = request.num_output_tokens()
        self.scheduler.abort(request.request_id)
        self.metrics.inc("requests_total", finish_reason="abort")
        return RequestOutput(request.request_id, deltas, True, request.num_prompt, num_output)

    def _step(self) -> None:
        try:
            plan = self.scheduler.schedule()
            result = self.executor.execute(plan)
            outputs, stats = self.scheduler.update(plan, result)
        except Exception:  # a bug or a device failure: fail what is in flight, keep serving
            log.exception("engine step failed")
            self._fail_all("internal error in the engine step; see the server log")
            return
        self._record(plan, result.elapsed_s, stats)
        self._deliver(outputs)

    def _record(self, plan: StepPlan, seconds: float, stats: StepStats) -> None:
        m = self.metrics
        if plan.work:
            m.record_step(seconds, stats.generated, stats.ttft_s, stats.itl_s, stats.prompt_tokens)
        if stats.preemptions:
            m.inc("preemptions_total", stats.preemptions)
        if stats.drafted:
            m.inc("spec_draft_tokens_total", stats.drafted)
            m.inc("spec_accepted_tokens_total", stats.accepted)
            self._spec_totals[0] += stats.drafted
            self._spec_totals[1] += stats.accepted
        for reason, n in stats.finished.items():
            m.inc("requests_total", n, finish_reason=reason)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        batch = []
        for out in outputs:
            request = self._requests.get(out.request_id)
            if request is None:
                continue  # aborted meanwhile
            if out.finished:
                del self._requests[out.request_id]
            batch.append((request.sink, out))
        if not batch:
            return
        if self._loop is None:
            _call_all(batch)
        else:
            try:
                self._loop.call_soon_threadsafe(_call_all, batch)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _fail_all(self, message: str) -> None:
        failed = []
        for request_id, request in list(self._requests.items()):
            self.scheduler.abort(request_id)
            failed.append(RequestOutput(request_id, [], True, request.num_prompt, 0, error=message))
        self._deliver(failed)
        self._requests.clear()
        # What the aborts released must reach the storage even if no step follows.
        if self.scheduler.has_work():
            try:
                self.executor.execute(self.scheduler.schedule())
            except Exception:
                log.exception("could not release the KV storage after a failure")

    def _publish(self) -> None:
        s = self.manager.stats()
        drafted, accepted = self._spec_totals
        self._snapshot = {
            "waiting": self.scheduler.num_waiting, "running": self.scheduler.num_running,
            "kv_total": s.num_blocks, "kv_used": s.num_used, "kv_free": s.num_free, "kv_cached": s.num_cached,
            "kv_usage": s.num_used / s.num_blocks, "prefix_hit_rate": s.hit_rate, "kv_retained": s.num_retained,
            "prefix_hits": s.prefix_hits, "prefix_queries": s.prefix_queries,
            "spec_acceptance": accepted / drafted if drafted else 0.0, "time": time.time(),
        }


class Arrival:
    """One request between the HTTP side receiving it and `ServingEngine.submit` (or its refusal): while
    any is open, an idle engine holds its first step (module doc). `close` is idempotent and wakes
    the engine to count again."""

    def __init__(self, engine: ServingEngine):
        self._engine = engine
        self._open = True
        with engine._arriving_lock:
            engine._arriving += 1

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        engine = self._engine
        with engine._arriving_lock:
            engine._arriving -= 1
        engine._inbox.put(_ARRIVED)


def _call_all(batch: list[tuple[Callable[[RequestOutput], None], RequestOutput]]) -> None:
    for sink, out in batch:
        try:
            sink(out)
        except Exception:  # one broken consumer must not starve the others
            log.exception("delivering output of %s failed", out.request_id)
