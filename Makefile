# Two commands: `make run` serves the embedded model on CPU; `make test` runs every check.
# Both install what they need into .venv first (idempotent).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PYPROJECTS := $(wildcard libs/*/pyproject.toml services/*/pyproject.toml apps/*/pyproject.toml)
MODEL ?= models/tiny
PYTEST_ARGS ?=

.PHONY: install run test test-gpu test-deploy images push lint typecheck protos protos-check clean help

help:
	@echo "make run    - install into .venv and serve $(MODEL) (OpenAI HTTP :8000, gRPC :50051)"
	@echo "make test   - install into .venv and run lint, proto checks and all tests"
	@echo "make typecheck - mypy over minisgl_core, the services and the app (config: pyproject.toml)"
	@echo "make protos - regenerate the Python stubs from protos/"
	@echo "make test-gpu - the GPU checks of tests/gpu (on a CUDA machine; skipped without one)"
	@echo "make test-deploy - install Docker if needed, build the images, run the compose stack's test"
	@echo "make images - build and tag every image as minisgl/<target>:$(VERSION)"
	@echo "make push REGISTRY=host/ns - retag the images under REGISTRY and push them"

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

# Settings and per-package strictness: [tool.mypy] in pyproject.toml; the cache lives in .cache/mypy.
typecheck: install
	$(PY) -m mypy

protos: install
	$(PY) scripts/gen_protos.py

test: install lint typecheck
	@scripts/ensure_test_tools.sh
	$(PY) -m pytest $(PYTEST_ARGS)

# The kernel and engine checks that need a CUDA device (tests/gpu). On the GPU machine, where the
# packages come from bench/gpu_env.sh rather than .venv: `make test-gpu PY=python3`.
# TRITON_INTERPRET=0: Triton compiles for the GPU (the CPU tests run its interpreter).
test-gpu:
	TRITON_INTERPRET=0 $(PY) -m pytest -m gpu tests/gpu $(PYTEST_ARGS)

# Containers (docs/deploy.md). Needs root on a fresh machine: installs and starts Docker.
test-deploy: install
	PY=$(PY) scripts/deploy/test_deploy.sh

VERSION ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' libs/minisgl_core/pyproject.toml)
# Image targets of deploy/docker/Dockerfile; worker-cuda needs the CUDA base image (a registry):
# `make images IMAGE_TARGETS="gateway tokenizer scheduler worker-cpu worker-cuda"`.
IMAGE_TARGETS ?= gateway tokenizer scheduler worker-cpu
# `make push` pushes REGISTRY/minisgl/<target>:VERSION, the layout of the Helm chart's
# image.registry / image.repository (minisgl) / <target>.
REGISTRY ?=

# Built through Compose (the engine's BuildKit, one layer cache with `make test-deploy`); the
# compose service building target worker-cpu is `worker`.
images:
	@scripts/deploy/setup.sh
	COMPOSE_BAKE=false MINISGL_VERSION=$(VERSION) docker compose --profile cpu --profile gpu build \
	  $(subst worker-cpu,worker,$(IMAGE_TARGETS))
	@docker images --filter reference='minisgl/*:$(VERSION)'

push:
	@test -n "$(REGISTRY)" || { echo "usage: make push REGISTRY=registry.example.com/team"; exit 1; }
	@for t in $(IMAGE_TARGETS); do \
	  docker tag minisgl/$$t:$(VERSION) $(REGISTRY)/minisgl/$$t:$(VERSION) \
	    && docker push $(REGISTRY)/minisgl/$$t:$(VERSION) || exit 1; \
	done

clean:
	rm -rf $(VENV) .cache tools/buf/node_modules clients/node/node_modules
