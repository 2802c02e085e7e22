# reprotrain: `make repro` and `make test` are the whole set-up on a fresh machine.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3.11
VENV ?= .venv
LOCK ?= requirements-cpu.lock
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Stage commands in dvc.yaml call `reprotrain`, so the venv must come first on PATH.
export PATH := $(abspath $(BIN)):$(PATH)
export DVC_NO_ANALYTICS := 1

.PHONY: help venv repro test test-gpu verify lint format lock bench ops clean

help: ## List the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  make %-8s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(STAMP): $(LOCK) pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "installing $(LOCK) into $(VENV) (hash-checked; log: $(VENV)/install.log)"
	@$(BIN)/python -m pip install --require-hashes --no-deps -r $(LOCK) >$(VENV)/install.log 2>&1 \
		|| { tail -n 30 $(VENV)/install.log; exit 1; }
	@$(BIN)/python -m pip install --no-deps --no-build-isolation -e . >>$(VENV)/install.log 2>&1 \
		|| { tail -n 30 $(VENV)/install.log; exit 1; }
	@$(BIN)/python -m pip check
	@touch $@

venv: $(STAMP) ## Create .venv from the lock (only what is missing or stale)

repro: venv ## Run the pipeline (dvc repro) on the embedded default data
	$(BIN)/dvc repro

test: venv lint ## Lint, then run the test suite
	$(BIN)/pytest

test-gpu: venv ## Run the GPU tests (marked `gpu`; they skip without CUDA)
	$(BIN)/pytest -m gpu

verify: venv ## Rerun training twice in fresh processes; fail unless the bits are identical
	$(BIN)/reprotrain verify

lint: venv ## ruff check and format check
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

format: venv ## Apply ruff fixes and formatting
	$(BIN)/ruff check --fix src tests benchmarks
	$(BIN)/ruff format src tests benchmarks

PIP_COMPILE = $(BIN)/pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras \
	--no-emit-find-links --no-emit-index-url --no-header

lock: venv ## Recompile both locks from requirements.in (hashes, no local paths)
	$(PIP_COMPILE) -o requirements-cpu.lock requirements.in
	@# The container lock: public index only, so torch is the CUDA build; the machine's
	@# pip config (a local CPU torch wheel) is isolated away.
	env PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= $(PIP_COMPILE) --pip-args "--isolated" \
		-o requirements.lock requirements.in

bench: venv ## Overhead of our train stage vs a bare Lightning loop
	$(BIN)/python benchmarks/overhead.py

ops: venv ## Probe the non-deterministic op catalog on this machine's CPU into docs/cpu/
	$(BIN)/reprotrain ops --device cpu --out-md docs/cpu/ops.md --out-json docs/cpu/ops.json

clean: ## Remove the venv and DVC outputs (not the DVC cache)
	rm -rf $(VENV) data/prepared models reports
