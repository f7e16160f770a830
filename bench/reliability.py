"""Reliability (issue 17): hostile files, a schema-driven fuzzer, load with disconnects, SIGTERM and SIGKILL.

    python bench/reliability.py            # the full run
    python bench/reliability.py --quick    # about a minute

Server parts, on the reference model (SmolLM2-135M Q4_1, llama.cpp, 1 thread):
- schemathesis over the server's own /openapi.json, every operation, positive and negative cases
  (tests/server_harness.fuzz_api): "schemathesis_cases", "server_5xx" (goal 0), "schemathesis_failures".
- "load": requests at concurrency 32 through the official `openai` client, every 10th client hanging
  up after its first chunk; "lost" (goal 0) counts failed or wrong answers, "kv_used_after" (goal 0).
- "sigterm": `edgefinfer serve` with 32 streams running gets SIGTERM: exit code (goal 0), streams lost
  (goal 0), how they ended, the 503 a new request got; with the default grace and with a short one
  that ends the streams with finish_reason "abort".
- "sigkill_restart": SIGKILL mid-stream, then the server starts again on the same port and answers.
File parts ("bundle_mutations", "bundle_refused", "tracebacks", "kill9_trials", "bad_destinations",
"disk_full", ...) come from bench/reliability_files.py.

Writes bench/results/reliability.json (reliability-quick.json with --quick).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import machine, print_table, versions, write_results  # noqa: E402

MODEL = "smollm2-135m"


def step(title: str) -> float:
    print(f"== {title}", flush=True)
    return time.perf_counter()


def file_parts(quick: bool) -> dict:
    try:
        from bench import reliability_files
    except ImportError as e:
        print(f"   bench/reliability_files.py is not importable ({e}); the file parts are left out", flush=True)
        return {"files": f"not run: {e}"}
    return reliability_files.run(quick)


def server_parts(quick: bool, workdir: Path) -> dict:
    from edgefinfer.server_gpu.api import create_app
    from edgefinfer.server_gpu.launch import BackgroundServer
    from edgefinfer.server_gpu.loader import ServeOptions, build_engine
    from tests.server_harness import fuzz_api, kill9_restart, load_with_disconnects, sigterm_under_load

    out: dict = {}
    # Two operations with bodies x two modes x examples, plus the three GETs: >= 1000 cases in the full run.
    examples = 25 if quick else 300
    t0 = step(f"schemathesis: {examples} examples per operation and mode")
    engine, name = build_engine(ServeOptions(MODEL, max_num_seqs=16, max_model_len=64, threads=1))
    with BackgroundServer(create_app(engine, name)) as srv:
        fuzz = fuzz_api(srv.url, name, examples)
    out.update(schemathesis_cases=fuzz["cases"], server_5xx=fuzz["server_5xx"],
               schemathesis_statuses=fuzz["statuses"], schemathesis_failures=fuzz["failures"],
               schemathesis_s=round(time.perf_counter() - t0, 1))
    print(f"   {fuzz['cases']} cases, {fuzz['server_5xx']} 5xx, {len(fuzz['failures'])} distinct failures, "
          f"statuses {fuzz['statuses']}", flush=True)

    requests = 100 if quick else 500
    step(f"load: {requests} requests at concurrency 32, 10% of clients leaving mid-stream")
    engine, name = build_engine(ServeOptions(MODEL, max_num_seqs=32, max_model_len=256, threads=1))
    with BackgroundServer(create_app(engine, name)) as srv:
        out["load"] = load_with_disconnects(srv.url, name, requests, 32,
                                            progress=lambda done, total: print(f"   {done}/{total}", flush=True))
    print(f"   lost {out['load']['lost']}, dropped {out['load']['dropped']}, "
          f"KV blocks used after {out['load']['kv_used_after']}", flush=True)

    out["sigterm"] = {}
    for label, grace_s, max_tokens in (("default_grace", 20.0, 32), ("short_grace", 1.0, 200)):
        step(f"SIGTERM with 32 streams running, --shutdown-grace-s {grace_s:g}")
        r = sigterm_under_load(MODEL, workdir / f"sigterm-{label}.log", streams=32, max_tokens=max_tokens,
                               grace_s=grace_s, serve_args=("--max-model-len", "256"))
        r["new_request_body"] = r["new_request_body"].get("error", r["new_request_body"])
        out["sigterm"][label] = r
        print(f"   exit {r['exit_code']}, lost {r['lost']}, finish reasons {r['finish_reasons']}, "
              f"new request -> {r['new_request_status']}", flush=True)
    # The keys, from the default-grace run.
    default = out["sigterm"]["default_grace"]
    out["sigterm"].update(exit_code=default["exit_code"], lost=default["lost"], grace_s=default["grace_s"])

    step("SIGKILL mid-stream, then restart on the same port")
    out["sigkill_restart"] = kill9_restart(MODEL, workdir / "sigkill.log")
    print(f"   {out['sigkill_restart']}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a run of about a minute")
    args = ap.parse_args()
    t0 = time.perf_counter()
    payload: dict = {"quick": args.quick, "machine": machine(),
                     "versions": versions("llama_cpp_python", "schemathesis", "hypothesis", "uvicorn", "openai")}
    step("bundles and model files (bench/reliability_files.py)")
    payload.update(file_parts(args.quick))
    with tempfile.TemporaryDirectory(prefix="edgefinfer-reliability-") as tmp:
        payload.update(server_parts(args.quick, Path(tmp)))
    payload["seconds"] = round(time.perf_counter() - t0, 1)
    path = write_results("reliability", payload, quick=args.quick)

    load, term, short = payload["load"], payload["sigterm"], payload["sigterm"]["short_grace"]
    rows = [
        {"check": "schemathesis cases", "value": payload["schemathesis_cases"], "goal": ">= 1000 (full run)"},
        {"check": "server 5xx", "value": payload["server_5xx"], "goal": "0"},
        {"check": "load: requests / dropped", "value": f"{load['requests']} / {load['dropped']}", "goal": "500 / ~10%"},
        {"check": "load: lost", "value": load["lost"], "goal": "0"},
        {"check": "load: KV blocks used after", "value": load["kv_used_after"], "goal": "0"},
        {"check": f"SIGTERM (grace {term['grace_s']:g} s): exit code", "value": term["exit_code"], "goal": "0"},
        {"check": "SIGTERM: streams lost", "value": term["lost"], "goal": "0"},
        {"check": f"SIGTERM (grace {short['grace_s']:g} s): ended 'abort'",
         "value": short["finish_reasons"].get("abort", 0), "goal": "32, exit 0"},
        {"check": "SIGTERM: new request", "value": term["default_grace"]["new_request_status"], "goal": "503"},
        {"check": "SIGKILL + restart: status", "value": payload["sigkill_restart"]["status_after"], "goal": "200"},
    ]
    for key in ("bundle_mutations", "bundle_refused", "tracebacks", "kill9_trials", "bad_destinations", "disk_full"):
        if key in payload:
            rows.append({"check": key, "value": payload[key] if not isinstance(payload[key], dict) else "see JSON",
                         "goal": {"tracebacks": "0", "bad_destinations": "0", "kill9_trials": "10"}.get(key, "")})
    print()
    print_table(rows, ["check", "value", "goal"])
    print(f"\nwrote {path} in {payload['seconds']:.0f} s")


if __name__ == "__main__":
    main()
