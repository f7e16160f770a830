"""Sessions benchmark (issue 31): a 10-turn chat with and without a session, per backend.

    python bench/sessions.py [--quick] [--threads N] [--only torch,llamacpp,...] [--bundles DIR]
    python bench/sessions.py --startup-only --bundles DIR [--runs 3] [--threads 1]   # the start-up rows alone

The reference model (SmolLM2-135M-Instruct) on each backend: torch (the float32 checkpoint), llama.cpp
(the shipped Q4_1 GGUF), ONNX Runtime and ExecuTorch (`edgefinfer build --target linux-x86_64` /
`android` bundles, built into --bundles once if missing). Greedy, threads set explicitly.

Per backend: time to first token of turn 1 and of turn 10 through one `Engine.session()` (turn 10
prefills only its new tokens), against turn 10 as a stateless run prefilling the whole history (fed in
the calls a session makes: on ExecuTorch one per turn, `runtime.session.conversation_cuts`); each a
median of 3 (turn 10 with a session is re-run from the cache state after turn 9). `same_text`: the
session's replies equal the stateless runs' (every turn; --quick: turn 10); `same_turns` counts the
turns that do, `parted_at` names the others as [turn, first differing reply token]. Then save/load: the next
turn's TTFT from a session loaded from its file against the live session's (median of 3 each), and the
file's size and state ("kv": the cache itself; "tokens": ids only, the history is prefilled again).

Start-up ("startup_rows"; `--startup` adds them to a full run, `--startup-only` measures them alone and keeps
the file's session rows): process start to first token and peak RSS of `edgefinfer run BUNDLE -p PROMPT
--max-tokens 16` next to the peer's own runner on the same artefact (and, "ours_input": "gguf-alone", of
`edgefinfer run model.gguf` on the gpu-server bundle's GGUF in a folder of its own, against llama.cpp's CLI), each a fresh process measured from
outside: the clock starts before the process is spawned and stops at the first byte it writes to stdout
(each runner streams its reply, the first token first); the peak RSS is the kernel's (`wait4`'s
ru_maxrss, taken by a small launcher process: see LAUNCHER). Peers: on the gpu-server bundle's GGUF,
llama.cpp's own CLI (`llama-completion` built from the pinned sources by bench/peers.py: `-p PROMPT -n 16
--temp 0 -fa off -no-cnv --no-display-prompt`, its defaults otherwise, warm-up decode included) and llama.cpp
through llama-cpp-python (`Llama`, its tokenizer and loop, the Python runner beside ours); onnxruntime-genai's
Generator on the linux-x86_64 bundle, ExecuTorch's TextLLMRunner on the android bundle's .pte. Runs
alternate ours / peer, `--runs` of each (median and range), after one unmeasured run of each; both with a
bytecode cache (`startup_env`), as installed packages have. The prompt is the chat template rendered
around one question (the same text for every runner).
Goals (issue 31): peak RSS <= artefact size + 250 MiB (ONNX, GGUF) or no more than the peer's (.pte);
start to first token no worse than the peer's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_table, uptime, versions, write_results  # noqa: E402

BACKENDS = ("executorch", "onnxruntime", "llamacpp", "torch")
TARGETS = {"onnxruntime": "linux-x86_64", "executorch": "android"}
# backend -> (bundle, its peers' runners): a row per pair.
STARTUP = {"llamacpp": ("gpu-server", ("llama-cpp-python (Llama)", LLAMA_CLI := "llama.cpp CLI (llama-completion)")),
           "onnxruntime": ("linux-x86_64", ("onnxruntime-genai",)),
           "executorch": ("android", ("ExecuTorch TextLLMRunner",))}
# Also `edgefinfer run` on the gpu-server bundle's GGUF alone, in a folder of its own (no tokenizer files:
# the tokenizer, template and stop ids are the file's), against llama.cpp's CLI on the same file.
ALONE = {"llamacpp": LLAMA_CLI}
STARTUP_QUESTION = "What is the capital of France?"
STARTUP_TOKENS = 16
RSS_HEADROOM_MIB = 250
CTX = 1024
TOPICS = ["a lighthouse keeper", "the history of tea", "a bicycle repair", "the rings of Saturn", "a village bakery",
          "the migration of eels", "an old clock tower", "the first printing press", "a winter garden",
          "a river delta", "a chess tournament"]


def messages(n: int) -> list[str]:
    """n user messages of about 30 tokens each."""
    return [f"Turn {i + 1}. Now tell me about {TOPICS[i % len(TOPICS)]}, in two short sentences, and mention "
            f"one surprising fact that most people would not know about it." for i in range(n)]


def artefact(backend: str, bundles: Path, threads: int) -> Path:
    from edgefinfer.model import reference

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


def run_backend(backend: str, path: Path, threads: int, quick: bool, prefill_grid: int | None = None) -> dict:
    from edgefinfer.runtime.engine import Engine
    from edgefinfer.runtime.session import conversation_cuts, encode_messages

    if backend == "torch":
        import torch

        torch.set_num_threads(threads)
    engine = Engine.load(path, backend=None if backend != "torch" else "torch", threads=threads,
                         max_seq_len=CTX if backend in ("torch", "llamacpp") else None, prefill_grid=prefill_grid)
    n_reply = 32 if quick else 48
    turns = messages(11)
    session = engine.session()

    def chat(message: str) -> tuple[list[int], float]:
        ids = reply(lambda on: session.chat(message, n_reply, on_token=on))
        return ids, session.last.ttft_s

    def stateless(history: list[dict]) -> tuple[list[int], float]:
        from edgefinfer.decoding.generation import Generation

        result = Generation("", [], "length")
        # In the calls a session makes (ExecuTorch: turn-aligned, `conversation_cuts`; elsewhere one call).
        ids = reply(lambda on: engine.stream_ids(encode_messages(engine.tokenizer, history), n_reply, on_token=on,
                                                 result=result, cuts=conversation_cuts(engine, history)))
        return ids, result.stats.prefill_s

    turn1 = []
    for _ in range(3):
        session.reset()
        turn1.append(chat(turns[0])[1])
    session.reset()
    replies, ttfts, state9 = [], [], None
    for i, message in enumerate(turns[:10]):
        if i == 9:
            state9 = snapshot(session)
        ids, ttft = chat(message)
        replies.append(ids)
        ttfts.append(ttft)
    prompt10, prefilled10, settle10 = session.last.prompt_tokens, session.last.prefilled_tokens, session.last.settle_s
    state10 = snapshot(session)
    turn10 = [ttfts[-1]]
    for _ in range(2):  # the same turn 10 from the cache as turn 9 left it (static caches: positional rollback)
        restore(session, state9)
        turn10.append(chat(turns[9])[1])

    # Save / load: turn 11 from the live session and from its file.
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "chat.efs"
        restore(session, state10)
        live11 = []
        for _ in range(3):
            restore(session, state10)
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
    same, parted = [], []
    checked = range(10) if not quick else [9]
    for i in checked:
        ids, _ = stateless(history[:2 * i + 1])
        same.append(ids == replies[i])
        if ids != replies[i]:  # (turn, first differing reply token): where greedy replies part
            parted.append([i + 1, next(j for j, (a, b) in enumerate(zip(ids + [-1], replies[i] + [-2])) if a != b)])
    stateless10 = [stateless(history[:19])[1] for _ in range(3)]
    t1, t10, s10 = statistics.median(turn1), statistics.median(turn10), statistics.median(stateless10)
    return {"backend": backend, "prefill_grid": prefill_grid, "artefact": str(path), "turn1_ttft_s": round(t1, 4), "turn10_ttft_s": round(t10, 4),
            "turn10_over_turn1_ttft": round(t10 / t1, 3), "stateless_turn10_ttft_s": round(s10, 4),
            "stateless_over_session_turn10": round(s10 / t10, 2), "same_text": all(same),
            "turns_compared": len(same), "same_turns": sum(same), "parted_at": parted, "turn10_prompt_tokens": prompt10, "turn10_prefilled_tokens": prefilled10,
            "reply_tokens": n_reply, "live_turn11_ttft_s": round(statistics.median(live11), 4),
            "restored_turn11_ttft_s": round(statistics.median(restored11), 4), "restored_same_text": restored_same,
            "session_file_bytes": file_bytes, "session_state": state,
            "turn10_settle_s": round(settle10, 4)}


# ---- start-up: process start to first token, peak RSS, measured from outside ---------------------------
def startup_prompt(bundle: Path) -> str:
    from edgefinfer.tokenization.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(bundle)
    return tok.apply_chat_template([{"role": "user", "content": STARTUP_QUESTION}])


def same_reply(ours: str, peer: str, bundle: Path) -> bool:
    """The two replies are the same text. TextLLMRunner prints the end-of-sequence token it stops on
    (`<|im_end|>`) and llama.cpp's CLI says " [end of text]" there, where `edgefinfer run` stops without
    printing anything: those marks alone do not count."""
    from edgefinfer.tokenization.tokenizer import Tokenizer

    eos = Tokenizer.from_dir(bundle).eos_token
    peer = peer.removesuffix("[end of text]").rstrip()
    return ours == peer or (bool(eos) and ours == peer.removesuffix(eos).rstrip())


def artefact_bytes(bundle: Path, backend: str) -> int:
    """The weights' bytes: every file of the bundle's artefact (an ONNX graph and its external data)."""
    from edgefinfer.bundle.manifest import load_manifest

    manifest = load_manifest(bundle, verify=False)
    files = [a for a in manifest.artefacts if a.backend == backend or a.format in ("onnx-data", "onnx_data")]
    paths = {bundle / a.path for a in files}
    art = next(a for a in manifest.artefacts if a.backend == backend)
    if art.path.endswith(".onnx") and (bundle / (art.path + ".data")).is_file():
        paths.add(bundle / (art.path + ".data"))
    return sum(p.stat().st_size for p in paths)


def peer_child(backend: str, bundle: str, prompt_file: str, n: int, threads: int) -> None:
    """The peer's own runner streaming its reply to stdout, a token at a time (run as a child process)."""
    prompt = Path(prompt_file).read_text()
    out = sys.stdout
    if backend == "llamacpp":
        import llama_cpp

        gguf = next(Path(bundle).glob("*.gguf"))
        llm = llama_cpp.Llama(str(gguf), n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)
        for chunk in llm(prompt, max_tokens=n, temperature=0.0, stream=True):
            out.write(chunk["choices"][0]["text"])
            out.flush()
    elif backend == "onnxruntime":
        import json as _json

        import numpy as np
        import onnxruntime_genai as og

        config = og.Config(bundle)
        config.overlay(_json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        model = og.Model(config)
        tokenizer = og.Tokenizer(model)
        stream = tokenizer.create_stream()
        ids = tokenizer.encode(prompt)
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + n, do_sample=False)
        gen = og.Generator(model, params)
        gen.append_tokens(np.asarray(ids, dtype=np.int32))
        while not gen.is_done():
            gen.generate_next_token()
            out.write(stream.decode(int(gen.get_next_tokens()[0])))
            out.flush()
    elif backend == "executorch":  # as the bundle's README.txt runs it (edgefinfer.app.peer_runners)
        # The C++ runner prints each token to fd 1 itself (stdio, block-buffered into a pipe, so it arrives at
        # exit): fd 1 goes to /dev/null and the callback writes to a duplicate of the real stdout, so the first
        # byte is the first token and the text is the reply once.
        out = os.fdopen(os.dup(1), "w")
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401 (the LLM kernels)
        import executorch.kernels.quantized  # noqa: F401
        import torch
        from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner
        from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

        _unsafe_reset_threadpool(threads)  # the process-wide pools `edgefinfer run --threads` sizes too:
        torch.set_num_threads(threads)  # ExecuTorch's, and libtorch's OpenMP pool its kernel libraries use
        runner = TextLLMRunner(str(next(Path(bundle).glob("*.pte"))), str(Path(bundle) / "tokenizer.json"))
        runner.generate(prompt, GenerationConfig(echo=False, max_new_tokens=n, temperature=0.0),
                        token_callback=lambda text: (out.write(text), out.flush()))
    out.write("\n")


# A process's ru_maxrss starts at the high-water mark of the memory it replaced at exec: a runner spawned
# from here (Python spawns with vfork) reports at least this process's own peak, about 300 MiB once torch
# and a tokenizer are loaded, whatever it used itself (`python -c pass` then reports 311 MiB, not 11).
# So each runner is started by this launcher, an isolated interpreter of about 10 MiB that forks, execs
# the runner and reports the runner's ru_maxrss as the last line of stderr. It adds its own start (10-20
# ms) to both runners' time to the first byte.
LAUNCHER = """import os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
sys.stderr.write(f"\\nPEAK_RSS_KB={usage.ru_maxrss}\\n")
sys.exit(os.waitstatus_to_exitcode(status))
"""


def snapshot(session) -> tuple:
    """What a turn reads of a session: the history, the cached ids and how many of them a prefill computed."""
    return list(session.messages), list(session.cached), session.prefilled


def restore(session, state: tuple) -> None:
    session.messages, session.cached, session.prefilled = list(state[0]), list(state[1]), state[2]


def time_process(cmd: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """(seconds from spawn to the first stdout byte, peak RSS MiB, stdout) of one run of `cmd`."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", LAUNCHER, *cmd], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    first = proc.stdout.read(1)
    ttft = time.perf_counter() - t0
    rest = proc.stdout.read()
    err = proc.stderr.read()
    proc.wait()
    err, _, peak = err.decode(errors="replace").rpartition("PEAK_RSS_KB=")
    if proc.returncode != 0 or not first or not peak.strip().isdigit():
        raise RuntimeError(f"{cmd[:4]} failed ({proc.returncode}):\n{err[-2000:]}")
    return ttft, int(peak) / 1024, (first + rest).decode(errors="replace")


def startup_env(pycache: Path) -> dict[str, str]:
    """Both runners' environment: unbuffered stdout (the first token is written at once), and bytecode
    cached under `pycache` even where PYTHONDONTWRITEBYTECODE is set (a checkout's environment): an
    installed package is byte-compiled at install, a peer's site-packages were, and an editable checkout
    run without a cache compiles its own modules from source on every start (0.1 s of ours)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PYTHONUNBUFFERED": "1", "PYTHONPYCACHEPREFIX": str(pycache)}


def llama_cli_argv(bundle: Path, prompt_file: Path, threads: int) -> list[str]:
    """llama.cpp's completion CLI on the bundle's GGUF: the prompt as given (its template already rendered,
    special tokens parsed; `-p`, since `-f` drops a prompt's trailing newline), greedy, STARTUP_TOKENS
    tokens, only the reply on stdout. Flash attention off: the cells `edgefinfer run` keeps for a quantized
    GGUF (`runtime_cells`), so that the two replies can be compared token for token (with the CLI's
    default, on, the 16th token differed here); the prompt's 37 tokens take the same ~0.28 s either way."""
    import peers

    binary = peers.llama_tools(("llama-completion",))["llama-completion"]
    th = str(threads)
    return [str(binary), "-m", str(next(bundle.glob("*.gguf"))), "-p", prompt_file.read_text(), "-n",
            str(STARTUP_TOKENS), "--temp", "0", "-t", th, "-tb", th, "-c", "2048", "-fa", "off", "-no-cnv",
            "--no-display-prompt"]


def run_startup(backend: str, bundle: Path, threads: int, runs: int, peer_name: str, ours_input: str = "bundle") -> dict:
    """ours_input: what `edgefinfer run` is given, "bundle" or "gguf-alone" (the bundle's GGUF, linked
    into a folder of its own)."""
    prompt = startup_prompt(bundle)
    with tempfile.TemporaryDirectory() as tmp:
        env = startup_env(Path(tmp) / "pycache")
        prompt_file = Path(tmp) / "prompt.txt"
        prompt_file.write_text(prompt)
        target = bundle
        if ours_input == "gguf-alone":
            (Path(tmp) / "alone").mkdir()
            target = Path(tmp) / "alone" / "model.gguf"
            target.symlink_to(next(bundle.glob("*.gguf")).resolve())
        ours = [sys.executable, "-m", "edgefinfer", "run", str(target), "-p", prompt, "--max-tokens",
                str(STARTUP_TOKENS), "--threads", str(threads)]
        peer = (llama_cli_argv(bundle, prompt_file, threads) if peer_name == LLAMA_CLI else
                [sys.executable, str(Path(__file__).resolve()), "--peer-child", backend, str(bundle), str(prompt_file),
                 str(STARTUP_TOKENS), str(threads)])
        got: dict[str, list] = {"ours": [], "peer": []}
        texts = {}
        # One unmeasured run each: the page cache holds the files, the bytecode cache the modules.
        time_process(ours, env), time_process(peer, env)
        for _ in range(runs):
            for name, cmd in (("ours", ours), ("peer", peer)):
                ttft, rss, text = time_process(cmd, env)
                got[name].append((ttft, rss))
                texts[name] = text.strip()
    art_mib = artefact_bytes(bundle, backend) / 2**20

    def summary(samples: list) -> dict:
        t, r = [x[0] for x in samples], [x[1] for x in samples]
        return {"start_to_first_token_s": round(statistics.median(t), 3), "start_to_first_token_range_s":
                [round(min(t), 3), round(max(t), 3)], "peak_rss_mib": round(statistics.median(r), 1),
                "peak_rss_range_mib": [round(min(r), 1), round(max(r), 1)]}

    row = {"backend": backend, "bundle": str(bundle), "ours_input": ours_input, "artefact_mib": round(art_mib, 1), "runs": runs,
           "max_tokens": STARTUP_TOKENS, "threads": threads, "peer": peer_name,
           "bytecode": "cached for both (PYTHONPYCACHEPREFIX, filled by the unmeasured run)",
           **{f"ours_{k}": v for k, v in summary(got["ours"]).items()},
           **{f"peer_{k}": v for k, v in summary(got["peer"]).items()},
           # Each round runs ours then the peer: the median of their per-round ratios holds up better than a
           # ratio of medians while the host's load drifts.
           "ttft_ratio_paired": round(statistics.median(o[0] / q[0] for o, q in zip(got["ours"], got["peer"])), 3),
           "same_text": same_reply(texts["ours"], texts["peer"], bundle), "ours_text": texts["ours"],
           "peer_text": texts["peer"]}
    row["rss_goal_mib"] = (round(art_mib + RSS_HEADROOM_MIB, 1) if backend != "executorch"
                           else row["peer_peak_rss_mib"])
    row["rss_goal_met"] = row["ours_peak_rss_mib"] <= row["rss_goal_mib"]
    row["ttft_goal_met"] = row["ours_start_to_first_token_s"] <= row["peer_start_to_first_token_s"]
    return row


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--peer-child":
        backend, bundle, prompt_file, n, threads = sys.argv[2:7]
        return peer_child(backend, bundle, prompt_file, int(n), int(threads))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="replies of 32 tokens, turn 10 checked only")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default=",".join(BACKENDS))
    ap.add_argument("--bundles", type=Path, default=None, help="where the ONNX / ExecuTorch bundles are (built)")
    ap.add_argument("--startup", action="store_true", help="also measure the start-up rows")
    ap.add_argument("--startup-only", action="store_true", help="only the start-up rows (the session rows are kept)")
    ap.add_argument("--runs", type=int, default=3, help="start-up runs of each runner")
    ap.add_argument("--prefill-grid", type=int, default=None,
                    help="ExecuTorch: prompts in calls aligned to N tokens (rows then do not depend on the split)")
    args = ap.parse_args()
    from edgefinfer.files.user_cache import cache_dir

    bundles = args.bundles or cache_dir() / "bench" / "sessions"
    load_start = [round(x, 2) for x in os.getloadavg()]
    if args.startup_only:
        return main_startup(args, bundles, load_start)
    rows = []
    for backend in args.only.split(","):
        path = artefact(backend, bundles, args.threads)
        print(f"[{backend}] 10-turn chat on {path}", flush=True)
        before = uptime()
        grid = args.prefill_grid if backend == "executorch" else None
        row = run_backend(backend, path, args.threads, args.quick, grid)
        rows.append({**row, "threads": args.threads, "uptime_before": before, "uptime_after": uptime()})
    payload = {"machine": machine(), "versions": versions("executorch", "onnxruntime", "llama-cpp-python"),
               "threads": args.threads, "quick": args.quick, "load_avg_start": load_start,
               "load_avg_end": [round(x, 2) for x in os.getloadavg()], "rows": rows}
    if set(args.only.split(",")) != set(BACKENDS):  # an --only run keeps the file's other rows (and start-up rows)
        payload = merge_rows(payload, result_file(args.quick))
    out = write_results("sessions", payload, args.quick)
    print_table(rows, ["backend", "prefill_grid", "turn1_ttft_s", "turn10_ttft_s", "turn10_over_turn1_ttft",
                       "stateless_turn10_ttft_s", "same_text", "live_turn11_ttft_s", "restored_turn11_ttft_s",
                       "session_state"])
    if args.startup:
        payload["startup_rows"] = startup_rows(args, bundles)
        payload["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
        out = write_results("sessions", payload, args.quick)
    print(f"load average {load_start} -> {payload['load_avg_end']}; wrote {out}")


def startup_rows(args: argparse.Namespace, bundles: Path) -> list[dict]:
    rows = []
    for backend in (b for b in args.only.split(",") if b in STARTUP):
        bundle = bundles / STARTUP[backend][0]
        if not (bundle / "manifest.json").is_file():
            print(f"[startup] {backend}: no bundle at {bundle}, skipped", flush=True)
            continue
        pairs = [(peer, "bundle") for peer in STARTUP[backend][1]]
        if backend in ALONE:
            pairs.append((ALONE[backend], "gguf-alone"))
        for peer, ours_input in pairs:
            print(f"[startup] {backend}: {bundle} ({ours_input}) against {peer}, {args.runs} runs each", flush=True)
            before = uptime()
            row = run_startup(backend, bundle, args.threads, args.runs, peer, ours_input)
            rows.append({**row, "uptime_before": before, "uptime_after": uptime()})
    cols = ["backend", "ours_input", "peer", "artefact_mib", "ours_start_to_first_token_s", "peer_start_to_first_token_s",
            "ttft_ratio_paired", "ours_peak_rss_mib", "peer_peak_rss_mib", "rss_goal_mib", "rss_goal_met",
            "ttft_goal_met", "same_text"]
    print_table(rows, cols)
    return rows


def result_file(quick: bool) -> Path:
    from common import RESULTS, result_stem

    return RESULTS / f"{result_stem('sessions', quick)}.json"


def merge_rows(payload: dict, file: Path) -> dict:
    """`payload` with the file's rows of the backends it did not measure kept after its own, and the file's
    start-up rows; each kept row still carries the run-wide fields of its own run (threads, versions) there."""
    if not file.is_file():
        return payload
    old = json.loads(file.read_text())
    measured = {(r["backend"], r.get("prefill_grid")) for r in payload["rows"]}
    kept = [{"threads": old.get("threads"), "load_avg_start": old.get("load_avg_start"),
             "load_avg_end": old.get("load_avg_end"), **r} for r in old.get("rows", [])
            if (r["backend"], r.get("prefill_grid")) not in measured]
    merged = {**payload, "rows": kept + payload["rows"]}
    for key in ("startup_rows", "startup"):
        if key in old:
            merged[key] = old[key]
    return merged


def main_startup(args: argparse.Namespace, bundles: Path, load_start: list[float]) -> None:
    """Measure the start-up rows and merge them into the results file (its session rows kept)."""
    file = result_file(args.quick)
    payload = json.loads(file.read_text()) if file.is_file() else {"rows": []}
    rows = startup_rows(args, bundles)
    def key(r: dict) -> tuple:
        return r["backend"], r["peer"], r.get("ours_input", "bundle")

    measured = {key(r) for r in rows}
    run = payload.get("startup", {})  # the previous run's load, kept on the rows it measured
    kept = [{"load_avg_start": run.get("load_avg_start"), "load_avg_end": run.get("load_avg_end"), **r}
            for r in payload.get("startup_rows", []) if key(r) not in measured]
    payload["startup_rows"] = kept + rows
    payload["startup"] = {"machine": machine(), "threads": args.threads, "runs": args.runs,
                          "load_avg_start": load_start, "load_avg_end": [round(x, 2) for x in os.getloadavg()],
                          "versions": versions("onnxruntime", "onnxruntime-genai", "llama-cpp-python", "executorch")}
    out = write_results("sessions", payload, args.quick)
    print(f"load average {load_start} -> {payload['startup']['load_avg_end']}; wrote {out}")


if __name__ == "__main__":
    main()
