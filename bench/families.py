"""Every supported family through every path, on tiny random models built from transformers' classes.

    python bench/families.py            # all seven families, every path (about 10 minutes on 2 cores)
    python bench/families.py --quick    # transformers, ONNX Runtime and llama.cpp only (a few minutes)

Writes bench/results/families.json: one row per family and path with `family`, `path`, `ok`,
`max_abs_logit_err` (against our eager float model on a 12-token prompt; for `transformers`, ours
against theirs) and `tokens_equal` (16 greedy tokens; the peer's own generation loop where it has one).
Paths: `transformers` (the HF folder read by our loader), `llamacpp` (our F32 GGUF in llama.cpp, under
its own architecture name; the tiny config adjusted where llama.cpp hard-codes a choice, see
tests/families.llamacpp_config), `onnxruntime` (the fused static graph), `onnxruntime-genai` (its own
Generator on the exported folder), `executorch` (the .pte on ExecuTorch's runtime, fp32, custom ops).
Family names: llama, qwen2, qwen3, gemma3, phi3, smollm3, mistral. The figures are about exactness of
the paths, not speed; the models are random, so no perplexity is meaningful here.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.families import NAMES, byte_tokenizer, llamacpp_config, random_hf_model, save_hf  # noqa: E402

PROMPT = [1, 17, 33, 5, 99, 64, 12, 7, 81, 40, 3, 120]
NEW_TOKENS = 16
MAX_SEQ = 64
TOLERANCE = {"llamacpp": {"gemma3": 1e-2}}  # llama.cpp's GELU reads an fp16 table (tests/test_families_gguf.py)


def eager_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].float().numpy()


def eager_greedy(model, ids: list[int], n: int = NEW_TOKENS) -> list[int]:
    ids = list(ids)
    for _ in range(n):
        ids.append(int(eager_logits(model, ids)[-1].argmax()))
    return ids[len(PROMPT):]


def backend_row(backend, model) -> tuple[float, bool]:
    """Logit error on the prompt and greedy tokens through edgefinfer's own token loop on `backend`."""
    from edgefinfer.runtime.decode import generate_tokens

    backend.reset()
    got = np.asarray(backend.forward(PROMPT, 0))[-len(PROMPT):]
    err = float(np.abs(got - eager_logits(model, PROMPT)).max())
    backend.reset()
    tokens = list(generate_tokens(backend, PROMPT, NEW_TOKENS))
    return err, tokens == eager_greedy(model, PROMPT)


def path_transformers(name: str, tmp: Path):
    from edgefinfer.model.checkpoint import load_model

    ref = save_hf(name, tmp / "hf")
    ours = load_model(tmp / "hf")
    with torch.no_grad():
        err = float((ours(torch.tensor([PROMPT])) - ref(torch.tensor([PROMPT])).logits).abs().max())
        theirs = ref.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              min_new_tokens=NEW_TOKENS)[0, len(PROMPT):].tolist()
    return err, theirs == eager_greedy(ours, PROMPT)


def path_llamacpp(name: str, tmp: Path):
    from edgefinfer.model.checkpoint import load_model
    from edgefinfer.compile.gguf_export import export_gguf
    from edgefinfer.runtime.backends.llamacpp import LlamaCppBackend

    random_hf_model(llamacpp_config(name), gemma=name == "gemma3").save_pretrained(tmp / "hf-llamacpp")
    ours = load_model(tmp / "hf-llamacpp")
    export_gguf(ours, byte_tokenizer(ours.config.vocab_size), tmp / "m.gguf", "f32")
    backend = LlamaCppBackend(tmp / "m.gguf", n_ctx=MAX_SEQ, threads=1)  # F32 KV cache
    return backend_row(backend, ours)


def _model(name: str, tmp: Path):
    from edgefinfer.model.checkpoint import load_model

    if not (tmp / "hf").is_dir():
        save_hf(name, tmp / "hf")
    return load_model(tmp / "hf")


def path_onnxruntime(name: str, tmp: Path):
    from edgefinfer.compile.onnx_export import export_onnx
    from edgefinfer.runtime.engine import open_backend

    model = _model(name, tmp)
    export_onnx(model, tmp / "onnx", max_seq_len=MAX_SEQ)
    byte_tokenizer(model.config.vocab_size).save(tmp / "onnx")  # the runtime loads a tokenizer beside it
    backend, _, _ = open_backend(tmp / "onnx" / "model.onnx", "onnxruntime", threads=1)
    return backend_row(backend, model)


def path_genai(name: str, tmp: Path):
    import onnxruntime_genai as og

    model = _model(name, tmp)
    if not (tmp / "onnx" / "genai_config.json").is_file():
        from edgefinfer.compile.onnx_export import export_onnx

        export_onnx(model, tmp / "onnx", max_seq_len=MAX_SEQ)
    config = og.Config(str(tmp / "onnx"))
    config.overlay('{"model": {"decoder": {"session_options": {"intra_op_num_threads": 1}}}}')
    genai = og.Model(config)
    params = og.GeneratorParams(genai)
    params.set_search_options(do_sample=False, max_length=len(PROMPT) + NEW_TOKENS)
    gen = og.Generator(genai, params)
    gen.append_tokens(PROMPT)
    got = []
    while not gen.is_done():
        gen.generate_next_token()
        got.append(int(gen.get_next_tokens()[0]))
    want = eager_greedy(model, PROMPT)
    eos = set(model.config.eos_token_ids)
    stop = next((i for i, t in enumerate(want) if t in eos), None)  # genai stops at an end token
    return None, got == (want if stop is None else want[: stop + 1])


def path_executorch(name: str, tmp: Path):
    from edgefinfer.compile.executorch_export import export_pte
    from edgefinfer.runtime.engine import open_backend

    model = _model(name, tmp)
    export_pte(model, tmp / "model.pte", recipe="fp32", max_seq_len=MAX_SEQ, progress=False, cache=False)
    byte_tokenizer(model.config.vocab_size).save(tmp)
    backend, _, _ = open_backend(tmp / "model.pte", "executorch", threads=1)
    return backend_row(backend, model)


PATHS = {"transformers": path_transformers, "llamacpp": path_llamacpp, "onnxruntime": path_onnxruntime,
         "onnxruntime-genai": path_genai, "executorch": path_executorch}
QUICK = ("transformers", "llamacpp", "onnxruntime")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="transformers, ONNX Runtime and llama.cpp only")
    ap.add_argument("--families", default=",".join(NAMES))
    ap.add_argument("--out", default="families")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import transformers

    transformers.utils.logging.disable_progress_bar()  # "Writing model shards" per saved folder
    paths = QUICK if args.quick else tuple(PATHS)
    rows = []
    t0 = time.perf_counter()
    for name in args.families.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            for path in paths:
                t = time.perf_counter()
                try:
                    err, equal = PATHS[path](name, Path(tmp))
                    limit = TOLERANCE.get(path, {}).get(name, 1e-3)
                    ok = bool(equal) and (err is None or err < limit)
                    row = {"family": name, "path": path, "ok": ok, "max_abs_logit_err": err, "tokens_equal": equal}
                except Exception as e:  # a path that fails is a row, not the end of the benchmark
                    traceback.print_exc()
                    row = {"family": name, "path": path, "ok": False, "max_abs_logit_err": None,
                           "tokens_equal": False, "error": f"{type(e).__name__}: {e}"[:300]}
                row["seconds"] = round(time.perf_counter() - t, 1)
                rows.append(row)
                err = row["max_abs_logit_err"]
                print(f"{name:<8} {path:<18} {'ok' if row['ok'] else 'FAIL':<5} "
                      f"err {'-' if err is None else f'{err:.1e}':>8}  tokens equal {row['tokens_equal']}  "
                      f"{row['seconds']:.1f}s", flush=True)
    out = Path(__file__).parent / "results" / f"{args.out}.json"
    result = {"command": "python bench/families.py" + (" --quick" if args.quick else ""),
              "torch_threads": 1, "prompt_tokens": len(PROMPT), "new_tokens": NEW_TOKENS,
              "all_ok": all(r["ok"] for r in rows), "wall_s": round(time.perf_counter() - t0, 1), "rows": rows}
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{sum(r['ok'] for r in rows)}/{len(rows)} rows ok; wrote {out}")


if __name__ == "__main__":
    main()
