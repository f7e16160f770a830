"""Where a decode step's time goes: the android .pte (ExecuTorch's ETDump, XNNPACK's own op events)
beside onnxruntime-genai's int4 (ONNX Runtime's profiler), same prompt, same thread count.

    python bench/android_profile.py [--bundle dist/android] [--threads 1] [--steps 32]

bench/android_speed.py says how fast each engine decodes; this says why. Each engine runs in its own
process with its profiler on: a 128-token prompt, then `--steps` decode steps, whose events are summed
by kind and divided by the steps (ms per decode step). Kinds, ours:
- `int4 linears` (XNNPACK's QD8 x QB4W fully connected), `int8 linears` (QD8 x QC8W: the output head),
  `float linears` (F32: a float zero point's group offsets, float channels), `quantize activations`
  (XNNPACK's F32 -> QD8 convert), `other delegated` (XNNPACK's remaining ops);
- `attention (custom_sdpa)`, `cache update`, `other operators`: ExecuTorch's kernels outside XNNPACK;
- `delegate call overhead`: each XNNPACK call's time beyond its ops' (92 calls a step on SmolLM2);
- `runtime overhead`: Method::execute beyond its delegate and operator calls.
genai's: `int4 linears` (MatMulNBits, the head included: its builder quantizes lm_head too),
`attention` (GroupQueryAttention), `other nodes`, `runtime overhead` (a run beyond its nodes; genai's
own work between runs is not in ORT's trace). The profilers add their own cost, so the totals here are
above bench/android_speed.py's; compare the kinds, not the totals, with that file.

Writes bench/results/android_profile.json and android_profile.png (one stacked bar per engine).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, print_table, versions, write_results  # noqa: E402

HERE = Path(__file__).resolve()
XNNPACK_KINDS = (  # (prefix of XNNPACK's operator event, kind); the first that matches
    ("Fully Connected (NC, QD8, F32, QB4W)", "int4 linears"),
    ("Fully Connected (NC, QD8, F32, QC4W)", "int4 linears"),
    ("Fully Connected (NC, QD8, F32, QC8W)", "int8 linears"),
    ("Fully Connected (NC, F32)", "float linears"),
    ("Convert (NC, F32, QD8)", "quantize activations"),
)
ET_OPERATOR_KINDS = {"llama::custom_sdpa.out": "attention (custom_sdpa)", "llama::update_cache.out": "cache update"}
ORT_KINDS = {"MatMulNBits": "int4 linears", "GroupQueryAttention": "attention"}


def kind_of_xnnpack(name: str) -> str:
    return next((kind for prefix, kind in XNNPACK_KINDS if name.startswith(prefix)), "other delegated")


# ---- children (one engine each, its own process) --------------------------------------------------------

def child_ours(pte: str, prompt: list[int], steps: int, threads: int) -> dict[str, float]:
    """ms per decode step by kind, from an ETDump of `steps` decode calls after the prompt's."""
    import torch

    from edgefinfer.runtime.backends.executorch import register_kernels, runtime_module, set_threads
    from executorch.devtools import Inspector

    register_kernels()
    set_threads(threads)
    module = runtime_module()._load_for_executorch(pte, enable_etdump=True, debug_buffer_size=0)
    token, pos = int(module.forward([torch.tensor([prompt]), torch.tensor([0])])[0][0, -1].argmax()), len(prompt)
    for _ in range(steps):
        token = int(module.forward([torch.tensor([[token]]), torch.tensor([pos])])[0][0, -1].argmax())
        pos += 1
    with tempfile.TemporaryDirectory() as tmp:
        etdump = Path(tmp) / "decode.etdp"
        module.write_etdump_result_to_file(str(etdump), str(Path(tmp) / "debug.bin"))
        blocks = Inspector(etdump_path=str(etdump)).event_blocks
    totals: dict[str, float] = collections.defaultdict(float)  # ms over the decode steps
    for block in blocks:
        for event in block.events:
            samples = event.perf_data.raw if event.perf_data is not None else []
            if len(samples) <= steps:  # the load's events; each decode-time event has prompt + steps samples
                continue
            totals[event.name] += sum(samples[-steps:])  # ms; the first sample is the prompt's call
    kinds: dict[str, float] = collections.defaultdict(float)
    delegated = 0.0
    for name, ms in totals.items():
        if name in ("Method::execute", "DELEGATE_CALL", "OPERATOR_CALL") or name.startswith("native_call_"):
            continue
        if name in ET_OPERATOR_KINDS:
            kinds[ET_OPERATOR_KINDS[name]] += ms
        else:  # XNNPACK's own events, inside the delegate calls
            kinds[kind_of_xnnpack(name)] += ms
            delegated += ms
    operators = totals["OPERATOR_CALL"] - sum(totals[n] for n in ET_OPERATOR_KINDS)
    kinds["other operators"] += max(operators, 0.0)
    kinds["delegate call overhead"] += max(totals["DELEGATE_CALL"] - delegated, 0.0)
    kinds["runtime overhead"] += max(totals["Method::execute"] - totals["DELEGATE_CALL"] - totals["OPERATOR_CALL"], 0.0)
    return {k: v / steps for k, v in kinds.items()}


def child_genai(folder: str, prompt: list[int], steps: int, threads: int) -> dict[str, float]:
    """ms per decode step by kind, from ONNX Runtime's trace of genai's decoder session."""
    import numpy as np
    import onnxruntime_genai as og

    with tempfile.TemporaryDirectory() as tmp:
        prefix = str(Path(tmp) / "ort")
        config = og.Config(folder)
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": threads, "inter_op_num_threads": 1, "enable_profiling": prefix}}}}))
        model = og.Model(config)
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + steps + 1, min_length=len(prompt) + steps + 1,
                                  do_sample=False)
        gen = og.Generator(model, params)
        gen.append_tokens(np.array(prompt, dtype=np.int32))
        gen.generate_next_token()
        while not gen.is_done():
            gen.generate_next_token()
        del gen, params, model  # the trace is written when the session closes
        trace = json.loads(Path(sorted(glob.glob(prefix + "*.json"))[-1]).read_text())
    runs = sorted((e for e in trace if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: e["ts"])[-steps:]  # the decode steps' runs (the prompt's is first)
    start = runs[0]["ts"]
    kinds: dict[str, float] = collections.defaultdict(float)
    nodes = 0.0
    for e in trace:
        if e.get("cat") != "Node" or e["ts"] < start or not e["name"].endswith("_kernel_time"):
            continue
        ms = e["dur"] / 1000.0
        kinds[ORT_KINDS.get(e["args"].get("op_name"), "other nodes")] += ms
        nodes += ms
    kinds["runtime overhead"] += max(sum(r["dur"] for r in runs) / 1000.0 - nodes, 0.0)
    return {k: v / steps for k, v in kinds.items()}


# ---- the run ------------------------------------------------------------------------------------------------

def profile(child: str, path: Path, prompt_file: Path, steps: int, threads: int) -> dict[str, float]:
    from runtime import engine_env

    proc = subprocess.run([sys.executable, str(HERE), "--child", child, "--path", str(path), "--prompt-file",
                           str(prompt_file), "--steps", str(steps), "--threads", str(threads)],
                          capture_output=True, text=True, env=engine_env(child, threads), timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{child} failed:\n{proc.stderr[-3000:]}")


def plot(engines: dict[str, dict[str, float]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    kinds = list(dict.fromkeys(k for got in engines.values() for k in got))
    colors = plt.cm.tab20(range(len(kinds)))
    fig, ax = plt.subplots(figsize=(10, 3))
    for i, got in enumerate(engines.values()):
        left = 0.0
        for kind, color in zip(kinds, colors):
            ax.barh(i, got.get(kind, 0.0), left=left, color=color)
            left += got.get(kind, 0.0)
    ax.set_yticks(range(len(engines)), list(engines))
    ax.set_xlabel("ms per decode step (profilers on)")
    ax.legend([plt.Rectangle((0, 0), 1, 1, color=c) for c in colors], kinds, fontsize=7,
              loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", default="dist/android")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--child", choices=("ours", "genai"), help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--prompt-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        prompt = json.loads(Path(args.prompt_file).read_text())
        fn = child_ours if args.child == "ours" else child_genai
        print("RESULT " + json.dumps(fn(args.path, prompt, args.steps, args.threads)), flush=True)
        return

    from android_speed import bundle_and_peer

    start_load = [round(x, 2) for x in os.getloadavg()]
    bundle = Path(args.bundle)
    pte, recipe, genai, prompt_file, _ = bundle_and_peer(bundle)
    engines = {f"edgefinfer android ({recipe})": profile("ours", pte, prompt_file, args.steps, args.threads),
               "onnxruntime-genai int4": profile("genai", genai, prompt_file, args.steps, args.threads)}
    kinds = list(dict.fromkeys(k for got in engines.values() for k in got))
    rows = [{"kind": k, **{name: round(got.get(k, 0.0), 3) for name, got in engines.items()}} for k in kinds]
    rows.append({"kind": "total", **{name: round(sum(got.values()), 3) for name, got in engines.items()}})
    print_table(rows, ["kind", *engines])
    plot(engines, RESULTS / "android_profile.png")
    write_results("android_profile", {
        "command": " ".join(["python", "bench/android_profile.py", *sys.argv[1:]]), "threads": args.threads,
        "decode_steps": args.steps, "prompt_tokens": 128, "unit": "ms per decode step, profiler on", "rows": rows,
        "load_avg": {"start": start_load, "end": [round(x, 2) for x in os.getloadavg()]},
        "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(), "versions": versions("executorch", "onnxruntime", "onnxruntime-genai")})


if __name__ == "__main__":
    main()
