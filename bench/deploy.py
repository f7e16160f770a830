"""Deploy check: each target's default bundle, run unmodified by the peer's own runner.

    python bench/deploy.py [--quick] [--targets android,linux-x86_64,gpu-server,qnn] [--tokens N]

Builds every target's default bundle of the shipped model with `edgefinfer build` (ExecuTorch's
program cache makes a rebuild of an unchanged android bundle a copy), then for a plain and a chat
prompt compares (edgefinfer.app.peer_runners.check_bundle):

    android        ExecuTorch's C++ TextLLMRunner (the demo apps' runner) on model.pte + tokenizer.json
    linux-x86_64   onnxruntime-genai's Generator with its own tokenizer and genai_config.json
    gpu-server     llama.cpp's tokenizer, chat template and generation loop from the GGUF (llama-cpp-python)
    qnn            the context binaries on the QNN EP (HTP emulator) vs the CPU EP on the same QDQ graphs

tokens_match: the peer's greedy tokens equal `edgefinfer run`'s; ids_match: its ids of the prompt and
of 20 probe strings (Unicode, digits, spaces, special tokens) equal Hugging Face tokenizers'.
--quick checks bundles of the model cut to its first layer (same tokenizer and vocabulary): a few
minutes (the HTP emulator is the slow part). Writes bench/results/deploy.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_table, versions, write_results  # noqa: E402

TARGETS = ("android", "linux-x86_64", "gpu-server", "qnn")
WORK = Path(__file__).resolve().parent.parent / "dist" / "bench-deploy"


def one_layer_model(folder: Path) -> Path:
    """The reference model cut to its first decoder layer (for --quick)."""
    from edgefinfer.model.checkpoint import load_model, save_model
    from edgefinfer.model.reference import pull

    source = pull("smollm2-135m")
    if not (folder / "config.json").is_file():
        model = load_model(source)
        model.model.layers = model.model.layers[:1]
        model.config = dataclasses.replace(model.config, num_hidden_layers=1)
        save_model(model, folder)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(source / name, folder / name)
    return folder


def build(target: str, model: str, out: Path, eval_tokens: int) -> float:
    t0 = time.perf_counter()
    print(f"[deploy] build {target} -> {out}", file=sys.stderr, flush=True)
    proc = subprocess.run([sys.executable, "-m", "edgefinfer", "build", "--target", target, "--model", model,
                           "-o", str(out), "--eval-tokens", str(eval_tokens)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"build --target {target} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--tokens", type=int, default=None, help="greedy tokens per prompt (default 32, quick 12)")
    args = ap.parse_args()
    from edgefinfer.app.peer_runners import check_bundle
    from edgefinfer.libraries.quiet import quiet

    targets = [t for t in args.targets.split(",") if t]
    tokens = args.tokens or (12 if args.quick else 32)
    work = WORK / ("quick" if args.quick else "full")
    model = str(one_layer_model(work / "smollm2-1layer")) if args.quick else "smollm2-135m"
    rows, build_s = [], {}
    for target in targets:
        bundle = work / target
        build_s[target] = round(build(target, model, bundle, 128 if args.quick else 1024), 1)
        t0 = time.perf_counter()
        print(f"[deploy] run {target} in its peer's runner", file=sys.stderr, flush=True)
        # The HTP emulator runs ~10 s a token and ~45 s a prompt chunk on SmolLM2: fewer tokens there.
        with quiet():  # the runtimes' start-up chatter (ExecuTorch's cpuinfo lines, torchao, the QNN EP)
            checked = check_bundle(bundle, max_new_tokens=min(tokens, 8) if target == "qnn" else tokens)
        rows += [dict(row.to_dict(), check_s=round(time.perf_counter() - t0, 1)) for row in checked]
    print_table(rows, ["target", "runner", "prompt", "tokens_match", "ids_match", "detail"])
    ok = all(r["tokens_match"] and r["ids_match"] for r in rows)
    print(f"\n{'every row matches' if ok else 'MISMATCH: see the rows above'} ({len(rows)} rows)")
    path = write_results("deploy", {
        "model": model, "tokens_per_prompt": tokens, "all_match": ok, "rows": rows, "build_s": build_s,
        "machine": machine(), "versions": versions("executorch", "onnxruntime", "onnxruntime-genai",
                                                   "llama_cpp_python", "pytorch_tokenizers", "onnxruntime-qnn"),
    }, quick=args.quick)
    print(f"wrote {path}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
