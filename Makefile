# `make demo` and `make test` set everything up into .venv on a fresh machine (Python 3.11 + pip).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Pinned so pip takes the CPU wheel on CPU machines; override on GPU hosts, e.g. TORCH=torch.
TORCH ?= torch==2.13.0

.PHONY: install demo test lint bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

demo: install
	$(BIN)/python -m axon_nb.notebooks examples/quickstart.ipynb --output build/quickstart.ipynb

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest

bench: install
	$(BIN)/python benchmarks/cluster_start.py
	$(BIN)/python benchmarks/launch_overhead.py

clean:
	rm -rf $(VENV) build
