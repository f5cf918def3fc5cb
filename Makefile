# Two commands on a fresh machine:  `make fit` (install + main job), `make test` (install + tests).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Without a GPU, pin the CPU build that installs from local disk instead of a multi-GB CUDA wheel.
# The package itself only asks for a range (see pyproject.toml); override e.g. TORCH_SPEC="torch>=2.4".
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "torch>=2.4,<3" || echo "torch==2.13.0")
CONFIG ?= configs/tiny_lm.yaml
PYTEST_ARGS ?=

.PHONY: install fit test lint bench docs serve-docs clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

# the tests also cover the [hf] extra (transformers, peft), build the docs ([docs]: mkdocs) and run the
# peers' own trainers on the same inputs ([peers]: TRL)
$(VENV)/.installed-hf: $(VENV)/.installed pyproject.toml
	$(BIN)/python -m pip install -q -e ".[dev,hf,docs,peers]"
	touch $@

install: $(VENV)/.installed

fit: install
	$(BIN)/lit-losses fit --config $(CONFIG)

test: $(VENV)/.installed-hf
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# the docs site (docs/, mkdocs.yml) into site/; serve-docs: live at http://127.0.0.1:8000
docs: $(VENV)/.installed-hf
	$(BIN)/python -m mkdocs build --strict

serve-docs: $(VENV)/.installed-hf
	$(BIN)/python -m mkdocs serve

bench: install
	$(BIN)/python benchmarks/fused_head.py

clean:
	rm -rf $(VENV) runs lightning_logs .pytest_cache site
