# reprotrain: `make repro` and `make test` are the whole set-up on a fresh machine.
SHELL := /bin/bash
.DEFAULT_GOAL := help

# The interpreter the venv is made with: PYTHON if given (make repro PYTHON=/usr/bin/python3.11),
# else the first Python $(PYTHON_MINOR) with venv that tools/find-python finds (python3.11 on
# PATH, pyenv's, uv's managed Pythons); none: one line says what to install.
PYTHON_MINOR := 3.11
PYTHON ?=
# Added by tools/torch-index only when the configured pip sources lack the lock's +cpu torch.
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
VENV ?= .venv
LOCK ?= requirements-cpu.lock
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Stage commands in dvc.yaml call `reprotrain`, so the venv must come first on PATH.
export PATH := $(abspath $(BIN)):$(PATH)
export DVC_NO_ANALYTICS := 1

# The container (Dockerfile): `make image`, then `make docker-repro`. BASE_IMAGE empty
# keeps the Dockerfile's digest-pinned default.
DOCKER ?= docker
IMAGE ?= reprotrain:latest
BASE_IMAGE ?=

.PHONY: help venv repro test test-slow test-gpu gpu-evidence test-container verify check-reference status lint format lock bench ops clean \
	image docker-repro docker-verify

help: ## List the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  make %-15s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(STAMP): $(LOCK) pyproject.toml
	@test -x $(BIN)/python || { \
		python="$(PYTHON)"; \
		if [ -z "$$python" ]; then python=$$(tools/find-python $(PYTHON_MINOR)) || exit 1; \
		elif ! command -v "$$python" >/dev/null; then \
			echo "make: PYTHON=$$python is not a command here; give a Python $(PYTHON_MINOR)" \
				"(or leave PYTHON unset to search PATH, pyenv and uv)"; exit 1; fi; \
		echo "creating $(VENV) with $$python"; "$$python" -m venv $(VENV); }
	@extra=$$(tools/torch-index $(BIN)/python $(LOCK) $(TORCH_INDEX_URL)); \
	if [ -n "$$extra" ]; then echo "the pip sources configured here lack $(LOCK)'s torch" \
		"wheel: adding $$extra (same pinned hash)"; fi; \
	echo "installing $(LOCK) into $(VENV) (hash-checked; log: $(VENV)/install.log)"; \
	$(BIN)/python -m pip install --require-hashes --no-deps $$extra -r $(LOCK) >$(VENV)/install.log 2>&1 \
		|| { tail -n 30 $(VENV)/install.log; exit 1; }
	@$(BIN)/python -m pip install --no-deps --no-build-isolation -e . >>$(VENV)/install.log 2>&1 \
		|| { tail -n 30 $(VENV)/install.log; exit 1; }
	@$(BIN)/python -m pip check
	@touch $@

venv: $(STAMP) ## Create .venv from the lock (only what is missing or stale)

repro: venv ## Run the pipelines (dvc repro): the digits default, the language model, compiled
	$(BIN)/dvc repro
	$(BIN)/dvc repro pipelines/lm/dvc.yaml
	$(BIN)/dvc repro pipelines/lm-compiled/dvc.yaml
	@$(BIN)/reprotrain reference-note

# Test files run in parallel (pytest-xdist), one file per worker at a time, so module
# fixtures (a training run shared by a file's tests) are built once; --durations lists
# the slowest tests, so a CI log shows where the time goes.
PYTEST_PARALLEL ?= -n auto --dist loadfile --durations=15
# One intra-op thread per process in the quick suite: with one xdist worker per core,
# two threads each only contend (measured on 2 cores: 316 s -> 263 s of pytest). Every
# comparison in it is between runs made under the same setting, so no guarantee changes.
QUICK_THREADS ?= 1

# The pytest processes run at ATen's scalar level, not the host's, while what they
# start (reprotrain, dvc) inherits nothing contradicting the CPU profile
# (tests/conftest.py): what the suite meets on a host whose own level is not the
# portable pin (AVX-512), on every CPU, so a test that only passes where the host's
# level is AVX2 fails everywhere. PYTEST_ATEN_LEVEL= (empty) runs at the host's level.
PYTEST_ATEN_LEVEL ?= default

test: venv lint ## Lint, then run the quick test suite (not the slow ones, not the container build)
	REPROTRAIN_TEST_ATEN_LEVEL=$(PYTEST_ATEN_LEVEL) OMP_NUM_THREADS=$(QUICK_THREADS) \
		$(BIN)/pytest $(PYTEST_PARALLEL)

test-slow: venv ## Run the tests marked slow: kill points, DDP process groups, extra pipeline runs
	$(BIN)/pytest $(PYTEST_PARALLEL) -m slow

test-gpu: venv ## Run the GPU tests (marked `gpu`; they skip without CUDA)
	$(BIN)/pytest -m gpu

# On a lent GPU host (its own Python and torch, no venv, no DVC, no network): no venv here.
GPU_EVIDENCE_ARGS ?=
gpu-evidence: ## On a GPU host: twin runs, noise floor, cost, ops, DDP, trace into docs/gpu/
	PYTHONPATH=src python3 benchmarks/gpu/gpu_evidence.py $(GPU_EVIDENCE_ARGS)
	python3 benchmarks/gpu/gpu_rows.py

verify: venv ## Rerun training twice in fresh processes; fail unless the bits are identical
	$(BIN)/reprotrain verify

check-reference: venv ## One dvc repro in a clone of HEAD: are dvc.lock and reports/ as committed?
	$(BIN)/reprotrain verify --reference HEAD

status: venv ## Would dvc repro change anything that decides the bits? (exit 0: no)
	$(BIN)/reprotrain status

test-container: venv ## Build the image on a stand-in base, run the pipeline in it twice, compare bits
	@$(DOCKER) info >/dev/null 2>&1 || { echo "make test-container: no Docker engine answers" \
		"('$(DOCKER) info' fails); start dockerd (CI: .ci/run does)"; exit 1; }
	$(BIN)/pytest -m container

lint: venv ## ruff check and format check; zizmor on the GitHub workflows (offline)
	$(BIN)/ruff check src tests benchmarks .ci/run-workflow
	$(BIN)/ruff format --check src tests benchmarks .ci/run-workflow
	$(BIN)/zizmor --offline .github/workflows/

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
	$(BIN)/python benchmarks/overhead/overhead.py

ops: venv ## Probe the non-deterministic op catalog on this machine's CPU into docs/cpu/
	$(BIN)/reprotrain ops --device cpu --out-md docs/cpu/ops.md --out-json docs/cpu/ops.json

image: ## Build the container image, tag it $(IMAGE), print its ID
	$(DOCKER) build $(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE)) -t $(IMAGE) .
	@$(DOCKER) image inspect --format '{{.Id}}' $(IMAGE)

# --user: outputs belong to the caller (the image needs no passwd entry for it);
# REPROTRAIN_IMAGE_ID: the image cannot know its own ID, the environment record should.
# $(1): the command run in the image (empty: its default, `dvc repro`).
define docker_run
	@image_id=$$($(DOCKER) image inspect --format '{{.Id}}' $(IMAGE) 2>/dev/null) \
		|| { echo "make $@: no image $(IMAGE); run 'make image' first"; exit 1; }; \
	gpus=$$(nvidia-smi -L >/dev/null 2>&1 && echo "--gpus all"); \
	set -x; $(DOCKER) run --rm $$gpus --user "$$(id -u):$$(id -g)" \
		-e REPROTRAIN_IMAGE_ID="$$image_id" -v "$(CURDIR):/workspace" $(IMAGE) $(1)
endef

docker-repro: ## dvc repro in the image on this repository (--gpus all when nvidia-smi -L works)
	$(call docker_run,)

docker-verify: ## reprotrain verify $(VERIFY_ARGS) in the image on this repository (GPU as above)
	$(call docker_run,reprotrain verify $(VERIFY_ARGS))

clean: ## Remove the venv and DVC outputs (not the DVC cache)
	rm -rf $(VENV) data/prepared models reports
