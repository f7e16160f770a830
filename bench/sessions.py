"""Sessions benchmark (issue 31): a 10-turn chat with and without a session, per backend.

    python bench/sessions.py [--quick] [--threads N] [--only torch,llamacpp,...] [--bundles DIR]

The reference model (SmolLM2-135M-Instruct) on each backend: torch (the float32 checkpoint), llama.cpp
(the shipped Q4_1 GGUF), ONNX Runtime and ExecuTorch (`edgefinfer build --target linux-x86_64` /
`android` bundles, built into --bundles once if missing). Greedy, threads set explicitly.

Per backend: time to first token of turn 1 and of turn 10 through one `Engine.session()` (turn 10
prefills only its new tokens), against turn 10 as a stateless run prefilling the whole history; each a
median of 3 (turn 10 with a session is re-run from the cache state after turn 9). `same_text`: the
session's replies equal the stateless runs' (every turn; --quick: turn 10). Then save/load: the next
turn's TTFT from a session loaded from its file against the live session's (median of 3 each), and the
file's size and state ("kv": the cache itself; "tokens": ids only, the history is prefilled again).
Writes bench/results/sessions.json (--quick: sessions-quick.json).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_table, versions, write_results  # noqa: E402

BACKENDS = ("executorch", "onnxruntime", "llamacpp", "torch")
TARGETS = {"onnxruntime": "linux-x86_64", "executorch": "android"}
CTX = 1024
TOPICS = ["a lighthouse keeper", "the history of tea", "a bicycle repair", "the rings of Saturn", "a village bakery",
          "the migration of eels", "an old clock tower", "the first printing press", "a winter garden",
          "a river delta", "a chess tournament"]


def messages(n: int) -> list[str]:
    """n user messages of about 30 tokens each."""
    return [f"Turn {i + 1}. Now tell me about {TOPICS[i % len(TOPICS)]}, in two short sentences, and mention "
            f"one surprising fact that most people would not know about it." for i in range(n)]


def artefact(backend: str, bundles: Path, threads: int) -> Path:
    from edgefinfer import reference

    if backend == "torch":
        return reference.pull("smollm2-135m")
    if backend == "llamacpp":
        return reference.gguf_path("smollm2-135m")
    out = bundles / TARGETS[backend]
    if not (out / "manifest.json").is_file():
        print(f"[{backend}] building {out} (once)", flush=True)
        subprocess.run([sys.executable, "-m", "edgefinfer", "build", "-t", TARGETS[backend], "-o", str(out),
                        "--eval-tokens", "0", "--max-seq-len", str(CTX), "--threads", str(threads)], check=True)
    return out


def reply(stream_factory) -> list[int]:
    out: list[int] = []
    for _ in stream_factory(out.append):
        pass
    return out


def run_backend(backend: str, path: Path, threads: int, quick: bool) -> dict:
    from edgefinfer.runtime.engine import Engine
    from edgefinfer.runtime.session import encode_messages

    if backend == "torch":
        import torch

        torch.set_num_threads(threads)
    engine = Engine.load(path, backend=None if backend != "torch" else "torch", threads=threads,
                         max_seq_len=CTX if backend in ("torch", "llamacpp") else None)
    n_reply = 32 if quick else 48
    turns = messages(11)
    session = engine.session()

    def chat(message: str) -> tuple[list[int], float]:
        ids = reply(lambda on: session.chat(message, n_reply, on_token=on))
        return ids, session.last.ttft_s

    def stateless(history: list[dict]) -> tuple[list[int], float]:
        from edgefinfer.generation import Generation

        result = Generation("", [], "length")
        ids = reply(lambda on: engine.stream_ids(encode_messages(engine.tokenizer, history), n_reply, on_token=on,
                                                 result=result))
        return ids, result.stats.prefill_s

    turn1 = []
    for _ in range(3):
        session.reset()
        turn1.append(chat(turns[0])[1])
    session.reset()
    replies, ttfts, state9 = [], [], None
    for i, message in enumerate(turns[:10]):
        if i == 9:
            state9 = (list(session.messages), list(session.cached))
        ids, ttft = chat(message)
        replies.append(ids)
        ttfts.append(ttft)
    prompt10, prefilled10 = session.last.prompt_tokens, session.last.prefilled_tokens
    state10 = (list(session.messages), list(session.cached))
    turn10 = [ttfts[-1]]
    for _ in range(2):  # the same turn 10 from the cache as turn 9 left it (static caches: positional rollback)
        session.messages, session.cached = list(state9[0]), list(state9[1])
        turn10.append(chat(turns[9])[1])

    # Save / load: turn 11 from the live session and from its file.
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "chat.efs"
        session.messages, session.cached = list(state10[0]), list(state10[1])
        live11 = []
        for _ in range(3):
            session.messages, session.cached = list(state10[0]), list(state10[1])
            if not live11:
                session.save(file)
            live_ids, t = chat(turns[10])
            live11.append(t)
        restored11, restored_same = [], True
        for _ in range(3):
            loaded = engine.load_session(file)
            ids = reply(lambda on: loaded.chat(turns[10], n_reply, on_token=on))
            restored11.append(loaded.last.ttft_s)
            restored_same &= ids == live_ids
        file_bytes = file.stat().st_size
        from edgefinfer.runtime.session import read_session_file

        state = read_session_file(file)[0]["state"]

    # Stateless: the whole history prefilled for each turn (the engine's cache is no longer the session's).
    history = state10[0]
    same = []
    checked = range(10) if not quick else [9]
    for i in checked:
        ids, _ = stateless(history[:2 * i + 1])
        same.append(ids == replies[i])
    stateless10 = [stateless(history[:19])[1] for _ in range(3)]
    t1, t10, s10 = statistics.median(turn1), statistics.median(turn10), statistics.median(stateless10)
    return {"backend": backend, "artefact": str(path), "turn1_ttft_s": round(t1, 4), "turn10_ttft_s": round(t10, 4),
            "turn10_over_turn1_ttft": round(t10 / t1, 3), "stateless_turn10_ttft_s": round(s10, 4),
            "stateless_over_session_turn10": round(s10 / t10, 2), "same_text": all(same),
            "turns_compared": len(same), "turn10_prompt_tokens": prompt10, "turn10_prefilled_tokens": prefilled10,
            "reply_tokens": n_reply, "live_turn11_ttft_s": round(statistics.median(live11), 4),
            "restored_turn11_ttft_s": round(statistics.median(restored11), 4), "restored_same_text": restored_same,
            "session_file_bytes": file_bytes, "session_state": state}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="replies of 32 tokens, turn 10 checked only")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default=",".join(BACKENDS))
    ap.add_argument("--bundles", type=Path, default=None, help="where the ONNX / ExecuTorch bundles are (built)")
    args = ap.parse_args()
    from edgefinfer.data import cache_dir

    bundles = args.bundles or cache_dir() / "bench" / "sessions"
    load_start = [round(x, 2) for x in os.getloadavg()]
    rows = []
    for backend in args.only.split(","):
        path = artefact(backend, bundles, args.threads)
        print(f"[{backend}] 10-turn chat on {path}", flush=True)
        rows.append(run_backend(backend, path, args.threads, args.quick))
    payload = {"machine": machine(), "versions": versions("executorch", "onnxruntime", "llama-cpp-python"),
               "threads": args.threads, "quick": args.quick, "load_avg_start": load_start,
               "load_avg_end": [round(x, 2) for x in os.getloadavg()], "rows": rows}
    out = write_results("sessions", payload, args.quick)
    print_table(rows, ["backend", "turn1_ttft_s", "turn10_ttft_s", "turn10_over_turn1_ttft",
                       "stateless_turn10_ttft_s", "same_text", "live_turn11_ttft_s", "restored_turn11_ttft_s",
                       "session_state"])
    print(f"load average {load_start} -> {payload['load_avg_end']}; wrote {out}")


if __name__ == "__main__":
    main()
