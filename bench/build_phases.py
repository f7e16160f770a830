"""Where a cold `edgefinfer build --target android` spends its CPU, phase by phase (issue 30 item 1).

    python bench/build_phases.py [--target android] [--cache DIR] [--keep] [--out PATH]

The build runs in this process exactly as the CLI runs it (`edgefinfer.app.build.build`), with an empty
artefact cache (`EDGEFINFER_CACHE` pointed at a fresh temporary folder, so the reference model's GGUF is
converted again too), and each phase is timed in process CPU seconds (all threads, and any child
process) beside its wall time: the host is shared, so wall time is noisy and CPU time is the figure to
compare. Phases nest (the export's stages are inside `compile`); the table indents them. Writes
bench/results/build_phases.json (`--out`): one run per `--code` label (default: the checkout's commit),
a new run replacing the file's run with the same label and keeping the others (the code before a
change, measured beside it), each with the load average before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, versions  # noqa: E402


def cpu_s() -> float:
    """CPU seconds of this process (every thread) and its waited-for children."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class Phases:
    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.depth = 0

    @contextlib.contextmanager
    def phase(self, name: str):
        row = {"phase": name, "depth": self.depth}
        self.rows.append(row)
        c, w = cpu_s(), time.perf_counter()
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            row["cpu_s"], row["wall_s"] = round(cpu_s() - c, 2), round(time.perf_counter() - w, 2)

    def wrap(self, owner, attr: str, name: str | None = None) -> None:
        """Time every call of `owner.attr` as a phase (named `name`, default the attribute)."""
        fn = getattr(owner, attr)
        raw = fn.__func__ if isinstance(fn, classmethod) else fn

        @functools.wraps(raw)
        def timed(*args, **kwargs):
            with self.phase(name or attr):
                return raw(*args, **kwargs)

        setattr(owner, attr, timed)


def owner(attr: str, *modules: str):
    """The first of `modules` (import paths, tried in order: the package's layout moves) holding `attr`."""
    import importlib

    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, attr):
            return module
    raise ImportError(f"none of {', '.join(modules)} has {attr}")


def instrument(phases: Phases) -> None:
    import edgefinfer.app.build as build
    import edgefinfer.compile.artefact_cache as artefact_cache
    import edgefinfer.compile.executorch_export as ete
    import edgefinfer.runtime.decode as decode
    import edgefinfer.runtime.engine as engine

    bundle = owner("BundleWriter", "edgefinfer.bundle.manifest", "edgefinfer.bundle")
    Tokenizer = owner("Tokenizer", "edgefinfer.tokenization.tokenizer", "edgefinfer.tokenizer").Tokenizer

    for attr, name in (("resolve_model", "load: resolve model (GGUF -> HF folder)"),
                       ("_load", "load: read the checkpoint"),
                       ("_test_tokens", "load: test tokens"),
                       ("_runner_tokenizer", "load: runner tokenizer rewrite + checks"),
                       ("_float_perplexity", "float perplexity (eager)"),
                       ("quantize_for", "quantize (RTN)"),
                       ("compile_artefact", "compile (export_pte)"),
                       ("evaluate_artefact", "evaluate the artefact (ExecuTorch)")):
        phases.wrap(build, attr, name)
    tok_from_dir = Tokenizer.from_dir.__func__

    def from_dir(cls, *a, **kw):
        with phases.phase("load: tokenizer"):
            return tok_from_dir(cls, *a, **kw)

    Tokenizer.from_dir = classmethod(from_dir)
    phases.wrap(engine, "open_backend", "open the .pte")
    phases.wrap(build, "_perplexity_of", "perplexity")
    generate = decode.generate_tokens

    def generate_tokens(*args, **kwargs):  # a generator: timed while it is consumed
        with phases.phase("decode speed (64 + 33 tokens)"):
            yield from generate(*args, **kwargs)

    decode.generate_tokens = generate_tokens
    phases.wrap(artefact_cache.ArtefactCache, "put", "artefact cache: store")
    phases.wrap(bundle.BundleWriter, "commit", "bundle: commit")

    stage = ete._stage

    @contextlib.contextmanager
    def timed_stage(name, say, times, beat_s=30.0):
        with phases.phase(f"export: {name}"), stage(name, say, times, beat_s):
            yield

    ete._stage = timed_stage


def print_rows(rows: list[dict]) -> None:
    print(f"{'phase':<52} {'CPU s':>8} {'wall s':>8}")
    for r in rows:
        print(f"{'  ' * r['depth'] + r['phase']:<52} {r['cpu_s']:>8.1f} {r['wall_s']:>8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="android")
    ap.add_argument("--cache", type=Path, default=None, help="artefact cache folder (default: a fresh empty one)")
    ap.add_argument("--keep", action="store_true", help="keep the bundle and the cache folder")
    ap.add_argument("--out", type=Path, default=RESULTS / "build_phases.json")
    ap.add_argument("--code", default=None, help="label of the code measured (default: the commit)")
    args = ap.parse_args()
    if args.code is None:
        import subprocess

        args.code = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                   cwd=Path(__file__).resolve().parent).stdout.strip()
    load_before = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="edgefinfer-build-phases-"))
    os.environ["EDGEFINFER_CACHE"] = str(args.cache or tmp / "cache")
    phases = Phases()
    cpu0, wall0 = cpu_s(), time.perf_counter()
    with phases.phase("imports (torch, edgefinfer)"):
        import torch  # noqa: F401
        from edgefinfer.app.build import BuildOptions, build

        quiet = owner("quiet", "edgefinfer.libraries.quiet", "edgefinfer.quiet").quiet

        instrument(phases)
    with quiet(True), phases.phase("build"):
        bundle = build(BuildOptions(target=args.target, out=tmp / "bundle"))
    manifest = json.loads((bundle / "manifest.json").read_text())
    total = {"cpu_s": round(cpu_s() - cpu0, 1), "wall_s": round(time.perf_counter() - wall0, 1)}
    print_rows(phases.rows)
    print(f"total: {total['cpu_s']} s CPU, {total['wall_s']} s wall (process start-up not included)")
    model = next(a for a in manifest["artefacts"] if a["role"] == "model")
    run = {"code": args.code, "target": args.target, "total": total, "phases": phases.rows,
           "metrics": manifest.get("metrics"), "size_bytes": model.get("size"),
           "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()],
           "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    runs = json.loads(args.out.read_text())["runs"] if args.out.is_file() else []
    runs = [r for r in runs if r["code"] != args.code] + [run]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine(), "versions": versions("executorch", "torchao"),
                                    "runs": runs}, indent=1) + "\n")
    if not args.keep:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"kept {tmp}")


if __name__ == "__main__":
    main()
