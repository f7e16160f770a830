"""bench/first_run.py without running it (a fresh-clone `make demo` takes 30+ minutes): its arguments, how
it reads the demo's parts from the build's progress lines, and the results file it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import first_run

SCRIPT = Path(first_run.__file__)
# What `make demo` prints, time-stamped: pip first, then the build's five steps, the summary, the chat.
DEMO = [(0.5, "pip install -q -e '.[data,compile,runtime]'"),
        (300.0, "[build 1/5] load /x/smollm2 ..."), (304.0, "[build 1/5] load /x/smollm2 done in 4.0s"),
        (304.0, "[build 2/5] float perplexity (eager torch) ..."),
        (320.0, "[build 2/5] float perplexity (eager torch) done in 16.0s: 45.160"),
        (320.0, "[build 3/5] quantize (8da4w-g32-fzp) ..."),
        (330.0, "[build 3/5] quantize (8da4w-g32-fzp) done in 10.0s: 8da4w-g32-fzp"),
        (330.0, "[build 4/5] compile pte for android (8da4w-g32-fzp) ..."),
        (630.0, "[executorch] lower (xnnpack) ... 30s"),
        (700.0, "[build 4/5] compile pte for android (8da4w-g32-fzp) done in 370.0s (reused the artefact cache)"),
        (700.0, "[build 5/5] evaluate the artefact with its runtime ..."),
        (760.0, "[build 5/5] evaluate the artefact with its runtime done in 60.0s"),
        (761.0, "android  8da4w-g32-fzp  model.pte  125.0  46.004  +1.87%"),
        (790.0, "The capital of France is Paris.")]


def test_the_parts_come_from_the_builds_progress_lines():
    parts = first_run.build_parts(DEMO)
    assert parts == {"install_s": 300.0, "load_s": 4.0, "float_eval_s": 16.0, "quantize_s": 10.0, "lower_s": 370.0,
                     "evaluate_s": 60.0, "run_s": 30.0, "build_s": 460.0}
    assert first_run.said_reused(DEMO) and not first_run.said_reused(DEMO[:8])


def test_output_without_build_lines_leaves_the_parts_unknown():
    parts = first_run.build_parts([(1.0, "make: *** [demo] Error 2")])
    assert set(parts.values()) == {None}


def test_the_results_file_has_the_goal_keys_and_is_written_whole(tmp_path):
    payload = first_run.results(demo_s=790.04, parts=first_run.build_parts(DEMO), cached_build_s=41.26,
                                cached_parts=first_run.build_parts(DEMO[1:]), cache_hit=True, ci_s=None,
                                ppl_delta_pct=1.87, uptime_before="load average: 0.1",
                                uptime_after="load average: 2.0", commit="abc")
    path = first_run.write_json(tmp_path / "results" / "first_run.json", payload)
    got = json.loads(path.read_text())
    assert {"cold_build_s", "cached_build_s", "demo_s", "ci_s", "ppl_delta_pct", "parts_s", "uptime_before",
            "uptime_after"} <= set(got)
    assert got["cold_build_s"] == 460.0 and got["cached_build_s"] == 41.3 and got["demo_s"] == 790.0
    assert got["ci_s"] is None and got["parts_s"]["lower_s"] == 370.0 and got["cached_parts_s"]["install_s"] == 300.0
    assert [p.name for p in path.parent.iterdir()] == ["first_run.json"]  # no temporary left beside it


def test_arguments(tmp_path):
    args = first_run.parse_args(["--ci", "--out", str(tmp_path / "r.json")])
    assert args.ci and args.out == tmp_path / "r.json" and (args.repo / ".git").exists()
    assert not first_run.parse_args([]).ci


def test_a_folder_that_is_not_a_repository_is_one_usage_line(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--repo", str(tmp_path)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(SCRIPT.parent.parent)}, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith(f"{tmp_path} is not a git repository; "
                                                        f"pass --repo with the folder of a clone")
    assert not (tmp_path / "first_run.json").exists()


@pytest.mark.parametrize("argv", [["--bogus"], ["--out"]])
def test_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as e:
        first_run.parse_args(argv)
    assert e.value.code == 2
