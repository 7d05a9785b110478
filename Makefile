# quarry: `make demo` runs the main job on the embedded default; `make test` checks everything.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test lint typecheck pytest bench clean install-local install-dev

$(BIN)/python:
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found (quarry needs Python 3.11)" >&2; exit 2; }
	$(PYTHON) -m venv $(VENV)

# Stamp files make a second run reuse the environment instead of reinstalling.
# The install compiles the chunker (hatch_build.py): a changed source reinstalls.
$(VENV)/.local-installed: pyproject.toml hatch_build.py src/quarry/_cpieces.c src/quarry/chunking.py | $(BIN)/python
	# torch first and pinned: any other resolution pulls a multi-GB CUDA build.
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[local]"
	touch $@

$(VENV)/.dev-installed: pyproject.toml $(VENV)/.local-installed
	$(PIP) install -q -e ".[local,dev]"
	touch $@

install-local: $(VENV)/.local-installed
install-dev: $(VENV)/.dev-installed

demo: $(VENV)/.local-installed
	$(BIN)/python -m quarry.demo

lint: $(VENV)/.dev-installed
	$(BIN)/ruff check src flows tests bench hatch_build.py
	$(BIN)/ruff format --check src flows tests bench hatch_build.py

typecheck: $(VENV)/.dev-installed
	$(BIN)/mypy

pytest: $(VENV)/.dev-installed
	$(BIN)/pytest -q

test: lint typecheck pytest

bench: $(VENV)/.dev-installed
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) .quarry .pytest_cache .mypy_cache .ruff_cache
