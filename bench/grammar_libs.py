"""Which grammar engine for structured output: llguidance or xgrammar, measured on this CPU.

For each of the 50 JSON schemas of bench/structured.py, both engines compile the schema for the
reference model's tokenizer (49,152 tokens), then step through the tokens of a valid instance,
computing the next-token mask before each token (the work a constrained decode adds per token).
Reported: compile time, mask time per token (median and p99 over all tokens), and the one-off
tokenizer set-up. The same instance tokens for both, compact JSON separators for both.

xgrammar is not a dependency of edgefinfer; install it beside the dev environment to run this:

    pip install --target /tmp/xgr --no-deps xgrammar==0.2.8 apache-tvm-ffi
    PYTHONPATH=/tmp/xgr python bench/grammar_libs.py        # writes bench/results/grammar_libs.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, versions, write_results  # noqa: E402
from structured_tasks import example, tasks  # noqa: E402

VOCAB = 49152
STOP_IDS = [2, 0]  # <|im_end|>, <|endoftext|>


def _llguidance(tokenizer, schemas, token_lists):
    from edgefinfer.decoding.structured import Constraint, GrammarCompiler

    t0 = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, VOCAB, STOP_IDS)
    compiler.ll_tokenizer
    setup = time.perf_counter() - t0
    compile_s, mask_s = [], []
    for schema, ids in zip(schemas, token_lists):
        t0 = time.perf_counter()
        matcher = compiler.compile(Constraint.json_schema(schema)).matcher()
        compile_s.append(time.perf_counter() - t0)
        for t in ids:
            t0 = time.perf_counter()
            allowed = matcher.allowed()
            mask_s.append(time.perf_counter() - t0)
            assert allowed[t], "llguidance rejected a valid instance"
            matcher.accept(t)
    return setup, compile_s, mask_s


def _xgrammar(tokenizer, schemas, token_lists):
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    t0 = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend, eos_token="<|im_end|>")
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB, stop_token_ids=STOP_IDS)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    setup = time.perf_counter() - t0
    compile_s, mask_s = [], []
    for schema, ids in zip(schemas, token_lists):
        t0 = time.perf_counter()
        grammar = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
        matcher = xgr.GrammarMatcher(grammar)
        compile_s.append(time.perf_counter() - t0)
        for t in ids:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            # the same unpacking to a [V] bool row as edgefinfer's matcher does
            allowed = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:VOCAB].astype(bool)
            mask_s.append(time.perf_counter() - t0)
            assert allowed[t], "xgrammar rejected a valid instance"
            assert matcher.accept_token(t)
    return setup, compile_s, mask_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10 schemas instead of 50")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    from edgefinfer.model import reference
    from edgefinfer.tokenization.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(reference.pull("smollm2-135m"))
    items = tasks()[: 10 if args.quick else None]
    schemas = [t["schema"] for t in items]
    token_lists = [tokenizer.encode(json.dumps(example(s))) for s in schemas]
    rows = []
    for name, fn in (("llguidance", _llguidance), ("xgrammar", _xgrammar)):
        print(f"{name}: {len(schemas)} schemas, {sum(map(len, token_lists))} tokens ...", flush=True)
        setup, compile_s, mask_s = fn(tokenizer, schemas, token_lists)
        mask_sorted = sorted(mask_s)
        rows.append({"library": name, "tokenizer_setup_s": round(setup, 3),
                     "compile_ms_median": round(statistics.median(compile_s) * 1e3, 3),
                     "compile_ms_max": round(max(compile_s) * 1e3, 3),
                     "mask_us_median": round(statistics.median(mask_s) * 1e6, 1),
                     "mask_us_p99": round(mask_sorted[int(0.99 * (len(mask_sorted) - 1))] * 1e6, 1),
                     "tokens": len(mask_s)})
    print_table(rows, list(rows[0]))
    path = write_results("grammar_libs", {"rows": rows, "schemas": len(schemas), "vocab": VOCAB,
                                          "versions": versions("llguidance", "xgrammar")}, quick=args.quick)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
