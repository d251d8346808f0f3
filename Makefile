# rlyard: `make install` then `make run`; `make test`.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONFIG ?= configs/cpu-smoke.yaml
PYTEST_ARGS ?=

.PHONY: install run test test-fast proto proto-check bench lint clean help

help:
	@echo "make install   create .venv, install every service, provision the model and the sandbox template"
	@echo "make run       start the four services and run $(CONFIG) (CONFIG=... to choose another)"
	@echo "make test      the default test suite (CPU)"
	@echo "make proto     regenerate the gRPC stubs from proto/"
	@echo "make bench     CPU benchmarks (results in bench/results/)"

install:
	bash scripts/install.sh

run:
	$(BIN)/python -m services.launch --config $(CONFIG)

test:
	$(BIN)/python scripts/gen_proto.py --check
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-fast:
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

proto:
	$(BIN)/python scripts/gen_proto.py

bench:
	$(BIN)/python bench/sandbox.py
	$(BIN)/python bench/engine.py
	$(BIN)/python bench/rollout.py

clean:
	rm -rf runs .pytest_cache
	find . -name __pycache__ -prune -exec rm -rf {} +
