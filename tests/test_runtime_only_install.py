"""A phone-side install: a fresh virtualenv with only the `runtime` extra runs a bundle, and the
runtime never imports an exporter (edgefinfer.compile, onnx, torchao, transformers); `edgefinfer run`
on an ONNX bundle or a GGUF never imports torch (nor, on a GGUF, ONNX Runtime), on a .pte none of
ExecuTorch's exporter (exir) nor torch's compiler, and prints the tokens the Engine gives in-process."""

import hashlib
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from edgefinfer.app.build import BuildOptions, build
from edgefinfer.model.checkpoint import save_model
from tests.helpers import tiny_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
CHECK = """
import sys
from edgefinfer.runtime.engine import Engine
out = Engine.load(sys.argv[1]).generate("It is a truth", max_tokens=8)
banned = [m for m in sys.modules if m.split(".")[0] in ("onnx", "torchao", "transformers", "onnxscript")
          or m.startswith("edgefinfer.compile")]
assert not banned, banned
print("tokens", out.token_ids)
"""


@pytest.fixture(scope="module")
def onnx_bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("rt")
    tok = tiny_tokenizer(320)
    tok.eos_token = None
    save_model(tiny_model(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                          max_position_embeddings=256, eos_token_id=None), root / "m")
    tok.save(root / "m")
    return build(BuildOptions(target="linux-x86_64", model=root / "m", out=root / "bundle", eval_tokens=0,
                              max_seq_len=128))


def test_runtime_never_imports_the_exporters(onnx_bundle):
    proc = subprocess.run([sys.executable, "-c", CHECK, str(onnx_bundle)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("tokens")


def _runtime_venv(env: dict[str, str]) -> Path:
    """A virtualenv holding the `runtime` extra's dependencies and nothing else, kept between runs in the
    cache, keyed on pyproject.toml and this Python (what decides what pip installs): a first run creates
    it (minutes), later ones reuse it. This checkout's own code is reinstalled into it every time, so the
    test always runs the code under test."""
    from edgefinfer.files.user_cache import cache_dir

    key = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + sys.version.encode()).hexdigest()[:16]
    env_dir = cache_dir() / "test-venvs" / f"runtime-{key}"
    done = env_dir / ".complete"  # written last: a venv without it was interrupted and is made again
    py = env_dir / "bin" / "python"
    if not done.is_file():
        shutil.rmtree(env_dir, ignore_errors=True)
        venv.EnvBuilder(with_pip=True).create(env_dir)
        install = subprocess.run([str(py), "-m", "pip", "install", "-q", f"{ROOT}[runtime]"], capture_output=True,
                                 text=True, timeout=1200, env=env)
        assert install.returncode == 0, install.stderr[-2000:]
        done.touch()
    else:  # the dependencies are the extra's; only our package changes between runs
        install = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(ROOT)],
                                 capture_output=True, text=True, timeout=600, env=env)
        assert install.returncode == 0, install.stderr[-2000:]
    return env_dir


@pytest.mark.install
def test_runtime_extra_alone_runs_a_bundle(onnx_bundle, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env_dir = _runtime_venv(env)
    py = env_dir / "bin" / "python"
    listed = subprocess.run([str(py), "-m", "pip", "list"], capture_output=True, text=True, env=env).stdout
    for absent in ("transformers", "onnxscript", "llama_cpp_python", "fastapi"):
        assert absent not in listed.replace("-", "_").lower(), absent
    proc = subprocess.run([str(py), "-c", CHECK, str(onnx_bundle)], capture_output=True, text=True, timeout=300,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cli = subprocess.run([str(env_dir / "bin" / "edgefinfer"), "run", str(onnx_bundle), "-p", "It is", "-n", "4",
                          "--no-stream"], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert cli.returncode == 0, cli.stderr[-2000:]


# `edgefinfer run ARGS` as the console command runs it, reporting at exit which heavy packages got loaded.
RUN_REPORTING_MODULES = """
import atexit, runpy, sys
HEAVY = ("torch", "onnxruntime", "gguf", "transformers", "executorch")
# What only an exporter needs (ExecuTorch's Python wrappers import them: seconds of a .pte's start).
EXPORTERS = ("executorch.exir", "torch._inductor", "torch._dynamo")
# What a plain prompt does not need: llama-cpp-python's high-level `Llama` and a chat template's jinja2
# never; tokenizers not on a GGUF (its own vocabulary splits, llamacpp_tokenizer).
UNUSED = ("llama_cpp.llama", "jinja2", "tokenizers")
atexit.register(lambda: sys.stderr.write("\\nLOADED " + ",".join(sorted({m.split(".")[0] for m in sys.modules
                                                                         if m.split(".")[0] in HEAVY}))
                                         + " EXPORTERS " + ",".join(sorted({e for e in EXPORTERS for m in sys.modules
                                                                            if m == e or m.startswith(e + ".")}))
                                         + " UNUSED " + ",".join(sorted({e for e in UNUSED for m in sys.modules
                                                                         if m == e or m.startswith(e + ".")}))
                                         + "\\n"))
sys.argv = ["edgefinfer", "run", *sys.argv[1:]]
runpy.run_module("edgefinfer", run_name="__main__")
"""


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    from tests.server_harness import tiny_gguf

    return tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def gguf_bundle(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    root = tmp_path_factory.mktemp("gpu")
    tok = tiny_tokenizer(320)  # its config names its EOS, as a real model's does (else gguf-py reads the file's)
    save_model(tiny_model(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                          max_position_embeddings=256, eos_token_id=tok.eos_id), root / "m")
    tok.save(root / "m")
    return build(BuildOptions(target="gpu-server", model=root / "m", out=root / "bundle", eval_tokens=0))


@pytest.fixture(scope="module")
def pte_file(tmp_path_factory):
    """A .pte using both kernel libraries (4-bit embedding, the LLM custom ops), its tokenizer beside it."""
    pytest.importorskip("executorch")
    from edgefinfer.compile.executorch_export import export_pte

    root = tmp_path_factory.mktemp("pte")
    tok = tiny_tokenizer(320)
    tok.eos_token = None
    model = tiny_model(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, max_position_embeddings=256,
                       eos_token_id=None)
    export_pte(model, root / "model.pte", recipe="8da4w", embedding_4bit=True, max_seq_len=128, progress=False,
               cache=False)
    tok.save(root)
    return root / "model.pte"


# A GGUF, bare or in a bundle, is tokenized by llama.cpp (neither gguf-py nor tokenizers). A .pte needs torch
# (ExecuTorch's runtime extension links libtorch) but nothing of an exporter.
@pytest.mark.parametrize("artefact, allowed", [("onnx_bundle", {"onnxruntime"}), ("gguf_file", set()),
                                               ("gguf_bundle", set()), ("pte_file", {"torch", "executorch"})])
def test_run_loads_only_the_runtime_it_needs(request, artefact, allowed):
    from edgefinfer.runtime.engine import Engine

    path = request.getfixturevalue(artefact)
    prompt = "It is a truth"
    proc = subprocess.run([sys.executable, "-c", RUN_REPORTING_MODULES, str(path), "-p", prompt, "--max-tokens", "8",
                           "--threads", "1"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    report = proc.stderr.rsplit("LOADED ", 1)[1].split("\n")[0]
    loaded_text, _, rest = report.partition(" EXPORTERS ")
    exporters, _, unused = rest.partition(" UNUSED ")
    loaded = set(loaded_text.split(",")) - {""}
    assert loaded == allowed, proc.stderr  # no torch: greedy decoding on ONNX Runtime and llama.cpp needs none
    assert exporters == "", proc.stderr
    assert unused == ("" if artefact.startswith("gguf") else "tokenizers"), proc.stderr
    expect = Engine.load(path, threads=1).generate(prompt, max_tokens=8)
    assert expect.token_ids
    assert proc.stdout == expect.text + "\n"  # the same tokens as the Engine in-process


def test_a_bundle_parses_its_tokenizer_while_the_weights_load(onnx_bundle, monkeypatch):
    # tokenizers' parse holds the GIL throughout: started before the backend reached its native load, it
    # kept the main thread's Python waiting (no overlap); it starts when the backend calls native_load.
    import time

    from edgefinfer.runtime import engine
    from edgefinfer.tokenization.tokenizer import Tokenizer

    events = []
    real_open, real_from_dir = engine._open, Tokenizer.from_dir.__func__

    def open_slowly(*args, **kw):
        native_load = args[-1]
        events.append("python before the load")
        time.sleep(0.3)  # a parse started now would be recorded before the load
        native_load()
        time.sleep(1.0)  # the native load (GIL released): the parse runs here
        events.append("native load done")
        return real_open(*args[:-1], **kw)

    def from_dir(cls, path):
        events.append("parse")
        return real_from_dir(cls, path)

    monkeypatch.setattr(engine, "_open", open_slowly)
    monkeypatch.setattr(Tokenizer, "from_dir", classmethod(from_dir))
    backend, tokenizer, _ = engine.open_backend(onnx_bundle, threads=1)
    assert events == ["python before the load", "parse", "native load done"]
    assert tokenizer.vocab_size == backend.vocab_size


@pytest.mark.parametrize("artefact", ["onnx_bundle", "gguf_file"])
def test_backends_call_native_load_once_before_loading(request, artefact):
    """Once, and by the time the backend exists: llama.cpp right before its native load, ONNX Runtime
    GRAPH_READ_S into its session build or at its end, whichever comes first."""
    path = request.getfixturevalue(artefact)
    calls = []
    if artefact == "gguf_file":
        from edgefinfer.runtime.backends.llamacpp import LlamaCppBackend

        LlamaCppBackend(path, n_ctx=64, threads=1, native_load=lambda: calls.append(1))
    else:
        from edgefinfer.runtime.backends.ort import OrtBackend

        OrtBackend(path, threads=1, native_load=lambda: calls.append(1))
    assert calls == [1]


def test_run_starts_loading_a_gguf_bundle_before_importing_numpy(gguf_bundle):
    """`edgefinfer run` starts llama.cpp's load of a GGUF bundle in a thread before numpy and the runtime
    import, and the Engine takes that model instead of loading the file again."""
    code = f"""
import sys
from edgefinfer.runtime.backends import llamacpp_lib
from edgefinfer.runtime.early import start_loading
start_loading({str(gguf_bundle)!r}, None)
print("early", sorted(map(str, llamacpp_lib._early)), "numpy" in sys.modules)
taken = []
real = llamacpp_lib.take_early_load
def take(path):
    model = real(path)
    taken.append(model is not None)
    return model
import edgefinfer.runtime.backends.llamacpp_binding as binding
binding.take_early_load = take
from edgefinfer.runtime.engine import Engine
out = Engine.load({str(gguf_bundle)!r}, threads=1).generate("It is a truth", max_tokens=4)
print("taken", taken, llamacpp_lib._early, out.token_ids)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    early, taken = proc.stdout.splitlines()
    assert early == f"early ['{(gguf_bundle / 'model.gguf').resolve()}'] False"
    from edgefinfer.runtime.engine import Engine

    expect = Engine.load(gguf_bundle, threads=1).generate("It is a truth", max_tokens=4).token_ids
    assert taken == f"taken [True] {{}} {expect}"


def test_an_early_load_of_a_bad_gguf_leaves_the_error_to_the_engine(tmp_path):
    from edgefinfer.errors import UserError
    from edgefinfer.runtime.backends import llamacpp_lib
    from edgefinfer.runtime.backends.llamacpp_binding import LlamaModel

    pytest.importorskip("llama_cpp")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 60)
    llamacpp_lib.start_early_load(bad)
    with pytest.raises(UserError) as e:
        LlamaModel(bad)
    assert "\n" not in str(e.value) and str(bad) in str(e.value)
    assert llamacpp_lib.take_early_load(bad) is None  # the thread loaded nothing (the header check failed)
