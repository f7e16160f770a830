"""llama.cpp's CPU kernels: the portable build the Makefile installs by default against a native one.

    make llama-native                         # builds the native wheel once per CPU (see the Makefile)
    python bench/llamacpp_kernels.py --native-wheel ~/.cache/edgefinfer/wheels/<key>/llama_cpp_python-*.whl

The portable wheel is compiled with -DGGML_NATIVE=OFF: AVX2 code that runs on any x86-64-v3 host,
so pip's wheel cache (keyed on the sdist alone) can hand it to any machine. The native one is
-march=native: AVX-512 / VNNI / BF16 kernels where the CPU has them. Both run the same rows of
bench/runtime.py (ours and llama-cpp-python's high-level API, Q8_0 and Q4_0 GGUFs of the reference
model, `--threads` each), alternating portable / native for `--runs` rounds so that a busy host
slows both alike; each figure is the median of the rounds with its range.

The native wheel is unpacked into a scratch folder put first on PYTHONPATH of the native rounds
(nothing in the venv changes). Writes bench/results/llamacpp_kernels.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, print_table, versions, write_results  # noqa: E402

HERE = Path(__file__).resolve().parent


def cpu_features(python: str, env: dict) -> str:
    out = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"],
                         capture_output=True, text=True, env=env, check=True).stdout
    return " ".join(f.split("=")[0].strip() for f in out.split("|") if f.strip().endswith("= 1"))


def one_round(kind: str, threads: int, env: dict, i: int) -> dict:
    name = f"llamacpp-kernels-{kind}-{i}"
    subprocess.run([sys.executable, str(HERE / "runtime.py"), "--only", "llamacpp", "--threads", str(threads),
                    "--out", name], env=env, check=True, stdout=subprocess.DEVNULL)
    path = RESULTS / f"{name}.json"
    result = json.loads(path.read_text())
    for leftover in RESULTS.glob(f"{name}.*"):
        leftover.unlink()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--native-wheel", required=True, type=Path, help="the wheel `make llama-native` built")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not args.native_wheel.is_file():
        sys.exit(f"no wheel at {args.native_wheel}: run `make llama-native` first")

    site = Path(tempfile.mkdtemp(prefix="llama-native-"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                    str(args.native_wheel)], check=True)
    envs = {"portable": dict(os.environ),
            "native": dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(site),
                                                                                os.environ.get("PYTHONPATH")])))}
    features = {k: cpu_features(sys.executable, e) for k, e in envs.items()}
    rounds: dict[str, list[dict]] = {"portable": [], "native": []}
    for i in range(args.runs):
        for kind, env in envs.items():
            print(f"[kernels] round {i + 1}/{args.runs}: {kind}", file=sys.stderr, flush=True)
            rounds[kind].append(one_round(kind, args.threads, env, i))

    rows = []
    for kind, results in rounds.items():
        for j, first in enumerate(results[0]["rows"]):
            cells = [r["rows"][j] for r in results]
            row = {"build": kind, "engine": first["engine"], "quant": first["quant"]}
            for key in ("decode_tok_s", "prefill_tok_s", "ttft_s"):
                vals = [c[key] for c in cells]
                row[key] = statistics.median(vals)
                row[f"{key}_range"] = [min(vals), max(vals)]
            rows.append(row)
    ratios = []
    for p in (r for r in rows if r["build"] == "portable"):
        n = next(r for r in rows if r["build"] == "native" and (r["engine"], r["quant"]) == (p["engine"], p["quant"]))
        ratios.append({"engine": p["engine"], "quant": p["quant"],
                       "decode_native_over_portable": n["decode_tok_s"] / p["decode_tok_s"],
                       "prefill_native_over_portable": n["prefill_tok_s"] / p["prefill_tok_s"]})
    print_table(rows, ["build", "engine", "quant", "decode_tok_s", "prefill_tok_s", "ttft_s"])
    print_table(ratios, ["engine", "quant", "decode_native_over_portable", "prefill_native_over_portable"])
    write_results("llamacpp_kernels", {
        "rows": rows, "ratios": ratios, "features": features, "runs": args.runs, "threads": args.threads,
        "bandwidth_gb_s": {k: [r["read_bandwidth_gb_s"] for r in v] for k, v in rounds.items()},
        "settings": rounds["portable"][0]["settings"], "machine": machine(), "versions": versions("llama-cpp-python"),
    })


if __name__ == "__main__":
    main()
