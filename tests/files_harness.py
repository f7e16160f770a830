"""Crash-safety trials of bundle writes, shared by tests/test_atomic.py and bench/reliability_files.py.

`kill9_trials`: a gpu-server build of a tiny model is killed with SIGKILL at random moments while it
replaces an existing bundle; the destination must always verify (`load_manifest`: every artefact's size
and sha256) as either the old bundle or the new one. `disk_full_trial`: the same build under an
RLIMIT_FSIZE that a file of the build overruns (EFBIG, as a full disk gives ENOSPC) must end with one
error line, a non-zero exit, and the old bundle intact."""

from __future__ import annotations

import hashlib
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from edgefinfer.files.atomic import atomic_dir
from edgefinfer.bundle.manifest import MANIFEST, load_manifest
from edgefinfer.errors import UserError

OLD_RECIPE, NEW_RECIPE = "llamacpp-q4_1", "int8-g32-emb8"  # two bundles that differ in every artefact


def make_tiny_model_dir(folder: Path) -> Path:
    """A random tiny Llama with a trained BPE tokenizer, as a HF folder (a build of it takes seconds)."""
    from edgefinfer.model.checkpoint import save_model
    from tests.helpers import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer(320)
    save_model(tiny_model(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                          max_position_embeddings=256), folder)
    tok.save(folder)
    return folder


def build_command(model_dir: Path, dest: Path, recipe: str | None = None) -> list[str]:
    return [sys.executable, "-m", "edgefinfer", "build", "--target", "gpu-server", "--model", str(model_dir),
            "-o", str(dest), "--eval-tokens", "64", *(["--recipe", recipe] if recipe else [])]


def build(model_dir: Path, dest: Path, recipe: str | None = None, timeout: float = 600) -> None:
    proc = subprocess.run(build_command(model_dir, dest, recipe), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"build of {dest} failed: {proc.stderr[-2000:]}")


def bundle_state(dest: Path) -> str:
    """'old' or 'new' (a bundle that verifies, by recipe), else what is wrong with the destination."""
    try:
        recipe = load_manifest(dest, target="gpu-server").recipe.get("name")
    except UserError as e:
        return f"bad: {e}"
    return {OLD_RECIPE: "old", NEW_RECIPE: "new"}.get(recipe, f"bad: recipe {recipe}")


def leftovers(dest: Path) -> list[str]:
    return sorted(p.name for p in dest.parent.iterdir() if p.name != dest.name)


def build_old_bundle(model_dir: Path, dest: Path) -> float:
    """The bundle every trial replaces; returns how long its build took (the kill moments spread over
    about that much)."""
    t0 = time.perf_counter()
    build(model_dir, dest, OLD_RECIPE)
    return time.perf_counter() - t0


def restore(old: Path, dest: Path) -> None:
    """Write `old` over `dest` the crash-safe way (this write also removes the dead writers' leftovers)."""
    with atomic_dir(dest) as tmp:
        shutil.copytree(old, tmp, dirs_exist_ok=True)


def kill9_trials(workdir: Path, model_dir: Path, old: Path, build_s: float | None, trials: int,
                 seed: int = 0) -> dict:
    """SIGKILL a build that replaces the `old` bundle by a new one at `trials` random moments between 0.2
    and 1.1 times `build_s` (None: the time a whole replacing build takes, measured first)."""
    rng = random.Random(seed)
    dest = workdir / "dist" / "gpu"
    if build_s is None:
        restore(old, dest)
        t0 = time.perf_counter()
        build(model_dir, dest, NEW_RECIPE)
        build_s = time.perf_counter() - t0
    outcomes: dict[str, int] = {}
    bad, finished, with_leftovers = [], 0, 0
    for i in range(trials):
        restore(old, dest)
        proc = subprocess.Popen(build_command(model_dir, dest, NEW_RECIPE), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        at = rng.uniform(0.2, 1.1) * build_s
        try:
            proc.wait(timeout=at)
            finished += 1
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        state = bundle_state(dest)
        outcomes[state if not state.startswith("bad") else "bad"] = outcomes.get(state, 0) + 1
        if state.startswith("bad"):
            bad.append({"trial": i, "killed_at_s": round(at, 2), "state": state})
        with_leftovers += bool(leftovers(dest))
    restore(old, dest)
    return {"kill9_trials": trials, "bad_destinations": len(bad), "kill9": {
        "build_s": round(build_s, 2), "outcomes": outcomes, "finished_before_kill": finished,
        "trials_with_leftovers": with_leftovers, "leftovers_after_next_write": leftovers(dest), "bad": bad}}


def disk_full_trial(workdir: Path, model_dir: Path, old: Path, limit_bytes: int = 50_000) -> dict:
    """A build over the `old` bundle whose process may not write a file past `limit_bytes`."""
    dest = workdir / "full" / "gpu"
    restore(old, dest)
    before = hashlib.sha256((dest / MANIFEST).read_bytes()).hexdigest()

    def limit() -> None:  # EFBIG instead of the default SIGXFSZ, which would kill the process
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    proc = subprocess.run(build_command(model_dir, dest, NEW_RECIPE), capture_output=True, text=True,
                          preexec_fn=limit, timeout=600)
    lines = proc.stderr.strip().splitlines()
    return {"limit_bytes": limit_bytes, "exit_code": proc.returncode, "last_line": lines[-1] if lines else "",
            "error_lines": sum(line.startswith("error:") for line in lines),
            "traceback": "Traceback" in proc.stderr, "previous_bundle": bundle_state(dest),
            "previous_manifest_unchanged": hashlib.sha256((dest / MANIFEST).read_bytes()).hexdigest() == before,
            "leftovers": leftovers(dest)}
