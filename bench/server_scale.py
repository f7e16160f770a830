"""Past one process: `edgefinfer serve --replicas 2 --threads 1` on Ray Serve, routed by prompt prefix
and round-robin, against one `edgefinfer serve --threads 2` process; same GGUF, same client, same chats.

    python bench/server_scale.py           # 3 repeats per arm, 32 output tokens (7 minutes on a quiet 2-core host)
    python bench/server_scale.py --quick   # 1 repeat, 16 output tokens, no plot (a few minutes)

Workload: 64 chats in SmolLM2's chat template, each a system turn from 4 distinct 512-token system
prompts (16 chats each, in a fixed shuffled order so that no balancer meets them in a pattern) and a
user question that is new in every run (bench/server.py's "{tag}": the system prompts are warm, as a
deployed assistant's are; the questions are not); greedy, end-of-sequence banned, `--max-tokens`
tokens each, closed loop with 16 clients; bench/server.py's client, prompts and counting.

Arms, one at a time (one Ray instance at a time, each started once per arm, its repeats back to back):
- `affinity`: `--replicas 2 --threads 1` (prefix routing, the default);
- `round-robin`: `--replicas 2 --threads 1 --routing round-robin`;
- `single`: one process, `--threads 2`.
Every engine at bench/server.py's capacity (16 sequences of 2048 tokens) and the server's defaults
otherwise. Per run: output tokens/s, TTFT p50/p99, and the prefix-cache hit rate of that run (prompt
tokens served from a prefix cache / looked up, from the counters in /metrics before and after it,
summed over replicas); rows hold medians of the repeats.

Then the fault run, on the affinity arm: the same 64 chats, and the replica with the most requests in
flight SIGKILLed when 32 have finished. Each request ends `done` ([DONE] after all its tokens), with an `error` event, as an HTTP
error, or `hung` (no end within --hung-after-s); also the seconds until /metrics lists a new replica
and until that replica has served a request.

Writes bench/results/server_scale.json (and .png). The host is shared: throughput is noisy (uptime is
recorded before and after); the hit rates and the fault figures are the point.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench.server as sb  # noqa: E402
from bench.common import RESULTS, machine, print_table, result_stem, uptime, versions, write_results  # noqa: E402

CHATS = 64
CLIENTS = 16
SYSTEM_TOKENS = 512
# Four assistants whose system prompts differ from their first word: four prefix keys.
SYSTEM_SEEDS = (
    sb.SYSTEM_SEED,
    "Kitchen helper for a school canteen: suggest recipes from the week's stock, list allergens first, scale "
    "every quantity to the number of pupils, and say when a dish cannot be made from what is in store. ",
    "Travel desk of a regional railway. Quote timetables only from the published tables, give platform "
    "numbers when known, offer the next two connections, and mention step-free access where it exists. ",
    "Reviewer of Python pull requests: point at the line, name the bug or the risk, propose the smallest "
    "fix, prefer the standard library, and never approve code whose tests you have not seen pass. ",
)
ARM_NAMES = ("affinity", "round-robin", "single")


def arm_flags(replicas: int, threads: int, single_threads: int) -> dict[str, tuple[int, list[str]]]:
    """Each arm's threads per engine and its flags (here: 2 engines of 1 thread, or 1 of 2)."""
    return {"affinity": (threads, ["--replicas", str(replicas), "--routing", "prefix"]),
            "round-robin": (threads, ["--replicas", str(replicas), "--routing", "round-robin"]),
            "single": (single_threads, [])}
REPORT_WAIT_S = 1.5  # replicas push their counters every 0.5 s: three periods


def chat(tokenizer, system: str, question: str) -> str:
    return tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": question}])


def chats(tokenizer, systems: list[str]) -> sb.Workload:
    """The 64 chat prompts: 16 per system prompt, in a fixed shuffled order; "{tag}" makes each run's
    questions new."""
    prompts = [chat(tokenizer, systems[i % len(systems)], "{tag}" + sb.PROMPTS[i % len(sb.PROMPTS)])
               for i in range(CHATS)]
    random.Random(0).shuffle(prompts)
    return sb.Workload("chats", tuple(prompts), (CLIENTS,), CHATS // CLIENTS, CHATS)


# ------------------------------------------------------------------------------------------ metrics
def prefix_counters(url: str) -> dict[str, tuple[int, int]]:
    """(prefix hits, lookups) in prompt tokens, per replica (the ingress's /metrics) or for the one
    process (key "single")."""
    text = httpx.get(url + "/metrics", timeout=30).text
    per = collections.defaultdict(lambda: [0, 0])
    for m in re.finditer(r'^edgefinfer_replica_prefix_cache_(hits|queries)_total\{replica="([^"]+)"\} (\S+)$', text, re.M):
        per[m[2]][m[1] == "queries"] = int(float(m[3]))
    for m in re.finditer(r"^edgefinfer_prefix_cache_(hits|queries)_total (\S+)$", text, re.M):
        per["single"][m[1] == "queries"] = int(float(m[2]))
    return {k: (v[0], v[1]) for k, v in per.items()}


def replica_gauge(url: str, name: str) -> dict[str, int]:
    """One per-replica figure of the ingress's /metrics, by replica id."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {m[1]: int(float(m[2])) for m in
            re.finditer(rf'^edgefinfer_replica_{name}\{{replica="([^"]+)"\}} (\S+)$', text, re.M)}


def replica_requests(url: str) -> dict[str, int]:
    return replica_gauge(url, "requests_total")


def hit_rate(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> float:
    """Hits over lookups of the prompts sent between two readings, summed over replicas."""
    hits = sum(h - before.get(k, (0, 0))[0] for k, (h, _) in after.items())
    queries = sum(q - before.get(k, (0, 0))[1] for k, (_, q) in after.items())
    return round(hits / queries, 4) if queries else 0.0


# ------------------------------------------------------------------------------------------ processes
def busiest_replica(url: str) -> tuple[int, int]:
    """(pid, requests in flight) of the replica with the most requests running or waiting now: the one
    whose death tests the most."""
    running, waiting, pids = (replica_gauge(url, n) for n in ("requests_running", "requests_waiting", "pid"))
    busiest = max(pids, key=lambda r: (running.get(r, 0) + waiting.get(r, 0), r))
    return pids[busiest], running.get(busiest, 0) + waiting.get(busiest, 0)


def wait_replicas(url: str, n: int, timeout_s: float = 300) -> None:
    """Until all `n` replicas report (the first one answers requests while the others still load: a
    run begun then would see one replica), and Ray's routers have heard of the last."""
    deadline = time.monotonic() + timeout_s
    while len(replica_requests(url)) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{n} replicas did not come up in {timeout_s:g} s")
        time.sleep(0.5)
    time.sleep(2.0)


@contextlib.contextmanager
def arm_server(arm: str, threads: int, flags: list[str], gpu_layers: int, gguf: Path, banned: tuple[int, ...],
               log: Path):
    """One arm's server; on the way out (failure included) it and every process it started are gone,
    Ray's among them."""
    port = sb.free_port()
    argv = sb.ours_argv(gguf, port, threads, gpu_layers) + flags
    server = sb.ServerProcess("edgefinfer", arm, argv, port, env=sb.OURS_ENV, log=log,
                              body={"logit_bias": {str(t): -100 for t in banned}})
    family: set[psutil.Process] = set()
    try:
        with server:
            family |= set(psutil.Process(server.proc.pid).children(recursive=True))
            if "--replicas" in flags:
                wait_replicas(server.url, int(flags[flags.index("--replicas") + 1]))
                family |= set(psutil.Process(server.proc.pid).children(recursive=True))
            yield server
            with contextlib.suppress(psutil.NoSuchProcess):
                family |= set(psutil.Process(server.proc.pid).children(recursive=True))
    finally:
        for p in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


# ------------------------------------------------------------------------------------------ runs
def measured_run(server: sb.ServerProcess, work: sb.Workload, max_tokens: int, tokenizer, run_index: int) -> dict:
    before = prefix_counters(server.url)
    requests_before = replica_requests(server.url)
    run = sb.measure(server, work, CLIENTS, max_tokens, tokenizer, run_index)
    time.sleep(REPORT_WAIT_S)
    after = prefix_counters(server.url)
    split = {k: v - requests_before.get(k, 0) for k, v in replica_requests(server.url).items()}
    run |= {"prefix_hit_rate": hit_rate(before, after), "requests_per_replica": sorted(split.values()),
            "prefix_hit_rate_per_replica": sorted(hit_rate({k: before.get(k, (0, 0))}, {k: v})
                                                  for k, v in after.items())}
    print(f"    prefix hit rate {run['prefix_hit_rate']}, requests per replica {run['requests_per_replica']}",
          flush=True)
    return run


async def _outcome(client: httpx.AsyncClient, server: sb.ServerProcess, prompt: str, max_tokens: int,
                   hung_after_s: float) -> dict:
    try:
        r = await asyncio.wait_for(sb.one_request(client, server, prompt, max_tokens), hung_after_s)
    except asyncio.TimeoutError:
        return {"outcome": "hung"}
    except httpx.HTTPStatusError as e:
        return {"outcome": f"http {e.response.status_code}"}
    except httpx.HTTPError as e:
        return {"outcome": f"transport error ({type(e).__name__})"}
    outcome = "error event" if r["error"] else "done" if r["done"] else "ended without [DONE]"
    return {"outcome": outcome, **r}


async def _probe_new_replica(server: sb.ServerProcess, old: set[str], t_kill: float, deadline_s: float) -> dict:
    """Seconds from the kill until /metrics lists a replica that was not there before, and until it has
    served a request (short prompts: no prefix key, so they go to the least loaded replica, the new one)."""
    listed = served = None
    async with httpx.AsyncClient(timeout=60) as client:
        while served is None and time.monotonic() - t_kill < deadline_s:
            counts = replica_requests(server.url)
            new = {k: v for k, v in counts.items() if k not in old}
            if new and listed is None:
                listed = round(time.monotonic() - t_kill, 1)
            if any(new.values()):
                served = round(time.monotonic() - t_kill, 1)
                break
            if new:
                await asyncio.gather(*[sb.one_request(client, server, p, 4) for p in sb.PROMPTS[:4]])
            await asyncio.sleep(0.5)
    return {"replacement_listed_s": listed, "replacement_served_s": served}


def fault_run(server: sb.ServerProcess, work: sb.Workload, max_tokens: int, tokenizer, run_index: int,
              hung_after_s: float) -> dict:
    """The chats with one replica SIGKILLed once half of them have finished."""
    prompts = sb.run_prompts(work, run_index, CHATS, tokenizer)
    old = set(replica_requests(server.url))
    results: list[dict] = []
    killed: dict = {}

    async def run() -> dict:
        queue, kill = list(prompts), asyncio.Event()

        async def worker(client: httpx.AsyncClient) -> None:
            while queue:
                results.append(await _outcome(client, server, queue.pop(0), max_tokens, hung_after_s))
                if len(results) == CHATS // 2 and not kill.is_set():
                    kill.set()
                    killed["pid"], killed["in_flight"] = busiest_replica(server.url)
                    psutil.Process(killed["pid"]).kill()
                    killed["t"] = time.monotonic()

        async def replacement() -> dict:
            await kill.wait()
            return await _probe_new_replica(server, old, killed["t"], 180)

        async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=CLIENTS + 8)) as client:
            t0 = time.perf_counter()
            probe = asyncio.create_task(replacement())
            await asyncio.gather(*[worker(client) for _ in range(CLIENTS)])
            wall = time.perf_counter() - t0
            return {"wall_s": round(wall, 2), **await asyncio.wait_for(probe, 240)}

    out = asyncio.run(run())
    outcomes = collections.Counter(r["outcome"] for r in results)
    done = [r for r in results if r["outcome"] == "done"]
    tokens = sum(len(tokenizer.encode(r["text"])) for r in results if "text" in r)
    print(f"  fault run: {dict(outcomes)}; replacement listed after {out['replacement_listed_s']} s, serving after "
          f"{out['replacement_served_s']} s", flush=True)
    return {"requests": len(results), "outcomes": dict(outcomes), "hung": outcomes.get("hung", 0),
            "completed": len(done), "killed_after_requests": CHATS // 2, "killed_pid": killed.get("pid"),
            "killed_replica_in_flight": killed.get("in_flight"), "replicas_before": len(old), "output_tokens": tokens,
            "tok_s": round(tokens / out["wall_s"], 2), **out,
            "every_request_done_or_error_event": set(outcomes) <= {"done", "error event"}}


def median_row(arm: str, runs: list[dict]) -> dict:
    mine = [r for r in runs if r["arm"] == arm]
    med = {k: round(statistics.median(r[k] for r in mine), 4)
           for k in ("tok_s", "ttft_p50_s", "ttft_p99_s", "prefix_hit_rate")}
    return {"arm": arm, **med, "tok_s_min": min(r["tok_s"] for r in mine), "tok_s_max": max(r["tok_s"] for r in mine),
            "runs": len(mine), "requests": mine[0]["requests"], "retries": sum(r["retries"] for r in mine)}


def arms_title(flags: dict[str, tuple[int, list[str]]], arms: list[str]) -> str:
    return " / ".join(f"{arm}: --threads {flags[arm][0]} {' '.join(flags[arm][1])}".strip() for arm in arms)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    names = [r["arm"] for r in rows]
    for ax, key, heading in ((axes[0], "prefix_hit_rate", "prefix-cache hit rate"),
                           (axes[1], "tok_s", "output tokens/s"), (axes[2], None, "TTFT p50 / p99, s")):
        if key:
            ax.bar(names, [r[key] for r in rows], color=["C0", "C1", "C2"][: len(rows)])
        else:
            xs = range(len(rows))
            ax.bar([x - 0.2 for x in xs], [r["ttft_p50_s"] for r in rows], 0.4, label="p50")
            ax.bar([x + 0.2 for x in xs], [r["ttft_p99_s"] for r in rows], 0.4, label="p99")
            ax.set_xticks(list(xs), names)
            ax.legend(fontsize=8)
        ax.set_title(heading)
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_ylim(0, 1)
    fig.suptitle(f"{CHATS} chats over {len(SYSTEM_SEEDS)} system prompts of {SYSTEM_TOKENS} tokens, C = {CLIENTS}: "
                 f"{title}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 repeat per arm, 16 output tokens")
    ap.add_argument("--repeats", type=int, default=None, help="runs per arm (default 3; 1 with --quick)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per chat (default 32, 16 quick)")
    ap.add_argument("--arms", default=",".join(ARM_NAMES), help="comma-separated subset of " + ", ".join(ARM_NAMES))
    ap.add_argument("--replicas", type=int, default=2, help="replicas of the two Ray arms")
    ap.add_argument("--threads", type=int, default=1, help="threads per replica")
    ap.add_argument("--single-threads", type=int, default=2, help="threads of the single process")
    ap.add_argument("--gpu-layers", type=int, default=0,
                    help="layers offloaded, every engine (CUDA builds; each replica then takes one GPU)")
    ap.add_argument("--model", default=None, help="GGUF file (default: the shipped SmolLM2-135M Q4_1)")
    ap.add_argument("--out", default="server_scale")
    ap.add_argument("--no-fault", action="store_true", help="skip the killed-replica run")
    ap.add_argument("--hung-after-s", type=float, default=300.0, help="a request not ended by then counts as hung")
    args = ap.parse_args()
    # A SIGTERM (`timeout`, CI) unwinds like Ctrl-C: every server and Ray process is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from edgefinfer.model import reference
    from edgefinfer.model.gguf_import import open_gguf, tokenizer_from_gguf

    gguf = Path(args.model) if args.model else reference.gguf_path("smollm2-135m")
    meta = open_gguf(gguf)
    tokenizer = tokenizer_from_gguf(meta)
    banned = sb.end_tokens(meta, tokenizer)
    repeats = args.repeats or (1 if args.quick else 3)
    max_tokens = args.max_tokens or (16 if args.quick else 32)
    systems = [sb.text_of_tokens(tokenizer, seed, SYSTEM_TOKENS) for seed in SYSTEM_SEEDS]
    work = chats(tokenizer, systems)
    flags = arm_flags(args.replicas, args.threads, args.single_threads)
    arms = [a for a in args.arms.split(",") if a in flags]
    logs = Path(tempfile.gettempdir()) / "edgefinfer-server-scale"  # each server's stderr (Ray's among it)
    logs.mkdir(parents=True, exist_ok=True)
    uptime_before, t0 = uptime(), time.time()
    print(f"server logs in {logs}; model {gguf.name}, {CHATS} chats at C = {CLIENTS}, {max_tokens} tokens, {repeats} repeat(s); "
          f"{uptime_before}", flush=True)
    runs: list[dict] = []
    fault: dict = {}
    uptimes: dict[str, list[str]] = {}

    def results(done: list[str]) -> tuple[list[dict], dict, Path]:
        """Rows, summary and the JSON written, with the arms `done` so far (a run cut short keeps them)."""
        rows = [median_row(arm, runs) for arm in done]
        by_arm = {r["arm"]: r for r in rows}
        summary = {
            "prefix_hit_rate_affinity": by_arm.get("affinity", {}).get("prefix_hit_rate"),
            "prefix_hit_rate_round_robin": by_arm.get("round-robin", {}).get("prefix_hit_rate"),
            "prefix_hit_rate_single": by_arm.get("single", {}).get("prefix_hit_rate"),
            "hung_after_kill": fault.get("hung"),
            "every_request_done_or_error_event_after_kill": fault.get("every_request_done_or_error_event"),
            "replacement_served_s": fault.get("replacement_served_s"),
            **{arm.replace("-", "_"): {k: r[k] for k in ("tok_s", "ttft_p50_s", "ttft_p99_s")} for arm, r in by_arm.items()},
        }
        if "affinity" in by_arm:
            summary["goal_hit_rate_affinity_ge_0.9"] = by_arm["affinity"]["prefix_hit_rate"] >= 0.9
        payload = {"summary": summary, "rows": rows, "fault": fault, "all_runs": runs,
                   "workload": {"chats": CHATS, "clients": CLIENTS, "system_prompts": len(SYSTEM_SEEDS),
                                "system_prompt_tokens": SYSTEM_TOKENS, "max_tokens": max_tokens,
                                "prompt": "SmolLM2 chat template: system turn + a user question new in every run"},
                   "arms": {arm: arms_title(flags, [arm]).split(": ", 1)[1] for arm in done},
                   "gpu_layers": args.gpu_layers,
                   "engine_flags": "bench/server.py's: --max-num-seqs 16 --max-model-len 2048, the defaults otherwise",
                   "quick": args.quick, "repeats": repeats,
                   "repeats_note": "each arm's repeats run back to back on one server (a Ray instance starts once "
                                   "per arm); arms run one after another, so the host's load can differ between arms",
                   "model": gguf.name, "machine": machine(), "uptime_before": uptime_before, "uptime_by_arm": uptimes,
                   "uptime_after": uptime(), "versions": versions("llama-cpp-python", "ray", "fastapi", "httpx"),
                   "elapsed_s": round(time.time() - t0, 1)}
        payload["complete"] = done == arms
        return rows, summary, write_results(args.out, payload, quick=args.quick)

    for i, arm in enumerate(arms):
        started = time.monotonic()
        with arm_server(arm, *flags[arm], args.gpu_layers, gguf, banned, logs / f"{args.out}-{arm}.log") as server:
            startup_s = round(time.monotonic() - started, 1)
            print(f"{arm}: up in {startup_s} s", flush=True)
            uptimes[arm] = [uptime()]
            # Each system prompt seen once before the first measured run, through the arm's routing.
            asyncio.run(sb.run_level(server, [chat(tokenizer, s, "Hello.") for s in systems], 1, 2))
            for rep in range(repeats):
                run = measured_run(server, work, max_tokens, tokenizer, len(runs))
                runs.append({"arm": arm, "repeat": rep, "startup_s": startup_s, **run})
            if arm == "affinity" and not args.no_fault:
                fault = fault_run(server, work, max_tokens, tokenizer, len(runs) + 100, args.hung_after_s)
            uptimes[arm].append(uptime())
        if i < len(arms) - 1:
            results(arms[: i + 1])
    rows, summary, path = results(arms)
    print_table(rows, ["arm", "prefix_hit_rate", "tok_s", "tok_s_min", "tok_s_max", "ttft_p50_s", "ttft_p99_s", "runs"])
    for k, v in summary.items():
        print(f"  {k}: {v}")
    if not args.quick:
        png = RESULTS / f"{result_stem(args.out, False)}.png"
        plot(rows, png, arms_title(flags, arms))
        print(f"wrote {png}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
