"""The peers' own binaries, built once from the llama.cpp that the pinned llama-cpp-python vendors.

    python bench/peers.py llama-server                  # prints the binary's path, building it if needed
    python bench/peers.py llama-server -DGGML_CUDA=ON   # a CUDA build (bench/server_gpu.sh), cached apart
    python bench/peers.py llama-imatrix llama-quantize  # llama.cpp's importance matrix and quantizer tools
    python bench/peers.py genai-builder                 # onnxruntime-genai's model builder for Gemma 3 (below)

llama-cpp-python's sdist carries llama.cpp's full source (vendor/llama.cpp); building `llama-server`
from it with the same ggml flags as our wheel (the Makefile's CMAKE_ARGS) gives the peer the very
kernels our server calls, so a serving comparison measures the servers, not two builds of ggml.
The binary lives outside the repository, in ~/.cache/edgefinfer/peers/llama.cpp-<version>-<flags>/,
and is reused. The first build takes about 6 minutes on 2 cores (download, configure, ~150 objects).

onnxruntime-genai's model builder for Gemma 3 runs in a side environment (`genai_builder_python`): the
pinned onnxruntime-genai's builder (0.18, written against transformers 5) reads Gemma 3's RoPE as one flat
`rope_parameters` and `config.rope_local_base_freq`, but transformers 5's Gemma3TextConfig keeps one
`rope_parameters` per layer type and drops `rope_local_base_freq`, so that builder stops on
`KeyError: 'rope_type'` whichever transformers 5 is installed (and it imports transformers-5-only classes,
so an older transformers cannot stand in under it). onnxruntime-genai 0.14 is its last release whose
tests ran on transformers 4 (`transformers<5.0.0`); its builder reads Gemma 3's 4.x config as written.
So the builder comes from GENAI_BUILDER's pins, in ~/.cache/edgefinfer/peers/genai-builder-<pins>/,
and the model it writes runs on the pinned onnxruntime-genai's runtime, like any other genai model.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from importlib import metadata
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"  # pyproject.toml's pin
# The Makefile's flags (portable: no -march=native), and no libcurl: the server loads local files only.
GGML_FLAGS = ("-DGGML_NATIVE=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
              "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF")
CACHE = Path(os.environ.get("EDGEFINFER_PEERS", Path.home() / ".cache" / "edgefinfer" / "peers"))
# onnxruntime-genai's builder for models its current builder cannot read under transformers 5 (Gemma 3):
# its last transformers-4 release and the transformers 4 line's last release, with what that transformers
# needs below the versions we run. torch, onnx, onnxruntime, safetensors and numpy come from this
# environment (the side environment reads our site-packages after its own).
GENAI_BUILDER = {"onnxruntime-genai": "0.14.1", "transformers": "4.57.6", "huggingface-hub": "0.36.2",
                 "tokenizers": "0.22.2"}


def build_dir(extra_flags: tuple[str, ...] = ()) -> Path:
    flags = GGML_FLAGS + extra_flags
    tag = hashlib.sha256(" ".join(flags).encode()).hexdigest()[:8]
    return CACHE / f"llama.cpp-{LLAMA_CPP_PYTHON}-{tag}"


def _log(msg: str) -> None:
    print(f"[peers] {msg}", file=sys.stderr, flush=True)


def _sdist(work: Path) -> Path:
    """The llama-cpp-python sdist's llama.cpp source folder (downloaded from the package index)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                    "-d", str(work), f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], check=True)
    archive = next(work.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(work, filter="data")
    return next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))


def llama_server(extra_flags: tuple[str, ...] = (), jobs: int | None = None) -> Path:
    """Path of a `llama-server` binary built from the pinned sources; built on first use."""
    return llama_tools(("llama-server",), extra_flags, jobs)["llama-server"]


def llama_tools(names: tuple[str, ...], extra_flags: tuple[str, ...] = (), jobs: int | None = None
                ) -> dict[str, Path]:
    """Paths of llama.cpp's tools `names` (llama-server, llama-imatrix, llama-quantize, ...) built from
    the pinned sources; those not built yet are built together, in one configure and one ggml."""
    out = build_dir(extra_flags)
    binaries = {name: out / name for name in names}
    missing = [name for name, path in binaries.items() if not path.is_file()]
    if not missing:
        return binaries
    installed = metadata.version("llama-cpp-python") if _installed() else None
    if installed not in (None, LLAMA_CPP_PYTHON):
        _log(f"note: llama-cpp-python {installed} is installed, building the peer from {LLAMA_CPP_PYTHON}")
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="llama-tools-") as tmp:
        work = Path(tmp)
        _log(f"building {', '.join(missing)} from llama-cpp-python {LLAMA_CPP_PYTHON}'s vendored llama.cpp "
             f"(about 6 minutes on 2 cores, once)")
        src = _sdist(work)
        build = work / "build"
        subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                        *GGML_FLAGS, *extra_flags], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(build), "--target", *missing, "-j",
                        str(jobs or os.cpu_count() or 2)], check=True, stdout=subprocess.DEVNULL)
        out.mkdir(parents=True, exist_ok=True)
        (out / "flags.txt").write_text(" ".join(GGML_FLAGS + extra_flags) + "\n")
        for name in missing:
            tmp_bin = out / f"{name}.tmp"
            shutil.copy2(next(build.glob(f"bin/{name}")), tmp_bin)
            os.replace(tmp_bin, binaries[name])  # a half-copied binary never looks built
    _log(f"built {', '.join(missing)} in {time.time() - t0:.0f} s")
    return binaries


def genai_builder_python() -> Path:
    """The interpreter of a side environment holding GENAI_BUILDER's pins over this environment's
    packages; created on first use (about 20 s: four wheels from the package index or pip's cache)."""
    import site
    import sysconfig

    tag = hashlib.sha256(repr(sorted(GENAI_BUILDER.items())).encode()).hexdigest()[:8]
    env = CACHE / f"genai-builder-{GENAI_BUILDER['onnxruntime-genai']}-{tag}"
    python, done = env / "bin" / "python", env / "pins.txt"
    pins = [f"{name}=={version}" for name, version in GENAI_BUILDER.items()]
    if done.is_file() and done.read_text().split() == pins:
        return python
    _log(f"creating {env.name}: {' '.join(pins)} over this environment's torch and onnxruntime")
    shutil.rmtree(env, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    purelib = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  check=True, capture_output=True, text=True).stdout.strip())
    # ours after its own: every site-packages folder this interpreter reads (a venv may chain to another
    # through a .pth file, which the side environment would not follow), and no source checkout
    ours = dict.fromkeys(p for p in [sysconfig.get_paths()["purelib"], *site.getsitepackages(), *sys.path]
                         if p.endswith("site-packages") and Path(p).is_dir())
    (purelib / "zz-edgefinfer-env.pth").write_text("".join(f"{p}\n" for p in ours))
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", *pins],
                   check=True)
    done.write_text("\n".join(pins) + "\n")  # written last: a half-made environment is made again
    return python


def _installed() -> bool:
    try:
        metadata.version("llama-cpp-python")
        return True
    except metadata.PackageNotFoundError:
        return False


if __name__ == "__main__":
    # python bench/peers.py TOOL [TOOL ...] [-DFLAG=VALUE ...]   extra CMake flags, e.g. -DGGML_CUDA=ON
    if sys.argv[1:] == ["genai-builder"]:
        print(genai_builder_python())
        sys.exit()
    tools = tuple(a for a in sys.argv[1:] if not a.startswith("-D"))
    if not tools or not all(t.startswith("llama-") for t in tools):
        sys.exit("usage: python bench/peers.py llama-server [llama-imatrix ...] [-DCMAKE_FLAG=VALUE ...]\n"
                 "       python bench/peers.py genai-builder")
    for path in llama_tools(tools, tuple(a for a in sys.argv[1:] if a.startswith("-D"))).values():
        print(path)
