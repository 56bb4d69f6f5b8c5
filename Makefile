# Two commands: `make run` serves the embedded model on CPU; `make test` runs every check.
# Both install what they need into .venv first (idempotent).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PYPROJECTS := $(wildcard libs/*/pyproject.toml services/*/pyproject.toml)
MODEL ?= models/tiny
PYTEST_ARGS ?=

.PHONY: install run test lint protos protos-check clean help

help:
	@echo "make run    - install into .venv and serve $(MODEL) (OpenAI HTTP :8000, gRPC :50051)"
	@echo "make test   - install into .venv and run lint, proto checks and all tests"
	@echo "make protos - regenerate the Python stubs from protos/"

install: $(STAMP)

$(STAMP): requirements-dev.txt $(PYPROJECTS)
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required"'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# The CPU build of torch; a bare `torch` requirement would pull a multi-GB CUDA build.
	@$(PY) -c 'import torch' 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -r requirements-dev.txt
	@touch $@

run: install
	$(VENV)/bin/minisgl serve --model $(MODEL)

lint: install
	$(VENV)/bin/ruff check .

protos: install
	$(PY) scripts/gen_protos.py

test: install lint
	@scripts/ensure_test_tools.sh
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .cache tools/buf/node_modules clients/node/node_modules
