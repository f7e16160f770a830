"""First run as a new user has it (issue 30's goals): `make demo` on a fresh clone with an empty
edgefinfer cache and pip's wheel cache warm, then the same build again (an artefact-cache hit).

    python bench/first_run.py [--ci] [--repo PATH] [--keep] [--out PATH]

1. `git clone` of the repository (its committed HEAD) into a temporary folder, with
   `EDGEFINFER_CACHE` pointed at an empty folder there (pip's own cache is left as it is: warm).
2. `make demo` in the clone, every output line time-stamped as it arrives: its parts are read from
   the build's progress lines (`[build i/5] ... done in Xs`): install (until the build starts), load,
   float perplexity, quantize, lower (the compile step), evaluate, and the final `edgefinfer run`.
3. The same `edgefinfer build --target android` again (a new output folder, the same cache): its wall
   time, and whether it said it reused the artefact cache.
4. `--ci`: `bash .ci/run` in the clone (`make test`), wall time.

Writes bench/results/first_run.json: `cold_build_s`, `cached_build_s`, `demo_s`, `ci_s` (null without
--ci), `ppl_delta_pct` (the demo bundle's, measured by ExecuTorch), `parts_s` and `cached_parts_s`,
`cache_hit`, and the `uptime` load before and after (a busy host slows every part). It takes 30+
minutes on 2 cores: run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, uptime  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEMO_BUNDLE = "dist/android"  # where the Makefile's demo writes its bundle
REBUILD = ["build", "--target", "android", "-o", "dist/android-again"]  # the demo's build, to a new folder
# `[build 3/5] quantize (8da4w-g32-fzp) done in 12.3s`: the build's progress lines (edgefinfer.app.build)
STEP = re.compile(r"^\[build (\d)/(\d)\] (.*?)(?: done in ([\d.]+)s(.*))?$")
PARTS = {1: "load_s", 2: "float_eval_s", 3: "quantize_s", 4: "lower_s", 5: "evaluate_s"}
REUSED = "reused the artefact cache"

Line = tuple[float, str]  # (seconds since the command started, the line)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", type=Path, default=REPO, help="the repository to clone (default: this one)")
    p.add_argument("--ci", action="store_true", help="also time `bash .ci/run` (the whole test suite) in the clone")
    p.add_argument("--keep", action="store_true", help="keep the clone and its cache (the folder is printed)")
    p.add_argument("--out", type=Path, default=RESULTS / "first_run.json", help="the results file")
    args = p.parse_args(argv)
    if not (args.repo / ".git").exists():
        p.error(f"{args.repo} is not a git repository; pass --repo with the folder of a clone")
    return args


def build_parts(lines: Sequence[Line]) -> dict[str, float | None]:
    """The demo's parts from its time-stamped output: each build step's own `done in` figure; install is
    everything before the build's first line, run everything after its last."""
    parts: dict[str, float | None] = {"install_s": None, **{v: None for v in PARTS.values()}, "run_s": None,
                                      "build_s": None}
    first = last = None
    for t, line in lines:
        m = STEP.match(line.strip())
        if not m:
            continue
        first = t if first is None else first
        if m[4] is not None:
            parts[PARTS.get(int(m[1]), f"step{m[1]}_s")] = float(m[4])
            last = t
    if first is not None:
        parts["install_s"] = round(first, 1)
    if first is not None and last is not None:
        parts["build_s"] = round(last - first, 1)
        parts["run_s"] = round(lines[-1][0] - last, 1) if lines else None
    return parts


def said_reused(lines: Sequence[Line]) -> bool:
    return any(REUSED in line for _, line in lines)


def results(*, demo_s: float, parts: dict, cached_build_s: float, cached_parts: dict, cache_hit: bool,
            ci_s: float | None,
            ppl_delta_pct: float | None, uptime_before: str, uptime_after: str, commit: str) -> dict:
    """The results file's payload (the keys issue 30's goals name first)."""
    return {
        "cold_build_s": parts.get("build_s"),
        "cached_build_s": round(cached_build_s, 1),
        "demo_s": round(demo_s, 1),
        "ci_s": None if ci_s is None else round(ci_s, 1),
        "ppl_delta_pct": ppl_delta_pct,
        "cache_hit": cache_hit,
        "parts_s": parts,
        "cached_parts_s": cached_parts,  # install_s here: the interpreter's start and imports
        "uptime_before": uptime_before,
        "uptime_after": uptime_after,
        "commit": commit,
        "goals_s": {"cold_build_s": 360, "cached_build_s": 60, "demo_s": 600, "ci_s": 900},
    }


def write_json(path: Path, payload: dict) -> Path:
    from edgefinfer.files.atomic import write_bytes

    write_bytes(Path(path), (json.dumps(payload, indent=2) + "\n").encode())
    return Path(path)


def timed(cmd: Sequence[str], cwd: Path, env: dict[str, str]) -> tuple[float, list[Line], int]:
    """Run `cmd`, echoing and time-stamping each output line (stdout and stderr merged)."""
    t0 = time.perf_counter()
    lines: list[Line] = []
    with subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          bufsize=1) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.perf_counter() - t0, line.rstrip("\n")))
            print(f"  | {line}", end="", flush=True)
    return time.perf_counter() - t0, lines, proc.returncode


def _check(what: str, rc: int, lines: Sequence[Line]) -> None:
    if rc != 0:
        tail = lines[-1][1] if lines else "no output"
        raise SystemExit(f"first_run: {what} failed (exit {rc}): {tail}")


def _ppl_delta(bundle: Path) -> float | None:
    metrics = json.loads((bundle / "manifest.json").read_text()).get("metrics", {})
    return metrics.get("ppl_delta_pct")


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    before = uptime()
    work = Path(tempfile.mkdtemp(prefix="edgefinfer-first-run-"))
    clone, cache = work / "clone", work / "cache"
    env = {**os.environ, "EDGEFINFER_CACHE": str(cache)}  # an empty edgefinfer cache; pip's stays warm
    env.pop("VIRTUAL_ENV", None)  # the clone's Makefile makes its own .venv
    try:
        subprocess.run(["git", "clone", "--quiet", str(args.repo), str(clone)], check=True)
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True).stdout.strip()
        print(f"first_run: fresh clone of {commit[:12]} in {clone}, cache {cache}", flush=True)
        demo_s, demo_lines, rc = timed(["make", "demo"], clone, env)
        _check("make demo", rc, demo_lines)
        again_s, again_lines, rc = timed([str(clone / ".venv/bin/edgefinfer"), *REBUILD], clone, env)
        _check("the second build", rc, again_lines)
        ci_s = None
        if args.ci:
            ci_s, ci_lines, rc = timed(["bash", ".ci/run"], clone, env)
            _check("bash .ci/run", rc, ci_lines)
        payload = results(demo_s=demo_s, parts=build_parts(demo_lines), cached_build_s=again_s,
                          cached_parts=build_parts(again_lines), cache_hit=said_reused(again_lines), ci_s=ci_s,
                          ppl_delta_pct=_ppl_delta(clone / DEMO_BUNDLE),
                          uptime_before=before, uptime_after=uptime(), commit=commit)
        payload["machine"] = machine()
    finally:
        if args.keep:
            print(f"first_run: kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    path = write_json(args.out, payload)
    print(f"\n{'demo s':>8} {'cold build s':>13} {'cached build s':>15} {'ci s':>7} {'ppl delta %':>12}")
    print(f"{payload['demo_s']:>8.1f} {_fmt(payload['cold_build_s'], '13.1f')} {payload['cached_build_s']:>15.1f} "
          f"{_fmt(payload['ci_s'], '7.1f')} {_fmt(payload['ppl_delta_pct'], '+12.2f')}")
    print(f"parts: {payload['parts_s']}\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
