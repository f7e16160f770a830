"""Reliability of bundles and model files (issue 17, items 1 and 5); bench/reliability.py includes it.

    python bench/reliability_files.py            # the full run (~5 min on 2 cores)
    python bench/reliability_files.py --quick    # about a minute

- The regression corpus (tests/test_bundle_hostile.py, tests/test_model_files_hostile.py) applied to a
  real gpu-server bundle of a tiny model: "bundle_mutations", "bundle_refused" (every one, with a
  one-line UserError), "tracebacks" (goal 0). The GGUF mutations also go through `edgefinfer run` in a
  subprocess ("cli": exit 2 expected; a negative code is a native crash), all of them in the full run,
  the three that abort llama.cpp unchecked in --quick.
- "fuzz": Hypothesis over the manifest parser (any JSON value; a good manifest with one field replaced)
  and the GGUF header parser (a good GGUF with bytes overwritten or cut): tracebacks (goal 0); the
  mutants our check accepts are then loaded and run by llama.cpp in a subprocess, counting native
  crashes (goal 0).
- "kill9_trials" / "bad_destinations": a build replacing a bundle is SIGKILLed at random moments; the
  destination must verify as the old or the new bundle (goal 0 bad). "disk_full": the same build with
  RLIMIT_FSIZE: exit code, the error line, the old bundle intact.

Writes bench/results/reliability_files.json (-quick.json with --quick).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import print_table, write_results  # noqa: E402


def step(text: str) -> None:
    print(f"-- {text}", flush=True)


# ---- the regression corpus ---------------------------------------------------------------------------
class Tally:
    """Outcomes of feeding inputs to a reader: refused in one line, accepted, or a traceback."""

    def __init__(self) -> None:
        self.n = self.refused = self.accepted = 0
        self.tracebacks: list[str] = []

    def feed(self, name: str, read: Callable[[], Any]) -> bool:
        """Run `read`; True if it accepted the input."""
        from edgefinfer.errors import UserError

        self.n += 1
        try:
            read()
        except UserError as e:
            if "\n" in str(e) or not str(e):
                self.tracebacks.append(f"{name}: a UserError that is not one line")
            self.refused += 1
            return False
        except Exception as e:  # noqa: BLE001 - what the bench counts
            self.tracebacks.append(f"{name}: {type(e).__name__}: {str(e)[:120]}")
            return False
        self.accepted += 1
        return True

    def summary(self) -> dict:
        return {"mutations": self.n, "refused": self.refused, "accepted": self.accepted,
                "tracebacks": len(self.tracebacks), "traceback_examples": self.tracebacks[:5]}


def bundle_corpus(work: Path) -> dict:
    import tests.test_bundle_hostile as tb
    from edgefinfer.bundle.manifest import MANIFEST, load_manifest

    tally = Tally()
    for name, edit in tb.MANIFEST_EDITS.items():
        case = work / "bundle" / name.replace(" ", "_")
        bundle = tb.good_bundle(case / "b")
        tb.outside_file(case)
        (bundle / MANIFEST).write_text(json.dumps(edit(tb.manifest_of(bundle), case)))
        tally.feed(f"manifest: {name}", lambda: load_manifest(bundle))
    for name, edit in tb.FILE_EDITS.items():
        case = work / "bundle-files" / name.replace(" ", "_")
        bundle = tb.good_bundle(case / "b")
        edit(bundle, case)
        tally.feed(f"file: {name}", lambda: load_manifest(bundle))
    return tally.summary()


def model_file_corpus(work: Path, model_dir: Path, gpu: Path) -> dict:
    import tests.test_model_files_hostile as tm
    from edgefinfer.model.checkpoint import load_model
    from edgefinfer.model.gguf_import import open_gguf
    from edgefinfer.tokenization.tokenizer import Tokenizer

    tally = Tally()
    data = (gpu / "model.gguf").read_bytes()
    layout = tm._gguf_layout(data, work)
    for name, (edit, _) in tm.GGUF_EDITS.items():
        file = work / "gguf" / f"{name.replace(' ', '_')}.gguf"
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_bytes(edit(data, layout))
        tally.feed(f"gguf: {name}", lambda: open_gguf(file))  # our check, then gguf-py's reader

    def hf_case(name: str, file: str, new: bytes, read: Callable[[Path], Any]) -> None:
        folder = work / "hf" / name.replace(" ", "_")
        shutil.copytree(model_dir, folder)
        (folder / file).write_bytes(new)
        tally.feed(f"{file}: {name}", lambda: read(folder))

    weights = (model_dir / "model.safetensors").read_bytes()
    for name, edit in tm.SAFETENSORS_EDITS.items():
        hf_case(name, "model.safetensors", edit(weights), load_model)
    config = json.loads((model_dir / "config.json").read_text())
    for name, (edit, _) in tm.CONFIG_EDITS.items():
        hf_case(name, "config.json", json.dumps(edit(config)).encode(), load_model)
    for name, (file, text, _) in tm.TOKENIZER_EDITS.items():
        hf_case(name, file, text.encode(), Tokenizer.from_dir)
    return tally.summary()


def cli_gguf_runs(work: Path, gpu: Path, names: list[str]) -> dict:
    """`edgefinfer run` on bundles whose GGUF is hostile and whose manifest vouches for it."""
    import tests.test_model_files_hostile as tm

    work.mkdir(parents=True, exist_ok=True)
    data = (gpu / "model.gguf").read_bytes()
    layout = tm._gguf_layout(data, work)
    codes: list[int] = []
    bad = []
    for i, name in enumerate(names):
        bundle = tm._hostile_bundle(gpu, work / "cli" / str(i), "model.gguf", tm.GGUF_EDITS[name][0](data, layout))
        proc = subprocess.run([sys.executable, "-m", "edgefinfer", "run", str(bundle), "-p", "hi", "--max-tokens", "2"],
                              capture_output=True, text=True, timeout=300)
        codes.append(proc.returncode)
        if proc.returncode != 2 or proc.stderr.strip().count("\n") or "Traceback" in proc.stderr:
            bad.append({"mutation": name, "exit_code": proc.returncode, "stderr": proc.stderr.strip()[-300:]})
    return {"runs": len(names), "exit_codes": {str(c): codes.count(c) for c in sorted(set(codes))},
            "native_crashes": sum(c < 0 for c in codes), "not_one_line_exit_2": bad}


# ---- fuzzing ----------------------------------------------------------------------------------------------
def fuzz_manifest(good: dict, examples: int) -> dict:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from edgefinfer.bundle.manifest import parse_manifest

    json_values = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
        max_leaves=12)
    keys = sorted(good) + ["artefacts.0." + k for k in good["artefacts"][0]]

    def replace(key: str, value: Any) -> dict:
        m = json.loads(json.dumps(good))
        if key.startswith("artefacts.0."):
            m["artefacts"][0][key.removeprefix("artefacts.0.")] = value
        else:
            m[key] = value
        return m

    manifests = json_values | st.builds(replace, st.sampled_from(keys), json_values)
    tally = Tally()

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(manifests)
    def run(raw: Any) -> None:
        tally.feed(f"manifest {json.dumps(raw)[:80]}", lambda: parse_manifest(raw))

    run()
    return tally.summary()


def fuzz_gguf(good: bytes, work: Path, examples: int) -> tuple[dict, list[Path]]:
    """Overwrite 1-8 spans of the header (or cut the file) and read it with our check and gguf-py."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from edgefinfer.model.gguf_import import open_gguf
    from edgefinfer.files.untrusted import check_gguf

    header_end = min(len(good), 8192)  # metadata + tensor infos of the tiny model's GGUF
    spans = st.lists(st.tuples(st.integers(0, header_end - 1), st.binary(min_size=1, max_size=8)), min_size=1,
                     max_size=8)
    interesting = st.sampled_from([0, 1, 0xFF, 0xFFFFFFFF, 1 << 31, 1 << 40, 1 << 63, 2**64 - 1])
    words = st.lists(st.tuples(st.integers(0, header_end - 8), interesting), min_size=1, max_size=3)
    ours, gguf_py, accepted = Tally(), Tally(), []
    file = work / "fuzz.gguf"

    def mutate(data: bytes, edits: list[tuple[int, bytes]], cut: int | None) -> bytes:
        out = bytearray(data)
        for at, raw in edits:
            out[at:at + len(raw)] = raw
        return bytes(out[:cut] if cut is not None else out)

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(spans | words.map(lambda ws: [(at, v.to_bytes(8, "little")) for at, v in ws]),
           st.none() | st.integers(0, len(good)))
    def run(edits: list[tuple[int, bytes]], cut: int | None) -> None:
        data = mutate(good, edits, cut)
        file.write_bytes(data)
        if ours.feed(f"check_gguf {edits[:2]} cut {cut}", lambda: check_gguf(file)):
            keep = work / "accepted" / f"{hashlib.sha256(data).hexdigest()[:16]}.gguf"
            keep.parent.mkdir(exist_ok=True)
            if not keep.exists():
                keep.write_bytes(data)
                accepted.append(keep)
            gguf_py.feed(f"open_gguf {edits[:2]} cut {cut}", lambda: open_gguf(file))

    run()
    return {**ours.summary(), "gguf_py_after_check": gguf_py.summary()}, accepted


_LLAMA_WORKER = """
import sys, llama_cpp
for path in sys.argv[1:]:
    print(path, flush=True)
    try:
        m = llama_cpp.Llama(path, n_ctx=32, n_batch=32, verbose=False)
        m.eval(m.tokenize(b"It is", add_bos=False)[:4] or [0])
    except Exception:
        pass
"""


def llama_on(files: list[Path]) -> dict:
    """Load and run each file in llama.cpp (one worker process, restarted after a crash)."""
    crashes, left = [], list(files)
    while left:
        proc = subprocess.run([sys.executable, "-c", _LLAMA_WORKER, *map(str, left)], capture_output=True,
                              text=True, timeout=600)
        done = proc.stdout.split()
        if proc.returncode == 0:
            break
        crashes.append({"file": done[-1] if done else str(left[0]), "exit_code": proc.returncode})
        left = left[len(done):] if done else left[1:]
    return {"files": len(files), "native_crashes": len(crashes), "crash_examples": crashes[:5]}


# ---- run ------------------------------------------------------------------------------------------------
def run(quick: bool) -> dict:
    from edgefinfer.bundle.manifest import load_manifest
    from tests.files_harness import build_old_bundle, disk_full_trial, kill9_trials, make_tiny_model_dir
    from tests.test_model_files_hostile import LLAMA_CPP_ABORTS, GGUF_EDITS

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="edgefinfer-files-") as tmp:
        work = Path(tmp)
        step("a tiny model and its gpu-server bundle")
        model_dir = make_tiny_model_dir(work / "tiny")
        gpu = work / "gpu"
        build_old_bundle(model_dir, gpu)

        step("regression corpus: bundles (manifest, paths, files) and model files")
        bundles, models = bundle_corpus(work / "corpus"), model_file_corpus(work / "corpus", model_dir, gpu)
        out["bundle_mutations"] = bundles["mutations"] + models["mutations"]
        out["bundle_refused"] = bundles["refused"] + models["refused"]
        out["corpus"] = {"bundles": bundles, "model_files": models}
        names = list(LLAMA_CPP_ABORTS) if quick else list(GGUF_EDITS)
        step(f"`edgefinfer run` on {len(names)} bundles with a hostile GGUF")
        out["corpus"]["cli_gguf"] = cli_gguf_runs(work / "cli", gpu, names)

        n = 300 if quick else 3000
        step(f"fuzz: {n} manifests, {n} GGUF headers (Hypothesis)")
        manifest = json.loads((gpu / "manifest.json").read_text())
        gguf_fuzz, accepted = fuzz_gguf((gpu / "model.gguf").read_bytes(), work, n)
        cap = 10 if quick else 60
        step(f"llama.cpp on {min(cap, len(accepted))} of the {len(accepted)} fuzzed GGUFs our check accepts")
        out["fuzz"] = {"manifest": fuzz_manifest(manifest, n), "gguf": gguf_fuzz, "llama_cpp": llama_on(accepted[:cap])}
        out["tracebacks"] = (bundles["tracebacks"] + models["tracebacks"] + out["fuzz"]["manifest"]["tracebacks"]
                             + gguf_fuzz["tracebacks"] + gguf_fuzz["gguf_py_after_check"]["tracebacks"] + len(out["corpus"]["cli_gguf"]["not_one_line_exit_2"]))

        trials = 3 if quick else 10
        step(f"{trials} builds killed with SIGKILL at random moments")
        out.update(kill9_trials(work / "kill", model_dir, gpu, None, trials))
        step("a build on a full disk (RLIMIT_FSIZE)")
        out["disk_full"] = disk_full_trial(work / "disk", model_dir, gpu)
        load_manifest(gpu)  # the template bundle itself was never touched
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a run of about a minute")
    args = ap.parse_args()
    t0 = time.perf_counter()
    payload = {"quick": args.quick, **run(args.quick)}
    payload["seconds"] = round(time.perf_counter() - t0, 1)
    path = write_results("reliability_files", payload, quick=args.quick)
    fz, full, k9 = payload["fuzz"], payload["disk_full"], payload["kill9"]
    rows = [
        {"check": "mutations refused in one line", "value": f"{payload['bundle_refused']} / {payload['bundle_mutations']}",
         "goal": "all"},
        {"check": "tracebacks", "value": payload["tracebacks"], "goal": "0"},
        {"check": "`run` on hostile GGUF bundles: exit codes", "value": payload["corpus"]["cli_gguf"]["exit_codes"],
         "goal": "all 2"},
        {"check": "fuzz: manifests / GGUF headers", "value": f"{fz['manifest']['mutations']} / {fz['gguf']['mutations']}",
         "goal": ""},
        {"check": "fuzz: tracebacks", "value": fz["manifest"]["tracebacks"] + fz["gguf"]["tracebacks"], "goal": "0"},
        {"check": "fuzz: llama.cpp native crashes", "value": f"{fz['llama_cpp']['native_crashes']} of "
                                                             f"{fz['llama_cpp']['files']} accepted", "goal": "0"},
        {"check": "SIGKILL trials / bad destinations", "value": f"{payload['kill9_trials']} / {payload['bad_destinations']}",
         "goal": "10 / 0"},
        {"check": "SIGKILL outcomes", "value": k9["outcomes"], "goal": "old or new"},
        {"check": "full disk: exit, old bundle", "value": f"{full['exit_code']}, {full['previous_bundle']}",
         "goal": "2, old"},
    ]
    print()
    print_table(rows, ["check", "value", "goal"])
    print(f"\nwrote {path} in {payload['seconds']:.0f} s")


if __name__ == "__main__":
    main()
