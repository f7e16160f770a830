"""Structured output on every backend and on the server: valid JSON for 50 schemas, and what the
grammar mask costs per token.

For each of the 50 JSON-schema prompts of bench/structured_tasks.py (nested objects, enums, arrays,
numbers with ranges; chat template, greedy), each engine generates once with the schema as its
`response_format` and once without:

- valid_rate: replies that parse as JSON and validate against the schema (jsonschema);
- unconstrained_valid_rate: the same judge on the unconstrained reply, given its best chance: its
  first complete {...} object, whatever text or code fences surround it (generation stops there);
- mask_overhead: constrained decode time per token over unconstrained decode time per token, minus 1
  (decode time excludes prefill: stats.decode_s on the device, first-to-last token on the server);
- same_as_engine (server only): replies whose text equals the llama.cpp device Engine's.

Engines: the device Engine on eager torch (the reference model, fp32), ExecuTorch (the android
bundle, 8da4w), ONNX Runtime (the linux-x86_64 bundle, int4) and llama.cpp (the shipped Q4_1 GGUF),
and the server (`edgefinfer serve` in-process, llama.cpp, one request at a time). Bundles come from
dist/ (built with `edgefinfer build --target android|linux-x86_64` when missing). Two threads
everywhere but eager torch, which runs on one (OpenMP's busy-waiting, see the README).

    python bench/structured.py            # 50 prompts, writes bench/results/structured.json
    python bench/structured.py --quick    # 6 prompts, llama.cpp Engine and server only (about a minute)
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_table, versions, write_results  # noqa: E402
from structured_tasks import is_valid, tasks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
THREADS = 2
MAX_TOKENS = 256


def first_object(text: str) -> str | None:
    """An unconstrained reply's best chance: its first complete top-level {...} (code fences and any
    text around it ignored; braces inside JSON strings do not count). None while it is unfinished."""
    start = text.find("{")
    if start < 0:
        return None
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return text[start:i + 1]
    return None


def unconstrained_valid(text: str | None, schema: dict) -> bool:
    return text is not None and is_valid(text, schema)


def generate_unconstrained(engine, prompt: str):
    """Greedy, unconstrained, stopped as soon as the reply's first object is complete (what the judge
    reads); a reply that never closes one runs to MAX_TOKENS."""
    from edgefinfer.decoding.generation import Generation

    result = Generation("", [], "length")
    stream = engine.stream(prompt, max_tokens=MAX_TOKENS, chat=True, result=result)
    for _ in stream:
        if first_object(result.text) is not None:
            stream.close()
            break
    return result


def bundle(target: str) -> Path:
    folder = ROOT / "dist" / target
    if not (folder / "manifest.json").is_file():
        print(f"building {folder} (edgefinfer build --target {target}) ...", flush=True)
        cli = Path(sys.executable).with_name("edgefinfer")
        subprocess.run([str(cli), "build", "--target", target, "-o", str(folder), "--eval-tokens", "0"], check=True)
    return folder


def engine_row(name: str, backend: str, engine, items: list[dict]) -> tuple[dict, list[str]]:
    valid = plain_valid = 0
    c_time = c_tokens = u_time = u_tokens = 0.0
    texts = []
    for i, task in enumerate(items):
        fmt = {"type": "json_schema", "json_schema": {"name": task["name"], "schema": task["schema"]}}
        out = engine.generate(task["prompt"], max_tokens=MAX_TOKENS, chat=True, response_format=fmt)
        plain = generate_unconstrained(engine, task["prompt"])
        valid += is_valid(out.text, task["schema"])
        plain_valid += unconstrained_valid(first_object(plain.text), task["schema"])
        for stats, acc in ((out.stats, "c"), (plain.stats, "u")):
            steps = max(stats.generated_tokens - 1, 0)
            if acc == "c":
                c_time, c_tokens = c_time + stats.decode_s, c_tokens + steps
            else:
                u_time, u_tokens = u_time + stats.decode_s, u_tokens + steps
        texts.append(out.text)
        print(f"  {name}/{backend} {i + 1}/{len(items)} valid {valid} (unconstrained {plain_valid})", flush=True)
    per_c, per_u = c_time / max(c_tokens, 1), u_time / max(u_tokens, 1)
    return ({"engine": name, "backend": backend, "task": "json_schema", "prompts": len(items), "max_tokens": MAX_TOKENS,
             "valid_rate": valid / len(items), "unconstrained_valid_rate": plain_valid / len(items),
             "mask_overhead": round(per_c / per_u - 1, 4), "decode_ms_per_token": round(per_c * 1e3, 2),
             "unconstrained_decode_ms_per_token": round(per_u * 1e3, 2)}, texts)


def server_row(items: list[dict], engine_texts: list[str]) -> dict:
    import openai

    from edgefinfer.server_gpu.api import create_app
    from edgefinfer.server_gpu.launch import BackgroundServer
    from edgefinfer.server_gpu.loader import ServeOptions, build_engine

    engine, name = build_engine(ServeOptions(MODEL, max_num_seqs=4, max_model_len=1024, threads=THREADS,
                                             batch_invariant=True))
    valid = plain_valid = same = 0
    per = {"c": [0.0, 0], "u": [0.0, 0]}
    with BackgroundServer(create_app(engine, name)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        for i, task in enumerate(items):
            fmt = {"type": "json_schema", "json_schema": {"name": task["name"], "schema": task["schema"]}}
            texts = {}
            for key, extra in (("c", {"response_format": fmt}), ("u", {})):
                stream = client.chat.completions.create(
                    model=name, messages=[{"role": "user", "content": task["prompt"]}], max_tokens=MAX_TOKENS,
                    temperature=0, stream=True, stream_options={"include_usage": True}, **extra)
                parts, first, last, tokens = [], None, None, 0
                for chunk in stream:
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                    if chunk.choices and chunk.choices[0].delta.content:
                        last = time.perf_counter()
                        first = first or last
                        parts.append(chunk.choices[0].delta.content)
                        tokens += 1  # streamed deltas, until the usage chunk gives the exact count
                        if key == "u" and first_object("".join(parts)) is not None:
                            stream.close()  # as on the device: the judge has what it reads
                            break
                texts[key] = "".join(parts)
                if first is not None and tokens > 1:
                    per[key][0] += last - first
                    per[key][1] += tokens - 1
            valid += is_valid(texts["c"], task["schema"])
            plain_valid += unconstrained_valid(first_object(texts["u"]), task["schema"])
            same += texts["c"] == engine_texts[i]
            print(f"  server {i + 1}/{len(items)} valid {valid} (unconstrained {plain_valid}), same {same}", flush=True)
    engine.executor.close()
    per_c, per_u = per["c"][0] / max(per["c"][1], 1), per["u"][0] / max(per["u"][1], 1)
    return {"engine": "server", "backend": "llamacpp", "task": "json_schema", "prompts": len(items),
            "max_tokens": MAX_TOKENS,
            "valid_rate": valid / len(items), "unconstrained_valid_rate": plain_valid / len(items),
            "mask_overhead": round(per_c / per_u - 1, 4), "decode_ms_per_token": round(per_c * 1e3, 2),
            "unconstrained_decode_ms_per_token": round(per_u * 1e3, 2), "same_as_engine": same / len(items)}


def main() -> None:
    global MAX_TOKENS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="6 prompts, llama.cpp only")
    ap.add_argument("--backends", default="llamacpp,executorch,onnxruntime,torch",
                    help="device backends to run (comma-separated)")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="per reply, constrained or not")
    ap.add_argument("--merge", action="store_true",
                    help="keep the other backends' rows of the existing results (run backends in several sittings)")
    args = ap.parse_args()
    MAX_TOKENS = args.max_tokens

    from edgefinfer.model import reference
    from edgefinfer.runtime.engine import Engine

    items = tasks()[::8][:6] if args.quick else tasks()
    backends = ["llamacpp"] if args.quick else args.backends.split(",")
    rows: list[dict] = []
    if args.merge:
        from common import RESULTS, result_stem

        old = RESULTS / f"{result_stem('structured', args.quick)}.json"
        if old.is_file():
            before = json.loads(old.read_text())
            rows = [{"max_tokens": before["max_tokens"], **r} for r in before["rows"] if r["backend"] not in backends]
    t_start = time.perf_counter()
    columns = ["engine", "backend", "prompts", "valid_rate", "unconstrained_valid_rate", "mask_overhead",
               "decode_ms_per_token", "unconstrained_decode_ms_per_token", "same_as_engine"]

    def save() -> Path:  # after every engine, so a long run that is stopped keeps what it measured
        payload = {"rows": rows, "max_tokens": MAX_TOKENS, "threads": THREADS,  # this sitting's; rows say their own "grammar_engine": "llguidance",
                   "seconds": round(time.perf_counter() - t_start, 1), "machine": machine(),
                   "versions": versions("llguidance", "executorch", "onnxruntime", "llama-cpp-python")}
        return write_results("structured", payload, quick=args.quick)

    for backend in backends:
        path = {"torch": lambda: reference.pull(MODEL), "llamacpp": lambda: reference.gguf_path(MODEL),
                "executorch": lambda: bundle("android"), "onnxruntime": lambda: bundle("linux-x86_64")}[backend]()
        print(f"{backend}: {path}", flush=True)
        # Eager torch on one thread: OpenMP's busy-waiting makes it several times slower on 2 cores, and
        # PASSIVE would slow llama.cpp's OpenMP threads in this same process (see the README).
        engine = Engine.load(path, backend=backend, threads=1 if backend == "torch" else THREADS)
        row, texts = engine_row("engine", backend, engine, items)
        rows.append(row)
        del engine
        if backend == "llamacpp":  # the server on the same GGUF, judged against this Engine's replies
            rows.append(server_row(items, texts))
        save()
    print_table(rows, columns)
    print(f"wrote {save()}")


if __name__ == "__main__":
    main()
